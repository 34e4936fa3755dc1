"""The training step and evaluation over batches: graphs cached per shape, token-mean loss
over the whole optimizer step, NaN stops before any parameter changes.  Evaluation alone
(no optimizer state) is ``pytrain.step.evaluate.Evaluator``."""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np

from pytrain.step import loss as loss_mod
from pytrain.step.distributed import World
from pytrain.step.evaluate import MAX_EVAL_GRAPHS, Evaluator
from pytrain.step.graphs import GradGraph, bucket_length
from pytrain.models.lora import LoraAdapter
from pytrain.models.model import Model
from pytrain.step.optimizer import OptimizerState, AdamWSettings, Optimizer
from pytrain.step.free_memory import available_bytes
from pytrain.step.graph_memory import compute_bytes, needs_recompute
from pytrain.step.recompute import RecomputeGraph


class NonFiniteLoss(RuntimeError):
    """Loss or gradient norm became NaN/inf; the parameters were left as they were."""


@dataclass
class StepResult:
    loss: float
    n_valid: int
    grad_norm: float
    clip: float
    lr: float
    tokens: int
    seconds: float
    allreduce_seconds: float = 0.0      # data-parallel: summing the step across ranks
    extra: dict | None = None           # objective-specific metrics (preference rewards)


class Trainer:
    def __init__(self, model: Model, adapter: LoraAdapter, hp: AdamWSettings, buggy_loss: bool = False,
                 max_graphs: int = 12, recompute: str = "auto", memory_bytes: int | None = None,
                 world=None, max_eval_graphs: int = MAX_EVAL_GRAPHS):
        """``memory_bytes``: what ``recompute="auto"`` may plan a step for, weights included
        (``train.memory_gib``); None: what the device has free (pytrain.step.free_memory).
        ``world``: the data-parallel ranks a step is shared by (pytrain.step.distributed;
        None: this process alone)."""
        self.world = world or World()
        self.model, self.adapter, self.hp = model, adapter, hp
        self.buggy = buggy_loss
        if recompute not in ("auto", "off", "layers"):
            raise ValueError(f"recompute must be auto, off or layers, got {recompute!r}")
        self.recompute = recompute
        self.memory_bytes = memory_bytes
        self.opt_state = OptimizerState(model.runtime, adapter.params())
        try:
            self.opt = Optimizer(model.runtime, self.opt_state, hp)
        except BaseException:
            self.opt_state.close()
            raise
        self.graphs: dict[tuple[int, int, int | None], GradGraph] = {}   # (B, T, rows)
        self.max_graphs = max_graphs
        self._auto: dict[tuple[int, int], bool] = {}
        self.evaluator = Evaluator(model, adapter, self.world, max_eval_graphs)
        # the optimizer update runs inside hold(): the run's Interrupt lets no second Ctrl-C
        # stop it half way (a checkpoint must never hold half an update)
        self.hold = contextlib.nullcontext

    @property
    def eval_graphs(self) -> dict:
        """The evaluation graphs kept now, by (B, T, rows)."""
        return self.evaluator.graphs

    def graph(self, B: int, T: int, n_targets: int | None = None):
        """The step graph for a [B, T] micro-batch with ``n_targets`` targets (None: the head
        and loss on every row, as the bug reproduction needs): one ``GradGraph``, or a
        ``RecomputeGraph`` (layer by layer, the head on row chunks) when ``recompute`` says so."""
        T = bucket_length(self.model, T)
        if n_targets is not None and self._recompute(B, T):
            key = (B, T, "layers")
        else:
            key = (B, T, None if n_targets is None else loss_mod.rows_bucket(n_targets, B * T))
        if key not in self.graphs:
            if len(self.graphs) >= self.max_graphs:   # drop the oldest shape
                self._drop(next(iter(self.graphs)))
            if key[2] == "layers":
                self.graphs[key] = RecomputeGraph(self.model, self.adapter, B, T, opt_state=self.opt_state)
            else:
                self.graphs[key] = GradGraph(self.model, self.adapter, B, T, opt_state=self.opt_state,
                                             rows=key[2])
        return self.graphs[key]

    def _recompute(self, B: int, T: int) -> bool:
        """``auto``: recompute only when one graph would not fit comfortably
        (``needs_recompute``): its compute buffer, measured by the scheduler without
        allocating, against the memory left for it (what the device has free now, the weights
        being loaded, and on the CPU what the container's cgroup allows; or ``memory_bytes``
        less the weights)."""
        if self.recompute != "auto":
            return self.recompute == "layers"
        if (B, T) not in self._auto:
            g = GradGraph(self.model, self.adapter, B, T, opt_state=self.opt_state,
                          rows=loss_mod.rows_bucket(B * T, B * T))
            try:
                need = compute_bytes(self.model.runtime, g.graph)
            finally:
                g.close()
            left = (self.memory_bytes - self.model.weights.total_bytes
                    if self.memory_bytes is not None else available_bytes(self.model.runtime))
            self._auto[(B, T)] = needs_recompute(need, left)
        return self._auto[(B, T)]

    def _drop(self, key) -> None:
        g = self.graphs.pop(key)
        g.close()

    def targets(self, batch) -> np.ndarray:
        if self.buggy:
            return loss_mod.buggy_targets(batch.tokens, batch.seg, self.model.pad_id)
        return loss_mod.shift_targets(batch.tokens, batch.train_mask, batch.seg)

    def step(self, micro_batches: list, lr: float) -> StepResult | None:
        """One optimizer step over ``micro_batches`` (gradient accumulation; with several
        data-parallel ranks, this rank's share of the step's micro-batches, possibly none).
        Returns None when the whole step has no valid target (skipped, nothing divided by
        zero)."""
        t0 = time.perf_counter()
        w = self.world
        tgts = [self.targets(b) for b in micro_batches]
        counts = [int((t >= 0).sum()) for t in tgts]
        n_step = w.sum(sum(counts))       # baked into every micro-batch's loss_scale
        if self.buggy:   # the unfixed loss: each micro-batch's mean over ALL its rows,
            n_step = w.sum(len(micro_batches))   # averaged over micro-batches as ggml-opt does
        if n_step == 0:
            return None
        self.opt_state.zero_grads()
        total, tokens = 0.0, 0
        for i, (b, tg, n) in enumerate(zip(micro_batches, tgts, counts)):
            g = self.graph(*b.tokens.shape, None if self.buggy else n)
            # dropout masks by (step, the micro-batch's index in the whole step): as with
            # one process, whatever the ranks
            part, _ = g.accumulate(b.tokens, b.seg, tg, n_step, self.buggy,
                                   dropout_key=(self.opt.t, w.rank + i * w.size))
            total += part
            tokens += int((b.seg >= 0).sum())
        t_comm = 0.0
        if w.size > 1:
            t1 = time.perf_counter()
            sums = w.allreduce_sum(np.array([total, tokens], np.float64))     # one message
            total, tokens = float(sums[0]), int(sums[1])
            self.opt_state.allreduce_grads(w)    # before the NaN check, the norm and AdamW
            t_comm = time.perf_counter() - t1
        norm, clip = self.update(total, lr)
        return StepResult(total, n_step, norm, clip, lr, tokens, time.perf_counter() - t0,
                          t_comm)

    def update(self, loss: float, lr: float) -> tuple[float, float]:
        """AdamW on the accumulated gradients, unless the step's loss or gradient norm is NaN
        or inf (``NonFiniteLoss``: nothing changed); returns (gradient norm, clip factor)."""
        if not math.isfinite(loss):
            raise NonFiniteLoss(f"loss is {loss}")
        norm = self.opt.grad_norm()
        if not math.isfinite(norm):
            raise NonFiniteLoss(f"gradient norm is {norm}")
        with self.hold():
            return norm, self.opt.step(lr, norm)

    def evaluate(self, batches: list) -> dict:
        """Loss, token accuracy and perplexity over valid targets only (``Evaluator``)."""
        return self.evaluator.evaluate(batches)

    def close(self) -> None:
        """Free every graph and the optimizer state; the model and the adapter are the
        caller's."""
        for g in self.graphs.values():
            g.close()
        self.graphs.clear()
        self.evaluator.close()
        self.opt.close()
        self.opt_state.close()
