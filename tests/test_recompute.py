"""Layer-wise recompute (``pytrain.step.recompute``) gives the one-graph step's loss and LoRA
gradients, and needs a fraction of its compute buffer."""
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import pytrain
import step_rounding
from bounds import assert_adamw_close, f32_bound
from pytrain.step import loss as L
from pytrain.models import lora
from pytrain.step import recompute as R
from pytrain.step.graphs import GradGraph
from pytrain.models.lora_targets import select_targets

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"
ONE_CHUNK = R.HEAD_CHUNK_BYTES          # the default: the fixtures' targets fit one chunk

pytestmark = pytest.mark.slow   # training steps three ways at several shapes: tens of seconds


def adapted(path, **load):
    """The model at ``path`` (``load``: more ``load_model`` arguments) with a rank-4 adapter
    whose B is not zero."""
    m = pytrain.load_model(path, device="cpu", threads=2, **load)
    ad = lora.create(m.runtime, m.config, select_targets(m.config), rank=4, alpha=8, seed=0)
    rng = np.random.default_rng(0)
    vals = ad.get()
    for k in vals:                  # B != 0 so that A gets a gradient too
        if k.endswith("lora_b"):
            vals[k] = rng.normal(0, 0.05, vals[k].shape).astype(np.float32)
    ad.set(vals)
    return m, ad


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
    when the head and loss run on several chunks of 16 rows (66 targets here): within the
    float32 rounding of the one-graph step measured on the same batch
    (tests/step_rounding.py)."""
    monkeypatch.setattr(R, "HEAD_CHUNK_BYTES", chunk_bytes)
    m, ad = adapted(FIX / fixture)
    try:
        tokens, seg, tgt = packed_batch()
        rounding = step_rounding.measure(m, ad, 3, 40, tokens, seg, tgt)
        one = rounding["ref"]
        r = R.RecomputeGraph(m, ad, 3, 40)
        assert r.l0 == min(int(n.split(".")[1]) for n in ad.names) > 0
        n_chunks = -(-one["n_valid"] // r.rows)
        assert (n_chunks > 1) == (chunk_bytes != ONE_CHUNK)
        rec = r.run(tokens, seg, tgt)
        r.close()
    finally:
        m.close()
    assert rec["n_valid"] == one["n_valid"] > 0
    assert max(float(np.abs(v).max()) for v in one["grads"].values()) > 0
    step_rounding.assert_step_close(rec, one, rounding)


def test_training_with_recompute_gives_the_same_adapter():
    """Three AdamW steps of two micro-batches each, recompute on, off and auto (which measures
    the one-graph step with a scheduler of its own, then trains one graph: this model is
    tiny; measuring with the runtime's scheduler once left a plan without buffers and the
    next step crashed)."""
    from pytrain.data import Example, make_batches
    from pytrain.step.optimizer import AdamWSettings
    from pytrain.step.trainer import Trainer
    rng = np.random.default_rng(3)
    ex = [Example(rng.integers(0, 480, n).astype(np.int32), rng.random(n) < 0.7)
          for n in (17, 30, 9, 24, 31, 12, 20, 26, 14, 33, 8, 21)]
    batches = make_batches(ex, 2, seed=1)
    out = {}
    for mode in ("off", "layers", "auto", "calib"):
        # calib: the one-graph steps again with every micro-batch's rows reversed and the F32
        # matmuls on the other kernels (BLAS toggled): the same training, rounded otherwise
        blas = os.environ.get("PYTRAIN_BLAS", "1")
        if mode == "calib":
            os.environ["PYTRAIN_BLAS"] = "0" if blas not in ("", "0") else "1"
        try:
            m, ad = adapted(FIX / "gqa-f32.gguf")
        finally:
            os.environ["PYTRAIN_BLAS"] = blas
        tr = Trainer(m, ad, AdamWSettings(lr=1e-2), recompute="off" if mode == "calib" else mode)
        steps = [batches[i:i + 2] for i in (0, 2, 4)]
        if mode == "calib":
            steps = [[SimpleNamespace(tokens=b.tokens[::-1].copy(), seg=b.seg[::-1].copy(),
                                      train_mask=b.train_mask[::-1].copy()) for b in s]
                     for s in steps]
        results = [tr.step(s, 1e-2) for s in steps]
        kinds = {type(g).__name__ for g in tr.graphs.values()}
        out[mode] = (results, ad.get(), kinds)
        tr.close()
        m.close()
    assert out["off"][2] == out["auto"][2] == {"GradGraph"}
    assert out["layers"][2] == {"RecomputeGraph"}
    for mode in ("layers", "auto"):
        # every step's loss and gradient norm within the rounding of the same step measured by
        # the calibration run (from step 2 on both pairs also carry AdamW's amplification of
        # step 1's rounding, alike); the adapter within AdamW's own bound (tests/bounds.py)
        for got, want, calib in zip(out[mode][0], out["off"][0], out["calib"][0]):
            assert got.n_valid == want.n_valid
            for key in ("loss", "grad_norm"):
                x, y, z = getattr(got, key), getattr(want, key), getattr(calib, key)
                assert abs(x - y) <= f32_bound(abs(y - z), y), (mode, key, x, y, z)
        assert_adamw_close(out[mode][1], out["off"][1], lrs=[1e-2] * 3, calib=out["calib"][1])


def test_recompute_needs_a_fraction_of_the_memory_at_the_2b_shape():
    """Measured by the scheduler without allocating: batch 4 x 1024 of the Qwen3.5-2B shape,
    half the tokens targets.  The one-graph step needs ~22 GiB (34 before the DeltaNet layers'
    fused recurrence, patch 0020, on the CPU); layer by layer the largest graph needs under
    1 GiB."""
    from pytrain.models.qwen35_config import QWEN35_2B
    from pytrain.step.graph_memory import compute_bytes, shape_model
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
    assert one > 16 * 2**30
    assert peak < one / 8, (peak / 2**30, one / 2**30)


def test_compute_bytes_counts_a_shared_buffer_once(monkeypatch):
    """The BLAS and CPU backends share one compute buffer (same buffer type): the planned size
    with both equals the size with the CPU backend alone, not twice it."""
    from pytrain.step.graph_memory import compute_bytes
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
    """``auto``: layer-wise when the one-graph step's buffer exceeds half of the memory left
    for it, one graph when it fits (memory left set to ``factor`` x that buffer)."""
    from pytrain.step import trainer as trainer_mod
    from pytrain.step.optimizer import AdamWSettings
    from pytrain.step.graph_memory import compute_bytes
    from pytrain.step.trainer import Trainer, bucket_length
    m, ad = adapted(FIX / "gqa-f32.gguf")
    try:
        T = bucket_length(m, 40)                  # the length the trainer's graphs run at
        g = GradGraph(m, ad, 3, T, rows=L.rows_bucket(3 * T, 3 * T))
        need = compute_bytes(m.runtime, g.graph)
        g.close()
        monkeypatch.setattr(trainer_mod, "available_bytes", lambda rt: int(factor * need))
        tr = Trainer(m, ad, AdamWSettings(lr=1e-3), recompute="auto")
        assert isinstance(tr.graph(3, 40, n_targets=10), R.RecomputeGraph) == layer_wise
        tr.close()
        # train.memory_gib overrides what the device reports (weights included)
        tr = Trainer(m, ad, AdamWSettings(lr=1e-3), recompute="auto",
                     memory_bytes=m.weights.total_bytes + int(factor * need))
        assert isinstance(tr.graph(3, 40, n_targets=10), R.RecomputeGraph) == layer_wise
        tr.close()
    finally:
        m.close()


@pytest.mark.parametrize("version", [1, 2])
def test_memory_left_follows_the_containers_cgroup(tmp_path, monkeypatch, version):
    """On the CPU ggml reports physical pages, blind to a container's limit: the cgroup's
    limit minus its usage bounds what a step may plan for (v2 memory.max / memory.current
    under the process's unified path; v1 memory.limit_in_bytes / memory.usage_in_bytes)."""
    from pytrain.step import free_memory as memory
    root = tmp_path / "cgroup"
    if version == 2:
        d = root / "job"
        d.mkdir(parents=True)
        (d / "memory.max").write_text(f"{3 * 2**30}\n")
        (d / "memory.current").write_text(f"{2**30}\n")
        (tmp_path / "self").write_text("0::/job\n")
    else:
        d = root / "memory" / "job"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{3 * 2**30}\n")
        (d / "memory.usage_in_bytes").write_text(f"{2**30}\n")
        (tmp_path / "self").write_text("4:memory:/job\n0::/\n")
    monkeypatch.setattr(memory, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory, "PROC_SELF_CGROUP", tmp_path / "self")
    # the system's MemAvailable fixed too: the machine's own moves by pages between two reads
    meminfo = tmp_path / "meminfo"
    monkeypatch.setattr(memory, "MEMINFO", meminfo)
    meminfo.write_text(f"MemTotal:       {8 * 2**20} kB\nMemAvailable:   {5 * 2**20} kB\n")
    assert memory.cgroup_available() == 2 * 2**30 and memory.system_available() == 5 * 2**30
    m, _ = adapted(FIX / "gqa-f32.gguf")
    try:
        assert memory.available_bytes(m.runtime) == 2 * 2**30          # the cgroup's, lower
        meminfo.write_text(f"MemAvailable:   {2**20} kB\n")
        assert memory.available_bytes(m.runtime) == 2**30               # the system's, lower
        meminfo.write_text(f"MemAvailable:   {5 * 2**20} kB\n")
        (d / ("memory.max" if version == 2 else "memory.limit_in_bytes")).write_text(
            "max\n" if version == 2 else f"{2**63 - 4096}\n")     # no limit
        assert memory.cgroup_available() is None
        assert memory.available_bytes(m.runtime) == 5 * 2**30
    finally:
        m.close()