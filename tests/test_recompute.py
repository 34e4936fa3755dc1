"""Layer-wise recompute (``pytrain.train.recompute``) gives the one-graph step's loss and LoRA
gradients, and needs a fraction of its compute buffer."""
from pathlib import Path

import numpy as np
import pytest

import pytrain
from pytrain.train import loss as L
from pytrain.models import lora
from pytrain.train import recompute as R
from pytrain.train.graphs import GradGraph
from pytrain.models.lora_targets import select_targets

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"
ONE_CHUNK = R.HEAD_CHUNK_BYTES          # the default: the fixtures' targets fit one chunk
GRAD_ROUNDING = 5e-5                    # as in test_masked_loss.py: float32 sums regrouped


def adapted(path):
    m = pytrain.load_model(path, device="cpu", threads=2)
    ad = lora.create(m.runtime, m.config, select_targets(m.config), rank=4, alpha=8, seed=0)
    rng = np.random.default_rng(0)
    vals = ad.get()
    for k in vals:                  # B != 0 so that A gets a gradient too
        if k.endswith("lora_b"):
            vals[k] = rng.normal(0, 0.05, vals[k].shape).astype(np.float32)
    ad.set(vals)
    return m, ad


def adapted_start():
    """The adapter ``adapted`` starts from (on the gqa fixture)."""
    m, ad = adapted(FIX / "gqa-f32.gguf")
    try:
        return ad.get()
    finally:
        m.close()


