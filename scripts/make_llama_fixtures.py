"""Make the Llama-family fixtures in tests/fixtures/{llama,qwen2,qwen3}/: small random HF
``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` models converted by the
pinned llama.cpp converter, with HF's log-probabilities, a float64 reference of every GGUF, and
PEFT's LoRA gradients.

Why: pytrain's ``llama`` graph (GGUF loading, the converter's q/k row permutation under NORM
rope, rope scaling, biases, tied/untied heads) is checked against HF transformers, and its LoRA
gradients against PEFT, on models nobody here wrote the reference for.  The adapter layouts are
checked against llama.cpp's own ``convert_lora_to_gguf.py``.

    gqa     hidden 64, 3 layers, 4 q / 2 kv heads x 16, FFN 128, tied, rope base 1e5;
            written as F32, F16 and Q8_0
    untied  hidden 64, 2 layers, 8 q / 1 kv heads x 8 (multi-query), untied, q/k/v/o biases,
            linear rope scaling x2; F32
    llama3  hidden 64, 2 layers, 4 q / 4 kv heads x 16, tied, FFN biases, Llama 3 rope
            (factor 8, original context 32: the converter writes rope_freqs.weight); F32
    qwen2   (tests/fixtures/qwen2) Qwen2ForCausalLM: hidden 64, 2 layers, 4 q / 2 kv heads x
            16, tied, q/k/v biases (every Qwen2 has them), rope base 1e6; F32, F16, Q8_0
    qwen3   (tests/fixtures/qwen3) Qwen3ForCausalLM: hidden 64, 2 layers, 4 q / 2 kv heads x
            32 (wider than hidden / heads, as on the small Qwen3s), per-head q/k norms,
            untied, rope base 1e6; F32, Q8_0
    gemma3  (tests/fixtures/gemma3) Gemma3ForCausalLM: hidden 64, 6 layers (0-4 with a
            sliding window of 8 and rope base 1e4, 5 global with 1e6, as llama.cpp reads a
            file without a layer pattern), 2 q / 1 kv heads x 32 (query_pre_attn_scalar 32:
            the scale llama.cpp uses), q/k norms, pre- and post-norms around attention and
            FFN (norm weights near 0: Gemma multiplies by 1 + w, which the converter stores),
            GELU-tanh, tied, vocabulary 506 (the converter drops embedding rows past the
            tokenizer's); F32, Q8_0

Outputs (tests/fixtures/FAMILY/):
    NAME-TYPE.gguf          the converter's files
    NAME.npz                tokens int32 [N, T] right-padded with the pad id, lengths int32 [N],
                            logprobs float32 [N, T, V]: log_softmax of HF float32 logits (each
                            sequence alone, no padding), config_json
    NAME-TYPE.f64.npz       logprobs64 float32 [N, T, V]: a float64 numpy forward over the
                            GGUF's own (dequantized) tensors, written here from the GGUF format
                            (scripts/llama_ref.py: independent of pytrain and of HF), for every file
    peft_NAME.npz           PEFT LoRA r 4 / alpha 8 on q/k/v/o of every layer (and gate/up/down
                            for llama3), deterministic non-zero A and B; a padded, prompt-masked
                            batch (input_ids, attention_mask, labels, n_valid), HF's loss (float32
                            run) and loss64 (float64 run); per GGUF base tensor ``.lora_a``,
                            ``.lora_b``, ``.lora_a.grad``, ``.lora_b.grad`` (float32 run) and
                            ``.grad64`` (float64 run), all in llama.cpp's layout as
                            ``convert_lora_to_gguf.py`` wrote them (the gradients converted as an
                            adapter of their own: the converter's q/k permutation is linear in B)
    peft_NAME/              PEFT's own folder (adapter_config.json,
                            adapter_model.safetensors), for the PEFT reader/writer tests

Checks made here: HF runs are deterministic; every tensor of each F32 GGUF equals the HF tensor
under our own statement of the converter transforms (llama: q/k rows permuted per head; qwen2
and qwen3: none; gemma3: every norm weight stored as 1 + w, in float32); the numpy
float64 forward of each F32 GGUF matches HF's float32 golden to < 1e-4; PEFT's loss equals a
float64 CE of its logits; the float64 PEFT run computes in float64 only.

How (repo root, with the reference stack of scripts/requirements-reference.txt):

    /opt/refenv/bin/python -m scripts.make_llama_fixtures [--family qwen2,qwen3,gemma3]  # ~30 s each

Deterministic: fixed seeds, one thread.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from scripts import llama_ref
from scripts import make_peft_golden as mg
from scripts import make_qwen35_fixtures as fx
from scripts import qwen35_gguf as qg
from scripts import qwen35_reference as ref

VOCAB = 512
FIXTURES = ref.REPO / "tests" / "fixtures"
# family -> (transformers config class, model class, modeling module, converter permutes q/k)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", False),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3", False),
}
TOKENIZER = ref.REPO / "tests" / "fixtures" / "qwen35" / "tokenizer"
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, rms_norm_eps=1e-5,
              max_position_embeddings=4096, hidden_act="silu", bos_token_id=None,
              pad_token_id=None)
MODELS = {
    "gqa": dict(config=dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e5}),
                seed=101, outtypes=["f32", "f16", "q8_0"],
                lora=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "untied": dict(config=dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1,
                               head_dim=8, tie_word_embeddings=False, attention_bias=True,
                               rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                "rope_theta": 1e4}),
                   seed=102, outtypes=["f32"], lora=None),
    "llama3": dict(config=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                               head_dim=16, tie_word_embeddings=True, mlp_bias=True,
                               rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 32,
                                                "rope_theta": 5e5}),
                   seed=103, outtypes=["f32"],
                   lora=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"]),
    "qwen2": dict(family="qwen2",
                  config=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                  seed=111, outtypes=["f32", "f16", "q8_0"],
                  lora=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "qwen3": dict(family="qwen3",
                  config=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                  seed=112, outtypes=["f32", "q8_0"],
                  lora=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]),
}


MODELS["gemma3"] = dict(
    family="gemma3",
    # 6 layers: 0-4 slide over the last 8 positions, 5 is global (llama.cpp's pattern; HF's
    # layer_types say the same); heads of 32 on hidden 64; the attention scale HF takes from
    # query_pre_attn_scalar is the one llama.cpp uses (1/sqrt(head_dim)) only if they agree
    config=dict(num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                intermediate_size=64,
                vocab_size=506,     # the converter drops embedding rows past the tokenizer's
                tie_word_embeddings=True, sliding_window=8, query_pre_attn_scalar=32,
                hidden_activation="gelu_pytorch_tanh", hidden_act=None,
                final_logit_softcapping=None, attn_logit_softcapping=None,
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 1e4}}),
    seed=121, outtypes=["f32", "q8_0"],
    lora=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def family(name: str) -> str:
    return MODELS[name].get("family", "llama")
HF_TO_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
RANK, ALPHA = 4, 8


# --------------------------------------------------------------------------- HF models

def build(name: str, dtype):
    import torch
    import transformers
    spec = MODELS[name]
    config_class, model_class, _, _ = FAMILIES[family(name)]
    kw = {k: v for k, v in {**COMMON, **spec["config"]}.items() if v is not None}
    cfg = getattr(transformers, config_class)(eos_token_id=482, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(spec["seed"])
    model = getattr(transformers, model_class)(cfg)
    model.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():
        for n, p in sorted(model.named_parameters(), key=lambda t: t[0]):
            if n.endswith("embed_tokens.weight") or n == "lm_head.weight":
                v = torch.randn(p.shape, generator=g) * 0.3
            elif n.endswith("norm.weight"):         # Gemma's norms multiply by 1 + w
                v = (0.0 if family(name) == "gemma3" else 1.0) + \
                    torch.randn(p.shape, generator=g) * 0.2
            elif n.endswith(".bias"):
                v = torch.randn(p.shape, generator=g) * 0.1
            else:
                half = n.endswith(("o_proj.weight", "down_proj.weight"))
                v = torch.randn(p.shape, generator=g) * ((0.5 if half else 1.0) / p.shape[1] ** 0.5)
            p.copy_(v)
    return model.to(dtype).eval()


def true_float64(name: str):
    """The HF model entirely in float64 (``qwen35_reference.true_float64``: its RMSNorm,
    softmax and rotary embedding are float32 islands otherwise)."""
    import importlib
    mod = FAMILIES[family(name)][2]
    return ref.true_float64(importlib.import_module(f"transformers.models.{mod}.modeling_{mod}"))


# --------------------------------------------------------------------------- GGUF side

def permute_rows(w, n_heads: int):
    """Our statement of the converter's q/k transform: within each head, rows
    [x_0..x_{d/2-1} | y_0..y_{d/2-1}] -> [x_0, y_0, x_1, y_1, ...]."""
    import numpy as np
    d = w.shape[0] // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2)
                                .reshape(w.shape))


def check_layout(name: str, model, path: Path) -> None:
    """Every tensor of an F32 GGUF is the HF tensor under the documented transforms."""
    import numpy as np
    G = qg.gguf_tensors_f32(path)
    cfg = model.config
    exp = {}
    sd = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    exp["token_embd.weight"] = sd["model.embed_tokens.weight"]
    exp["output_norm.weight"] = sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        exp["output.weight"] = sd["lm_head.weight"]
    permutes = FAMILIES[family(name)][3]
    gemma = family(name) == "gemma3"
    # Gemma's post-attention norm is its own tensor; the converter stores each norm as 1 + w
    names = {"input_layernorm": "attn_norm",
             "post_attention_layernorm": "post_attention_norm" if gemma else "ffn_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             **{f"self_attn.{k}": v for k, v in HF_TO_GGUF.items() if k[0] in "qkvo"},
             **{f"mlp.{k}": v for k, v in HF_TO_GGUF.items() if k[0] not in "qkvo"}}
    for k, v in sd.items():
        if not k.startswith("model.layers."):
            continue
        parts = k.split(".")
        mod, kind = ".".join(parts[3:-1]), parts[-1]
        g = f"blk.{parts[2]}.{names[mod]}.{kind}"
        if permutes and mod == "self_attn.q_proj":
            v = permute_rows(v, cfg.num_attention_heads)
        elif permutes and mod == "self_attn.k_proj":
            v = permute_rows(v, cfg.num_key_value_heads)
        exp[g] = v
    if gemma:
        exp = {k: (v.astype(np.float32) + np.float32(1)).astype(np.float64)     # in float32
               if k.endswith("norm.weight") else v for k, v in exp.items()}
    extra = set(G) - set(exp)
    assert extra <= {"rope_freqs.weight"}, extra
    for k, e in exp.items():
        err = float(np.abs(G[k].reshape(e.shape) - e).max())
        assert err < 1e-7, (path.name, k, err)


# --------------------------------------------------------------------------- PEFT

def lora_values(mods: dict) -> dict:
    """Deterministic non-zero A ~ U(+-1/sqrt(n_in)) and B ~ N(0, 0.2), by PEFT tensor name."""
    import torch
    g = torch.Generator().manual_seed(2026)
    values = {}
    for n in sorted(mods):
        A, B = mods[n].lora_A["default"].weight, mods[n].lora_B["default"].weight
        values[n + ".lora_A.weight"] = ((torch.rand(A.shape, generator=g) * 2 - 1)
                                        / A.shape[1] ** 0.5).numpy()
        values[n + ".lora_B.weight"] = (torch.randn(B.shape, generator=g) * 0.2).numpy()
    return values


def peft_run(pm, mods: dict, values: dict, batch: dict, dtype) -> tuple[float, dict]:
    """PEFT's loss (checked against a float64 CE of its logits) and LoRA gradients on ``batch``."""
    a_b = {n: (values[n + ".lora_A.weight"], values[n + ".lora_B.weight"]) for n in mods}
    out, mine = mg.lora_backward(pm, mods, a_b, batch, dtype)
    assert abs(mine - out.loss.item()) < 1e-5, (mine, out.loss.item())
    grads = {}
    for n, (ga, gb) in mg.lora_grads(mods).items():
        grads[n + ".lora_A.weight"], grads[n + ".lora_B.weight"] = ga, gb
    return out.loss.item(), grads


