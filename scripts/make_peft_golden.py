"""Make tests/fixtures/qwen35/peft_grads.npz: PEFT LoRA loss and gradients on the `gqa` model.

Why: pytrain's LoRA gradients (adapter hook, masked CE, ggml backward through gated attention and
DeltaNet) are checked against HF transformers + PEFT on the very model that `gqa-f32.gguf` was
converted from, with a padded, prompt-masked batch, so the loss convention (shifted labels, mean
over valid targets) and every adapter gradient are compared with the reference implementation.

What:
  * rebuild HF `gqa` exactly as scripts/make_qwen35_fixtures.py does (its MODELS["gqa"] spec,
    qwen35_text_config + build_model + randomize_weights, seed 1234) and check its config and its
    log-probabilities on two sequences equal the committed tests/fixtures/qwen35/gqa.npz (to
    float32 rounding: ``check_same_model``; bit-identical on the machine that made them);
  * wrap it with PEFT LoRA r=4, alpha=8, dropout 0, bias none, on q_proj/k_proj/v_proj/o_proj of
    the full-attention layers only (layers_to_transform = layers 1 and 3, from config.layer_types);
  * set every lora_A / lora_B to deterministic random values (A ~ U(+-1/sqrt(n_in)),
    B ~ N(0, 0.2): non-zero, so A gets gradient and the loss moves visibly);
  * run a batch of 3 rows of lengths 20, 13, 7 (from the golden's chat + English sequence)
    right-padded to 20 with the pad id (480), attention_mask 0 on padding, labels = input ids with
    -100 on padding and on a prompt prefix (5, 3, 2 tokens); loss = HF's causal-LM loss (labels
    shifted inside; transformers 5.23 `fixed_cross_entropy` takes reduction "mean" without
    num_items_in_batch and sum / num_items_in_batch with it: both are run and must agree, and
    agree with a float64 CE computed here from the logits); backward;
  * once in float32 (PEFT as users run it), and once in true float64 on the GGUF's exact
    weights: HF's modeling code computes RMSNorm, softmax, rope and the DeltaNet fallback in
    float32 even for a float64 model, so `true_float64()` maps those casts to float64 and proves
    that no op returned float32; and the converter's float32 `1 + w` norms and `-exp(A_log)`
    (which alone move float64 log-probabilities by 1.2e-5 here) are copied back from the GGUF
    (`match_gguf_weights`).  That run matches the independent numpy float64 forward over the
    GGUF (`numpy_forward_gguf`) to ~2e-8, so its gradients are the exact answer for the model
    pytrain runs, and show how much of any pytrain-vs-PEFT difference is float32 rounding.

Output keys:
    input_ids int64 [3, 20], attention_mask int64 [3, 20], labels int64 [3, 20], n_valid int64 [],
    loss float64 [] (HF's float32 loss), loss64 float64 [] (the float64 run), and per adapted
    module, keyed by the GGUF base tensor name (HF model.layers.N.self_attn.{q,k,v,o}_proj =
    blk.N.attn_{q,k,v,output}.weight: the converter does not permute attention q/k/v/o; attn_q
    rows are per head [query | gate] in both):
      "<base>.lora_a"         float32 [r, n_in]   (PEFT lora_A.weight)
      "<base>.lora_b"         float32 [n_out, r]  (PEFT lora_B.weight)
      "<base>.lora_a.grad"    float32 [r, n_in]   d loss / d A, PEFT float32
      "<base>.lora_b.grad"    float32 [n_out, r]  d loss / d B, PEFT float32
      "<base>.lora_a.grad64"  float64             the same, float64 run
      "<base>.lora_b.grad64"  float64

Measured when made: PEFT float32 vs float64 loss -1.8e-6; gradients up to 4.6e-5 of each
tensor's max on layer 1 (whose gradients cross DeltaNet layer 2 and attention layer 3), 7e-6 on
layer 3.  HF float32 logits of a padded row vs the row run alone: 1.8e-5 (float64: 3e-14).

Variants (``--variant``): ``lora`` (the above, peft_grads.npz) and ``rslora`` (the same with
PEFT's ``use_rslora=True``: scale alpha/sqrt(r) = 4 instead of alpha/r = 2; peft_rslora.npz),
which pytrain's ``lora.use_rslora`` must match.

How (repo root):  /opt/refenv/bin/python -m scripts.make_peft_golden [--variant rslora]
Deterministic (fixed seeds, one thread; a rerun writes the same bytes); ~10 s on 2 cores.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from scripts import make_qwen35_fixtures as fx
from scripts import qwen35_gguf as qg
from scripts import qwen35_reference as ref

FIX = ref.REPO / "tests" / "fixtures" / "qwen35"
RANK, ALPHA = 4, 8
LENGTHS = [20, 13, 7]
PROMPTS = [5, 3, 2]          # masked prompt prefix per row
STARTS = [0, 37, 81]         # where each row starts in the source: distinct rows
PAD_ID = 480                 # <|endoftext|>
EOS_ID = 482                 # <|im_end|>
HF_TO_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def true_float64():
    """HF Qwen3.5 entirely in float64 (``qwen35_reference.true_float64``)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mq
    return ref.true_float64(mq)


