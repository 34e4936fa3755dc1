"""Building graphs: forward graphs, the backward graph of a loss (with gradient accumulators
when micro-batches add up), and the scheduler size a graph needs.

Model code makes the nodes itself with ``lib.ggml_*`` calls; these helpers hold the steps
that are easy to get subtly wrong (marking the loss, seeding or accumulating its gradient).
"""
from __future__ import annotations

from pytrain.ggml.loader import ffi, lib
from pytrain.ggml.tensors import Context


def op_name(t) -> str:
    """A node's op as ggml describes it ("MUL_MAT", "ADD"), for messages."""
    return ffi.string(lib.ggml_op_desc(t)).decode()


def sched_size(graph) -> int:
    """The scheduler size a graph needs: its nodes, leafs and the copies added between
    backends.  Counted from the nodes, not the graph's capacity: the scheduler reserves
    ~60 tensor structs per unit of size (about 20 KiB), so sizing it by a training graph's
    capacity (200k at the 2B shape) asked malloc for 8 GiB; its leafs (weights, inputs) are
    covered by the constant."""
    return 2 * int(lib.ggml_graph_n_nodes(graph)) + 4096


def new_graph(ctx: Context, size: int = 8192, grads: bool = False):
    return lib.ggml_new_graph_custom(ctx.ptr, size, grads)


def new_graph_for(ctx, *outputs, size: int = 64):
    """A small graph computing ``outputs`` (forward only), in the raw context ``ctx``."""
    g = lib.ggml_new_graph_custom(ctx, size, False)
    for t in outputs:
        lib.ggml_build_forward_expand(g, t)
    return g


def grad_of(graph, t):
    """The gradient tensor of ``t`` in a backward graph, or None."""
    g = lib.ggml_graph_get_grad(graph, t)
    return None if g == ffi.NULL else g


def build_backward(ctx: Context, forward, loss, accumulators: dict | None = None,
                   loss_seed=None):
    """A graph computing ``forward`` then the gradients of the scalar ``loss`` with respect to
    every tensor marked with ``ggml_set_param``.

    Without ``accumulators`` the gradients are fresh each compute; ``lib.ggml_graph_reset``
    after allocating writes the seed d(loss)/d(loss) = 1.  With ``accumulators`` (param tensor address -> static F32 tensor of
    the same shape) and a static ``loss_seed`` holding 1.0, each compute ADDS its gradients
    into the accumulators (ggml's grad_accs): gradient accumulation across micro-batches and
    across graphs of different shapes, zeroed by the caller."""
    lib.ggml_set_loss(loss)
    lib.ggml_set_output(loss)
    backward = lib.ggml_graph_dup(ctx.ptr, forward, True)
    if accumulators is None:
        lib.ggml_build_backward_expand(ctx.ptr, backward, ffi.NULL)
        acc = lib.ggml_graph_get_grad_acc(backward, loss)
        lib.ggml_set_input(acc)  # the seed d(loss)/d(loss) = 1 is written before each compute
        return backward
    n = lib.ggml_graph_n_nodes(backward)
    accs = ffi.new("struct ggml_tensor *[]", n)
    for i in range(n):
        node = lib.ggml_graph_node(backward, i)
        key = int(ffi.cast("uintptr_t", node))
        if key in accumulators:
            accs[i] = accumulators[key]
        elif node == loss:
            accs[i] = loss_seed
    lib.ggml_build_backward_expand(ctx.ptr, backward, accs)
    return backward

