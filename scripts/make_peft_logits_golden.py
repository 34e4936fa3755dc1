"""Make tests/fixtures/qwen35/peft_logits.npz: HF + PEFT logits with adapters pytrain wrote.

Why: `pytrain.formats.adapter_peft.write_peft_adapter` must produce a folder that PEFT loads as the very
adapter pytrain trained, and `read_peft_adapter` must bring it back.  This script is the
reference side: it lets PEFT itself load folders written by pytrain's writer into the HF model
behind `tests/fixtures/qwen35/gqa-f32.gguf`, and stores the logits; tests/test_peft_adapter.py
(no torch) checks that pytrain with the same GGUF-keyed tensors computes the same logits.

What:
  * rebuild HF `gqa` exactly (scripts/make_peft_golden.py's `build_gqa`, checked against the
    committed gqa.npz to < 1e-6); its pytrain `Qwen35Config` comes from gqa-f32.gguf's metadata;
  * three deterministic pytrain-style tensor sets (GGUF names, numpy rng, A ~ U(+-1/sqrt(n_in)),
    B ~ N(0, 0.1)):
      - "all":    every target pytrain supports on every layer where it exists (attention
                  q/k/v/o on layers 1, 3; FFN gate/up/down on all; DeltaNet attn_qkv,
                  attn_gate, ssm_beta, ssm_alpha, ssm_out on layers 0, 2), r=4, alpha=8
                  -> written as short target_modules + layers_to_transform [0..3];
      - "sparse": an irregular set (attn_q + attn_v of layer 3, attn_output of 1, ssm_out and
                  ffn_down of 0, attn_qkv of 2), r=2, alpha=3.5 -> written as full module names;
      - "rslora": the sparse modules with rsLoRA (``use_rslora``: scale alpha/sqrt(r)),
                  r=4, alpha=8, written by ``write_peft_adapter(use_rslora=True)``; PEFT must
                  scale it by 8/2 = 4 (llama.cpp's converter copies alpha and ignores the flag);
    gqa has 2 key / 4 value DeltaNet heads, so the converter's grouped -> tiled value-head
    re-ordering is exercised (attn_qkv's value rows, attn_gate/ssm_beta/ssm_alpha rows,
    ssm_out columns);
  * each set written with `write_peft_adapter(..., model_config=...)`, loaded with
    `PeftModel.from_pretrained(fresh gqa, folder)`: the modules PEFT wrapped must be exactly
    the adapted ones, every loaded lora_A/lora_B must equal the file, scaling alpha/r;
  * adapter_config.json against the one PEFT writes itself (`get_peft_model` +
    `save_pretrained` with the same targets): identical dicts;
  * llama.cpp's own `convert_lora_to_gguf.py` (pinned source, `--outtype f32`, `no_mtp` set
    at run time as for the base converter) turns each folder back into an adapter GGUF: its
    tensors must equal the pytrain tensors bit for bit, and its alpha the written alpha; this
    proves the PEFT names and the value-head permutations are the exact inverse of the
    converter;
  * PEFT's `save_pretrained` of the loaded adapter (float32, and bfloat16 for "sparse") is
    kept byte for byte, so the test also imports folders PEFT itself wrote;
  * HF float32 logits (eager attention, each sequence alone, no padding) on sequences 2 and 4
    of gqa.npz (33 random ids over the whole vocabulary, specials included; 100-token chat +
    English, longer than pytrain's 32-token DeltaNet chunk) with each adapter (the base logits
    are gqa.npz's business; only the largest change each adapter makes is kept).

Output keys (tokens: gqa.npz's first 100 columns; per adapter set S in {all, sparse}):
    tokens int32 [2, 100] (pad 480), lengths int32 [2], S/logits float32 [2, 100, 512] (zero
    past each length), S/effect float64 [] (max |HF+PEFT - HF| logits), S/alpha float64 [],
    S/rank int64 [], S/logits64 float64 [2, 100, 512] (HF + PEFT in true float64 on the
    GGUF's exact weights: the exact answer pytrain is held to),
    S/config_json (our adapter_config.json text), S/peft_config_json (PEFT's own),
    S/t/<gguf base>.lora_a float32 [r, n_in], S/t/<gguf base>.lora_b float32 [n_out, r],
    S/peft_saved/<file> uint8: the bytes of adapter_config.json and adapter_model.safetensors
    as PEFT's own `save_pretrained` re-writes the loaded adapter (float32), and for "sparse"
    also S/peft_saved_bf16/<file> (the PeftModel cast to bfloat16 first).

How (repo root):
    /opt/refenv/bin/python -m scripts.make_peft_logits_golden [--sets rslora --merge]
(refenv needs numpy and safetensors for pytrain.formats.adapter_peft; gguf is the pinned gguf-py.)
Deterministic (fixed seeds, one thread, PYTHONHASHSEED=0 set by re-exec): a rerun writes the
same bytes; ~20 s on 2 cores.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from pytrain.formats.adapter_peft import (hf_tables, peft_module_name, read_peft_adapter,
                                          write_peft_adapter)
from pytrain.models.qwen35_config import Qwen35Config
from scripts import make_peft_golden as mg
from scripts import qwen35_gguf as qg
from scripts import qwen35_reference as ref

FIX = ref.REPO / "tests" / "fixtures" / "qwen35"
GGUF = FIX / "gqa-f32.gguf"
SEQS = [2, 4]
SPARSE = ["blk.3.attn_q.weight", "blk.3.attn_v.weight", "blk.1.attn_output.weight",
          "blk.0.ssm_out.weight", "blk.0.ffn_down.weight", "blk.2.attn_qkv.weight"]
SETS = {"all": dict(rank=4, alpha=8.0, seed=11, names=None),
        "sparse": dict(rank=2, alpha=3.5, seed=12, names=SPARSE),
        # rsLoRA (use_rslora: scale alpha/sqrt(r)) on the sparse modules
        "rslora": dict(rank=4, alpha=8.0, seed=13, names=SPARSE, rslora=True)}


def scaling(spec: dict) -> float:
    """PEFT's scaling of a set: alpha/r, or alpha/sqrt(r) for rsLoRA."""
    return spec["alpha"] / (spec["rank"] ** 0.5 if spec.get("rslora") else spec["rank"])


