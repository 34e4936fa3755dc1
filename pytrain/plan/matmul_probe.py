"""The rate one matrix product reaches through the library a training step uses: a ggml graph
of one MUL_MAT (or OUT_PROD) at a given shape, computed by a runtime's scheduler.

Why: "the step is slow" needs a yardstick on the same machine, library and thread count.
The probe goes through the step's own path: the first operand sits in a weights buffer as the
model's do, the scheduler gives the node to ggml-blas where it takes it (OpenBLAS sgemm for
F32; oneDNN's bf16 matmul for BF16 weights, patch 0018) and to ggml-cpu otherwise, with the
runtime's threads.  Its operands are contiguous and filled with small nonzero values (an
exactly zero gradient row is skipped by OUT_PROD, patch 0002).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from pytrain import ggml
from pytrain.ggml import ffi, lib
from pytrain.plan.products import Shape

_TYPES = {k.upper(): v for k, v in ggml.TYPES.items()}


@dataclass
class ProbeResult:
    label: str
    flops: int
    backend: str            # where the scheduler ran the node ("BLAS", "CPU")
    times: list[float]      # seconds per product, after the warm-up computes
    best_gflops: float      # from the fastest product: contention only adds time
    median_gflops: float

    def to_dict(self) -> dict:
        return asdict(self)


def square(n: int, a_type: str = "F32") -> Shape:
    """An n x n x n MUL_MAT (a [n, n] of ``a_type`` times b [n, n] F32)."""
    return Shape("MUL_MAT", a_type, (n, n, 1, 1), (n, n, 1, 1), (n, n, 1, 1))


def _fill(t, seed: int, chunk_bytes: int = 16 << 20) -> None:
    """Small nonzero values: a few random rows encoded in the tensor's type (ggml's own
    conversion), copied over the whole tensor a chunk at a time (a random array of a 2B head
    weight's size would cost seconds and gigabytes)."""
    row = int(t.ne[0])
    n_rows = int(lib.ggml_nelements(t)) // row
    vals = np.random.default_rng(seed).uniform(0.5, 1.0, row * min(n_rows, 7)) / 64
    raw = ggml.to_bytes(vals.astype(np.float32), t.type, row)
    reps = max(1, chunk_bytes // raw.nbytes)
    chunk = np.tile(raw, reps)
    total, off = int(lib.ggml_nbytes(t)), 0
    while off < total:
        n = min(chunk.nbytes, total - off)
        lib.ggml_backend_tensor_set(t, ffi.from_buffer(chunk), off, n)
        off += n


def probe(runtime, shape: Shape, reps: int = 3, budget_s: float = 1.0) -> ProbeResult:
    """Time computes of one ``shape.op`` node at ``shape``'s operand shapes (the first operand
    of ``shape.a_type`` in a weights buffer, the second F32) on ``runtime``: one warm-up
    compute (oneDNN makes its primitive, the pages are touched), then ``reps``, fewer (at
    least 1) where they would take more than ``budget_s``: the mid shape's LM-head products
    take 0.4-0.8 s each on 2 cores, and the probes must stay a small part of a benchmark
    run."""
    if shape.op not in ("MUL_MAT", "OUT_PROD"):
        raise ValueError(f"no probe for {shape.op}")
    wctx = ggml.Context(n_tensors=2)
    gctx = ggml.Context(n_tensors=4, graph_size=16)
    buf = None
    try:
        a = lib.ggml_new_tensor(wctx.ptr, _TYPES[shape.a_type], 4, ffi.new("int64_t[]", shape.a))
        b = lib.ggml_new_tensor(wctx.ptr, lib.GGML_TYPE_F32, 4, ffi.new("int64_t[]", shape.b))
        buf = runtime.alloc(wctx)
        lib.ggml_backend_buffer_set_usage(buf, lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        _fill(a, 1)
        _fill(b, 2)
        op = lib.ggml_mul_mat if shape.op == "MUL_MAT" else lib.ggml_out_prod
        out = op(gctx.ptr, a, b)
        if tuple(int(out.ne[i]) for i in range(4)) != tuple(shape.dst):
            raise ValueError(f"{shape.label()}: result ne {[int(out.ne[i]) for i in range(4)]}, "
                             f"expected {list(shape.dst)}")
        g = ggml.new_graph(gctx, 16)
        lib.ggml_build_forward_expand(g, out)
        runtime.alloc_graph(g, gctx)
        backend = runtime.node_backend(out)
        t0 = time.perf_counter()
        runtime.compute(g)
        warm = time.perf_counter() - t0
        times = []
        for _ in range(max(1, min(reps, int(budget_s / max(warm, 1e-9))))):
            t0 = time.perf_counter()
            runtime.compute(g)
            times.append(time.perf_counter() - t0)
    finally:
        runtime.forget_graph()
        gctx.close()
        if buf is not None:
            runtime.free(buf)
        wctx.close()
    f = shape.flops
    return ProbeResult(shape.label(), f, backend, times, f / min(times) / 1e9,
                       f / statistics.median(times) / 1e9)


def probe_all(runtime, shapes: list[Shape], reps: int = 3,
              budget_s: float = 1.0) -> list[ProbeResult]:
    """Each shape once (duplicates and shapes without a probe left out), in order."""
    out, seen = [], set()
    for s in shapes:
        if s in seen or s.op not in ("MUL_MAT", "OUT_PROD") or math.prod(s.dst) == 0:
            continue
        seen.add(s)
        out.append(probe(runtime, s, reps, budget_s))
    return out
