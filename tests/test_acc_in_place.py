"""Patch 0010: a gradient through many views of one tensor costs O(size), not O(views x size).

ggml's backward adds the gradient of each VIEW into its source's gradient with an ACC, which
copied the whole gradient every time; pytrain's chunked DeltaNet reads six tensors per layer
through one view per chunk, so that was quadratic in the sequence length.  The patched
backward adds in place along a chain that starts from its own zero tensor, and keeps copying
where the gradient came from another op first (it may be shared); the patched forward lets an
in-place ACC chain (the DeltaNet output stacked chunk by chunk) take a gradient.  Checked here:
the values against numpy, and which ACCs run in place.
"""
import numpy as np
import pytest
from graph_harness import run

from pytrain.ggml import ffi, lib

D, C, NC = 8, 4, 6          # each chunk: a [D, C] block of a [D, C * NC] tensor


def _chunk(ctx, t, c: int):
    """Chunk c of x [D, C * NC] as a contiguous [D, C] view (rows c*C .. c*C+C-1)."""
    return lib.ggml_view_2d(ctx, t, D, C, t.nb[1], c * C * t.nb[1])


def _stack_squares(ctx, x, order, inplace: bool):
    """canvas chunk c = (x chunk order[c])², the canvas built by an ACC chain."""
    canvas = lib.ggml_scale(ctx, x, 0.0)
    acc = lib.ggml_acc_inplace if inplace else lib.ggml_acc
    for c, src in enumerate(order):
        sq = lib.ggml_sqr(ctx, _chunk(ctx, x, src))
        canvas = acc(ctx, canvas, sq, canvas.nb[1], canvas.nb[2], canvas.nb[3], c * C * canvas.nb[1])
    return canvas


def _accs(graph) -> list[tuple[bool, int]]:
    """(in place, elements written) of every ACC node."""
    out = []
    for i in range(lib.ggml_graph_n_nodes(graph)):
        t = lib.ggml_graph_node(graph, i)
        if t.op == lib.GGML_OP_ACC:
            inplace = bool(ffi.cast("int32_t *", t.op_params)[4])
            out.append((inplace, int(lib.ggml_nelements(t.src[1] if inplace else t))))
    return out


def _expected(x, seed, order):
    """Gradient of Σ canvas·seed for canvas chunk c = (x chunk order[c])²."""
    g = np.zeros_like(x)
    for c, src in enumerate(order):
        g[src * C:(src + 1) * C] += 2 * x[src * C:(src + 1) * C] * seed[c * C:(c + 1) * C]
    return g


@pytest.mark.parametrize("inplace_forward", [False, True])
def test_view_gradients_accumulate_in_place_and_exactly(inplace_forward):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((C * NC, D)).astype(np.float32)      # numpy [rows, D] = ggml [D, rows]
    seed = rng.standard_normal((C * NC, D)).astype(np.float32)
    order = [3, 0, 5, 1, 4, 2]
    seen = {}
    out, grads = run(lambda ctx, t: _stack_squares(ctx, t["x"], order, inplace_forward),
                     {"x": x}, grad_of=("x",), seed_grad=seed,
                     inspect=lambda g: seen.setdefault("accs", _accs(g)))
    want = np.concatenate([x[s * C:(s + 1) * C] ** 2 for s in order])
    np.testing.assert_array_equal(out, want)
    np.testing.assert_allclose(grads["x"], _expected(x, seed, order), rtol=1e-6, atol=1e-6)
    accs = seen["accs"]
    fwd, bwd = accs[:NC], accs[NC:]
    assert all(ip == inplace_forward for ip, _ in fwd)
    # the backward: one ACC per view of x, all in place, writing x's size once in all
    # (unpatched: NC copies of the whole [D, C * NC] gradient)
    assert len(bwd) == NC and all(ip for ip, _ in bwd), bwd
    assert sum(n for _, n in bwd) == x.size


def test_a_gradient_that_came_from_another_op_is_not_accumulated_in_place():
    """out = canvas + x: the ADD's backward hands x the output's own gradient tensor (shared
    with the canvas chain's), so adding the views' gradients into it in place would change
    the gradient the canvas chunks still read.  Those ACCs must copy."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((C * NC, D)).astype(np.float32)
    seed = rng.standard_normal((C * NC, D)).astype(np.float32)
    order = [5, 4, 3, 2, 1, 0]
    seen = {}

    def build(ctx, t):
        return lib.ggml_add(ctx, _stack_squares(ctx, t["x"], order, True), t["x"])

    _out, grads = run(build, {"x": x}, grad_of=("x",), seed_grad=seed,
                      inspect=lambda g: seen.setdefault("accs", _accs(g)))
    np.testing.assert_allclose(grads["x"], _expected(x, seed, order) + seed, rtol=1e-6, atol=1e-6)
    bwd = seen["accs"][NC:]
    assert len(bwd) == NC and not any(ip for ip, _ in bwd), bwd


def test_the_delta_net_step_writes_linear_acc_traffic():
    """The 2B shape's training graph at 4 x 1024 (32 chunks): the ACC nodes write ~3 G
    elements; before patch 0010 and the in-place output canvas they rewrote 24.9 G."""
    from test_cuda_op_set import shape_model

    from pytrain.models import lora
    from pytrain.models.lora_targets import select_targets
    from pytrain.models.qwen35_config import QWEN35_2B
    from pytrain.step.graphs import GradGraph
    m = shape_model("qwen35", QWEN35_2B, "bf16", device="cuda")
    try:
        ad = lora.create(m.runtime, m.config, select_targets(m.config), 16, 32.0)
        g = GradGraph(m, ad, 4, 1024, rows=4 * 1024 // 2)
        try:
            accs = _accs(g.graph)
        finally:
            g.close()
    finally:
        m.close()
    copying = [n for ip, n in accs if not ip]
    written = sum(n for _, n in accs)
    # the copies left: one causal-conv padding per DeltaNet layer (its canvas is a shared
    # zero input, so it must not be written in place)
    assert len(copying) == 18, len(copying)
    assert written < 4e9, written