def gguf_config() -> Qwen35Config:
    fields = qg.gguf_fields(GGUF)
    names = set(qg.gguf_tensors_f32(GGUF))
    return Qwen35Config.from_metadata(fields, names, source=str(GGUF))


def make_tensors(cfg: Qwen35Config, names, rank: int, seed: int):
    import numpy as np
    shapes = cfg.tensor_shapes()
    if names is None:
        names = [f"blk.{i}.{t}.weight" for i in range(cfg.n_layer) for t in hf_tables("qwen35")[0]
                 if f"blk.{i}.{t}.weight" in shapes]
    rng = np.random.default_rng(seed)
    out = {}
    for n in names:
        n_out, n_in = shapes[n]
        b = 1.0 / np.sqrt(n_in)
        out[n + ".lora_a"] = rng.uniform(-b, b, (rank, n_in)).astype(np.float32)
        out[n + ".lora_b"] = rng.normal(0, 0.1, (n_out, rank)).astype(np.float32)
    return out


def hf_logits(model, gold, dtype=None):
    import numpy as np
    import torch
    T = 100
    res = np.zeros((len(SEQS), T, 512), dtype or np.float32)
    with torch.no_grad():
        for j, i in enumerate(SEQS):
            n = int(gold["lengths"][i])
            out = model(input_ids=torch.tensor([gold["tokens"][i, :n].tolist()]), use_cache=False)
            res[j, :n] = out.logits[0].numpy() if dtype else out.logits[0].float().numpy()
    return res


def float64_logits(folder: Path, gold):
    """HF + PEFT in true float64 on the GGUF's exact weights (make_peft_golden's
    ``float64_model`` and ``true_float64``) with the folder's adapter: the exact logits of
    what pytrain computes, so the test can measure HF float32's own rounding on them."""
    import numpy as np
    import torch
    from peft import PeftModel
    pm = PeftModel.from_pretrained(mg.float64_model(gold), str(folder)).to(torch.float64)
    pm.eval()
    assert {p.dtype for p in pm.parameters()} == {torch.float64}
    with mg.true_float64() as seen:
        out = hf_logits(pm, gold, np.float64)
    assert seen == {torch.float64}, seen        # no op of the float64 run returned float32
    return out


def convert_with_llama_cpp(folder: Path, hf_dir: Path, out: Path) -> dict:
    ref.run_converter("convert_lora_to_gguf.py", ["--base", str(hf_dir), "--outfile", str(out),
                                                  "--outtype", "f32", str(folder)], patch=ref.NO_MTP)
    fields = qg.gguf_fields(out)
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora", fields
    return {"alpha": float(fields["adapter.lora.alpha"]), "tensors": qg.gguf_tensors_f32(out)}


