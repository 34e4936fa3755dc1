"""Every node of pytrain's training, evaluation and optimizer graphs runs on the Vulkan device:
no op falls back to the CPU, for every architecture and every weight type a Vulkan run keeps.

Two checks, both asking ggml-vulkan itself (lavapipe in CI):
  * the fixtures of each family, loaded on the device: their graphs are allocated by the
    scheduler, which places each node, and ``Runtime`` refuses a graph with a node on the CPU
    (``CPUFallbackError``); the backward's OUT_PROD nodes, whose src0 is the weight in its
    file type (pytrain's patch 0011), are placed on the device;
  * the real Qwen3.5-2B shape (metadata only: it would not fit), every node of its step
    graphs, one graph and layer-wise, through ``ggml_backend_supports_op`` of the device.
Allocation only: nothing is computed, so no pipeline is compiled."""
from pathlib import Path

import pytest
from vulkan_support import vulkan_device

from pytrain import ggml, models
from pytrain.ggml import lib
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets
from pytrain.models.model import Model
from pytrain.models.model_file import open_model
from pytrain.models.weights import load_weights
from pytrain.data.tokenizer import Tokenizer
from pytrain.step.graphs import EvalGraph, GradGraph
from pytrain.step.optimizer import AdamWSettings, Optimizer

FIX = Path(__file__).resolve().parent / "fixtures"
FILES = ["qwen35/gqa-f32.gguf", "qwen35/gqa-bf16.gguf", "qwen35/gqa-q8_0.gguf",
         "qwen35/untied-f32.gguf", "llama/gqa-f16.gguf", "llama/gqa-q8_0.gguf",
         "qwen2/qwen2-f16.gguf", "qwen3/qwen3-q8_0.gguf", "gemma3/gemma3-f32.gguf",
         "gemma3/gemma3-q8_0.gguf"]


@pytest.fixture(scope="module")
def device():
    return vulkan_device()


def on_vulkan(path: Path) -> Model:
    arch, meta, _infos, config = open_model(path)
    rt = ggml.Runtime("vulkan")
    w = load_weights(path, rt, config.tensor_shapes(), "auto")
    return Model(str(path), config, meta, rt, w, Tokenizer.from_metadata(meta), models.get(arch))


def nodes(graph):
    return [lib.ggml_graph_node(graph, i) for i in range(lib.ggml_graph_n_nodes(graph))]


def is_view(node) -> bool:
    return node.op in (lib.GGML_OP_NONE, lib.GGML_OP_VIEW, lib.GGML_OP_RESHAPE,
                       lib.GGML_OP_PERMUTE, lib.GGML_OP_TRANSPOSE)


def biggest(n) -> int:
    """The largest tensor a node touches, in bytes (itself or a src)."""
    return max([int(lib.ggml_nbytes(n))] + [int(lib.ggml_nbytes(n.src[j])) for j in range(4)
                                            if n.src[j] != ggml.ffi.NULL])


def unsupported(backend, graph, limit: int | None = None) -> list[str]:
    """``op(type <- src types)`` of each node the device's supports_op refuses; with
    ``limit``, only those whose tensors are all within it (the others are refused for their
    size alone: ``size_limit``)."""
    out = []
    for n in nodes(graph):
        if (not is_view(n) and not lib.ggml_backend_supports_op(backend, n)
                and (limit is None or biggest(n) <= limit)):
            srcs = ",".join(ggml.type_name(n.src[j].type) for j in range(2)
                            if n.src[j] != ggml.ffi.NULL)
            out.append(f"{ggml.op_name(n)}({ggml.type_name(n.type)} <- {srcs}) "
                       f"ne {[int(n.ne[k]) for k in range(4)]}")
    return out


