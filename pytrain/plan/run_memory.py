"""``pytrain plan``: the memory a config's run will need on its device, and whether it fits,
from the model file's index and keys and the graphs the trainer would build (measured by the
scheduler without allocating; nothing is loaded and no step is run)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from pytrain import ggml
from pytrain.ggml import lib
from pytrain.models import lora
from pytrain.models.lora_targets import lora_param_count, select_targets
from pytrain.models.model import Model
from pytrain.step.optimizer import OptimizerState
from pytrain.step.graph_memory import context_warning, file_shape_model
from pytrain.step.free_memory import available_bytes
# the step of the largest micro-batch, sized by the rule `pytrain train` applies too
from pytrain.step.step_memory import plan_step
from pytrain.run import type_choice
from pytrain.models import precision
from pytrain.formats.gguf_tensors import is_elementwise


@dataclass
class RunPlan:
    """The memory a config's training run needs on its device, and whether it fits.  Sizes
    are bytes; the batch is the largest micro-batch the config allows (``train.batch_size``
    rows of ``data.max_seq_len`` tokens, every token a target); a real batch of shorter
    examples needs less."""
    model: str
    arch: str
    device: str                   # cpu, cuda, vulkan or rpc: what model.device resolves to here
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
    warnings: list[str] = field(default_factory=list)   # lines starting "warning: "
    types: dict = field(default_factory=dict)   # type_policy's choice: TypeChoice.to_dict()
    device_label: str | None = None   # ggml's name and description of the device (None: the
                                      # device is not on this machine)
    compute: str = "compute f32"      # train.compute_type and, for bf16, the kernel
    unbuilt: str | None = None        # why the step's graphs were not built (StepPlan)

    def to_dict(self) -> dict:
        return asdict(self)


def _device_memory(device: str, threads: int | None, budget_set: bool
                   ) -> tuple[str, int | None, int | None, int | None, str | None]:
    """(device kind, free, total, available, ggml's label of the device) of the device a run
    on ``device`` computes on.
    A GPU this machine does not have is planned for (its weight types) when the budget is
    given (train.memory_gib): its memory is then None."""
    try:
        rt = ggml.Runtime(device, threads=threads)
    except ggml.DeviceError as e:
        if device not in ("cuda", "vulkan") and not device.startswith("rpc:"):
            raise
        if not budget_set:
            raise ggml.DeviceError(f"{e}; to plan for such a device from this machine, give "
                                   f"its memory: --set train.memory_gib=GIB") from e
        return device.split(":")[0], None, None, None, None
    try:
        free, total = rt.device_memory_info()
        return rt.device, free, total, available_bytes(rt), rt.device_label()
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


def plan_run(cfg) -> RunPlan:
    """The memory ``cfg``'s run needs on its device (model.device), from the model file's
    index and keys and the graphs the trainer would build, measured by the scheduler without
    allocating; nothing is loaded and no step is run."""
    device, free, total, available, label = _device_memory(
        cfg.model.device, cfg.model.threads, bool(cfg.train.memory_gib))
    t = cfg.train
    if t.memory_gib:
        budget, source = int(t.memory_gib * 2**30), "train.memory_gib"
    else:
        budget, source = available, ("the device's free memory" if device != "cpu" else
                                     "available memory: the least of the system's and the "
                                     "cgroup's")
    try:
        policy = precision.type_policy_for(t.compute_type, cfg.model.type_policy)
        compute = precision.check(t.compute_type, device, ggml.blas_enabled())
    except precision.ComputeTypeError as e:
        raise cfg.error("train", "compute_type", str(e)) from None
    chosen = []

    def choose_types(infos, shapes):      # the trainer's choice (type_choice.for_training)
        key = type_choice.device_key(device, ggml.blas_enabled())
        chosen.append(type_choice.choose(key, infos, shapes, cfg.model.type_policy, budget,
                                         source.split(":")[0], t.compute_type))
        return chosen[-1].dequantize
    model, files, not_loaded = file_shape_model(cfg.model.path, device, policy,
                                                cfg.model.threads or 1, choose_types)
    if t.compute_type == "bf16":           # what the run's log says (load_model)
        shapes = model.config.tensor_shapes()
        compute = precision.with_matrices(compute, ((ft, lt) for n, (ft, lt, _b) in files.items()
                                                    if not is_elementwise(n, tuple(shapes[n]))))
    try:
        names = select_targets(model.config, cfg.lora.targets, cfg.lora.skip_ssm)
        ad = lora.create(model.runtime, model.config, names, cfg.lora.rank, cfg.lora.alpha,
                         dropout=cfg.lora.dropout)     # its masks are graph tensors
        opt_state = OptimizerState(model.runtime, ad.params())
        adapter = sum(int(lib.ggml_nbytes(p)) for p in ad.params())
        weights = model.weights.loaded_bytes
        state = 3 * adapter              # gradient accumulator + m + v, each a copy of A/B
        step = plan_step(model, ad, opt_state, cfg,
                         budget - weights - (0 if t.memory_gib else state), source)
    finally:
        model.close()
    preference = t.objective != "sft"
    B, T = step.batch
    need = weights + adapter + state + step.bytes
    notes = ["plus a few small graphs (optimizer, labels) and, on a GPU, the CUDA context and "
             "the pool's slack"]
    if preference:
        notes.append(f"{t.objective}: a micro-batch is train.batch_size pairs, {B} sequences "
                     f"(chosen and rejected); a step runs a forward-only pass for the policy's "
                     f"log-probabilities, then forward + backward"
                     + ("; the reference (base model) log-probabilities are computed once "
                        "before training by forward-only passes and cached in the run folder"
                        if t.objective == "dpo" else ""))
    if label and ggml.is_lavapipe(label.partition(": ")[2]):
        notes.append("lavapipe (Mesa's Vulkan driver) runs on the CPU: its memory is the "
                     "system's")
    return RunPlan(str(cfg.model.path), model.arch.name, device, (B, T),
                   _weight_groups(files, model), weights, not_loaded, len(names),
                   lora_param_count(model.config, names, cfg.lora.rank), adapter, state,
                   step.one_graph, step.layerwise, t.recompute, step.layers, step.reason, free,
                   total, available, budget, source, need,
                   need <= budget and step.unbuilt is None, notes,
                   [w for w in [context_warning(model.config, cfg.data.max_seq_len)] if w],
                   chosen[-1].to_dict() if chosen else {}, label, compute, step.unbuilt)
