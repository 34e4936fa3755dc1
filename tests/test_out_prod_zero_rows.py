"""OUT_PROD with zero runs in its second operand (native/patches/0002): the backward of the LM
head, d(hidden) = out_prod(W, d(logits)^T), where the masked loss makes every ignored token's
row exactly zero and the patch skips those products.  The result must equal the plain sum for
every weight type the head can have on the CPU (F32, F16, quantized), for both the contiguous
(transposed gradient, as in the backward) and the strided layout of src1, and through the
unrolled (32 at a time) and scalar paths; an all-zero row must give exactly zero."""
import numpy as np
import pytest

from pytrain import ggml
from pytrain.ggml import lib

E, V, T = 64, 100, 7          # V = 3 unrolled blocks of 32 + a scalar remainder of 4


def gradient(rng):
    g = rng.normal(size=(T, V)).astype(np.float32)
    g[1] = 0.0                 # an ignored token: the whole row
    g[4] = -0.0
    g[2, 32:64] = 0.0          # one whole unrolled block
    g[3, ::3] = 0.0            # scattered zeros
    g[5, 96:] = 0.0            # the scalar remainder
    return g


@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("transposed", [True, False])
def test_out_prod_with_zero_runs_equals_the_full_sum(wtype, transposed):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(V, E)).astype(np.float32)            # numpy [V, E] = ggml ne [E, V]
    g = gradient(rng)                                         # numpy [T, V]
    rt = ggml.Runtime("cpu", threads=2)
    wctx = ggml.Context(n_tensors=1)
    wt = lib.ggml_new_tensor_2d(wctx.ptr, ggml.TYPES[wtype], E, V)
    rt.alloc(wctx)
    ggml.from_numpy(wt, w)
    w_used = ggml.to_numpy(wt).astype(np.float64)             # what ggml holds (rounded)

    ctx = ggml.Context(n_tensors=8, graph_size=16)
    c = ctx.ptr
    if transposed:   # as in MUL_MAT's backward: src1 = transpose(d(logits)), contiguous over V
        gt = lib.ggml_new_tensor_2d(c, lib.GGML_TYPE_F32, V, T)
        src1 = lib.ggml_transpose(c, gt)
        host = g
    else:            # src1 stored [T, V] with T fastest
        gt = lib.ggml_new_tensor_2d(c, lib.GGML_TYPE_F32, T, V)
        src1 = gt
        host = np.ascontiguousarray(g.T)
    lib.ggml_set_input(gt)
    out = lib.ggml_out_prod(c, wt, src1)                      # ne [E, T]
    lib.ggml_set_output(out)
    graph = ggml.new_graph(ctx, 16)
    lib.ggml_build_forward_expand(graph, out)
    rt.alloc_graph(graph, ctx)
    ggml.from_numpy(gt, host)
    rt.compute(graph)
    got = ggml.to_numpy(out)                                  # numpy [T, E]

    want = g.astype(np.float64) @ w_used                      # Σ_v g[t, v] W[v, :]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert not got[1].any() and not got[4].any()              # ignored rows: exactly zero
    rt.forget_graph()
    ctx.close()
    rt.close()