def to_llama_layout(name: str, pm, hf_dir: Path, sets: dict, tmp: Path) -> dict:
    """Each tensor set saved as a PEFT folder (the values as PEFT itself writes them, each
    gradient set as if it were an adapter) and put in llama.cpp's layout by its converter:
    what -> (folder, GGUF tensors, GGUF fields)."""
    import numpy as np
    from safetensors.numpy import save_file
    folders = {}
    for what, tensors in sets.items():
        d = tmp / f"peft-{name}-{what}"
        if what == "values":                   # what PEFT itself writes
            pm.save_pretrained(str(d))
        else:                                  # module names as PEFT saves them
            pm.peft_config["default"].save_pretrained(str(d))
            save_file({k: np.ascontiguousarray(v, dtype=np.float64 if what == "grad64"
                                               else np.float32)
                       for k, v in tensors.items()}, str(d / "adapter_model.safetensors"))
        out = tmp / f"lora-{name}-{what}.gguf"
        ref.run_converter("convert_lora_to_gguf.py", ["--outfile", str(out), "--outtype", "f32",
                                                      "--base", str(hf_dir), str(d)])
        folders[what] = (d, qg.gguf_tensors_f32(out), qg.gguf_fields(out))
    return folders


def peft_gradients(name: str, hf_dir: Path, seqs: list[list[int]], pad_id: int, tmp: Path) -> dict:
    """PEFT LoRA loss and gradients on a padded, prompt-masked batch, in float32 and float64,
    converted to llama.cpp's layout by convert_lora_to_gguf.py."""
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model

    batch = mg.padded_batch(seqs[-1], pad_id)
    lcfg = dict(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                target_modules=MODELS[name]["lora"], init_lora_weights=True)

    def wrapped(dtype):
        pm = get_peft_model(build(name, dtype), LoraConfig(**lcfg))
        pm.eval()
        mods = {n: m for n, m in pm.named_modules()
                if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)}
        return pm, mods

    pm, mods = wrapped(torch.float32)
    values = lora_values(mods)
    loss32, g32 = peft_run(pm, mods, values, batch, torch.float32)
    pm64, mods64 = wrapped(torch.float64)        # (PEFT initialises A, B in float32 first)
    assert {p.dtype for p in pm64.parameters()} == {torch.float64}
    with true_float64(name) as seen:
        loss64, g64 = peft_run(pm64, mods64, values, batch, torch.float64)
    assert seen == {torch.float64}, seen
    print(f"[peft {name}] loss {loss32:.9f} (float64 {loss64:.9f}) over {batch['n_valid']} targets")

    folders = to_llama_layout(name, pm, hf_dir, {"values": values, "grad": g32, "grad64": g64}, tmp)
    res = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
           "labels": batch["labels"], "n_valid": np.int64(batch["n_valid"]),
           "loss": np.float64(loss32), "loss64": np.float64(loss64)}
    conv, fields = folders["values"][1], folders["values"][2]
    assert fields["adapter.lora.alpha"] == ALPHA and fields["general.architecture"] == family(name)
    for k, v in conv.items():
        res[k] = v.astype(np.float32)
        res[k + ".grad"] = folders["grad"][1][k].astype(np.float32)
        res[k + ".grad64"] = folders["grad64"][1][k].astype(np.float64)
    assert len(conv) == 2 * len(mods), sorted(conv)
    return res, folders["values"][0]


