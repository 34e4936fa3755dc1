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
from pytrain.step import loss as loss_mod
from pytrain.step.graphs import GradGraph
from pytrain.step.free_memory import available_bytes
from pytrain.step.optimizer import OptimizerState
from pytrain.step.graph_memory import (compute_bytes, context_warning, file_shape_model,
                                     graph_context_bytes, host_available, needs_recompute)
from pytrain.step.recompute import RecomputeGraph
from pytrain.step.trainer import bucket_length
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


@dataclass
class StepPlan:
    """The step of the largest micro-batch a config allows: its compute buffers, whether it
    runs layer by layer, and the memory it takes.  ``unbuilt``: the graphs were not built,
    their metadata alone being over the host's memory; ``bytes`` is then that metadata."""
    batch: tuple[int, int]        # (B, T): sequences (a preference pair's two) x padded length
    one_graph: int
    layerwise: dict | None
    layers: bool
    reason: str
    bytes: int                    # one graph, or layer-wise's largest graph + kept inputs
    unbuilt: str | None = None


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


def preference_step_buffer(model: Model, adapter, opt_state, B: int, T: int) -> int:
    """Compute buffer of a preference step (step/preference.py): its forward-and-backward
    graph of B sequences with every position a target, per-sequence loss; the policy's
    forward-only pass and the reference pass before training need less (no backward)."""
    g = GradGraph(model, adapter, B, T, opt_state=opt_state, rows_per_seq=T, measure_only=True)
    try:
        return compute_bytes(model.runtime, g.graph)
    finally:
        g.close()


def step_buffers(model: Model, adapter, opt_state, B: int, T: int, n_targets: int | None = None
                 ) -> tuple[int, dict | None]:
    """Compute buffer of the one-graph step with the head and loss on the rows of
    ``n_targets`` targets (None: every row, as the trainer's recompute = auto measures it), and
    of layer-wise recompute's graphs (None where the adapter has tensors outside the blocks,
    which layer-wise recompute refuses)."""
    g = GradGraph(model, adapter, B, T, opt_state=opt_state,
                  rows=loss_mod.rows_bucket(n_targets or B * T, B * T), measure_only=True)
    try:
        one = compute_bytes(model.runtime, g.graph)
    finally:
        g.close()
    try:
        r = RecomputeGraph(model, adapter, B, T, opt_state=opt_state, measure_only=True)
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
    """Layer-wise recompute or not, and why (the trainer's rule, ``needs_recompute``)."""
    if setting != "auto":
        return setting == "layers", f"train.recompute = \"{setting}\""
    layers = needs_recompute(one, left)
    cmp = "over" if layers else "within"
    after = "the weights" if source == "train.memory_gib" else "the weights and LoRA state"
    why = (f"train.recompute = \"auto\": the one-graph compute buffer ({size(one)}) is {cmp} "
           f"half of the {size(left)} left after {after} ({source})")
    if layers and layerwise is None:
        why += "; but the adapter has tensors outside the blocks, which recompute refuses"
    return layers, why


