"""Llama GGUFs in every weight type users have on disk load, run and train.

A random ``llama`` model with rows of 256/512 (so every K-quant applies) is written with ggml's
own quantizers (tests/gguf_factory.write_llama) in each type; for each:

* the loaded type follows the CPU policy (kept; BF16 as F16, exact for these values);
* loaded as F32, the logits equal a float64 numpy forward of the file's weights dequantized by
  the ``gguf`` package (tests/llama_ref.py): 1e-4, whatever the type;
* with the default loading (weights kept, activations rounded to the weight's dot type by ggml
  as llama.cpp does: F16, or 8-bit blocks for the quantized types) the logits stay within 2x
  their measured distance from the float64 answer (0.17 - 0.29 on this random net, whose tied
  head amplifies the 8-bit activation rounding; 5.5e-3 - 7.7e-3 for F16 and BF16; another CPU's
  kernels sum in another order and flip other roundings);
* pytrain computes what llama.cpp computes on the same file.  Both run ggml-cpu's kernels, so
  the logits are bit-identical (measured: 0 for q4_0, q4_1, q5_0, q5_1, q8_0; 1.4e-6 - 4.2e-6
  for the K-quants) unless a last-bit difference upstream (llama.cpp's softmax runs over its
  padded KV cache) flips the 8-bit rounding of an activation, which moves the logits by a part
  of the type's own error (q3_K: 7.5e-2, a quarter of its 0.29 from float64).  Bound: 1e-4 or
  half the type's distance from float64, whichever is larger; F16 (llama.cpp's F16 matmuls take
  another path) 2e-2, measured 3.5e-3.  BF16 is not compared: pytrain runs it as F16, llama.cpp
  rounds the activations to BF16 (4.5e-2 apart);
* one training step's LoRA gradients with the weights kept equal those with the weights as F32
  to within that activation rounding (relative to each gradient's scale).
"""
import numpy as np
import pytest
from gguf_factory import write_llama
from llama_ref import forward_gguf

import pytrain
from pytrain import ggml
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets
from pytrain.train import loss as L
from pytrain.train.graphs import GradGraph

# max |Δ log-softmax| of the default loading from the float64 answer, and of its LoRA
# gradients from those of the F32 loading (of their scale), measured as in the docstring
MEASURED = {"f16": (7.7e-3, 1.5e-3), "bf16": (5.5e-3, 1.4e-3), "q8_0": (0.165, 3.9e-2),
            "q6_K": (0.274, 7.4e-2), "q5_K": (0.273, 5.3e-2), "q5_0": (0.208, 5.1e-2),
            "q5_1": (0.216, 4.6e-2), "q4_K": (0.285, 7.1e-2), "q4_0": (0.225, 4.6e-2),
            "q4_1": (0.170, 4.2e-2), "q3_K": (0.292, 4.6e-2), "q2_K": (0.261, 7.2e-2)}
TOKENS = np.random.default_rng(5).integers(0, 64, 24)


def log_softmax(x):
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def grads(path, policy):
    m = pytrain.load_model(path, device="cpu", threads=2, type_policy=policy)
    try:
        names = select_targets(m.config)
        ad = lora.create(m.runtime, m.config, names, rank=4, alpha=8, seed=0)
        rng = np.random.default_rng(1)
        ad.set({k: rng.normal(0, 0.1, v.shape).astype(np.float32) for k, v in ad.get().items()})
        tok = TOKENS[None]
        seg = np.zeros_like(tok)
        tgt = L.shift_targets(tok, np.ones(tok.shape, bool), seg)
        g = GradGraph(m, ad, B=1, T=tok.shape[1])
        out = g.run(tok, seg, tgt)
        g.close()
        return out, {n: m.weights.tensors[n].type for n in m.weights.tensors}
    finally:
        m.close()


@pytest.mark.parametrize("dtype", list(MEASURED))
def test_weight_type(tmp_path, dtype):
    model = write_llama(tmp_path / f"m-{dtype}.gguf", dtype)
    assert model.types["blk.1.ffn_down.weight"] == dtype
    want = forward_gguf(model.path, TOKENS)

    errs = {}
    for policy in ("f32", "auto"):
        m = pytrain.load_model(model.path, device="cpu", threads=2, type_policy=policy)
        try:
            loaded = ggml.type_name(m.weights.tensors["blk.0.attn_q.weight"].type).lower()
            errs[policy] = float(np.abs(log_softmax(m.logits(TOKENS)) - want).max())
        finally:
            m.close()
        if policy == "auto":
            assert loaded == ("f16" if dtype == "bf16" else dtype.lower()), loaded
    bound = 2 * MEASURED[dtype][0]
    print(f"{dtype}: as F32 {errs['f32']:.2e}, kept {errs['auto']:.2e} (bound {bound:.1e})")
    assert errs["f32"] < 1e-4, errs
    assert errs["auto"] < bound, errs

    kept, _ = grads(model.path, "auto")
    exact, _ = grads(model.path, "f32")
    assert kept["n_valid"] == exact["n_valid"] == len(TOKENS) - 1
    assert abs(kept["loss"] - exact["loss"]) < bound
    worst = 0.0
    for k, v in exact["grads"].items():
        scale = float(np.abs(v).max())
        assert scale > 0 and np.isfinite(kept["grads"][k]).all()
        err = float(np.abs(kept["grads"][k] - v).max()) / scale
        worst = max(worst, err)
    print(f"{dtype}: loss kept - as F32 {kept['loss'] - exact['loss']:+.2e}, gradients {worst:.2e}"
          f" of their scale")
    assert worst < 2 * MEASURED[dtype][1], worst


@pytest.mark.parametrize("dtype", ["f16", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1", "q6_K",
                                   "q5_K", "q4_K", "q3_K", "q2_K"])
def test_weight_type_matches_llama_cpp(llama_logits_exe, tmp_path, dtype):
    from llama_cpp_check import run_llama
    model = write_llama(tmp_path / f"m-{dtype}.gguf", dtype)
    m = pytrain.load_model(model.path, device="cpu", threads=2)
    try:
        ours = log_softmax(m.logits(TOKENS))
    finally:
        m.close()
    theirs = log_softmax(run_llama(llama_logits_exe, model.path, None, TOKENS,
                                   tmp_path / "l.f32", 64))
    err = float(np.abs(ours - theirs).max())
    print(f"{dtype}: pytrain vs llama.cpp {err:.2e}")
    assert err < (2e-2 if dtype == "f16" else max(1e-4, 0.5 * MEASURED[dtype][0])), err
