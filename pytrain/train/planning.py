"""Sizes of a training run before anything is loaded: the graphs pytrain would build for a
model's shape and weight types, with the weights as tensor metadata only.

Why: the compute buffer of a training step (activations kept for the backward, gradients,
logits) is most of the memory a run needs, and it depends on the batch shape.  The scheduler
measures it for a graph without allocating (``ggml_backend_sched_reserve_size``), so a CPU
machine can tell what a GPU run of a 2B model at batch 4 x 4096 needs, and tests can build
the real graph of a model nobody downloaded.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

from pytrain import ggml
from pytrain.ggml import ffi, lib
from pytrain import models
from pytrain.models.model import Model
from pytrain.models import ModelConfig
from pytrain.models.weights import WeightsError, is_elementwise, load_type

_PLACEHOLDER = ffi.cast("void *", 1 << 20)   # never dereferenced: shape models are not computed

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
    return _metadata_model(arch, config, types, f"<{file_type} shape>", threads)


def file_shape_model(path: str, device: str = "cpu", type_policy: str = "auto",
                     threads: int = 1) -> tuple[Model, dict[str, tuple[str, str, int]], dict]:
    """The model of the GGUF at ``path`` with its weights as metadata only, each tensor in the
    type ``device`` would load it as (``type_policy``); per loaded tensor (file type, loaded
    type, bytes in the file); and the file's other tensors (MTP blocks, extras: name -> bytes),
    which are not loaded.  Reads the file's index and keys, no tensor data."""
    from pytrain.formats.model_file import open_model
    arch, _meta, infos, config = open_model(path)
    shapes = config.tensor_shapes()
    missing = [n for n in shapes if n not in infos]
    if missing:
        raise WeightsError(f"{path}: missing tensor{'s' if len(missing) > 1 else ''}: "
                           + ", ".join(missing[:10]))
    types, files = {}, {}
    for n, shape in shapes.items():
        info = infos[n]
        lt = load_type(n, tuple(shape), info.type, device, type_policy)
        types[n] = (shape, lt)
        files[n] = (info.type_name, ggml.type_name(lt), info.n_bytes)
    model = _metadata_model(arch, config, types, str(path), threads)
    return model, files, {n: i.n_bytes for n, i in infos.items() if n not in shapes}


def _metadata_model(arch: str, config: ModelConfig, types: dict, label: str,
                    threads: int) -> Model:
    """A Model over tensors ``name -> (numpy shape, ggml type)`` that hold no data."""
    ctx = ggml.Context(n_tensors=len(types))
    rt = ggml.Runtime("cpu", threads=threads)
    # a tiny CPU buffer the weights claim to live in: the scheduler places their ops by it
    stand_in = rt.alloc_buffer(64)
    tensors = {}
    for name, (shape, t) in types.items():
        ne = list(reversed(shape))
        tensors[name] = ggml.set_name(
            lib.ggml_new_tensor(ctx.ptr, t, len(ne), ffi.new("int64_t[]", ne)), name)
        tensors[name].data = _PLACEHOLDER
        tensors[name].buffer = stand_in
    n_bytes = sum(int(lib.ggml_nbytes(t)) for t in tensors.values())
    weights = SimpleNamespace(tensors=tensors, ctx=ctx, close=ctx.close, loaded_bytes=n_bytes,
                              total_bytes=n_bytes)
    return Model(label, config, {}, rt, weights, SimpleNamespace(pad_id=0), models.get(arch))


def compute_bytes(runtime: ggml.Runtime, graph) -> int:
    """The compute buffer the scheduler would allocate for ``graph`` (all backends, a buffer
    type shared by two of them counted once), without allocating it."""
    return sum(runtime.reserve_sizes(graph).values())


# --------------------------------------------------------------------------- a run's plan

