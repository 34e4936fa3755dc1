"""Llama GGUFs in every weight type users have on disk load, run and train.

A random ``llama`` model with rows of 256/512 (so every K-quant applies) is written with ggml's
own quantizers (scripts/gguf_models.write_llama) in each type; for each:

* the loaded type follows the CPU policy (kept; BF16 as F16, exact for these values);
* loaded as F32, the logits equal a float64 numpy forward of the file's weights dequantized by
  the ``gguf`` package (scripts/llama_ref.py), within ``bounds.f32_bound`` of this network's
  float32 rounding on these tokens, measured by perturbation (tests/perturbation.py: the F32
  file of the same net with every weight one float32 step off); the type only changes the
  weight values, not how float32 rounds the forward;
* with the default loading (weights kept) ggml rounds every matmul's activations to the
  weight's dot type (F16, or 8-bit blocks of 32 or 256), as llama.cpp does; on this random
  net, whose tied head amplifies that rounding, the log-probabilities move by up to ~0.3.
  The reference for that is the same float64 forward rounding the activations as ggml does
  (``llama_ref.round_activations``, written from ggml's quantize_row_q8_0/q8_K): pytrain
  kept and that emulation are two roundings of the F32 function, compared within the kept
  type's own noise on these tokens (``bounds.assert_same_rounding``; the emulation agrees
  with pytrain to 1e-6 for most types, and at most flips a few 8-bit roundings);
* the loss with the weights kept differs from the F32 one by at most the largest change of
  a log-probability (the loss is a mean of log-probabilities), and the LoRA gradients by at
  most that much relative to their scale;
* pytrain computes what llama.cpp computes on the same file, within the same noise bounds.
  Both run ggml-cpu's kernels, so the logits are usually bit-identical, unless a last-bit
  difference upstream (llama.cpp's softmax runs over its padded KV cache) flips the 8-bit
  rounding of an activation.  BF16 is not compared: pytrain runs it as F16, llama.cpp
  rounds the activations to BF16.
"""
import numpy as np
import pytest
from bounds import assert_same_rounding, log_softmax
from scripts.gguf_models import write_llama
from scripts.llama_ref import forward, gguf_contents, gguf_types

import pytrain
from pytrain import ggml
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets
from pytrain.step import loss as L
from pytrain.step.graphs import GradGraph

TYPES = ["f16", "bf16", "q8_0", "q6_K", "q5_K", "q5_0", "q5_1", "q4_K", "q4_0", "q4_1", "q3_K",
         "q2_K"]
TOKENS = np.random.default_rng(5).integers(0, 64, 24)


def kept_and_f32(path) -> dict:
    """pytrain's log-probabilities of TOKENS with the weights kept and as F32."""
    out = {}
    for policy in ("auto", "f32"):
        m = pytrain.load_model(path, device="cpu", threads=2, type_policy=policy)
        try:
            out[policy] = log_softmax(m.logits(TOKENS))
            out[policy + "_type"] = ggml.type_name(m.weights.tensors["blk.0.attn_q.weight"].type)
        finally:
            m.close()
    return out


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


@pytest.fixture(scope="module")
def f32_rounding(tmp_path_factory) -> float:
    """How far one unit of float32 rounding of every weight moves this net's log-probabilities
    of TOKENS (the F32 file of the same net, against a copy with its weights nudged)."""
    from perturbation import perturbed_model
    tmp = tmp_path_factory.mktemp("f32")
    path = write_llama(tmp / "m-f32.gguf", "f32").path
    logp = [kept_and_f32(p)["f32"] for p in (path, perturbed_model(path, tmp))]
    return float(np.abs(logp[0] - logp[1]).max())


@pytest.mark.parametrize("dtype", TYPES)
def test_weight_type(tmp_path, dtype, measured, f32_rounding):
    model = write_llama(tmp_path / f"m-{dtype}.gguf", dtype)
    assert model.types["blk.1.ffn_down.weight"] == dtype
    W, F = gguf_contents(model.path)
    exact = forward(W, F, TOKENS)
    # what pytrain keeps each tensor as (BF16 as F16): the activation rounding to emulate
    kept_as = {k: ("F16" if v == "BF16" else v) for k, v in gguf_types(model.path).items()}
    emulated = forward(W, F, TOKENS, kept_as)
    got = kept_and_f32(model.path)
    assert got["auto_type"].lower() == ("f16" if dtype == "bf16" else dtype.lower())
    err_f32 = float(np.abs(got["f32"] - exact).max())
    noise = float(np.abs(got["auto"] - got["f32"]).max())
    print(f"{dtype}: as F32 {err_f32:.2e}, kept {np.abs(got['auto'] - exact).max():.2e} "
          f"(emulated {np.abs(emulated - exact).max():.2e}, kept vs emulated "
          f"{np.abs(got['auto'] - emulated).max():.2e})")
    from bounds import f32_bound
    bound = f32_bound(f32_rounding, exact)
    measured(f"{dtype} loaded as F32 vs float64, max |Δ log-softmax|", err_f32, bound)
    measured(f"{dtype} kept vs float64 rounding activations as ggml does, max |Δ log-softmax|",
             float(np.abs(got["auto"] - emulated).max()), "the type's own noise")
    assert err_f32 <= bound, (err_f32, bound, f32_rounding)
    assert_same_rounding(got["auto"], emulated, got["f32"])

    kept, _ = grads(model.path, "auto")
    as_f32, _ = grads(model.path, "f32")
    assert kept["n_valid"] == as_f32["n_valid"] == len(TOKENS) - 1
    assert abs(kept["loss"] - as_f32["loss"]) <= noise
    worst = 0.0
    for k, v in as_f32["grads"].items():
        scale = float(np.abs(v).max())
        assert scale > 0 and np.isfinite(kept["grads"][k]).all()
        worst = max(worst, float(np.abs(kept["grads"][k] - v).max()) / scale)
    measured(f"{dtype} kept vs F32: loss |Δ|", abs(kept["loss"] - as_f32["loss"]), noise)
    measured(f"{dtype} kept vs F32: LoRA gradients, max error / max |grad|", worst, noise)
    assert worst <= noise, (worst, noise)


@pytest.mark.parametrize("dtype", [t for t in TYPES if t != "bf16"])
def test_weight_type_matches_llama_cpp(llama_logits_exe, tmp_path, dtype, measured):
    from llama_cpp_check import run_llama
    model = write_llama(tmp_path / f"m-{dtype}.gguf", dtype)
    got = kept_and_f32(model.path)
    theirs = log_softmax(run_llama(llama_logits_exe, model.path, None, TOKENS,
                                   tmp_path / "l.f32", 64))
    measured(f"{dtype} kept vs llama.cpp, max |Δ log-softmax|",
             float(np.abs(got["auto"] - theirs).max()), "the type's own noise")
    assert_same_rounding(got["auto"], theirs, got["f32"])
