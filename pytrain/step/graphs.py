"""The step graphs, one static graph per batch shape: ``GradGraph`` (forward with the adapter →
masked CE → backward, adding its gradients into the shared accumulators) and ``EvalGraph``
(forward → masked CE and argmax, for validation metrics).  The layer-wise variant of
``GradGraph`` is ``recompute.RecomputeGraph``.

Built once and reused for every micro-batch of that shape: only inputs change (tokens,
positions, masks, labels, loss_scale), so no graph is rebuilt per step.
"""
from __future__ import annotations

import numpy as np

from pytrain import ggml
from pytrain.step import loss as loss_mod
from pytrain.ggml import lib
from pytrain.models.lora import LoraAdapter
from pytrain.models.model import Model
from pytrain.step.optimizer import OptimizerState


def bucket_length(model: Model, T: int) -> int:
    """Graph length for a batch of T tokens: a multiple of 16 (few distinct graphs), then
    what the architecture pads to (e.g. whole chunks of a recurrent layer)."""
    return model.arch.padded_length(-(-T // 16) * 16)


def pad_batch(B: int, T: int, tokens: np.ndarray, seg: np.ndarray, targets: np.ndarray,
              pad_id: int, fill_target: int = loss_mod.IGNORE):
    """Right-pad a [B0, T0] batch to a graph's [B, T] (padding: pad token, sample id -1,
    ``fill_target``)."""
    B0, T0 = tokens.shape
    tok = np.full((B, T), pad_id, np.int64)
    sg = np.full((B, T), -1, np.int64)
    tg = np.full((B, T), fill_target, np.int64)
    tok[:B0, :T0], sg[:B0, :T0], tg[:B0, :T0] = tokens, seg, targets
    return tok, sg, tg


class GradGraph:
    def __init__(self, model: Model, adapter: LoraAdapter, B: int, T: int,
                 opt_state: OptimizerState | None = None, keep_logit_grad: bool = False,
                 rows: int | None = None, measure_only: bool = False,
                 rows_per_seq: int | None = None):
        """``rows``: run the LM head and the loss on that many positions, the micro-batch's
        targets (loss.select_rows), instead of all B·T; None: on all of them (needed by the
        bug reproduction, which trains every row, and by ``keep_logit_grad``).
        ``rows_per_seq``: the loss per sequence (``loss.SequenceCE``, preference training):
        each of the B rows' targets in a block of that many head rows.
        ``measure_only``: a graph only measured (``pytrain plan``), never run: its persistent
        inputs are not allocated (``Runtime.alloc``)."""
        assert rows is None or not keep_logit_grad, "logit gradients are kept for all rows only"
        self.rows_per_seq = rows_per_seq
        if rows_per_seq is not None:
            rows = B * rows_per_seq
        self.rows, self.measure_only = rows, measure_only
        self.model, self.adapter = model, adapter
        self.B, self.T = B, model.arch.padded_length(T)
        self.ce = self.seed_buf = self.seed_ctx = self.ctx = None
        self.own_state = opt_state is None
        self.opt_state = opt_state or OptimizerState(model.runtime, adapter.params())
        try:
            self._build(keep_logit_grad)
        except BaseException:       # a failed build keeps no buffer (they outlive Python's GC)
            self.close()
            raise

    def _build(self, keep_logit_grad: bool) -> None:
        model, adapter, rows, B = self.model, self.adapter, self.rows, self.B
        measure_only = self.measure_only
        size = model.graph_budget(self.T)
        self.ctx = ggml.Context(n_tensors=size * 2, graph_size=size * 2, grads=True)
        c = self.ctx.ptr
        row_mask = loss_mod.new_row_mask(c, rows or self.T * B)
        with adapter.training_masks() as self.masks:      # dropout masks, when lora.dropout
            self.fwd = model.graph.build(c, B, self.T, adapter.hook, rows=rows,
                                         row_mask=row_mask)
        self.ce = _loss(model, c, self.fwd.logits, row_mask, self.rows_per_seq, measure_only)
        gf = ggml.new_graph(self.ctx, size * 2, grads=True)
        lib.ggml_build_forward_expand(gf, self.ce.loss)
        # d(loss)/d(loss) = 1 lives in its own small static buffer
        self.seed_ctx = ggml.Context(n_tensors=1)
        seed = lib.ggml_new_tensor_1d(self.seed_ctx.ptr, lib.GGML_TYPE_F32, 1)
        self.seed_buf = model.runtime.alloc(self.seed_ctx, measure_only=measure_only)
        if not measure_only:
            ggml.from_numpy(seed, np.ones(1, np.float32))
        accs = {ggml.address(p): self.opt_state.grad[ggml.name(p)] for p in adapter.params()}
        self.graph = ggml.build_backward(self.ctx, gf, self.ce.loss, accs, seed)
        self.logit_grad = None
        if keep_logit_grad:
            g = ggml.grad_of(self.graph, self.fwd.logits)
            g = lib.ggml_cont(c, g) if not lib.ggml_is_contiguous(g) else g
            lib.ggml_build_forward_expand(self.graph, g)
            lib.ggml_set_output(g)
            self.logit_grad = g
        lib.ggml_set_output(self.fwd.logits)

    def accumulate(self, tokens: np.ndarray, seg: np.ndarray, targets: np.ndarray,
                   n_valid_step: int | None = None, buggy: bool = False,
                   dropout_key: tuple[int, ...] = (0, 0)) -> tuple[float, int]:
        """Forward + backward of one micro-batch, adding its gradients into the
        accumulators; returns (this micro-batch's share of the step loss, its valid count).
        ``dropout_key``: the micro-batch's place in the run, which draws its dropout masks."""
        pad = self.model.pad_id
        # the bug reproduction labels the graph's own padding with the pad token as well
        tok, sg, tg = pad_batch(self.B, self.T, tokens, seg, targets, pad,
                                pad if buggy else loss_mod.IGNORE)
        rt = self.model.runtime
        rt.alloc_graph(self.graph, self.ctx)
        self.model.arch.set_inputs(self.fwd.inputs, self.model.input_values(tok, sg))
        if self.masks:
            self.adapter.fill_masks(self.masks, dropout_key)
        if self.rows is not None:
            if buggy:
                raise ValueError("the bug reproduction trains every row: build with rows=None")
            sel, tg = loss_mod.select_rows(tg, self.rows)
            ggml.from_numpy(self.fwd.inputs.rows, sel)
        n_valid = self.ce.prepare(tg, self.model.tokenizer.pad_id, n_valid_step, buggy)
        rt.compute(self.graph)
        return float(ggml.to_numpy(self.ce.loss).reshape(-1)[0]), n_valid

    def accumulate_sequences(self, tokens: np.ndarray, seg: np.ndarray, targets: np.ndarray,
                             weights: np.ndarray) -> np.ndarray:
        """Forward + backward of sum_b weights[b] * CE_b (``rows_per_seq`` graphs), adding the
        gradients into the accumulators; returns each row's summed target log-probability."""
        w = np.zeros(self.B, np.float32)
        w[:len(weights)] = weights
        return _sequence_logps(self, tokens, seg, targets, w)

    def run(self, tokens: np.ndarray, seg: np.ndarray, targets: np.ndarray,
            n_valid_step: int | None = None, buggy: bool = False) -> dict:
        """Loss and fresh gradients of one micro-batch (zeroes the accumulators first)."""
        self.opt_state.zero_grads()
        loss, n_valid = self.accumulate(tokens, seg, targets, n_valid_step, buggy)
        out = {"loss": loss, "n_valid": n_valid, "grads": self.opt_state.grads()}
        if self.logit_grad is not None:
            V = self.model.config.n_vocab
            out["logit_grad"] = ggml.to_numpy(self.logit_grad).reshape(self.B, self.T, V).copy()
        return out

    def close(self) -> None:
        """Free what the graph made, also after a build that stopped half-way."""
        rt = self.model.runtime
        rt.forget_graph()
        if self.ce is not None:
            self.ce.close()
        if self.seed_buf is not None:
            rt.free(self.seed_buf)
            self.seed_buf = None
        for ctx in (self.seed_ctx, self.ctx):
            if ctx is not None:
                ctx.close()
        if self.own_state:
            self.opt_state.close()


class EvalGraph:
    """Forward + masked CE (sum form) + argmax, for validation metrics."""

    def __init__(self, model: Model, adapter: LoraAdapter | None, B: int, T: int, rows: int,
                 rows_per_seq: int | None = None):
        """``rows``: the LM head and loss run on that many positions (the targets).
        ``rows_per_seq``: per-sequence log-probabilities instead (``loss.SequenceCE``; rows is
        then B x rows_per_seq)."""
        self.model = model
        self.rows_per_seq = rows_per_seq
        if rows_per_seq is not None:
            rows = B * rows_per_seq
        self.B, self.T, self.rows = B, T, rows
        self.ce = None
        size = model.graph_budget(T)
        self.ctx = ggml.Context(n_tensors=size, graph_size=size)
        try:
            self._build(adapter, size)
        except BaseException:
            self.close()
            raise

    def _build(self, adapter: LoraAdapter | None, size: int) -> None:
        model, B, T, rows = self.model, self.B, self.T, self.rows
        c = self.ctx.ptr
        row_mask = loss_mod.new_row_mask(c, rows)
        self.fwd = model.graph.build(c, B, T, adapter.hook if adapter else None, rows=rows,
                                     row_mask=row_mask)
        self.ce = _loss(model, c, self.fwd.logits, row_mask, self.rows_per_seq)
        self.graph = ggml.new_graph(self.ctx, size)
        if self.rows_per_seq is not None:
            for t in self.ce.seq_ce:
                lib.ggml_build_forward_expand(self.graph, t)
            return
        self.pred = lib.ggml_argmax(c, lib.ggml_reshape_2d(c, self.fwd.logits,
                                                           model.config.n_vocab, rows))
        for t in (self.ce.loss, self.pred):
            lib.ggml_set_output(t)
        lib.ggml_build_forward_expand(self.graph, self.ce.loss)
        lib.ggml_build_forward_expand(self.graph, self.pred)

    def run(self, tokens, seg, targets) -> tuple[float, int]:
        """(sum of CE over valid targets, number of correct argmax predictions)."""
        tok, sg, tg = pad_batch(self.B, self.T, tokens, seg, targets,
                                self.model.pad_id)
        rt = self.model.runtime
        rt.alloc_graph(self.graph, self.ctx)
        self.model.arch.set_inputs(self.fwd.inputs, self.model.input_values(tok, sg))
        sel, tg = loss_mod.select_rows(tg, self.rows)
        ggml.from_numpy(self.fwd.inputs.rows, sel)
        n = self.ce.prepare(tg, self.model.tokenizer.pad_id)
        rt.compute(self.graph)
        mean = float(ggml.to_numpy(self.ce.loss).reshape(-1)[0])
        pred = ggml.to_numpy(self.pred).reshape(-1)
        ok = tg >= 0
        return mean * n, int((pred[ok] == tg[ok]).sum())

    def sequence_logps(self, tokens, seg, targets) -> np.ndarray:
        """Each row's summed target log-probability (float64 [rows of ``tokens``])."""
        return _sequence_logps(self, tokens, seg, targets)

    def close(self) -> None:
        self.model.runtime.forget_graph()
        if self.ce is not None:
            self.ce.close()
        self.ctx.close()


def _sequence_logps(g, tokens, seg, targets, weights=None) -> np.ndarray:
    """Run graph ``g`` (a GradGraph or EvalGraph built with ``rows_per_seq``) on a batch,
    each row's targets in its block of head rows; returns each row's summed target
    log-probability.  ``weights``: the per-sequence loss weights (GradGraph only)."""
    tok, sg, tg = pad_batch(g.B, g.T, tokens, seg, targets, g.model.pad_id)
    rt = g.model.runtime
    rt.alloc_graph(g.graph, g.ctx)
    g.model.arch.set_inputs(g.fwd.inputs, g.model.input_values(tok, sg))
    sel, tg = loss_mod.select_sequence_rows(tg, g.rows_per_seq)
    ggml.from_numpy(g.fwd.inputs.rows, sel)
    g.ce.prepare_sequences(tg, g.model.tokenizer.pad_id, weights)
    rt.compute(g.graph)
    return g.ce.log_probs()[:tokens.shape[0]]


def _loss(model: Model, ctx, logits, row_mask, rows_per_seq: int | None,
          measure_only: bool = False):
    """The masked CE over the head rows ``row_mask`` masks, per sequence when
    ``rows_per_seq`` is set."""
    V, rows = model.config.n_vocab, int(row_mask.ne[1])
    if rows_per_seq is None:
        return loss_mod.build(model.runtime, ctx, logits, V, rows, row_mask, measure_only)
    return loss_mod.SequenceCE(model.runtime, ctx, logits, V, rows // rows_per_seq,
                               rows_per_seq, row_mask, measure_only)
