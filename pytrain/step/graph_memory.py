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
from pytrain.formats.gguf_tensors import WeightsError, is_elementwise
from pytrain.models.model_file import open_model
from pytrain.models.weights import load_type
from pytrain.step.free_memory import cgroup_available, system_available


def shape_model(arch: str, config: ModelConfig, file_type: str = "f32", device: str = "cpu",
                threads: int = 1) -> Model:
    """A Model whose weights are metadata only: every matrix stored as ``file_type`` in the
    (imagined) file and loaded as ``device`` would load it; norms and other element-wise
    tensors F32.  Graphs can be built and measured, never computed: the weights' data
    pointers are a placeholder, so the allocator counts them as placed elsewhere (as real
    weights are) instead of sizing them into the compute buffer."""
    ft, f32 = ggml.TYPES[file_type], lib.GGML_TYPE_F32
    types = {}
    for name, shape in config.tensor_shapes().items():
        matrix = sum(d > 1 for d in shape) >= 2 and not is_elementwise(name, shape)
        types[name] = (shape, load_type(name, shape, ft if matrix else f32, device, "auto"))
    return _metadata_model(arch, config, types, f"<{file_type} shape>", threads, device)


def file_shape_model(path: str, device: str = "cpu", type_policy: str = "auto",
                     threads: int = 1, dequantize=None
                     ) -> tuple[Model, dict[str, tuple[str, str, int]], dict]:
    """The model of the GGUF at ``path`` with its weights as metadata only, each tensor in the
    type ``device`` would load it as (``type_policy``, refined by ``dequantize``: file type ->
    F32/F16, or a function of the file's tensor index and the shapes returning that); per
    loaded tensor (file type, loaded type, bytes in the file); and the file's other tensors
    (MTP blocks, extras: name -> bytes), which are not loaded.  Reads the file's index and
    keys, no tensor data."""
    arch, _meta, infos, config = open_model(path)
    shapes = config.tensor_shapes()
    missing = [n for n in shapes if n not in infos]
    if missing:
        raise WeightsError(f"{path}: missing tensor{'s' if len(missing) > 1 else ''}: "
                           + ", ".join(missing[:10]))
    if callable(dequantize):
        dequantize = dequantize(infos, shapes)
    types, files = {}, {}
    for n, shape in shapes.items():
        info = infos[n]
        lt = load_type(n, tuple(shape), info.type, device, type_policy, dequantize)
        types[n] = (shape, lt)
        files[n] = (info.type_name, ggml.type_name(lt), info.n_bytes)
    model = _metadata_model(arch, config, types, str(path), threads, device)
    return model, files, {n: i.n_bytes for n, i in infos.items() if n not in shapes}


def _metadata_model(arch: str, config: ModelConfig, types: dict, label: str,
                    threads: int, device: str) -> Model:
    """A Model over tensors ``name -> (numpy shape, ggml type)`` that hold no data, whose
    graphs are those ``device`` would run."""
    ctx = ggml.Context(n_tensors=len(types))
    rt = ggml.Runtime("cpu", threads=threads)
    tensors = {}
    for name, (shape, t) in types.items():
        ne = list(reversed(shape))
        tensors[name] = ggml.set_name(
            lib.ggml_new_tensor(ctx.ptr, t, len(ne), ffi.new("int64_t[]", ne)), name)
    # the weights claim to live in a tiny CPU buffer: the scheduler places their ops by it
    rt.alloc(ctx, on_cpu=True, measure_only=True)
    n_bytes = sum(int(lib.ggml_nbytes(t)) for t in tensors.values())
    weights = SimpleNamespace(tensors=tensors, ctx=ctx, close=ctx.close, loaded_bytes=n_bytes,
                              total_bytes=n_bytes)
    return Model(label, config, {}, rt, weights, SimpleNamespace(pad_id=0), models.get(arch),
                 device=device)


def compute_bytes(runtime: ggml.Runtime, graph) -> int:
    """The compute buffer the scheduler would allocate for ``graph`` (all backends, a buffer
    type shared by two of them counted once), without allocating it."""
    return sum(runtime.reserve_sizes(graph).values())


def graph_context_bytes(model: Model, T: int) -> int:
    """Host memory of the context a training step's graph at length ``T`` is built in (its
    tensors' and nodes' metadata, ``GradGraph``'s): sized by ``Model.graph_budget``, which
    for a hybrid model grows with T (the DeltaNet's chunks).  ggml allocates it whole and
    aborts the process when it cannot (``ggml_init``), so a length whose context is over the
    host's memory must be refused before the graph is built, not measured."""
    size = 2 * model.graph_budget(model.arch.padded_length(T))
    return (size * int(lib.ggml_tensor_overhead())
            + int(lib.ggml_graph_overhead_custom(size, True)) + 1024)


def host_available() -> int | None:
    """Host memory a graph's metadata may take now: the least of the system's available
    memory and the cgroup's (None: neither is known)."""
    known = [x for x in (system_available(), cgroup_available()) if x is not None]
    return min(known) if known else None


def needs_recompute(one_graph_bytes: int, left_bytes: int) -> bool:
    """``train.recompute = "auto"``'s rule, shared by the trainer and ``pytrain plan``:
    recompute only when the one-graph step's compute buffer is over half of the memory left
    for it.  Recompute costs a second forward of most layers (a third more compute), so it is
    kept for the steps that need it; the other half is the margin for what the measure does
    not see (small graphs, allocator slack)."""
    return one_graph_bytes > left_bytes / 2


def context_warning(config: ModelConfig, max_seq_len: int) -> str | None:
    """A warning when ``data.max_seq_len`` exceeds the context length the model file declares
    (``*.context_length``; 0: not declared): positions past it were never trained, so such a
    run fine-tunes on what the model cannot read well, at a memory cost that grows with the
    length.  A warning, not an error: a model may extrapolate, and short examples never reach
    the limit."""
    n_ctx = int(getattr(config, "context_length", 0) or 0)
    if n_ctx <= 0 or max_seq_len <= n_ctx:
        return None
    return (f"warning: data.max_seq_len = {max_seq_len} is longer than the model's context "
            f"length ({n_ctx}): positions past {n_ctx} were never trained")