def size_limit(backend) -> int:
    """The largest tensor, in bytes, the device takes: ggml-vulkan's supports_op refuses any
    node with a tensor above the device's buffer size or maxStorageBufferRange (unless it
    indexes with 64 bits), whatever the op.  Found by bisection on a SCALE node."""
    ctx = ggml.Context(n_tensors=160)
    try:
        def ok(n_floats: int) -> bool:
            x = lib.ggml_new_tensor_1d(ctx.ptr, lib.GGML_TYPE_F32, n_floats)
            return bool(lib.ggml_backend_supports_op(backend, lib.ggml_scale(ctx.ptr, x, 2.0)))
        lo, hi = 1, 1 << 34             # floats: 4 B .. 64 GiB
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return 4 * lo
    finally:
        ctx.close()


@pytest.mark.parametrize("name", FILES)
def test_training_evaluation_and_optimizer_graphs_stay_on_vulkan(device, name, measured):
    m = on_vulkan(FIX / name)
    try:
        rt = m.runtime
        assert rt.device == "vulkan" and rt.gpu is not None
        ad = lora.create(rt, m.config, select_targets(m.config), 4, 8.0)
        g = GradGraph(m, ad, 2, 64, rows=96)
        ev = EvalGraph(m, ad, 2, 64, 96)
        opt = Optimizer(rt, g.opt_state, AdamWSettings())
        try:
            for graph, ctx in ((g.graph, g.ctx), (ev.graph, ev.ctx)):
                rt.alloc_graph(graph, ctx)           # CPUFallbackError names any CPU node
                assert rt.cpu_fallbacks(graph) == []
            rt.alloc_graph(g.graph, g.ctx)
            prods = [n for n in nodes(g.graph) if n.op == lib.GGML_OP_OUT_PROD]
            kept = [n for n in prods if n.src[0].type != lib.GGML_TYPE_F32]
            assert prods and all(rt.node_backend(n).startswith("Vulkan") for n in prods)
            measured(f"{name}: training graph nodes on the CPU ({len(nodes(g.graph))} nodes, "
                     f"{len(prods)} OUT_PROD, {len(kept)} of them reading a kept weight)",
                     len(rt.cpu_fallbacks(g.graph)), 0)
            assert kept or all(t.type == lib.GGML_TYPE_F32 for t in m.weights.tensors.values()
                               if lib.ggml_n_dims(t) >= 2)
            # run on the device alone, outside the scheduler: the label graphs (on the
            # labels' owner) and the optimizer's kept graphs
            for graph in (g.ce.label_graph, ev.ce.label_graph, opt.norm_graph, opt.update_graph):
                assert unsupported(rt.gpu, graph) == []
        finally:
            opt.close()
            ev.close()
            g.close()
    finally:
        m.close()


@pytest.mark.parametrize("file_type", ["bf16", "q4_K"])
def test_qwen35_2b_step_graphs_are_vulkan_ops(device, file_type, measured):
    """The real model's shape at 4 x 1024 tokens, one graph and layer-wise (recompute =
    "layers"), weights kept as stored: every node is one the device runs, the backward's
    OUT_PROD nodes reading BF16 and Q4_K weights among them (patch 0011), except nodes with a
    tensor larger than the device takes at all (``size_limit``: 128 MiB on lavapipe, where
    the 248320-row embedding and LM head are beyond it; a GPU's limit is its own)."""
    from pytrain.models.qwen35_config import QWEN35_2B
    from pytrain.step.graph_memory import shape_model
    from pytrain.step.recompute import RecomputeGraph
    rt = ggml.Runtime("vulkan")
    limit = size_limit(rt.gpu)
    m = shape_model("qwen35", QWEN35_2B, file_type, device="vulkan")
    try:
        ad = lora.create(m.runtime, m.config, select_targets(m.config), 16, 32.0)
        g = GradGraph(m, ad, 4, 1024, rows=2048)
        try:
            bad = unsupported(rt.gpu, g.graph, limit)
            too_big = [n for n in nodes(g.graph) if not is_view(n) and biggest(n) > limit]
            measured(f"2B {file_type}, one graph: nodes refused, their tensors within "
                     f"the device's {limit / 2**20:.0f} MiB ({len(too_big)} of "
                     f"{len(nodes(g.graph))} nodes have a larger one)", len(bad), 0)
            assert bad == []
            assert [n for n in nodes(g.graph) if n.op == lib.GGML_OP_OUT_PROD
                    and n.src[0].type == ggml.TYPES[file_type] and biggest(n) <= limit]
        finally:
            g.close()
        r = RecomputeGraph(m, ad, 4, 1024, measure_only=True)
        try:
            for graph in r.graphs() + [r.ce.label_graph]:
                assert unsupported(rt.gpu, graph, limit) == []
        finally:
            r.close()
    finally:
        m.close()
        rt.close()


