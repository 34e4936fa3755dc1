"""OUT_PROD on ggml's BLAS backend for F32 operands in batches and with strided rows
(native/patches/0008: one sgemm per matrix, src0 broadcast over src1's batch as ggml-cpu does
for grouped-query attention).  Checked against a float64 numpy einsum, and the scheduler must
have run the op on BLAS (sizes below the patch's minimum stay on the CPU, also checked)."""
import os

import numpy as np
import pytest

from pytrain import ggml
from pytrain.ggml import ffi, lib

F32 = lib.GGML_TYPE_F32
pytestmark = pytest.mark.skipif(os.environ.get("PYTRAIN_BLAS", "1") in ("", "0"),
                                reason="PYTRAIN_BLAS=0: the BLAS backend is switched off")


def out_prod(a: np.ndarray, b: np.ndarray, *, transposed_b: bool, padded_a: bool):
    """ggml_out_prod of a (numpy [A2, k, n]) and b (numpy [B2, k, m]) -> ([B2, m, n], backend)."""
    A2, k, n = a.shape
    B2, _, m = b.shape
    rt = ggml.Runtime("cpu", threads=2)
    assert rt.blas is not None, "make build has the BLAS backend (unless PYTRAIN_BLAS=0)"
    ctx = ggml.Context(n_tensors=16, graph_size=16)
    c = ctx.ptr
    pad = 8 if padded_a else 0                      # a view of every row's first n of n + 8
    ta = lib.ggml_new_tensor_3d(c, F32, n + pad, k, A2)
    va = lib.ggml_view_3d(c, ta, n, k, A2, ta.nb[1], ta.nb[2], 0) if padded_a else ta
    if transposed_b:                                # stored [B2, m, k]; transpose -> ne [m, k]
        tb = lib.ggml_new_tensor_3d(c, F32, k, m, B2)
        vb = lib.ggml_transpose(c, tb)
        b_host = np.ascontiguousarray(np.swapaxes(b, 1, 2))
    else:
        tb = lib.ggml_new_tensor_3d(c, F32, m, k, B2)
        vb, b_host = tb, b
    for t in (ta, tb):
        lib.ggml_set_input(t)
    out = lib.ggml_out_prod(c, va, vb)             # ne [n, m, B2]
    lib.ggml_set_output(out)
    graph = ggml.new_graph(ctx, 16)
    lib.ggml_build_forward_expand(graph, out)
    rt.alloc_graph(graph, ctx)
    a_host = np.zeros((A2, k, n + pad), np.float32)
    a_host[..., :n] = a
    a_host[..., n:] = 1e6                          # must never be read
    ggml.from_numpy(ta, a_host)
    ggml.from_numpy(tb, b_host)
    rt.compute(graph)
    be = lib.ggml_backend_sched_get_tensor_backend(rt.sched, out)
    name = ffi.string(lib.ggml_backend_name(be)).decode()
    return ggml.to_numpy(out).reshape(B2, m, n), name


def reference(a, b):
    dps = b.shape[0] // a.shape[0]
    return np.einsum("bkm,bkn->bmn", b.astype(np.float64), np.repeat(a.astype(np.float64), dps, 0))


@pytest.mark.parametrize("transposed_b", [False, True])
@pytest.mark.parametrize("padded_a", [False, True])
@pytest.mark.parametrize("A2, B2", [(1, 1), (3, 3), (2, 6)])
def test_batched_strided_out_prod_on_blas(transposed_b, padded_a, A2, B2):
    rng = np.random.default_rng(A2 * 10 + B2)
    k, n, m = 48, 40, 36
    a = rng.normal(size=(A2, k, n)).astype(np.float32)
    b = rng.normal(size=(B2, k, m)).astype(np.float32)
    got, backend = out_prod(a, b, transposed_b=transposed_b, padded_a=padded_a)
    assert backend == "BLAS"
    want = reference(a, b)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_small_out_prod_stays_on_the_cpu():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2, 48, 16)).astype(np.float32)   # n = 16 < 32
    b = rng.normal(size=(4, 48, 36)).astype(np.float32)
    got, backend = out_prod(a, b, transposed_b=True, padded_a=False)
    assert backend == "CPU"
    np.testing.assert_allclose(got, reference(a, b), rtol=0, atol=1e-5 * np.abs(got).max())


@pytest.mark.parametrize("n", [45, 64])
def test_f16_weight_out_prod_on_blas(n):
    """A frozen F16 weight's OUT_PROD (the backward of a matmul for its input) on BLAS: the
    weight is converted to F32 in slabs (patch 0005; patch 0009: with F16C where the CPU has
    it, a row length with a scalar tail too), exactly, so the product is the float64 one of the
    F16 values."""
    rng = np.random.default_rng(n)
    k, m = 300, 40
    w = rng.normal(size=(k, n)).astype(np.float16)           # ggml ne [n, k], F16
    g = rng.normal(size=(m, k)).astype(np.float32)           # src1 = transpose of ne [k, m]
    rt = ggml.Runtime("cpu", threads=2)
    ctx = ggml.Context(n_tensors=8, graph_size=16)
    c = ctx.ptr
    tw = lib.ggml_new_tensor_2d(c, lib.GGML_TYPE_F16, n, k)
    tg = lib.ggml_new_tensor_2d(c, F32, k, m)
    for t in (tw, tg):
        lib.ggml_set_input(t)
    out = lib.ggml_out_prod(c, tw, lib.ggml_transpose(c, tg))   # ne [n, m]
    lib.ggml_set_output(out)
    graph = ggml.new_graph(ctx, 16)
    lib.ggml_build_forward_expand(graph, out)
    rt.alloc_graph(graph, ctx)
    lib.ggml_backend_tensor_set(tw, ffi.from_buffer(w), 0, w.nbytes)
    ggml.from_numpy(tg, g)
    rt.compute(graph)
    be = lib.ggml_backend_sched_get_tensor_backend(rt.sched, out)
    assert ffi.string(lib.ggml_backend_name(be)).decode() == "BLAS"
    want = g.astype(np.float64) @ w.astype(np.float64)      # [m, n]
    got = ggml.to_numpy(out).reshape(m, n)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