@dataclass
class RunPlan:
    """The memory a config's training run needs on its device, and whether it fits.  Sizes
    are bytes; the batch is the largest micro-batch the config allows (``train.batch_size``
    rows of ``data.max_seq_len`` tokens, every token a target); a real batch of shorter
    examples needs less."""
    model: str
    arch: str
    device: str                   # cpu, cuda or rpc: what model.device resolves to here
    batch: tuple[int, int]        # (B, T): T padded as the trainer pads it
    weights: list[dict]           # per (file type, loaded type): tensors, file/loaded bytes
    weight_bytes: int             # as loaded on the device
    not_loaded: dict[str, int]    # tensors of the file that are never loaded (MTP, extras)
    lora_tensors: int
    lora_params: int
    adapter_bytes: int            # the LoRA A and B tensors
    optimizer_bytes: int          # F32 gradient accumulators and AdamW's two moments
    one_graph: int                # compute buffer of the whole step as one graph
    layerwise: dict | None        # layer-wise recompute: largest graph, persistent tensors
    recompute: str                # train.recompute
    layers: bool                  # the step runs layer by layer (recompute)
    reason: str
    free_bytes: int | None        # the device's free memory as ggml reports it (None: the
    total_bytes: int | None       # device is not on this machine; train.memory_gib planned for)
    available_bytes: int | None   # what a step may plan for (CPU: also the cgroup's limit)
    budget_bytes: int             # what the run must fit in: available or train.memory_gib
    budget_source: str
    need_bytes: int
    fits: bool
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _device_memory(device: str, threads: int | None, budget_set: bool
                   ) -> tuple[str, int | None, int | None, int | None]:
    """(device kind, free, total, available) of the device a run on ``device`` computes on.
    A GPU this machine does not have is planned for (its weight types) when the budget is
    given (train.memory_gib): its memory is then None."""
    from pytrain.train.memory import available_bytes
    try:
        rt = ggml.Runtime(device, threads=threads)
    except ggml.DeviceError as e:
        if device != "cuda" and not device.startswith("rpc:"):
            raise
        if not budget_set:
            raise ggml.DeviceError(f"{e}; to plan for such a device from this machine, give "
                                   f"its memory: --set train.memory_gib=GIB") from e
        return ("rpc" if device.startswith("rpc:") else "cuda"), None, None, None
    try:
        free, total = rt.device_memory_info()
        return rt.device, free, total, available_bytes(rt)
    finally:
        rt.close()


def _weight_groups(files: dict[str, tuple[str, str, int]], model: Model) -> list[dict]:
    groups: dict[tuple[str, str], dict] = {}
    for n, (ft, lt, fb) in files.items():
        g = groups.setdefault((ft, lt), dict(file_type=ft, loaded_type=lt, tensors=0,
                                             file_bytes=0, loaded_bytes=0))
        g["tensors"] += 1
        g["file_bytes"] += fb
        g["loaded_bytes"] += int(lib.ggml_nbytes(model.weights.tensors[n]))
    return sorted(groups.values(), key=lambda g: -g["loaded_bytes"])


def step_buffers(model: Model, adapter, acc, B: int, T: int, n_targets: int | None = None
                 ) -> tuple[int, dict | None]:
    """Compute buffer of the one-graph step with the head and loss on the rows of
    ``n_targets`` targets (None: every row, as the trainer's recompute = auto measures it), and
    of layer-wise recompute's graphs (None where the adapter has tensors outside the blocks,
    which layer-wise recompute refuses)."""
    from pytrain.train import loss as loss_mod
    from pytrain.train.graphs import GradGraph
    from pytrain.train.recompute import RecomputeGraph
    g = GradGraph(model, adapter, B, T, acc=acc,
                  rows=loss_mod.rows_bucket(n_targets or B * T, B * T))
    try:
        one = compute_bytes(model.runtime, g.graph)
    finally:
        g.close()
    try:
        r = RecomputeGraph(model, adapter, B, T, acc=acc)
    except ValueError:
        return one, None
    try:
        rt = model.runtime
        graphs = {"pre": compute_bytes(rt, r.pre.graph),
                  "layer forward": max(compute_bytes(rt, f.graph) for f in r.fwd),
                  "head + loss chunk": compute_bytes(rt, r.head.graph),
                  "layer backward": max(compute_bytes(rt, b.graph) for b in r.bwd.values())}
        persistent = sum(int(lib.ggml_nbytes(t)) for t in r.pctx.tensors())
        return one, dict(largest=max(graphs.values()), graphs=graphs, persistent=persistent,
                         head_chunk_rows=r.rows, first_layer=r.l0)
    finally:
        r.close()