def build_gqa(dtype):
    spec = fx.MODELS["gqa"]
    cfg = ref.qwen35_text_config(eos_token_id=EOS_ID, **spec["config"])
    model = ref.build_model(cfg, spec["seed"])
    ref.randomize_weights(model, spec["seed"])
    return cfg, model.to(dtype)


def match_gguf_weights(model, gguf_path) -> None:
    """Give a float64 HF model exactly the GGUF's values where the converter computed in float32
    (norm weights stored as 1 + w; ssm_a = -exp(A_log), value heads tiled), then check every
    tensor against the GGUF (``expected_gguf_tensors`` under true_float64 is float64 exact)."""
    import numpy as np
    import torch
    G = qg.gguf_tensors_f32(gguf_path)
    cfg = model.config
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    grouped_of_tiled = np.arange(nv).reshape(nk, nv // nk).T.reshape(-1)
    plus1 = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight"}
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = name.split(".")
            rest = ".".join(parts[3:])
            if name == "model.norm.weight":
                p.copy_(torch.tensor(G["output_norm.weight"].astype(np.float64) - 1))
            elif rest in plus1:
                p.copy_(torch.tensor(G[f"blk.{parts[2]}.{plus1[rest]}"].astype(np.float64) - 1))
            elif rest == "linear_attn.A_log":
                a = G[f"blk.{parts[2]}.ssm_a"].astype(np.float64).reshape(-1)
                v = np.empty(nv)
                v[grouped_of_tiled] = a
                p.copy_(torch.tensor(np.log(-v)))
    exp = qg.expected_gguf_tensors(model)
    assert set(exp) == set(G)
    for k, e in exp.items():
        assert e.dtype == np.float64, k
        err = np.abs(G[k].reshape(e.shape).astype(np.float64) - e).max()
        assert err <= 1e-15 * max(1.0, np.abs(e).max()), (k, err)


VARIANTS = {"lora": ({}, "peft_grads.npz", ALPHA / RANK),
            "rslora": ({"use_rslora": True}, "peft_rslora.npz", ALPHA / RANK ** 0.5)}


def wrap_peft(model, full, variant: str = "lora"):
    """PEFT LoRA on q/k/v/o of the full-attention layers; returns (peft model, {GGUF name: module})."""
    import torch
    from peft import LoraConfig, get_peft_model
    extra, _, scaling = VARIANTS[variant]
    lcfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                      target_modules=list(HF_TO_GGUF), layers_to_transform=full,
                      layers_pattern="layers", init_lora_weights=True, **extra)
    pm = get_peft_model(model, lcfg)
    pm.eval()   # dropout is 0 anyway
    adapted = {}
    for name, mod in pm.named_modules():
        if hasattr(mod, "lora_A") and isinstance(getattr(mod, "lora_A"), torch.nn.ModuleDict):
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            assert parts[-2] == "self_attn", name
            adapted[f"blk.{layer}.{HF_TO_GGUF[parts[-1]]}.weight"] = mod
    assert len(adapted) == 4 * len(full), sorted(adapted)
    for mod in adapted.values():
        assert mod.scaling["default"] == scaling
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n in trainable) and len(trainable) == 2 * len(adapted), trainable
    return pm, adapted