def plan_step(model: Model, adapter, opt_state, cfg, left: int, source: str) -> StepPlan:
    """The step of ``cfg``'s largest micro-batch (``train.batch_size`` rows, a preference
    pair's two sequences each, of ``data.max_seq_len`` tokens padded as the trainer pads
    them), measured on ``model`` (a file's metadata for ``pytrain plan``, the loaded model for
    ``pytrain train``), with ``left`` bytes left for the step for recompute = auto.  One
    function for both commands, so that what the plan says does not fit is what the run
    refuses."""
    t = cfg.train
    preference = t.objective != "sft"
    B, T = t.batch_size * (2 if preference else 1), bucket_length(model, cfg.data.max_seq_len)
    meta, host = graph_context_bytes(model, T), host_available()
    if host is not None and meta > host:
        why = (f"the graph of a {B} x {T} micro-batch needs {size(meta)} of host memory for "
               f"its tensors' metadata alone, over the {size(host)} available: not built")
        return StepPlan((B, T), 0, None, False, why, meta, why)
    if preference:
        one = preference_step_buffer(model, adapter, opt_state, B, T)
        return StepPlan((B, T), one, None, False, f"train.objective = \"{t.objective}\": one "
                        f"graph a step (no layer-wise preference step yet)", one)
    one, lw = step_buffers(model, adapter, opt_state, B, T)
    layers, why = _decide(t.recompute, one, lw, left, source)
    return StepPlan((B, T), one, lw, layers, why,
                    lw["largest"] + lw["persistent"] if layers and lw else one)


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
                                         source.split(":")[0]))
        return chosen[-1].dequantize
    model, files, not_loaded = file_shape_model(cfg.model.path, device, policy,
                                                cfg.model.threads or 1,
                                                choose_types if policy != "bf16" else None)
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


def loaded_run_memory(model: Model, adapter, opt_state, cfg) -> tuple[int, int, str, StepPlan]:
    """(need, budget, where the budget comes from, the step) of a run whose model, adapter
    and optimizer state are loaded: ``plan_run``'s sum and comparison, on the loaded tensors.
    The budget is train.memory_gib, or what is available now plus what the run already holds
    (what was available before it loaded, as the plan counts it); recompute = auto decides
    with what the trainer itself sees left (``Trainer._recompute``)."""
    t = cfg.train
    weights = model.weights.loaded_bytes
    adapter_bytes = sum(int(lib.ggml_nbytes(p)) for p in adapter.params())
    state = 3 * adapter_bytes
    if t.memory_gib:
        budget, source = int(t.memory_gib * 2**30), "train.memory_gib"
        left = budget - model.weights.total_bytes
    else:
        left = available_bytes(model.runtime)
        budget = left + weights + adapter_bytes + state
        source = ("the device's free memory" if model.runtime.gpu is not None else
                  "available memory: the least of the system's and the cgroup's")
    step = plan_step(model, adapter, opt_state, cfg, left, source)
    return weights + adapter_bytes + state + step.bytes, budget, source, step


def check_run_fits(cfg, model: Model, adapter, opt_state, examples: list) -> None:
    """``pytrain train``'s side of ``pytrain plan``'s verdict: the same sum for the largest
    micro-batch the config allows, on the loaded model, and a ConfigError naming
    ``data.max_seq_len`` where it does not fit.  Why the config's largest and not this
    data's: a batch that long is what the config asks the run to be ready for (a packed row
    always is one), and a run refused at its start costs nothing where one stopped by its
    longest batch, hours in, loses them; ``examples`` (this data's) only say how long the
    longest is, a length that would do."""
    need, budget, source, step = loaded_run_memory(model, adapter, opt_state, cfg)
    if need <= budget and step.unbuilt is None:
        return
    B, T = step.batch
    what = step.unbuilt or (f"it needs {size(need)} (weights, LoRA, optimizer state and the "
                            f"step, {'layer-wise' if step.layers else 'one graph'}), "
                            f"{size(need - budget)} over the budget of {size(budget)} "
                            f"({source})")
    lower = "lower data.max_seq_len or train.batch_size"
    if examples and not cfg.data.packing:
        lower += f" (the longest example here has {max(map(len, examples))} tokens)"
    ways = [lower]
    if step.unbuilt is None:             # the host's memory is no device's budget
        if cfg.train.recompute == "off" and cfg.train.objective == "sft":
            ways.append('set train.recompute = "auto"')
        ways.append("set train.memory_gib if the device has more memory than that budget")
    raise cfg.error("data", "max_seq_len",
                    f"a micro-batch of {B} x {T} tokens (train.batch_size x "
                    f"data.max_seq_len: the largest this config allows) does not fit: {what}; "
                    f"`pytrain plan` shows the sizes: {', or '.join(ways)}")