def size(n: int) -> str:
    """Bytes as B / KiB / MiB / GiB."""
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << k:
            return f"{n / (1 << k):.2f} {unit}"
    return f"{n} B"


def _decide(setting: str, one: int, layerwise: dict | None, left: int, source: str
            ) -> tuple[bool, str]:
    """Layer-wise recompute or not, and why: the rule of ``Trainer._recompute``."""
    if setting != "auto":
        return setting == "layers", f"train.recompute = \"{setting}\""
    layers = one > left / 2
    cmp = "over" if layers else "within"
    after = "the weights" if source == "train.memory_gib" else "the weights and LoRA state"
    why = (f"train.recompute = \"auto\": the one-graph compute buffer ({size(one)}) is {cmp} "
           f"half of the {size(left)} left after {after} ({source})")
    if layers and layerwise is None:
        why += "; but the adapter has tensors outside the blocks, which recompute refuses"
    return layers, why


def plan_run(cfg) -> RunPlan:
    """The memory ``cfg``'s run needs on its device (model.device), from the model file's
    index and keys and the graphs the trainer would build, measured by the scheduler without
    allocating; nothing is loaded and no step is run."""
    from pytrain.models import lora
    from pytrain.models.lora_targets import lora_param_count, select_targets
    from pytrain.train.optimizer import OptimizerState
    from pytrain.train.trainer import bucket_length
    device, free, total, available = _device_memory(cfg.model.device, cfg.model.threads,
                                                    bool(cfg.train.memory_gib))
    model, files, not_loaded = file_shape_model(cfg.model.path, device,
                                                cfg.model.type_policy, cfg.model.threads or 1)
    try:
        names = select_targets(model.config, cfg.lora.targets, cfg.lora.skip_ssm)
        ad = lora.create(model.runtime, model.config, names, cfg.lora.rank, cfg.lora.alpha)
        acc = OptimizerState(model.runtime, ad.params())
        B, T = cfg.train.batch_size, bucket_length(model, cfg.data.max_seq_len)
        one, lw = step_buffers(model, ad, acc, B, T)
        adapter = sum(int(lib.ggml_nbytes(p)) for p in ad.params())
        weights = model.weights.loaded_bytes
    finally:
        model.close()
    state = 3 * adapter                  # gradient accumulator + m + v, each a copy of A/B
    t = cfg.train
    if t.memory_gib:
        budget, source = int(t.memory_gib * 2**30), "train.memory_gib"
    else:
        budget, source = available, ("the device's free memory" if device != "cpu" else
                                     "available memory: the least of the system's and the "
                                     "cgroup's")
    layers, why = _decide(t.recompute, one, lw, budget - weights - (0 if t.memory_gib else state),
                          source)
    step = lw["largest"] + lw["persistent"] if layers and lw else one
    need = weights + adapter + state + step
    notes = ["plus a few small graphs (optimizer, labels) and, on a GPU, the CUDA context and "
             "the pool's slack"]
    return RunPlan(str(cfg.model.path), model.arch.name, device, (B, T),
                   _weight_groups(files, model), weights, not_loaded, len(names),
                   lora_param_count(model.config, names, cfg.lora.rank), adapter, state, one, lw,
                   t.recompute, layers, why, free, total, available, budget, source, need,
                   need <= budget, notes)