def check_same_model(model, gold, seqs=(2, 4)) -> None:
    """``model`` (float32) computes the committed golden ``gold`` (gqa.npz, made by the same
    float32 HF code on another CPU) on the sequences ``seqs``, to float32 rounding.

    The bound is derived, not printed once (tests/bounds.py, ``f32_bound``): e = max |lp32 -
    lp64| is this CPU's float32 rounding error on the sequence, lp64 being the same weights
    run in true float64 (``true_float64``).  The golden is the same float32 computation with
    other kernels (AVX2 or AVX-512 blocking, another summation order), so its own error is at
    most 2e and |lp32 - golden| <= e + 2e; F32_SPREAD = 4 x max(e, 8 ulps of the values) holds
    that.  A different model (a changed seed, config or init) moves log-probabilities by O(1)."""
    import copy

    import numpy as np
    import torch

    from scripts.native_build import import_file
    # by path: the pinned gguf-py's editable install puts its own ``tests`` package on sys.path
    f32_bound = import_file("pytrain_test_bounds", ref.REPO / "tests" / "bounds.py").f32_bound
    model64 = copy.deepcopy(model).to(torch.float64)
    for i in seqs:
        n = int(gold["lengths"][i])
        toks = gold["tokens"][i, :n].tolist()
        lp = ref.hf_logprobs(model, toks)
        with true_float64(), torch.no_grad():
            out = model64(input_ids=torch.tensor([toks]), use_cache=False).logits[0]
            lp64 = torch.log_softmax(out, -1).numpy()
        err = float(np.abs(lp - gold["logprobs"][i, :n]).max())
        bound = f32_bound(float(np.abs(lp - lp64).max()), lp64)
        print(f"rebuilt gqa vs committed golden, sequence {i} (length {n}): max |dlogprob| = "
              f"{err:.3g} (bound {bound:.3g})")
        assert err <= bound, (i, err, bound)


def check_rebuilt(model, gold) -> None:
    """The rebuilt model is the one the fixtures were made from: same config, same
    log-probabilities on the 33 random-id sequence and the 100-token chat."""
    committed_cfg = json.loads(str(gold["config_json"]))
    mine_cfg = json.loads(json.dumps(model.config.to_dict(), sort_keys=True))
    for k in ("architectures", "dtype"):   # filled in by save_pretrained in the fixture script
        committed_cfg.pop(k, None), mine_cfg.pop(k, None)
    assert mine_cfg == committed_cfg, "config differs from the committed gqa.npz config_json"
    check_same_model(model, gold)


def lora_values(adapted: dict) -> dict:
    """Deterministic non-zero A ~ U(+-1/sqrt(n_in)) and B ~ N(0, 0.2) per adapted module."""
    import torch
    g = torch.Generator().manual_seed(2025)
    values = {}
    for base in sorted(adapted):
        mod = adapted[base]
        A, B = mod.lora_A["default"].weight, mod.lora_B["default"].weight
        values[base + ".lora_a"] = ((torch.rand(A.shape, generator=g) * 2 - 1) / A.shape[1] ** 0.5).numpy()
        values[base + ".lora_b"] = (torch.randn(B.shape, generator=g) * 0.2).numpy()
    return values


