"""Validation metrics over batches: loss, token accuracy and perplexity over valid targets
only, with or without an adapter, and nothing a training step needs (no optimizer state).

The evaluation graphs are kept per batch shape, at most ``max_graphs`` of them, the least
recently used freed first.  Why a bound: each graph's context holds the tensor metadata of a
whole forward (at the Qwen3.5-2B shape and 4096 tokens a 256 MB context, 47 MB of it used),
and validation sets of varied lengths make one shape per length bucket; unbounded, they all
stayed until the run ended.  Validation batches come in length order, so a pass past the
bound rebuilds each graph once (0.24 s at that shape), little next to computing it.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from pytrain.data import make_batches
from pytrain.models.lora import LoraAdapter
from pytrain.models.model import Model
from pytrain.step import loss as loss_mod
from pytrain.step.distributed import World
from pytrain.step.graphs import EvalGraph, bucket_length

MAX_EVAL_GRAPHS = 4


class Evaluator:
    """``evaluate(batches)`` for ``model`` with ``adapter`` (None: the base model, no LoRA in
    the graph); with several data-parallel ranks (``world``) each evaluates a share of the
    batches and the sums are combined."""

    def __init__(self, model: Model, adapter: LoraAdapter | None = None, world=None,
                 max_graphs: int = MAX_EVAL_GRAPHS):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        self.model, self.adapter = model, adapter
        self.world = world or World()
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple[int, int, int], EvalGraph] = OrderedDict()

    def graph(self, key: tuple[int, int, int]) -> EvalGraph:
        """The graph for (B, T, rows), built if not kept; the least recently used one is freed
        when there are more than ``max_graphs``."""
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)[1].close()
        self.graphs[key] = EvalGraph(self.model, self.adapter, *key)
        return self.graphs[key]

    def evaluate(self, batches: list) -> dict:
        """Loss, token accuracy and perplexity over the valid targets of ``batches``."""
        nll, correct, n = 0.0, 0, 0
        w = self.world
        for b in batches[w.rank::w.size]:
            tg = loss_mod.shift_targets(b.tokens, b.train_mask, b.seg)
            k = int((tg >= 0).sum())
            if k == 0:
                continue
            B, T = b.tokens.shape[0], bucket_length(self.model, b.tokens.shape[1])
            s, c = self.graph((B, T, loss_mod.rows_bucket(k, B * T))).run(b.tokens, b.seg, tg)
            nll += s
            correct += c
            n += k
        if w.size > 1:
            sums = w.allreduce_sum(np.array([nll, correct, n], np.float64))
            nll, correct, n = float(sums[0]), int(sums[1]), int(sums[2])
        if n == 0:
            return {"loss": float("nan"), "accuracy": float("nan"), "perplexity": float("nan"),
                    "n_valid": 0}
        return {"loss": nll / n, "accuracy": correct / n, "perplexity": math.exp(min(nll / n, 50)),
                "n_valid": n}

    def close(self) -> None:
        for g in self.graphs.values():
            g.close()
        self.graphs.clear()


def evaluate_examples(model: Model, examples: list, batch_size: int, *,
                      adapter: LoraAdapter | None = None, packing: bool = False,
                      max_seq_len: int | None = None) -> dict:
    """Loss, token accuracy and perplexity of ``model`` (with ``adapter``, or the base model)
    over the valid targets of ``examples``, batched in order (no shuffle) as a run's
    validation batches are.  A free function, so that ``pytrain eval`` and the Python API's
    ``LoadedModel.eval`` hold no trainer and no optimizer state."""
    batches = make_batches(examples, batch_size, packing, 0, shuffle=False,
                           max_seq_len=max_seq_len, pad_id=model.pad_id)
    evaluator = Evaluator(model, adapter)
    try:
        return evaluator.evaluate(batches)
    finally:
        evaluator.close()