def rebuilt_gqa(gold, cfg: Qwen35Config):
    """HF gqa rebuilt (make_peft_golden.build_gqa), checked against the committed golden and
    against the DeltaNet head counts of the GGUF's metadata."""
    import torch
    hf_cfg, base = mg.build_gqa(torch.float32)
    mg.check_same_model(base, gold, seqs=(2,))
    assert (hf_cfg.linear_num_key_heads, hf_cfg.linear_num_value_heads) == \
        (cfg.ssm_k_heads, cfg.ssm_v_heads) == (2, 4)
    return base


def write_ours(tmp: Path, sname: str, spec: dict, cfg: Qwen35Config):
    """One tensor set written by pytrain's writer and read back unchanged: (tensors, folder,
    its adapter_config.json)."""
    import numpy as np
    tensors = make_tensors(cfg, spec["names"], spec["rank"], spec["seed"])
    folder = write_peft_adapter(tmp / sname, tensors, spec["alpha"], spec["rank"],
                                metadata={"pytrain.fixture": sname}, model_config=cfg,
                                use_rslora=spec.get("rslora", False))
    ours = json.loads((folder / "adapter_config.json").read_text())
    print(f"[{sname}] {len(tensors) // 2} modules; target_modules {ours['target_modules']}, "
          f"layers_to_transform {ours['layers_to_transform']}")
    back, alpha, rank, _ = read_peft_adapter(folder, cfg)
    assert alpha / rank == scaling(spec) and rank == spec["rank"]    # a plain LoRA's alpha
    assert set(back) == set(tensors)
    assert all(np.array_equal(back[k], tensors[k]) for k in tensors)
    return tensors, folder, ours


def check_peft_config(tmp: Path, sname: str, spec: dict, ours: dict) -> Path:
    """PEFT's own adapter_config.json for the same targets equals ours; its folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    _, m0 = mg.build_gqa(torch.float32)
    kw = {k: ours[k] for k in ("target_modules", "layers_to_transform", "layers_pattern")}
    ref_pm = get_peft_model(m0, LoraConfig(
        r=spec["rank"], lora_alpha=ours["lora_alpha"], lora_dropout=0.0, bias="none",
        task_type="CAUSAL_LM", init_lora_weights=True, use_rslora=spec.get("rslora", False),
        **kw))
    folder = tmp / (sname + "-peft")
    ref_pm.save_pretrained(str(folder))
    theirs = json.loads((folder / "adapter_config.json").read_text())
    mine = dict(ours, target_modules=sorted(ours["target_modules"]))
    theirs["target_modules"] = sorted(theirs["target_modules"])
    if mine != theirs:
        diff = {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs)
                if mine.get(k) != theirs.get(k)}
        raise AssertionError(f"{sname}: adapter_config.json differs from PEFT's: {diff}")
    return folder


def load_in_peft(folder: Path, tensors: dict, spec: dict):
    """PEFT loads pytrain's folder into a fresh model: exactly the adapted modules wrapped,
    every lora_A / lora_B equal to the file, scaling alpha / r."""
    import numpy as np
    import torch
    from peft import PeftModel
    from safetensors.numpy import load_file
    _, m1 = mg.build_gqa(torch.float32)
    pm = PeftModel.from_pretrained(m1, str(folder))
    pm.eval()
    wrapped = {name: mod for name, mod in pm.base_model.model.named_modules()
               if hasattr(mod, "lora_A") and isinstance(mod.lora_A, torch.nn.ModuleDict)
               and "default" in mod.lora_A}
    want = {peft_module_name(k[:-7]) for k in tensors if k.endswith(".lora_a")}
    assert set(wrapped) == want, (sorted(wrapped), sorted(want))
    st = load_file(str(folder / "adapter_model.safetensors"))
    for name, mod in wrapped.items():
        key = "base_model.model." + name
        assert np.array_equal(mod.lora_A["default"].weight.detach().numpy(),
                              st[key + ".lora_A.weight"]), name
        assert np.array_equal(mod.lora_B["default"].weight.detach().numpy(),
                              st[key + ".lora_B.weight"]), name
        assert mod.scaling["default"] == scaling(spec), name
    return pm


def check_llama_cpp(folder: Path, hf_dir: Path, out: Path, spec: dict, tensors: dict) -> None:
    """llama.cpp's converter turns the folder back into pytrain's tensors, bit for bit."""
    import numpy as np
    conv = convert_with_llama_cpp(folder, hf_dir, out)
    # the converter copies lora_alpha and ignores use_rslora: its GGUF of an rsLoRA folder
    # scales by alpha/r in llama.cpp (pytrain's own GGUF holds alpha·sqrt(r) instead)
    assert conv["alpha"] == spec["alpha"], conv["alpha"]
    assert set(conv["tensors"]) == set(tensors), sorted(set(conv["tensors"]) ^ set(tensors))
    for k, v in tensors.items():
        assert np.array_equal(conv["tensors"][k], v), k
    print(f"[{out.stem}] convert_lora_to_gguf.py of the folder == pytrain's tensors "
          f"({len(tensors)} tensors, bit-exact)")


def peft_resaved(pm, tmp: Path, sname: str, ours: dict) -> dict:
    """PEFT re-saves the loaded adapter itself (float32, and bfloat16 for "sparse"): the test
    imports these PEFT-written folders into pytrain.  Their files' bytes, by output key."""
    import numpy as np
    import torch
    saved = {"peft_saved": tmp / (sname + "-resaved")}
    pm.save_pretrained(str(saved["peft_saved"]))
    again = json.loads((saved["peft_saved"] / "adapter_config.json").read_text())
    assert dict(again, target_modules=sorted(again["target_modules"])) == \
        dict(ours, target_modules=sorted(ours["target_modules"])), \
        "PEFT re-saved a different adapter_config.json"
    if sname == "sparse":
        saved["peft_saved_bf16"] = tmp / (sname + "-resaved-bf16")
        pm.to(torch.bfloat16).save_pretrained(str(saved["peft_saved_bf16"]))
        hdr = (saved["peft_saved_bf16"] / "adapter_model.safetensors").read_bytes()
        assert b'"BF16"' in hdr[:4096] and b'"F32"' not in hdr[:4096]
    return {f"{sname}/{tag}/{f}": np.frombuffer((d / f).read_bytes(), np.uint8)
            for tag, d in saved.items() for f in ("adapter_config.json", "adapter_model.safetensors")}