def test_the_size_check_is_the_devices(device):
    """``size_limit`` agrees with supports_op on both sides of it (a node of one float more
    is refused, one of exactly the limit is not)."""
    rt = ggml.Runtime("vulkan")
    ctx = ggml.Context(n_tensors=8)
    try:
        limit = size_limit(rt.gpu)
        assert 2**20 <= limit < 2**36
        for n_floats, want in ((limit // 4, True), (limit // 4 + 1, False)):
            x = lib.ggml_new_tensor_1d(ctx.ptr, lib.GGML_TYPE_F32, n_floats)
            y = lib.ggml_scale(ctx.ptr, x, 2.0)
            assert bool(lib.ggml_backend_supports_op(rt.gpu, y)) is want
    finally:
        ctx.close()
        rt.close()


def test_the_check_sees_an_op_vulkan_lacks(device):
    """DIAG_MASK_INF's backward, DIAG_MASK_ZERO, has no ggml-vulkan kernel: the check must
    name it (as the CUDA op-set test does)."""
    rt = ggml.Runtime("vulkan")
    ctx = ggml.Context(n_tensors=64, graph_size=64, grads=True)
    try:
        x = lib.ggml_new_tensor_2d(ctx.ptr, lib.GGML_TYPE_F32, 8, 8)
        lib.ggml_set_param(x)
        y = lib.ggml_sum(ctx.ptr, lib.ggml_exp(ctx.ptr, lib.ggml_diag_mask_inf(ctx.ptr, x, 0)))
        gf = ggml.new_graph(ctx, 64, grads=True)
        lib.ggml_build_forward_expand(gf, y)
        bad = unsupported(rt.gpu, ggml.build_backward(ctx, gf, y))
        assert len(bad) == 1 and bad[0].startswith("DIAG_MASK_ZERO"), bad
    finally:
        ctx.close()
        rt.close()


def test_a_weight_beyond_the_devices_limit_is_refused_by_name(device):
    """Loading refuses a weight the device cannot take in one tensor, naming it, the file and
    the device (ggml's scheduler aborted the process when a graph read it: the BF16 mid
    benchmark shape's 155.6 MB embedding on lavapipe); one of exactly the limit loads."""
    from pathlib import Path

    from pytrain.formats.gguf_tensors import WeightsError
    from pytrain.models.weights import _refuse_oversized
    rt = ggml.Runtime("vulkan")
    ctx = ggml.Context(n_tensors=4)
    try:
        limit = size_limit(rt.gpu)
        fits = lib.ggml_new_tensor_1d(ctx.ptr, lib.GGML_TYPE_F32, limit // 4)
        big = lib.ggml_new_tensor_2d(ctx.ptr, lib.GGML_TYPE_F32, 1024, limit // 4096 + 1)
        _refuse_oversized(Path("m.gguf"), rt, {"blk.0.ffn_up.weight": fits})
        with pytest.raises(WeightsError) as e:
            _refuse_oversized(Path("m.gguf"), rt, {"blk.0.ffn_up.weight": fits,
                                                   "token_embd.weight": big})
        msg = str(e.value)
        assert msg.startswith("m.gguf: tensor 'token_embd.weight'") and "\n" not in msg
        assert rt.device_label() in msg and "1 such weight" in msg
    finally:
        ctx.close()
        rt.close()
