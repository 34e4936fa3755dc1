"""Run a small ggml graph from numpy inputs, optionally with gradients, for op-level tests."""
import numpy as np

from pytrain import ggml
from pytrain.ggml import ffi, lib


def new_tensor(ctx, arr: np.ndarray):
    t = {np.dtype(np.float32): lib.GGML_TYPE_F32, np.dtype(np.int32): lib.GGML_TYPE_I32}[arr.dtype]
    return lib.ggml_new_tensor(ctx, t, arr.ndim, ffi.new("int64_t[]", list(reversed(arr.shape))))


def run(build, inputs: dict, grad_of: tuple = (), seed_grad: np.ndarray | None = None,
        threads: int = 2, graph_size: int = 16384, inspect=None):
    """build(ctx, tensors: dict) -> output tensor.  With ``grad_of``, the loss is
    Σ output·seed_grad and the gradients of those inputs are returned too.  ``inspect(graph)``
    is called on the allocated graph before it is computed."""
    rt = ggml.Runtime("cpu", threads=threads, graph_size=graph_size)
    ctx = ggml.Context(n_tensors=graph_size * 2, graph_size=graph_size, grads=bool(grad_of))
    c = ctx.ptr
    tensors = {}
    for name, arr in inputs.items():
        t = new_tensor(c, arr)
        lib.ggml_set_input(t)
        if name in grad_of:
            lib.ggml_set_param(t)
        tensors[name] = t
    out = build(c, tensors)
    lib.ggml_set_output(out)
    graph = ggml.new_graph(ctx, graph_size, grads=bool(grad_of))
    lib.ggml_build_forward_expand(graph, out)
    grads = {}
    if grad_of:
        r = new_tensor(c, seed_grad.astype(np.float32))
        lib.ggml_set_input(r)
        loss = lib.ggml_sum(c, lib.ggml_mul(c, out, r))
        lib.ggml_build_forward_expand(graph, loss)
        graph = ggml.build_backward(ctx, graph, loss)
        for name in grad_of:
            g = ggml.grad_of(graph, tensors[name])
            assert g is not None, f"no gradient reaches {name}"
            if not lib.ggml_is_contiguous(g):
                g = lib.ggml_cont(c, g)
                lib.ggml_build_forward_expand(graph, g)
            lib.ggml_set_output(g)
            grads[name] = g
    rt.alloc_graph(graph, ctx)
    for name, arr in inputs.items():
        if ggml.is_allocated(tensors[name]):
            ggml.from_numpy(tensors[name], arr)
    if grad_of:
        ggml.from_numpy(r, seed_grad.astype(np.float32))
        lib.ggml_graph_reset(graph)   # d(loss)/d(loss) = 1, accumulators zeroed
    if inspect is not None:
        inspect(graph)
    rt.compute(graph)
    result = ggml.to_numpy(out).copy()
    gvals = {k: ggml.to_numpy(g).copy() for k, g in grads.items()}
    rt.close()
    ctx.close()
    return (result, gvals) if grad_of else result
