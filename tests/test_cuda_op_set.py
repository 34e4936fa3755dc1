"""Every node of pytrain's training, evaluation and optimizer graphs is one ggml-cuda runs,
for the weight types a CUDA run loads, at every shape a user trains (up to T·B = 65536
tokens per micro-batch).  Built as metadata only on the CPU machines (no GPU needed; the rules
are ggml-cuda's ``supports_op``, restated in ``cuda_support.py``).  On a GPU the runtime's
``CPUFallbackError`` makes the same check for real."""
from pathlib import Path

import pytest
from cuda_support import supported, unsupported_nodes

from pytrain import ggml, models
from pytrain.models import lora
from pytrain.step.graphs import GradGraph
from pytrain.models.model_file import open_model
from pytrain.models.lora_targets import select_targets
from pytrain.models.model import Model
from pytrain.step.optimizer import AdamWSettings, Optimizer
from pytrain.models.qwen35_config import QWEN35_2B
from pytrain.step.graph_memory import shape_model
from pytrain.data.tokenizer import Tokenizer
from pytrain.step.graphs import EvalGraph
from pytrain.models.weights import load_weights

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"


def cuda_typed_model(path: Path) -> Model:
    """The model with the weight types a CUDA run loads, on the CPU backend."""
    _arch, meta, _infos, config = open_model(path)
    rt = ggml.Runtime("cpu", threads=1)
    w = load_weights(path, rt, config.tensor_shapes(), "auto", policy_device="cuda")
    return Model(str(path), config, meta, rt, w, Tokenizer.from_metadata(meta), models.get(_arch),
                 device="cuda")


@pytest.fixture(scope="module", params=["gqa-f32.gguf", "gqa-bf16.gguf", "gqa-q8_0.gguf",
                                        "untied-f32.gguf", "../llama/gqa-q8_0.gguf",
                                        "../qwen2/qwen2-f16.gguf", "../qwen3/qwen3-q8_0.gguf",
                                        "../gemma3/gemma3-f32.gguf", "../gemma3/gemma3-q8_0.gguf"])
def model(request):
    """Qwen3.5's fixtures, and one of each other family (Gemma 3 adds SQR, EXP, SOFTPLUS and
    the sliding window's second mask)."""
    m = cuda_typed_model(FIX / request.param)
    yield m
    m.close()