def padded_batch(src, pad_id: int) -> dict:
    """Rows of lengths LENGTHS cut from ``src`` at STARTS, right-padded with ``pad_id``, the
    first PROMPTS tokens of each row and its padding masked out of the labels."""
    import numpy as np
    T = max(LENGTHS)
    input_ids = np.full((len(LENGTHS), T), pad_id, np.int64)
    attn = np.zeros((len(LENGTHS), T), np.int64)
    labels = np.full((len(LENGTHS), T), -100, np.int64)
    for b, (n, p, start) in enumerate(zip(LENGTHS, PROMPTS, STARTS)):
        input_ids[b, :n] = src[start:start + n]
        attn[b, :n] = 1
        labels[b, p:n] = input_ids[b, p:n]
    n_valid = int((labels[:, 1:] != -100).sum())
    return {"input_ids": input_ids, "attention_mask": attn, "labels": labels, "n_valid": n_valid}


def lora_backward(pm, mods: dict, a_b: dict, batch: dict, dtype):
    """PEFT's forward and backward on ``batch`` with each module's lora_A / lora_B set to
    ``a_b[name]``: its output, and a float64 CE of its logits over the labelled targets."""
    import torch
    ids_t, attn_t, lab_t = (torch.tensor(batch[k]) for k in ("input_ids", "attention_mask", "labels"))
    with torch.no_grad():
        for n, mod in mods.items():
            a, b = a_b[n]
            mod.lora_A["default"].weight.copy_(torch.tensor(a, dtype=dtype))
            mod.lora_B["default"].weight.copy_(torch.tensor(b, dtype=dtype))
    out = pm(input_ids=ids_t, attention_mask=attn_t, labels=lab_t, use_cache=False)
    out.loss.backward()
    with torch.no_grad():
        lp = torch.log_softmax(out.logits.double(), -1)[:, :-1]
        tgt = lab_t[:, 1:]
        ok = tgt != -100
        mine = float(-lp[ok, tgt[ok]].mean())
    return out, mine


def lora_grads(mods: dict) -> dict:
    """name -> (d loss / d lora_A, d loss / d lora_B) as float64 arrays."""
    return {n: (mod.lora_A["default"].weight.grad.detach().double().numpy(),
                mod.lora_B["default"].weight.grad.detach().double().numpy())
            for n, mod in mods.items()}


def run_peft(pm, adapted: dict, values: dict, batch: dict, dtype) -> tuple[float, dict]:
    """Loss and LoRA gradients of one forward/backward on ``batch``, with the loss convention
    checked three ways and the padded rows against each row run alone."""
    import torch
    a_b = {base: (values[base + ".lora_a"], values[base + ".lora_b"]) for base in adapted}
    out, mine = lora_backward(pm, adapted, a_b, batch, dtype)
    assert out.logits.dtype == out.loss.dtype == dtype
    # the loss convention: mean over valid shifted targets == sum / num_items_in_batch
    # == a float64 CE computed from the logits
    ids_t, attn_t, lab_t = (torch.tensor(batch[k]) for k in ("input_ids", "attention_mask", "labels"))
    n_valid = batch["n_valid"]
    with torch.no_grad():
        out2 = pm(input_ids=ids_t, attention_mask=attn_t, labels=lab_t, use_cache=False,
                  num_items_in_batch=torch.tensor(n_valid))
        assert torch.equal(out2.logits, out.logits)
        # padding does not change the real rows: each row alone (no padding, no mask)
        pad_err = max(float((pm(input_ids=ids_t[b:b + 1, :n], use_cache=False).logits[0]
                             - out.logits[b, :n]).abs().max()) for b, n in enumerate(LENGTHS))
    print(f"[{dtype}] loss {out.loss.item():.9f} (mean over {n_valid} targets); "
          f"sum/num_items_in_batch {out2.loss.item():.9f}; float64 CE from logits {mine:.9f}; "
          f"rows alone vs padded batch: max |dlogit| {pad_err:.2g}")
    assert abs(out2.loss.item() - out.loss.item()) < 1e-6
    assert abs(mine - out.loss.item()) < 1e-5
    assert pad_err < 1e-4
    grads = {}
    for base, (ga, gb) in lora_grads(adapted).items():
        grads[base + ".lora_a"], grads[base + ".lora_b"] = ga, gb
    return out.loss.item(), grads


