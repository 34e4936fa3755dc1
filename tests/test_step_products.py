"""pytrain.plan.products (a step's matrix-product FLOPs from its graph nodes) and
pytrain.plan.matmul_probe (one product's rate through the runtime), against hand counts."""
from __future__ import annotations

import pytest

from pytrain import ggml
from pytrain.ggml import lib
from pytrain.plan.matmul_probe import probe, square
from pytrain.plan.products import Shape, StepProducts, counting, graph_shapes

F32 = lib.GGML_TYPE_F32
K, M, N = 8, 4, 3


def _loss_graph(ctx, trainable_weight: bool):
    """sum(W . x) with W [K, M] (a weight: ggml ne order) and x [K, N] trained: forward and
    backward graphs, nothing allocated (the shapes are all a count needs)."""
    w = lib.ggml_new_tensor_2d(ctx.ptr, F32, K, M)
    x = lib.ggml_new_tensor_2d(ctx.ptr, F32, K, N)
    lib.ggml_set_param(x)
    if trainable_weight:
        lib.ggml_set_param(w)
    loss = lib.ggml_sum(ctx.ptr, lib.ggml_mul_mat(ctx.ptr, w, x))
    gf = ggml.new_graph(ctx, 256, grads=True)
    lib.ggml_build_forward_expand(gf, loss)
    return gf, ggml.build_backward(ctx, gf, loss)


def test_shape_flops_by_hand():
    mm = Shape("MUL_MAT", "F32", (K, M, 1, 1), (K, N, 1, 1), (M, N, 1, 1))
    assert mm.k == K and mm.flops == 2 * K * M * N == 192
    batched = Shape("MUL_MAT", "F32", (K, M, 2, 3), (K, N, 2, 3), (M, N, 2, 3))
    assert batched.flops == 2 * K * M * N * 6
    op = Shape("OUT_PROD", "F32", (M, K, 1, 1), (N, K, 1, 1), (M, N, 1, 1))
    assert op.k == K and op.flops == 192
    assert Shape.from_dict(op.to_dict()) == op
    assert mm.label() == "MUL_MAT F32 [8 x 4] . [8 x 3]"
    assert batched.label() == "MUL_MAT F32 [8 x 4 x 2 x 3] . [8 x 3 x 2 x 3]"


def test_frozen_weight_gets_no_weight_gradient_product():
    """Forward W . x: 2·K·M·N; backward: x's gradient, OUT_PROD(W, dy) contracting over M,
    the same count; a frozen W has no OUT_PROD of its own, a trained one adds x ⊗ dy."""
    with ggml.Context(n_tensors=128, graph_size=256, grads=True) as ctx:
        gf, gb = _loss_graph(ctx, trainable_weight=False)
        assert [s.op for s in graph_shapes(gf)] == ["MUL_MAT"]
        sp = StepProducts.from_graphs([(gb, 1)])
        assert sp.by_op() == {"MUL_MAT": 192, "OUT_PROD": 192}
        (dx,) = [s for s in sp.counts if s.op == "OUT_PROD"]
        assert dx.a == (K, M, 1, 1) and dx.dst == (K, N, 1, 1) and dx.k == M
        assert StepProducts.from_graphs([(gb, 3)]).flops == 3 * 384
    with ggml.Context(n_tensors=128, graph_size=256, grads=True) as ctx:
        _, gb = _loss_graph(ctx, trainable_weight=True)
        sp = StepProducts.from_graphs([(gb, 1)])
        assert sp.by_op() == {"MUL_MAT": 192, "OUT_PROD": 384} and sp.flops == 576
        assert sp.top(1)[0][0].op in ("MUL_MAT", "OUT_PROD") and len(sp.top(5)) == 3


@pytest.mark.parametrize("shape", [
    square(48),
    Shape("OUT_PROD", "F32", (40, 24, 1, 1), (16, 24, 1, 1), (40, 16, 1, 1)),
    Shape("MUL_MAT", "F16", (64, 32, 1, 1), (64, 8, 1, 1), (32, 8, 1, 1)),
])
def test_probe_runs_the_shape_asked_and_counting_sees_every_compute(shape):
    """The probe's node has exactly the asked shape (the counter, wrapping the runtime's
    compute, sees it once per compute: one warm-up and the timed ones); its rate is FLOPs
    over the measured times."""
    rt = ggml.Runtime("cpu", threads=1)
    try:
        with counting(rt) as sp:
            r = probe(rt, shape, reps=2)
        assert sp.counts == {shape: 1 + len(r.times)} and len(r.times) == 2
        assert sp.graph_runs == 1 + len(r.times)
        assert r.flops == shape.flops and r.backend in ("BLAS", "CPU")
        assert r.best_gflops == pytest.approx(shape.flops / min(r.times) / 1e9)
        assert r.best_gflops >= r.median_gflops > 0
        assert "compute" not in rt.__dict__     # the wrapper is gone after the block
    finally:
        rt.close()


def test_probe_refuses_products_it_cannot_make():
    rt = ggml.Runtime("cpu", threads=1)
    try:
        with pytest.raises(ValueError):
            probe(rt, Shape("MUL_MAT_ID", "F32", (8, 4, 2, 1), (8, 1, 3, 1), (4, 1, 3, 1)))
    finally:
        rt.close()
