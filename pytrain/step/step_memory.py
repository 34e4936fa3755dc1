"""The step of the largest micro-batch a config allows: its compute buffers, whether it runs
layer by layer, and whether a run of it fits its memory budget.  One rule for ``pytrain plan``
(pytrain/plan/run_memory.py, on a file's metadata) and ``pytrain train`` (on the loaded model
before its first step): what the plan says does not fit is what the run refuses."""
from __future__ import annotations

from dataclasses import dataclass

from pytrain.ggml import lib
from pytrain.models.model import Model
from pytrain.step import loss as loss_mod
from pytrain.step.free_memory import available_bytes
from pytrain.step.graph_memory import (compute_bytes, graph_context_bytes, host_available,
                                       needs_recompute)
from pytrain.step.graphs import GradGraph
from pytrain.step.recompute import RecomputeGraph
from pytrain.step.trainer import bucket_length


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


def decide(setting: str, one: int, layerwise: dict | None, left: int, source: str
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
    layers, why = decide(t.recompute, one, lw, left, source)
    return StepPlan((B, T), one, lw, layers, why,
                    lw["largest"] + lw["persistent"] if layers and lw else one)


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