# --------------------------------------------------------------------------- main

def write_gguf(name: str, ot: str, model, hf_dir: Path, out: Path, seqs, lengths,
               logprobs) -> None:
    """The pinned converter's GGUF of ``model`` in type ``ot``, and the float64 numpy forward
    over that file (checked against HF float32 for F32)."""
    import numpy as np
    path = out / f"{name}-{ot}.gguf"
    ref.run_converter("convert_hf_to_gguf.py", [str(hf_dir), "--outfile", str(path),
                                                "--outtype", ot])
    assert path.stat().st_size < 1_000_000, path
    if ot == "f32":
        check_layout(name, model, path)
    f64 = np.zeros_like(logprobs)
    qg.pinned_gguf()
    contents = llama_ref.gguf_contents(path)
    for i, s in enumerate(seqs):
        f64[i, :len(s)] = llama_ref.forward(*contents, s)
    err = max(float(np.abs(f64[i, :n] - logprobs[i, :n]).max())
              for i, n in enumerate(lengths))
    print(f"[{name}-{ot}] numpy float64 over the GGUF vs HF float32: max "
          f"|dlogprob| {err:.3g} ({path.stat().st_size} bytes)")
    if ot == "f32":
        assert err < 1e-4, err
    np.savez_compressed(out / f"{name}-{ot}.f64.npz", logprobs64=f64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=FIXTURES, help="the fixtures folder (a "
                    "subfolder per family)")
    ap.add_argument("--family", default=",".join(FAMILIES), help="comma-separated families")
    ap.add_argument("--models", default=None, help="only these models (comma-separated, e.g. "
                    "llama3: one F32 file and its PEFT gradients, what the smoke test runs)")
    a = ap.parse_args()
    families = [f for f in a.family.split(",") if f]
    unknown = set(families) - set(FAMILIES)
    if unknown:
        ap.error(f"--family: unknown {sorted(unknown)}; known {sorted(FAMILIES)}")
    only = set(a.models.split(",")) if a.models else set(MODELS)
    if only - set(MODELS):
        ap.error(f"--models: unknown {sorted(only - set(MODELS))}; known {sorted(MODELS)}")
    ref.fix_hash_seed(__spec__.name)

    import numpy as np
    import torch
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)

    hf_tok = ref.load_hf_tokenizer(TOKENIZER)
    pad_id = hf_tok.convert_tokens_to_ids(ref.PAD_TOKEN)
    T = max(fx.SEQ_LENGTHS)

    with tempfile.TemporaryDirectory(prefix="llama-fixtures-") as tmp:
        tmp = Path(tmp)
        for name, spec in MODELS.items():
            if family(name) not in families or name not in only:
                continue
            out = a.out / family(name)
            out.mkdir(parents=True, exist_ok=True)
            model = build(name, torch.float32)
            V = model.config.vocab_size
            seqs = fx.make_sequences(hf_tok, V)
            tokens = np.full((len(seqs), T), pad_id, dtype=np.int32)
            lengths = np.array([len(s) for s in seqs], dtype=np.int32)
            logprobs = np.zeros((len(seqs), T, V), dtype=np.float32)
            for i, s in enumerate(seqs):
                lp = ref.hf_logprobs(model, s)
                assert np.array_equal(lp, ref.hf_logprobs(model, s)), f"{name}: HF not deterministic"
                tokens[i, :len(s)] = s
                logprobs[i, :len(s)] = lp
            hf_dir = tmp / name
            ref.save_hf_checkpoint(model, TOKENIZER, hf_dir)
            np.savez_compressed(out / f"{name}.npz", tokens=tokens, lengths=lengths,
                                logprobs=logprobs,
                                config_json=np.array(json.dumps(model.config.to_dict(),
                                                                sort_keys=True)))
            for ot in spec["outtypes"]:
                write_gguf(name, ot, model, hf_dir, out, seqs, lengths, logprobs)
            if spec["lora"]:
                res, folder = peft_gradients(name, hf_dir, seqs, pad_id, tmp)
                np.savez_compressed(out / f"peft_{name}.npz", **res)
                if name in ("gqa", "qwen2", "qwen3", "gemma3"):     # PEFT's own folder
                    dest = out / f"peft_{name}"
                    if dest.exists():
                        shutil.rmtree(dest)
                    shutil.copytree(folder, dest)
            ent = -(np.exp(logprobs) * logprobs).sum(-1)
            real = np.concatenate([ent[i, :n] for i, n in enumerate(lengths)])
            print(f"[{name}] params={sum(p.numel() for p in model.parameters())} "
                  f"entropy mean={real.mean():.3f} (uniform {np.log(V):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