def packed_batch(seed=0, B=3, T=40):
    """Rows with padding, two packed samples and prompt tokens masked."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 480, (B, T))
    seg = np.zeros((B, T), np.int64)
    seg[1, 30:] = -1
    seg[2, 20:] = 1
    return tokens, seg, L.shift_targets(tokens, rng.random((B, T)) < 0.6, seg)


@pytest.mark.parametrize("fixture", ["gqa-f32.gguf", "untied-f32.gguf"])
@pytest.mark.parametrize("chunk_bytes", [ONE_CHUNK, 4 * 1024 * 16])
def test_layer_recompute_equals_the_one_graph_step(fixture, chunk_bytes, monkeypatch):
    """Same loss, valid count and LoRA gradients (the same ops run, a layer at a time), also
    when the head and loss run on several chunks of 16 rows (66 targets here)."""
    monkeypatch.setattr(R, "HEAD_CHUNK_BYTES", chunk_bytes)
    m, ad = adapted(FIX / fixture)
    try:
        tokens, seg, tgt = packed_batch()
        g = GradGraph(m, ad, 3, 40)
        one = g.run(tokens, seg, tgt)
        g.close()
        r = R.RecomputeGraph(m, ad, 3, 40)
        assert r.l0 == min(int(n.split(".")[1]) for n in ad.names) > 0
        n_chunks = -(-one["n_valid"] // r.rows)
        assert (n_chunks > 1) == (chunk_bytes != ONE_CHUNK)
        rec = r.run(tokens, seg, tgt)
        r.close()
    finally:
        m.close()
    assert rec["n_valid"] == one["n_valid"] > 0
    assert rec["loss"] == pytest.approx(one["loss"], rel=1e-6)
    for k, v in one["grads"].items():
        scale = float(np.abs(v).max())
        assert scale > 0
        # the same ops; only the head's GEMM on 16-row chunks (ggml-cpu) instead of all rows
        # at once (BLAS) groups its sums differently: 1.3e-6 of the scale measured
        np.testing.assert_allclose(rec["grads"][k], v, atol=GRAD_ROUNDING * scale, rtol=0,
                                   err_msg=k)


def test_training_with_recompute_gives_the_same_adapter():
    """Three AdamW steps of two micro-batches each, recompute on, off and auto (which measures
    the one-graph step with a scheduler of its own, then trains one graph: this model is
    tiny; measuring with the runtime's scheduler once left a plan without buffers and the
    next step crashed)."""
    from pytrain.data import Example, make_batches
    from pytrain.train.optimizer import AdamW
    from pytrain.train.trainer import Trainer
    rng = np.random.default_rng(3)
    ex = [Example(rng.integers(0, 480, n).astype(np.int32), rng.random(n) < 0.7)
          for n in (17, 30, 9, 24, 31, 12, 20, 26, 14, 33, 8, 21)]
    batches = make_batches(ex, 2, seed=1)
    out = {}
    for mode in ("off", "layers", "auto"):
        m, ad = adapted(FIX / "gqa-f32.gguf")
        tr = Trainer(m, ad, AdamW(lr=1e-2), recompute=mode)
        losses = [tr.step(batches[i:i + 2], 1e-2).loss for i in (0, 2, 4)]
        kinds = {type(g).__name__ for g in tr.graphs.values()}
        out[mode] = (losses, ad.get(), kinds)
        tr.close()
        m.close()
    assert out["off"][2] == out["auto"][2] == {"GradGraph"}
    assert out["layers"][2] == {"RecomputeGraph"}
    lr, steps = 1e-2, 3
    for mode in ("layers", "auto"):
        np.testing.assert_allclose(out[mode][0], out["off"][0], rtol=1e-6)
        for k, v in out["off"][1].items():
            # AdamW divides each gradient element by its own running magnitude, so an element
            # whose gradient is near zero turns the float32 regrouping of the gradients
            # (GRAD_ROUNDING of their scale, test above) into an update difference of a
            # fraction of lr, not of the element: bit-identical on AMD EPYC (AVX2), 1.6e-6 =
            # 1.6e-4·lr on one element of 512 on an Intel Xeon with AVX-512 (other kernels
            # group the sums differently).  Bound: 1e-3·lr per step, and the whole adapter
            # within 1e-4 of the distance it moved.
            np.testing.assert_allclose(out[mode][1][k], v, atol=1e-3 * lr * steps, rtol=0,
                                       err_msg=k)
        start = adapted_start()
        moved = np.sqrt(sum(float(np.sum((v - start[k]) ** 2)) for k, v in out["off"][1].items()))
        diff = np.sqrt(sum(float(np.sum((out[mode][1][k] - v) ** 2))
                           for k, v in out["off"][1].items()))
        assert moved > 0 and diff <= 1e-4 * moved, (mode, diff, moved)


def test_recompute_needs_a_fraction_of_the_memory_at_the_2b_shape():
    """Measured by the scheduler without allocating: batch 4 x 1024 of the Qwen3.5-2B shape,
    half the tokens targets.  The one-graph step needs ~34 GiB; layer by layer the largest
    graph needs a few (bench_results/memory.md has the table)."""
    from pytrain.models.qwen35_config import QWEN35_2B
    from pytrain.train.planning import compute_bytes, shape_model
    m = shape_model("qwen35", QWEN35_2B, "f16")
    try:
        ad = lora.create(m.runtime, m.config, select_targets(m.config), 16, 32.0)
        g = GradGraph(m, ad, 4, 1024, rows=2048)
        one = compute_bytes(m.runtime, g.graph)
        g.close()
        r = R.RecomputeGraph(m, ad, 4, 1024)
        peak = max(compute_bytes(m.runtime, gr) for gr in r.graphs())
        r.close()
    finally:
        m.close()
    assert one > 30 * 2**30
    assert peak < one / 8, (peak / 2**30, one / 2**30)


def test_compute_bytes_counts_a_shared_buffer_once(monkeypatch):
    """The BLAS and CPU backends share one compute buffer (same buffer type): the planned size
    with both equals the size with the CPU backend alone, not twice it."""
    from pytrain.train.planning import compute_bytes
    sizes = {}
    for blas in ("1", "0"):
        monkeypatch.setenv("PYTRAIN_BLAS", blas)
        m, ad = adapted(FIX / "gqa-f32.gguf")
        try:
            assert (m.runtime.blas is not None) == (blas == "1")   # make build has BLAS
            g = GradGraph(m, ad, 3, 40)
            sizes[blas] = compute_bytes(m.runtime, g.graph)
            g.close()
        finally:
            m.close()
    assert sizes["1"] == sizes["0"] > 0, sizes


@pytest.mark.parametrize("factor, layer_wise", [(1.9, True), (2.1, False)])
def test_auto_recomputes_only_when_one_graph_would_not_fit(factor, layer_wise, monkeypatch):
    """``auto``: layer-wise when the one-graph step's buffer plus the weights exceed half of the
    device memory, one graph when they fit (device memory set to ``factor`` x that need)."""
    from pytrain.train.optimizer import AdamW
    from pytrain.train.planning import compute_bytes
    from pytrain.train.trainer import Trainer, bucket_length
    m, ad = adapted(FIX / "gqa-f32.gguf")
    try:
        T = bucket_length(m, 40)                  # the length the trainer's graphs run at
        g = GradGraph(m, ad, 3, T, rows=L.rows_bucket(3 * T, 3 * T))
        need = compute_bytes(m.runtime, g.graph) + m.weights.total_bytes
        g.close()
        monkeypatch.setattr(m.runtime, "device_memory", lambda: int(factor * need))
        tr = Trainer(m, ad, AdamW(lr=1e-3), recompute="auto")
        assert isinstance(tr.graph(3, 40, n_targets=10), R.RecomputeGraph) == layer_wise
        tr.close()
    finally:
        m.close()
