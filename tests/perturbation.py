"""Float32 rounding measured by perturbation (tests/bounds.py): the same model and adapter
with every float32 weight moved one float32 step up or down at random.  Where no float64
forward exists for an input (random tokens, an adapter), how far that moves the output is
how much this network amplifies one unit of float32 rounding on this input; two float32
implementations of the function are compared with ``bounds.f32_bound`` of it."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def nudged(tensors: dict, seed: int = 0) -> dict:
    """Each float32 array moved one float32 step up or down per element, at random."""
    rng = np.random.default_rng(seed)
    out = {}
    for k in sorted(tensors):
        v = np.asarray(tensors[k], np.float32)
        up = rng.integers(0, 2, v.shape).astype(bool)
        out[k] = np.where(up, np.nextafter(v, np.float32(np.inf)),
                          np.nextafter(v, np.float32(-np.inf))).astype(np.float32)
    return out


def perturbed_model(path: Path, tmp: Path) -> Path:
    """A copy of the GGUF at ``path`` with its F32 tensors nudged (scripts/gguf_models.py)."""
    from scripts.gguf_models import perturbed_copy
    return perturbed_copy(path, tmp / f"perturbed-{Path(path).name}")


def adapter_bounds(path: Path, tmp: Path, toks, ours_base, ours_lora,
                   adapter_of) -> tuple[float, float]:
    """``f32_bound`` of pytrain's logits without and with an adapter on ``path``: how far the
    perturbed model (and the adapter ``adapter_of(model)`` returns, nudged) moves them.  Two
    float32 implementations of the same function (pytrain and llama.cpp) are compared with
    these."""
    import pytrain
    from bounds import f32_bound
    mp = pytrain.load_model(perturbed_model(path, tmp), device="cpu", threads=2)
    try:
        adp = adapter_of(mp)
        adp.set(nudged(adp.get()))
        base = f32_bound(float(np.abs(mp.logits(toks) - ours_base).max()), ours_base)
        lora = f32_bound(float(np.abs(mp.logits(toks, lora=adp.hook) - ours_lora).max()),
                         ours_lora)
    finally:
        mp.close()
    return base, lora


def logprob_rounding(path: Path, logprobs_of) -> float:
    """pytrain's own float32 rounding of ``logprobs_of(model, perturbed)`` (an array) for the
    model at ``path``, measured now: max |Δ| between that model and its copy with every F32
    weight one float32 step off, both loaded as F32 (``perturbed`` says which: an adapter of
    the caller's is nudged with it).  ``bounds.reference_bounds`` takes it beside a
    reference's rounding made on another machine."""
    import tempfile

    import pytrain
    with tempfile.TemporaryDirectory() as tmp:
        got = []
        for bent, p in ((False, Path(path)), (True, perturbed_model(path, Path(tmp)))):
            m = pytrain.load_model(p, device="cpu", threads=2, type_policy="f32")
            try:
                got.append(np.asarray(logprobs_of(m, bent), np.float64))
            finally:
                m.close()
    return float(np.abs(got[0] - got[1]).max())
