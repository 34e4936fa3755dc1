"""Sizes of a training run before anything is loaded: the graphs pytrain would build for a
model's shape and weight types, with the weights as tensor metadata only.

Why: the compute buffer of a training step (activations kept for the backward, gradients,
logits) is most of the memory a run needs, and it depends on the batch shape.  The scheduler
measures it for a graph without allocating (``ggml_backend_sched_reserve_size``), so a CPU
machine can tell what a GPU run of a 2B model at batch 4 x 4096 needs, and tests can build
the real graph of a model nobody downloaded.
"""
from __future__ import annotations

from types import SimpleNamespace

from pytrain import ggml
from pytrain.ggml import ffi, lib
from pytrain import models
from pytrain.models.model import Model
from pytrain.models import ModelConfig
from pytrain.formats.gguf_tensors import is_elementwise
from pytrain.models.weights import load_type

_PLACEHOLDER = ffi.cast("void *", 1 << 20)   # never dereferenced: shape models are not computed

def shape_model(arch: str, config: ModelConfig, file_type: str = "f32", device: str = "cpu",
                threads: int = 1) -> Model:
    """A Model whose weights are metadata only: every matrix stored as ``file_type`` in the
    (imagined) file and loaded as ``device`` would load it; norms and other element-wise
    tensors F32.  Graphs can be built and measured, never computed: the weights' data
    pointers are a placeholder, so the allocator counts them as placed elsewhere (as real
    weights are) instead of sizing them into the compute buffer."""
    shapes = config.tensor_shapes()
    ctx = ggml.Context(n_tensors=len(shapes))
    rt = ggml.Runtime("cpu", threads=threads)
    # a tiny CPU buffer the weights claim to live in: the scheduler places their ops by it
    stand_in = lib.ggml_backend_buft_alloc_buffer(lib.ggml_backend_cpu_buffer_type(), 64)
    rt._buffers.append(stand_in)
    ft, f32 = ggml.TYPES[file_type], lib.GGML_TYPE_F32
    tensors = {}
    for name, shape in shapes.items():
        matrix = sum(d > 1 for d in shape) >= 2 and not is_elementwise(name, shape)
        t = load_type(name, shape, ft if matrix else f32, device, "auto")
        ne = list(reversed(shape))
        tensors[name] = ggml.set_name(
            lib.ggml_new_tensor(ctx.ptr, t, len(ne), ffi.new("int64_t[]", ne)), name)
        tensors[name].data = _PLACEHOLDER
        tensors[name].buffer = stand_in
    n_bytes = sum(int(lib.ggml_nbytes(t)) for t in tensors.values())
    weights = SimpleNamespace(tensors=tensors, ctx=ctx, close=ctx.close, loaded_bytes=n_bytes,
                              total_bytes=n_bytes)
    return Model(f"<{file_type} shape>", config, {}, rt, weights, SimpleNamespace(pad_id=0),
                 models.get(arch))


def compute_bytes(runtime: ggml.Runtime, graph) -> int:
    """The compute buffer the scheduler would allocate for ``graph`` (all backends), without
    allocating it.  Measured by a scheduler of its own: ``reserve_size`` leaves the planned
    sizes in the allocator without allocating, and a later graph that fits that plan would
    then be placed into buffers that were never made.  Backends with the same buffer type (BLAS
    and the CPU) share one buffer in ggml's allocator, and ``reserve_size`` reports it for each
    of them: it is counted once."""
    n = len(runtime.backends)
    sched = lib.ggml_backend_sched_new(runtime._backend_arr, ffi.NULL, n, ggml.sched_size(graph),
                                       False, True)
    try:
        sizes = ffi.new("size_t[]", n)
        lib.ggml_backend_sched_reserve_size(sched, graph, sizes)
        bufts = [ggml.address(lib.ggml_backend_get_default_buffer_type(b)) for b in runtime.backends]
        return int(sum(sizes[i] for i in range(n) if bufts[i] not in bufts[:i]))
    finally:
        lib.ggml_backend_sched_free(sched)
