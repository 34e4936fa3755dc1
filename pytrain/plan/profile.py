"""One training step computed node by node, each node timed and labelled by the part of the
model it belongs to (``pytrain profile``; the CPU and GPU benchmarks print the same).

Why: a step's wall time says nothing about where it goes.  The scheduler's eval callback
stops after every node, so each node's time is measured alone (the per-node dispatch adds
overhead: the sum is larger than a real step, shares are what matter); the labels come from
the weights a node reads (forward) and from the forward node whose gradient it computes
(backward).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pytrain import ggml
from pytrain.ggml import ffi, lib
from pytrain.plan.products import PRODUCT_OPS, StepProducts, node_shape
from pytrain.run import loop as run

HEAD, LORA, INPUTS = "LM head + CE", "LoRA", "inputs"
NOOP = {"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}   # no compute: left out


def step_graphs(trainer) -> list[tuple]:
    """The trainer's step graphs as (graph, kind): a ``GradGraph``'s one graph (kind "one"), or
    a ``RecomputeGraph``'s layer-wise graphs ("pre": embedding and the layers below the first
    adapter, "fwd": one layer forward, "head": head + loss on a chunk of rows, "bwd": one layer
    recomputed and differentiated)."""
    out = []
    for g in trainer.graphs.values():
        if hasattr(g, "bwd"):   # RecomputeGraph
            out += [(g.pre.graph, "pre"), *((f.graph, "fwd") for f in g.fwd),
                    (g.head.graph, "head"), *((b.graph, "bwd") for b in g.bwd.values())]
        else:
            out.append((g.graph, "one"))
    return out


def step_kind(trainer) -> str:
    """How the trainer runs its steps: one graph, or layer-wise recompute (head chunk rows)."""
    kinds = []
    for g in trainer.graphs.values():
        if hasattr(g, "bwd"):
            kinds.append(f"layer-wise recompute (layers {g.l0}-{g.model.config.n_layer - 1} run "
                         f"forward twice; head + loss on chunks of {g.rows} rows)")
        else:
            kinds.append("one graph")
    return "; ".join(dict.fromkeys(kinds))


def _weight_label(t, op: str, kind: dict[int, str]) -> str | None:
    """The part a weight (or LoRA tensor) belongs to, None for other tensors."""
    nm = ggml.name(t)
    if nm.startswith("blk."):
        if ".lora_" in nm:
            return LORA
        parts = nm.split(".")
        il, w = int(parts[1]), parts[2]
        return ("FFN" if (w.startswith("ffn_") or w == "post_attention_norm")
                else kind.get(il, "layers"))
    if nm in ("token_embd.weight", "output.weight"):
        return "embedding" if op == "GET_ROWS" else HEAD
    return HEAD if nm == "output_norm.weight" else None


def _forward_label(t, label: dict[int, str], index: dict[int, int], kind) -> str:
    """A forward node's part: the weights it reads, else the latest-computed source's part
    (LoRA and inputs only when nothing else is there)."""
    op = ggml.op_name(t)
    if op.startswith("CROSS_ENTROPY"):
        return HEAD
    if op == "NONE":   # a parameter (LoRA A/B) or an input
        return _weight_label(t, op, kind) or INPUTS
    found, best, best_i, low = None, None, -1, None
    for j in range(10):
        s = t.src[j]
        if s == ffi.NULL:
            continue
        w = _weight_label(s if s.view_src == ffi.NULL else s.view_src, op, kind)
        a = ggml.address(s)
        if w is not None:
            if found is None or found == LORA:
                found = w
        elif a in label:
            lab = label[a]
            if lab in (LORA, INPUTS):
                low = LORA if LORA in (low, lab) else lab
            elif index[a] > best_i:
                best, best_i = lab, index[a]
    return found or best or low or INPUTS


def label_graph(graph, config, recompute: bool = False) -> dict[int, str]:
    """Part of the model each node of a step graph belongs to (address -> label).

    The graph's loss is its node flagged as such (``ggml_set_loss``: the masked CE, or a
    layer-wise backward graph's surrogate); a graph without one is all forward.  ``recompute``:
    the graph is a layer-wise backward graph, whose forward nodes recompute the layer
    (labelled "... (recompute)").  Forward nodes: by the weights they read (blk.N.ffn_* /
    post_attention_norm -> FFN, other blk.N weights -> the layer's mixer: attention or
    DeltaNet, LoRA A/B -> LoRA, token_embd/output as the head -> LM head + CE, as get_rows ->
    embedding), else inherited from their sources.  Backward nodes: "(bwd)" of the forward
    node whose gradient they are (ggml_graph_get_grad); temporaries take the label of the next
    registered gradient after them."""
    n = int(lib.ggml_graph_n_nodes(graph))
    nodes = [lib.ggml_graph_node(graph, i) for i in range(n)]
    flagged = [i for i, t in enumerate(nodes) if t.flags & lib.GGML_TENSOR_FLAG_LOSS]
    loss_i = flagged[-1] if flagged else n - 1
    index = {ggml.address(t): i for i, t in enumerate(nodes)}
    recurrent = getattr(config, "recurrent", None) or [False] * config.n_layer
    kind = {i: ("DeltaNet" if r else "attention") for i, r in enumerate(recurrent)}
    label: dict[int, str] = {}
    for i in range(loss_i + 1):
        label[ggml.address(nodes[i])] = _forward_label(nodes[i], label, index, kind)
    grads = {}
    for i in range(loss_i + 1):
        g = lib.ggml_graph_get_grad(graph, nodes[i])
        if g != ffi.NULL:
            grads[ggml.address(g)] = label[ggml.address(nodes[i])]
    carry = HEAD
    for i in range(n - 1, loss_i, -1):
        a = ggml.address(nodes[i])
        carry = grads.get(a, carry)
        label[a] = carry if carry.endswith("(bwd)") else carry + " (bwd)"
    if recompute:
        for i in range(loss_i + 1):
            label[ggml.address(nodes[i])] += " (recompute)"
    return label


@dataclass
class StepProfile:
    """Node times of profiled steps (seconds per step; the per-node dispatch overhead, the
    median time of the no-op nodes, subtracted from every other node)."""
    steps: int
    wall: float           # seconds per profiled step, callbacks included
    total: float          # the node times summed: by_part, by_op, by_backend each sum to it
    overhead: float
    n_nodes: int          # nodes computed per step (no-op nodes included)
    by_part: dict[str, float]
    by_op: dict[str, float]
    by_part_op: dict[str, float]
    by_backend: dict[str, float]
    by_op_backend: dict[str, float]
    by_part_op_backend: dict[str, float]
    count_op_backend: dict[str, int]
    step_graph: str
    backends: list[str]
    product_flops: int = 0   # the matrix products' FLOPs per step (pytrain.plan.products)
    products: dict | None = None   # StepProducts.to_dict() of one profiled step

    def to_dict(self) -> dict:
        return asdict(self)

    def split(self) -> tuple[float, float]:
        """(seconds in the matrix-product nodes, seconds in every other node) per step."""
        prod = sum(v for k, v in self.by_op.items() if k in PRODUCT_OPS)
        return prod, self.total - prod


def _sums(recs: list[tuple[str, str, str, float]], over: float, steps: int) -> dict:
    """The node records summed by part, op, backend and their pairs, per step."""
    keys = ("by_part", "by_op", "by_part_op", "by_backend", "by_op_backend",
            "by_part_op_backend")
    out: dict = {k: {} for k in keys + ("count_op_backend",)}
    for part, op, be, dt in recs:
        if op in NOOP:
            continue
        dt = max(0.0, dt - over) / steps
        for k, key in zip(keys, (part, op, f"{part}: {op}", be, f"{op} [{be}]",
                                 f"{part}: {op} [{be}]")):
            out[k][key] = out[k].get(key, 0.0) + dt
        c = out["count_op_backend"]
        c[f"{op} [{be}]"] = c.get(f"{op} [{be}]", 0) + 1
    out["count_op_backend"] = {k: -(-v // steps) for k, v in out["count_op_backend"].items()}
    return out


def profile_step(trainer, micro_batches: list, lr: float, steps: int = 1) -> StepProfile:
    """``steps`` optimizer steps over ``micro_batches`` computed node by node (a warm-up step
    first when the trainer has no graph yet), node times summed by part of the model, op and
    the backend the scheduler ran each node on.  Nodes of graphs other than the step's (the
    label fill) count as "optimizer"; the optimizer's own graphs run outside the scheduler
    and are in ``wall`` only."""
    rt = trainer.model.runtime
    if not trainer.graphs:      # the step graphs exist after a first step
        trainer.step(micro_batches, lr)
    labels: dict[int, str] = {}
    for g, kind in step_graphs(trainer):
        labels.update(label_graph(g, trainer.model.config, recompute=kind == "bwd"))
    recs: list[tuple[str, str, str, float]] = []
    state = {"t": 0.0}
    products = StepProducts()

    @ffi.callback("bool(struct ggml_tensor *, bool, void *)")
    def cb(t, ask, _ud):
        if ask:
            state["t"] = time.perf_counter()
            return True
        # (the scheduler synchronises the backend before this call)
        dt = time.perf_counter() - state["t"]
        op = ggml.op_name(t)
        recs.append((labels.get(ggml.address(t), "optimizer"), op, rt.node_backend(t), dt))
        if op in PRODUCT_OPS:
            shape = node_shape(t)
            products.counts[shape] = products.counts.get(shape, 0) + 1
        return True

    rt.set_eval_callback(cb)
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            trainer.step(micro_batches, lr)
    finally:
        rt.set_eval_callback(None)
    wall = (time.perf_counter() - t0) / steps
    over = statistics.median([dt for _, op, _, dt in recs if op in NOOP] or [0.0])
    sums = _sums(recs, over, steps)
    products.counts = {k: -(-v // steps) for k, v in products.counts.items()}
    return StepProfile(steps, wall, sum(sums["by_op"].values()), over, len(recs) // steps,
                       step_graph=step_kind(trainer),
                       backends=[ggml.backend_name(b) for b in rt.backends],
                       product_flops=products.flops, products=products.to_dict(), **sums)


def profile_run(cfg, steps: int = 1, log=lambda s: None) -> tuple[StepProfile, dict]:
    """Profile the first optimizer step of ``cfg``'s run (its model, data, adapter and
    trainer, as ``pytrain train`` makes them): one warm-up step, then ``steps`` profiled ones
    over the same micro-batches.  Returns the profile and facts about the step (batch shapes,
    targets, device)."""

    s = run.open_session(cfg, Path(cfg.output.dir or "."), log)
    try:
        batches = s.epoch_steps(0)[0]
        trainer = s.trainer
        trainer.step(batches, cfg.train.lr)          # warm-up: builds and allocates the graphs
        r = trainer.step(batches, cfg.train.lr)      # a real step's time, for comparison
        prof = profile_step(trainer, batches, cfg.train.lr, steps)
        facts = dict(model=str(cfg.model.path), device=s.model.runtime.device,
                     threads=s.model.runtime.threads,
                     micro_batches=[list(b.tokens.shape) for b in batches],
                     targets=r.n_valid if r else 0, tokens=r.tokens if r else 0,
                     unprofiled_step=r.seconds if r else None,
                     runtime=run.runtime_summary(s.model))
        return prof, facts
    finally:
        s.close()