def float64_model(gold):
    """gqa in true float64 on the GGUF's exact weights: the exact answer for the model pytrain
    runs (the converter's float32 `1 + w` norms and `-exp(A_log)` move HF-float64
    log-probabilities by 1.2e-5 on this net; with the GGUF's values HF-float64 matches the
    independent numpy float64 forward to ~2e-8)."""
    import numpy as np
    import torch
    gguf = FIX / "gqa-f32.gguf"
    _, model64 = build_gqa(torch.float64)
    with true_float64() as seen0:
        match_gguf_weights(model64, gguf)
        toks = gold["tokens"][4, :100].tolist()
        with torch.no_grad():
            lp64 = torch.log_softmax(model64(input_ids=torch.tensor([toks]), use_cache=False).logits[0], -1)
        e = float(np.abs(lp64.numpy() - qg.numpy_forward_gguf(gguf, toks)).max())
        print(f"HF float64 on the GGUF weights vs numpy_forward_gguf (float64), sequence 4: "
              f"max |dlogprob| = {e:.2g}")
        assert e < 1e-6, e
    assert seen0 == {torch.float64}, seen0
    return model64


def golden(batch: dict, values: dict, run32: tuple, run64: tuple) -> dict:
    """The output arrays (module docstring), each gradient's float32 error printed."""
    import numpy as np
    (loss32, g32), (loss64, g64) = run32, run64
    res = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    res.update(loss=np.float64(loss32), loss64=np.float64(loss64), n_valid=np.int64(batch["n_valid"]))
    print(f"HF float32 loss - float64 loss: {loss32 - loss64:.3g}")
    for base in sorted({k.rsplit(".", 1)[0] for k in values}):
        line = f"  {base:26s}"
        for s in (".lora_a", ".lora_b"):
            res[base + s] = values[base + s].astype(np.float32)
            res[base + s + ".grad"] = g32[base + s].astype(np.float32)
            res[base + s + ".grad64"] = g64[base + s]
            scale = np.abs(g64[base + s]).max()
            assert scale > 1e-2, (base + s, scale)
            rel = np.abs(g32[base + s] - g64[base + s]).max() / scale
            line += f"  {s[1:]} {values[base + s].shape} max|g| {scale:.3g} f32-f64 {rel:.1e} of max"
        print(line)
    return res


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="lora")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: tests/fixtures/qwen35/ and the variant's file name")
    a = ap.parse_args()
    a.out = a.out or FIX / VARIANTS[a.variant][1]
    import numpy as np
    import torch

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)

    cfg, model = build_gqa(torch.float32)
    gold = np.load(FIX / "gqa.npz")
    check_rebuilt(model, gold)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full == [1, 3], full
    pm, adapted = wrap_peft(model, full, a.variant)
    values = lora_values(adapted)
    batch = padded_batch(gold["tokens"][4, :100], PAD_ID)   # the chat + English sequence
    run32 = run_peft(pm, adapted, values, batch, torch.float32)
    pm64, adapted64 = wrap_peft(float64_model(gold), full, a.variant)  # (A, B made float32 first)
    assert {p.dtype for p in pm64.parameters()} == {torch.float64}
    with true_float64() as seen:
        run64 = run_peft(pm64, adapted64, values, batch, torch.float64)
    assert seen == {torch.float64}, seen          # no op of the float64 run returned float32
    path = a.out
    np.savez_compressed(path, **golden(batch, values, run32, run64))
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
