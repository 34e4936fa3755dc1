"""The matrix products of a training step: their FLOPs, counted from the graph nodes the step
really computes (MUL_MAT, OUT_PROD, MUL_MAT_ID), grouped by shape.

Why: a step's wall time alone does not say how far it is from the machine's limit.  Its
products' FLOPs divided by the time, against the rate the same library reaches on one product
of the same shape (``pytrain.plan.matmul_probe``), does; and the largest shapes are the ones
worth probing.  Counted from the built graphs, not from a formula of the model's size, so
whatever the graph does is in: frozen weights getting no weight gradient, the LM head on the
target rows only, LoRA's small products, attention's score products, a layer-wise recompute's
second forward, a head run once per chunk of rows.

FLOPs of a node (multiply and add counted as 2), from its shapes (ggml's ``ne`` order):
  MUL_MAT     a [K, M, ...], b [K, N, ...] -> dst [M, N, d2, d3]:  2·K·M·N·d2·d3
  MUL_MAT_ID  a [K, M, experts], dst [M, used, N]:                 2·K·M·used·N
  OUT_PROD    a [M, K, ...], b [N, K, ...] -> dst [M, N, d2, d3]:  2·K·M·N·d2·d3
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

from pytrain import ggml
from pytrain.ggml import lib

PRODUCT_OPS = ("MUL_MAT", "OUT_PROD", "MUL_MAT_ID")


@dataclass(frozen=True)
class Shape:
    """One product's shape: the op, the type of its first operand (the weight, for a model's
    products), both operands' and the result's ``ne``."""
    op: str
    a_type: str
    a: tuple[int, int, int, int]
    b: tuple[int, int, int, int]
    dst: tuple[int, int, int, int]

    @property
    def k(self) -> int:
        """The contracted length."""
        return self.a[1] if self.op == "OUT_PROD" else self.a[0]

    @property
    def flops(self) -> int:
        return 2 * self.k * math.prod(self.dst)

    def label(self) -> str:
        """"MUL_MAT F32 [512 x 151936] . [512 x 256]": the op, the weight's type, and both
        operands' ne (batch dims after an x when there are any)."""
        def ne(x):
            return " x ".join(str(v) for v in (x if any(v != 1 for v in x[2:]) else x[:2]))
        return f"{self.op} {self.a_type} [{ne(self.a)}] . [{ne(self.b)}]"

    def to_dict(self) -> dict:
        return dict(op=self.op, a_type=self.a_type, a=list(self.a), b=list(self.b),
                    dst=list(self.dst), flops=self.flops, label=self.label())

    @classmethod
    def from_dict(cls, d: dict) -> "Shape":
        return cls(d["op"], d["a_type"], tuple(d["a"]), tuple(d["b"]), tuple(d["dst"]))


def _ne(t) -> tuple[int, int, int, int]:
    return tuple(int(t.ne[i]) for i in range(4))


def node_shape(t) -> Shape | None:
    """The product a graph node computes, None for any other node."""
    op = ggml.op_name(t)
    if op not in PRODUCT_OPS:
        return None
    a, b = t.src[0], t.src[1]
    return Shape(op, ggml.type_name(a.type), _ne(a), _ne(b), _ne(t))


def graph_shapes(graph) -> list[Shape]:
    """Every product node of a built graph, in node order (ggml_graph_n_nodes /
    ggml_graph_node: the nodes a compute runs)."""
    out = []
    for i in range(int(lib.ggml_graph_n_nodes(graph))):
        s = node_shape(lib.ggml_graph_node(graph, i))
        if s is not None:
            out.append(s)
    return out


@dataclass
class StepProducts:
    """A step's products by shape (how many times each ran) and the graph computes seen."""
    counts: dict[Shape, int] = field(default_factory=dict)
    graph_runs: int = 0

    def add(self, shapes: list[Shape], times: int = 1) -> None:
        self.graph_runs += times
        for s in shapes:
            self.counts[s] = self.counts.get(s, 0) + times

    @classmethod
    def from_graphs(cls, runs) -> "StepProducts":
        """From (graph, times computed per step) pairs."""
        sp = cls()
        for graph, times in runs:
            sp.add(graph_shapes(graph), times)
        return sp

    @property
    def flops(self) -> int:
        return sum(s.flops * n for s, n in self.counts.items())

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s, n in self.counts.items():
            out[s.op] = out.get(s.op, 0) + s.flops * n
        return out

    def top(self, k: int) -> list[tuple[Shape, int]]:
        """The ``k`` shapes holding the most FLOPs (shape, times run), largest first."""
        return sorted(self.counts.items(), key=lambda kv: (-kv[0].flops * kv[1], kv[0].label()))[:k]

    def to_dict(self, top: int = 12) -> dict:
        return dict(flops=self.flops, by_op=self.by_op(), graph_runs=self.graph_runs,
                    n_products=sum(self.counts.values()), n_shapes=len(self.counts),
                    top=[dict(s.to_dict(), times=n) for s, n in self.top(top)])


@contextmanager
def counting(runtime):
    """Count the products of every graph ``runtime`` computes inside the block (the
    scheduler's ``compute`` and the kept graphs' ``compute_resident``), as the step runs them:
    a graph computed twice counts twice.  Yields the StepProducts being filled.  The nodes are
    walked before each compute (a graph's address can be reused by the next one), ~10 us per
    node: for an untimed step."""
    sp = StepProducts()
    names = ("compute", "compute_resident")
    saved = {n: runtime.__dict__.get(n) for n in names}

    def wrap(fn):
        def w(graph, *a, **k):
            sp.add(graph_shapes(graph))
            return fn(graph, *a, **k)
        return w

    for n in names:
        setattr(runtime, n, wrap(getattr(runtime, n)))
    try:
        yield sp
    finally:
        for n in names:
            if saved[n] is None:
                runtime.__dict__.pop(n, None)
            else:
                setattr(runtime, n, saved[n])


def count_step(trainer, micro_batches: list, lr: float) -> StepProducts:
    """One real optimizer step of ``trainer`` (it trains: use a warm-up step), its products
    counted as they ran."""
    with counting(trainer.model.runtime) as sp:
        trainer.step(micro_batches, lr)
    return sp
