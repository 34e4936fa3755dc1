"""The float32 rounding of one training step (loss and LoRA gradients), measured on the same
input, for tests that compare two computations of a step that are mathematically equal
(another padding width, micro-batches against one batch, layer-wise recompute against one
graph).  ``bounds.py`` says why a measured rounding, not a fixed number, is the bound.

The step is computed twice more in a way that changes nothing but rounding: the batch's rows
in reverse order (every float32 sum over rows, the LoRA gradients among them, regrouped) and
the F32 matmuls rounded by the other kernels (the BLAS backend off if it was on, on if it was
off): the two things that make another batch shape, or another CPU, round differently."""
from __future__ import annotations

import os

import numpy as np

import pytrain
from bounds import F32_SPREAD, f32_bound, ulps
from pytrain.step.graphs import GradGraph


def _step(model, adapter, B, T, tokens, seg, targets, **kw) -> dict:
    g = GradGraph(model, adapter, B=B, T=T, **kw)
    try:
        return g.run(tokens, seg, targets)
    finally:
        g.close()


def measure(model, adapter, B: int, T: int, tokens, seg, targets,
            type_policy: str = "auto") -> dict:
    """{"loss": |Δ loss|, "grads": {name: max |Δ g|}} between the step as given and the step
    with rows reversed and the other matmul kernels."""
    ref = _step(model, adapter, B, T, tokens, seg, targets)
    blas = os.environ.get("PYTRAIN_BLAS", "1") not in ("", "0")
    old = os.environ.get("PYTRAIN_BLAS")
    os.environ["PYTRAIN_BLAS"] = "0" if blas else "1"
    try:
        other = pytrain.load_model(model.path, device="cpu", threads=model.runtime.threads,
                                   type_policy=type_policy)
    finally:
        if old is None:
            del os.environ["PYTRAIN_BLAS"]
        else:
            os.environ["PYTRAIN_BLAS"] = old
    try:
        from pytrain.models import lora
        ad = lora.create(other.runtime, other.config, sorted(adapter.names), adapter.rank,
                         adapter.alpha, seed=0, rslora=adapter.rslora)
        ad.set(adapter.get())
        rev = _step(other, ad, B, T, tokens[::-1].copy(), seg[::-1].copy(),
                    targets[::-1].copy())
    finally:
        other.close()
    return {"loss": abs(rev["loss"] - ref["loss"]),
            "grads": {k: float(np.abs(rev["grads"][k] - v).max()) for k, v in ref["grads"].items()},
            "ref": ref}


def worst(*roundings: dict) -> dict:
    """The larger rounding of several ``measure`` results, key by key: two computations of
    different shapes are compared with the rounding measured at each shape (only the wider
    one may reach the BLAS kernels, whose rounding the toggle then shows)."""
    return {"loss": max(r["loss"] for r in roundings),
            "grads": {k: max(r["grads"][k] for r in roundings) for k in roundings[0]["grads"]}}


def assert_step_close(got: dict, want: dict, rounding: dict) -> None:
    """``got`` and ``want`` (GradGraph.run results) equal to within ``bounds.F32_SPREAD`` times
    the rounding ``measure`` found on the same input (at least a few ulps of each value)."""
    assert got["n_valid"] == want["n_valid"]
    assert abs(got["loss"] - want["loss"]) <= f32_bound(rounding["loss"], want["loss"]), (
        got["loss"], want["loss"], rounding["loss"])
    for k, v in want["grads"].items():
        err = float(np.abs(got["grads"][k] - v).max())
        bound = F32_SPREAD * max(rounding["grads"][k], ulps(v))
        assert err <= bound, (k, err, bound)