@pytest.mark.parametrize("B, T", [(1, 20), (4, 256), (16, 4096), (1, 65536)])
def test_training_graph_runs_entirely_on_cuda(model, B, T):
    ad = lora.create(model.runtime, model.config, select_targets(model.config), 4, 8.0)
    g = GradGraph(model, ad, B, T, rows=B * T // 2)
    try:
        bad = unsupported_nodes(g.graph)
        assert not bad, f"{len(bad)} nodes ggml-cuda would not run, e.g.:\n" + "\n".join(bad[:12])
        lib = ggml.lib
        assert any(lib.ggml_graph_node(g.graph, i).op == lib.GGML_OP_OUT_PROD   # the backward
                   for i in range(lib.ggml_graph_n_nodes(g.graph)))
    finally:
        g.close()


@pytest.mark.parametrize("file_type", ["bf16", "f16", "q8_0", "q4_K", "q6_K"])
def test_qwen35_2b_training_graph_runs_entirely_on_cuda(file_type):
    """The real model's shape at the largest micro-batch (4 x 16384 tokens): head counts and
    widths decide which broadcasts and copies the graph needs.  The weights stay in the file's
    type, so the backward's OUT_PROD nodes read BF16/F16/quantized weights (patch 0003)."""
    m = shape_model("qwen35", QWEN35_2B, file_type, device="cuda")
    try:
        assert m.weights.tensors["token_embd.weight"].type == ggml.TYPES[file_type]
        ad = lora.create(m.runtime, m.config, select_targets(m.config), 16, 32.0)
        g = GradGraph(m, ad, 4, 16384, rows=4 * 16384 // 2)
        try:
            bad = unsupported_nodes(g.graph)
            assert not bad, f"{len(bad)} nodes, e.g.:\n" + "\n".join(bad[:12])
            quantized_out_prods = [
                n for n in (ggml.lib.ggml_graph_node(g.graph, i)
                            for i in range(ggml.lib.ggml_graph_n_nodes(g.graph)))
                if n.op == ggml.lib.GGML_OP_OUT_PROD and n.src[0].type == ggml.TYPES[file_type]]
            assert quantized_out_prods
        finally:
            g.close()
    finally:
        m.close()


def test_eval_and_optimizer_graphs_run_on_cuda(model):
    ad = lora.create(model.runtime, model.config, select_targets(model.config), 4, 8.0)
    ev = EvalGraph(model, ad, 4, 256, 512)
    g = GradGraph(model, ad, 1, 20)
    opt = Optimizer(model.runtime, g.opt_state, AdamWSettings())
    try:
        for graph in (ev.graph, ev.ce.label_graph, g.ce.label_graph, opt.norm_graph,
                      opt.update_graph):
            assert not unsupported_nodes(graph)
    finally:
        ev.close()
        g.close()


def test_the_check_finds_a_diag_mask_zero():
    """DIAG_MASK_INF's backward is DIAG_MASK_ZERO, which ggml-cuda has no kernel for: the
    check must flag it (pytrain's DeltaNet graph once used DIAG_MASK_INF)."""
    from pytrain.ggml import lib
    ctx = ggml.Context(n_tensors=64, graph_size=64, grads=True, no_alloc=True)
    x = lib.ggml_new_tensor_2d(ctx.ptr, lib.GGML_TYPE_F32, 8, 8)
    lib.ggml_set_param(x)
    y = lib.ggml_sum(ctx.ptr, lib.ggml_exp(ctx.ptr, lib.ggml_diag_mask_inf(ctx.ptr, x, 0)))
    gf = ggml.new_graph(ctx, 64, grads=True)
    lib.ggml_build_forward_expand(gf, y)
    gb = ggml.build_backward(ctx, gf, y)
    bad = unsupported_nodes(gb)
    assert len(bad) == 1 and bad[0].startswith("DIAG_MASK_ZERO"), bad
    ctx.close()


def test_the_check_knows_the_out_prod_and_repeat_back_limits():
    """Two limits of the pinned ggml-cuda the check must apply: OUT_PROD takes an F32 src0
    only (unless patched), REPEAT_BACK runs on the GPU for ne2·ne3 ≤ 32768 only."""
    from pytrain.ggml import lib
    ctx = ggml.Context(n_tensors=16, no_alloc=True)
    c = ctx.ptr
    a16 = lib.ggml_new_tensor_2d(c, lib.GGML_TYPE_F16, 64, 32)
    a32 = lib.ggml_new_tensor_2d(c, lib.GGML_TYPE_F32, 64, 32)
    b = lib.ggml_new_tensor_2d(c, lib.GGML_TYPE_F32, 16, 32)
    assert supported(lib.ggml_out_prod(c, a32, b))
    from cuda_support import OUT_PROD_SRC0_TYPES
    assert supported(lib.ggml_out_prod(c, a16, b)) == (lib.GGML_TYPE_F16 in OUT_PROD_SRC0_TYPES)
    small = lib.ggml_new_tensor_4d(c, lib.GGML_TYPE_F32, 4, 2, 128, 256)     # ne2·ne3 = 32768
    big = lib.ggml_new_tensor_4d(c, lib.GGML_TYPE_F32, 4, 2, 128, 257)
    assert supported(lib.ggml_repeat_back(c, small, lib.ggml_new_tensor_4d(
        c, lib.GGML_TYPE_F32, 1, 2, 128, 256)))
    assert not supported(lib.ggml_repeat_back(c, big, lib.ggml_new_tensor_4d(
        c, lib.GGML_TYPE_F32, 1, 2, 128, 257)))
    ctx.close()


@pytest.mark.parametrize("file_type", ["bf16", "q4_K"])
def test_layer_wise_recompute_graphs_run_entirely_on_cuda(file_type):
    """Every graph of a layer-wise step (recompute = "layers", what auto picks when one graph
    does not fit): the frozen layers below the first adapter, each layer's forward, the head
    and loss on a chunk of rows with its label graph, each layer's recomputing backward; at
    the 2B shape and the largest micro-batch."""
    from pytrain.step.recompute import RecomputeGraph
    m = shape_model("qwen35", QWEN35_2B, file_type, device="cuda")
    try:
        ad = lora.create(m.runtime, m.config, select_targets(m.config), 16, 32.0)
        r = RecomputeGraph(m, ad, 4, 16384)
        try:
            graphs = r.graphs() + [r.ce.label_graph]
            assert len(graphs) == 3 + len(r.fwd) + len(r.bwd)   # + pre, head, labels
            for graph in graphs:
                bad = unsupported_nodes(graph)
                assert not bad, f"{len(bad)} nodes, e.g.:\n" + "\n".join(bad[:12])
            assert any(ggml.lib.ggml_graph_node(b.graph, i).op == ggml.lib.GGML_OP_OUT_PROD
                       for b in r.bwd.values() for i in range(ggml.lib.ggml_graph_n_nodes(b.graph)))
        finally:
            r.close()
    finally:
        m.close()