def adapter_set(tmp: Path, hf_dir: Path, sname: str, spec: dict, cfg: Qwen35Config, gold,
                base_logits) -> dict:
    """Every check of one tensor set, and its output arrays (module docstring)."""
    import numpy as np
    tensors, folder, ours = write_ours(tmp, sname, spec, cfg)
    peft_folder = check_peft_config(tmp, sname, spec, ours)
    pm = load_in_peft(folder, tensors, spec)
    logits = hf_logits(pm, gold)
    effect = float(np.abs(logits - base_logits).max())
    print(f"[{sname}] HF+PEFT logits move by up to {effect:.3g} with the adapter")
    assert effect > 0.5, effect
    check_llama_cpp(folder, hf_dir, tmp / f"{sname}.gguf", spec, tensors)
    res = peft_resaved(pm, tmp, sname, ours)
    res[f"{sname}/logits"] = logits
    res[f"{sname}/logits64"] = float64_logits(folder, gold)
    print(f"[{sname}] HF+PEFT float32 vs float64: max |d logit| "
          f"{float(np.abs(logits - res[f'{sname}/logits64']).max()):.3g}")
    res[f"{sname}/effect"] = np.float64(effect)
    res[f"{sname}/alpha"] = np.float64(spec["alpha"])
    res[f"{sname}/rank"] = np.int64(spec["rank"])
    res[f"{sname}/config_json"] = np.array((folder / "adapter_config.json").read_text())
    res[f"{sname}/peft_config_json"] = np.array((peft_folder / "adapter_config.json").read_text())
    for k, v in tensors.items():
        res[f"{sname}/t/{k}"] = v
    return res


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=FIX / "peft_logits.npz")
    ap.add_argument("--sets", default=",".join(SETS), help="the tensor sets (comma-separated)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other sets' arrays already in --out (add or replace these)")
    a = ap.parse_args()
    import numpy as np
    import torch

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)

    gold = np.load(FIX / "gqa.npz")
    cfg = gguf_config()
    base = rebuilt_gqa(gold, cfg)
    res = {"tokens": gold["tokens"][SEQS, :100].astype(np.int32),
           "lengths": gold["lengths"][SEQS].astype(np.int32)}
    base_logits = hf_logits(base, gold)
    with tempfile.TemporaryDirectory(prefix="peft-logits-") as tmp:
        tmp = Path(tmp)
        hf_dir = tmp / "hf"
        ref.save_hf_checkpoint(base, FIX / "tokenizer", hf_dir)
        for sname, spec in SETS.items():
            if sname not in a.sets.split(","):
                continue
            res.update(adapter_set(tmp, hf_dir, sname, spec, cfg, gold, base_logits))
    path = a.out
    if a.merge and path.exists():
        with np.load(path) as old:
            res = {**{k: old[k] for k in old.files}, **res}
    np.savez_compressed(path, **res)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    ref.fix_hash_seed(__spec__.name)
    sys.exit(main())
