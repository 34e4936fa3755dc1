"""A graph the scheduler splits between a device and the CPU, computed again after another
graph (or after being allocated afresh), gives the same values as the first time.

ggml's scheduler rewires each node whose src lives on the other backend to a copy of it made
in its own context, which it re-makes in the same buffer at the next split: the graph kept
pointing at tensors that were by then another graph's copies (the RPC rehearsal's loss went
6.23 -> 0.00004).  pytrain's patch 0012 gives the graph its own srcs back after every call.
Without it this test aborts at its third computation (g1 again, after g2 was split): the
scheduler finds g1's node reading a copy it never placed, ``ggml-backend.cpp:1373:
GGML_ASSERT(src_backend_id != -1) failed``.

Each graph here is ggml-vulkan ops around a DIAG_MASK_ZERO, which ggml-vulkan has no kernel
for, so the scheduler splits it into device, CPU, device, with copies both ways.
Values against numpy in float64: the ops are exp, mul, sqr, add, a masked sum, float32
rounding of a few dozen terms; bound 64 float32 ulps of the sum of magnitudes."""
import numpy as np
import pytest
from vulkan_support import vulkan_device

from pytrain import ggml
from pytrain.ggml import lib

N = 8


@pytest.fixture
def split_device():
    vulkan_device()
    return "vulkan"


def graphs(rt):
    """Weights ``a`` on the device; two graphs over an input ``x``:
    g1: sum(mask0(exp(x·a)) · a), g2: mean(mask0((x + a)²))."""
    wctx = ggml.Context(n_tensors=4)
    a = lib.ggml_new_tensor_2d(wctx.ptr, lib.GGML_TYPE_F32, N, N)
    rt.alloc(wctx)
    ctxs, out = [], []
    for kind in ("g1", "g2"):
        ctx = ggml.Context(n_tensors=32, graph_size=64)
        c = ctx.ptr
        x = lib.ggml_new_tensor_2d(c, lib.GGML_TYPE_F32, N, N)
        lib.ggml_set_input(x)
        if kind == "g1":
            y = lib.ggml_sum(c, lib.ggml_mul(c, lib.ggml_diag_mask_zero(
                c, lib.ggml_exp(c, lib.ggml_mul(c, x, a)), 0), a))
        else:
            y = lib.ggml_mean(c, lib.ggml_reshape_1d(c, lib.ggml_diag_mask_zero(
                c, lib.ggml_sqr(c, lib.ggml_add(c, x, a)), 0), N * N))
        lib.ggml_set_output(y)
        g = ggml.new_graph(ctx, 64)
        lib.ggml_build_forward_expand(g, y)
        ctxs.append(ctx)
        out.append((g, ctx, x, y))
    return wctx, a, out


def want(kind: str, x: np.ndarray, a: np.ndarray) -> tuple[float, float]:
    """(value, bound) in float64; numpy's rows are ggml's dim 1, so the mask keeps j <= i."""
    keep = np.tril(np.ones((N, N)))
    x, a = x.astype(np.float64), a.astype(np.float64)
    terms = np.exp(x * a) * keep * a if kind == "g1" else (x + a) ** 2 * keep / (N * N)
    return float(terms.sum()), 64 * 2.0 ** -24 * float(np.abs(terms).sum())


def run(rt, entry, x_val):
    g, ctx, x, y = entry
    rt.alloc_graph(g, ctx)
    ggml.from_numpy(x, x_val)
    rt.compute(g)
    return float(ggml.to_numpy(y).reshape(-1)[0])


def test_split_graphs_alternate_and_reallocate_with_the_right_inputs(split_device):
    rng = np.random.default_rng(0)
    rt = ggml.Runtime(split_device, threads=2, allow_cpu_fallback=True)
    wctx, a, (g1, g2) = graphs(rt)
    try:
        a_val = rng.uniform(-1, 1, (N, N)).astype(np.float32)
        ggml.from_numpy(a, a_val)
        rt.alloc_graph(g1[0], g1[1])
        assert lib.ggml_backend_sched_get_n_splits(rt.sched) >= 3       # device, CPU, device
        assert sorted(set(rt.cpu_fallbacks(g1[0]))) == ["DIAG_MASK_ZERO"]
        # g1, g2, g1 again (re-split after g2), then g1 allocated afresh, each with new inputs
        for i, (entry, kind, fresh) in enumerate([(g1, "g1", False), (g2, "g2", False),
                                                  (g1, "g1", False), (g1, "g1", True),
                                                  (g2, "g2", False), (g1, "g1", False)]):
            if fresh:
                rt.forget_graph()
            x_val = rng.uniform(-1, 1, (N, N)).astype(np.float32)
            got = run(rt, entry, x_val)
            value, bound = want(kind, x_val, a_val)
            assert abs(got - value) <= bound, (i, kind, got, value)
    finally:
        for _, ctx, _, _ in (g1, g2):
            rt.forget_graph()
            ctx.close()
        rt.close()
        wctx.close()
