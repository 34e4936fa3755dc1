"""The masked cross-entropy: which positions are targets, and how the loss is averaged.

The bug this project exists for (seeds 000 and 004): ggml's fused CROSS_ENTROPY_LOSS divides
by every row and trains on whatever the label rows say, so padded and prompt positions become
targets.  Here, by construction:

  * targets are shifted (position t predicts token t+1) and carry IGNORE (-100) where the
    target is padding, prompt, or another packed sample — the pad *token id* never marks
    anything, so pad id == eos id keeps real EOS targets;
  * an ignored row has an all-zero label row, so it adds exactly 0 to the loss, and the row
    mask multiplies its LM-head input by 0 (``new_row_mask``, ``Transformer.head``), so no
    parameter receives a bit of gradient from it, whatever the CE op's backward hands that
    row (ggml's upstream op hands softmax/n, the seed's flaw; ggml-cpu's, with patch 0019,
    hands exactly 0, so the head's OUT_PROD skips the row: patch 0002);
  * the one-hot label rows are built on the device from the target ids (O(rows) uploaded, not
    O(rows · vocabulary)), and their pad-token column is read back once before the loss is
    computed;
  * the CE op's 1/n_rows is undone by a runtime scalar ``loss_scale = n_rows / n_valid_step``
    where n_valid_step counts valid targets over the whole optimizer step (all micro-batches),
    so the step's gradient is the token mean and no graph is rebuilt per batch;
  * the trainer's graphs feed the head and this loss with the target positions only
    (``select_rows``; spare rows of the bucket are ignored rows, so the same rules hold).

``buggy=True`` reproduces the unfixed behaviour for the regression experiments only: pad
positions labelled with the pad token, prompt not masked, division by all rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pytrain import ggml
from pytrain.ggml import ffi, lib

IGNORE = -100


def shift_targets(tokens: np.ndarray, train_mask: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Targets [B, T]: target[t] = tokens[t+1] when token t+1 is trained (``train_mask``) and
    belongs to the same sample as token t; IGNORE elsewhere (last position, padding with
    seg == -1, prompt tokens, packed-sample boundaries)."""
    B, T = tokens.shape
    tgt = np.full((B, T), IGNORE, np.int64)
    nxt_ok = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0) & train_mask[:, 1:].astype(bool)
    tgt[:, :-1] = np.where(nxt_ok, tokens[:, 1:], IGNORE)
    return tgt


def buggy_targets(tokens: np.ndarray, seg: np.ndarray, pad_id: int) -> np.ndarray:
    """The seed's bug: every next token is a target, padding included (as the pad token)."""
    B, T = tokens.shape
    tgt = np.full((B, T), pad_id, np.int64)
    tgt[:, :-1] = np.where(seg[:, 1:] >= 0, tokens[:, 1:], pad_id)
    return tgt


def rows_bucket(n_targets: int, n_rows: int) -> int:
    """How many rows a graph's LM head and loss run on for ``n_targets`` targets among
    ``n_rows`` positions: a quarter step of n_rows (at least 16), so a few graphs per batch
    shape serve every mix of prompt and answer."""
    q = max(16, -(-n_rows // 4))
    return min(n_rows, max(q, -(-n_targets // q) * q))


def select_rows(targets: np.ndarray, n_sel: int) -> tuple[np.ndarray, np.ndarray]:
    """The target positions of ``targets`` [B, T] as flat indices (t + T·b) padded to
    ``n_sel``, and their targets (IGNORE in the padding, which points at position 0: its row is
    masked, so it adds exactly 0 to position 0's gradient)."""
    flat = targets.reshape(-1)
    idx = np.nonzero(flat >= 0)[0]
    if idx.size > n_sel:
        raise ValueError(f"{idx.size} targets do not fit a graph of {n_sel} loss rows")
    rows = np.zeros(n_sel, np.int32)
    rows[:idx.size] = idx
    sel = np.full(n_sel, IGNORE, np.int64)
    sel[:idx.size] = flat[idx]
    return rows, sel


class LabelIntegrityError(RuntimeError):
    """The label tensor the CE op would consume holds a label no target asked for: a bug."""


@dataclass
class LossInputs:
    labels: object      # F32 [V, N]  one-hot rows, built on the device (``MaskedCE.build_labels``)
    row_mask: object    # F32 [1, N]  1 for a valid target row, 0 otherwise
    loss_scale: object  # F32 [1]     n_rows / n_valid_step


def new_row_mask(ctx, n_rows: int):
    """The F32 [1, N] input that is 1 on a target row and 0 on an ignored one: made before the
    forward graph, because the LM head multiplies its input by it (``Transformer.head``)."""
    mask = lib.ggml_new_tensor_2d(ctx, lib.GGML_TYPE_F32, 1, n_rows)
    lib.ggml_set_input(mask)
    return mask


class MaskedCE:
    """The masked loss over logits [V, N] (N rows) and the device-side construction of its
    label rows.

    The one-hot labels are built on the device from O(N) uploaded values: a zero fill of the
    [V, N] label tensor, then SET_ROWS writes each row's ``row_mask`` value (1 for a target, 0
    for an ignored row) at its flat index i·V + target_i.  That happens in a small graph of
    its own, run after the main graph is allocated and before it is computed, so the label
    tensor the CE op consumes can be read back (its pad-token column, once) before the loss
    exists: ``set_targets`` → ``build_labels`` → ``check_labels`` → compute."""

    def __init__(self, runtime, ctx, logits, n_vocab: int, n_rows: int, row_mask,
                 measure_only: bool = False):
        """``row_mask``: the ``new_row_mask`` input the head that made ``logits`` multiplied
        its input by; the label graph writes the same values into the label rows."""
        f32 = lib.GGML_TYPE_F32
        self.runtime, self.n_vocab, self.n_rows = runtime, n_vocab, n_rows
        self.inputs = LossInputs(labels=lib.ggml_new_tensor_2d(ctx, f32, n_vocab, n_rows),
                                 row_mask=row_mask,
                                 loss_scale=lib.ggml_new_tensor_1d(ctx, f32, 1))
        for t in (self.inputs.labels, self.inputs.loss_scale):
            lib.ggml_set_input(t)
        logits = lib.ggml_reshape_2d(ctx, logits, n_vocab, n_rows)
        self.loss = self._reduce(ctx, logits)
        # the flat one-positions live in a buffer of their own: only the label graph reads them
        self._index_ctx = ggml.Context(n_tensors=1)
        self.label_index = lib.ggml_new_tensor_1d(self._index_ctx.ptr, lib.GGML_TYPE_I64, n_rows)
        self._index_buf = runtime.alloc(self._index_ctx, measure_only=measure_only)
        zeros = lib.ggml_fill_inplace(ctx, self.inputs.labels, 0.0)
        ones = lib.ggml_set_rows(ctx, lib.ggml_reshape_2d(ctx, zeros, 1, n_vocab * n_rows),
                                 self.inputs.row_mask, self.label_index)
        self.label_graph = ggml.new_graph_for(ctx, ones)
        self._label_views = [lib.ggml_graph_node(self.label_graph, i)
                             for i in range(lib.ggml_graph_n_nodes(self.label_graph))]

    def _reduce(self, ctx, logits):
        """The loss the backward starts from: the CE of every row, scaled at run time."""
        ce = lib.ggml_cross_entropy_loss(ctx, logits, self.inputs.labels)   # Σ / n_rows
        return lib.ggml_mul(ctx, ce, self.inputs.loss_scale)

    def set_targets(self, targets: np.ndarray, buggy: bool = False) -> None:
        """Upload what the labels are built from, O(N): flat one-positions and the row mask
        (every row in the bug reproduction, whose pad rows are labelled with the pad token)."""
        flat = targets.reshape(-1)
        real = np.ones(flat.size, bool) if buggy else flat >= 0
        index = np.arange(flat.size, dtype=np.int64) * self.n_vocab + np.where(real, flat, 0)
        ggml.from_numpy(self.label_index, index)
        ggml.from_numpy(self.inputs.row_mask, real.astype(np.float32).reshape(-1, 1))

    def build_labels(self) -> None:
        """Fill the label tensor on its device (after the main graph is allocated)."""
        for v in self._label_views:                # views of the freshly placed label tensor
            v.data = ffi.NULL
            v.buffer = ffi.NULL
            lib.ggml_backend_view_init(v)
        self.runtime.compute_on_owner(self.label_graph, self.inputs.labels)

    def check_labels(self, targets: np.ndarray, pad_id: int | None,
                     n_valid_step: int | None = None, buggy: bool = False) -> int:
        """Where it costs nothing (labels in host memory: the CPU), ONE bulk strided read of the
        built label tensor's pad-token column checks that no row is labelled with the pad
        token unless it is a real target: such a row cannot come from IGNORE targets, so it
        means a bug in the label construction, and the step is refused
        (``LabelIntegrityError``), not repaired.  On a GPU the read would add a device-to-host
        sync to every micro-batch; the labels there are built by the same graph the CPU tests
        check.  Then the runtime ``loss_scale``; ``n_valid_step`` is the valid count of the
        whole optimizer step (defaults to this micro-batch's).  Returns this micro-batch's
        valid count."""
        flat = targets.reshape(-1)
        n = flat.size
        inp = self.inputs
        if buggy:   # every row trained, CE's division by all rows kept; n_valid_step = micro-batches
            ggml.from_numpy(inp.loss_scale, np.array([1.0 / (n_valid_step or 1)], np.float32))
            return n
        real = flat >= 0
        self._check_pad_column(real, pad_id)
        n_valid = int(real.sum())
        step = n_valid if n_valid_step is None else n_valid_step
        ggml.from_numpy(inp.loss_scale, np.array([n / step if step > 0 else 0.0], np.float32))
        return n_valid

    def _check_pad_column(self, real: np.ndarray, pad_id: int | None) -> None:
        """``check_labels``' read of the built labels' pad-token column (host memory only)."""
        labels = self.inputs.labels
        if pad_id is None or not lib.ggml_backend_buft_is_host(
                lib.ggml_backend_buffer_get_type(labels.buffer)):
            return
        stray = np.nonzero((read_column(labels, pad_id) != 0) & ~real)[0]
        if stray.size:
            raise LabelIntegrityError(
                f"{stray.size} label rows (first: row {int(stray[0])}) carry the pad token "
                f"{pad_id} without being targets: the device-built labels disagree with the "
                f"targets, a bug in pytrain; the step was not computed")

    def prepare(self, targets: np.ndarray, pad_id: int | None, n_valid_step: int | None = None,
                buggy: bool = False) -> int:
        """The three steps above, for a graph that is allocated: returns the valid count."""
        self.set_targets(targets, buggy)
        self.build_labels()
        return self.check_labels(targets, pad_id, n_valid_step, buggy)

    def close(self) -> None:
        if self._index_buf is not None:
            self.runtime.free(self._index_buf)
            self._index_buf = None
        self._index_ctx.close()


def select_sequence_rows(targets: np.ndarray, rows_per_seq: int
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Like ``select_rows``, but row b's targets in block b of ``rows_per_seq`` rows (flat
    index t + T·b), each block padded with IGNORE rows pointing at the row's position 0."""
    B, T = targets.shape
    rows = np.zeros((B, rows_per_seq), np.int32)
    sel = np.full((B, rows_per_seq), IGNORE, np.int64)
    for b in range(B):
        idx = np.nonzero(targets[b] >= 0)[0]
        if idx.size > rows_per_seq:
            raise ValueError(f"{idx.size} targets do not fit a block of {rows_per_seq} rows")
        rows[b] = b * T
        rows[b, :idx.size] = b * T + idx
        sel[b, :idx.size] = targets[b, idx]
    return rows.reshape(-1), sel.reshape(-1)


class SequenceCE(MaskedCE):
    """The masked CE per sequence: the rows come in ``n_seqs`` blocks of ``rows_per_seq``
    (``select_sequence_rows``), block b's CE is -(its summed target log-probabilities) /
    rows_per_seq, an output, and the loss is sum_b CE_b * weight_b with the weights a run-time
    input.  Why: a preference loss is a function of per-sequence log-probabilities, so its
    gradient is the per-sequence gradients weighted by its derivatives (step/preference.py).
    The blocks are views of one logits tensor, whose view gradients add in place (patch
    0010), so the backward costs what the single CE's does."""

    def __init__(self, runtime, ctx, logits, n_vocab: int, n_seqs: int, rows_per_seq: int,
                 row_mask, measure_only: bool = False):
        self.n_seqs, self.rows_per_seq = n_seqs, rows_per_seq
        super().__init__(runtime, ctx, logits, n_vocab, n_seqs * rows_per_seq, row_mask,
                         measure_only)

    def _reduce(self, ctx, logits):
        f32, V, R = lib.GGML_TYPE_F32, self.n_vocab, self.rows_per_seq
        self.weights = lib.ggml_new_tensor_1d(ctx, f32, self.n_seqs)
        lib.ggml_set_input(self.weights)
        labels, nb1 = self.inputs.labels, logits.nb[1]
        self.seq_ce, loss = [], None
        for b in range(self.n_seqs):
            x = lib.ggml_view_2d(ctx, logits, V, R, nb1, b * R * nb1)
            y = lib.ggml_view_2d(ctx, labels, V, R, labels.nb[1], b * R * labels.nb[1])
            ce = lib.ggml_cross_entropy_loss(ctx, x, y)                   # [1]
            lib.ggml_set_output(ce)
            self.seq_ce.append(ce)
            term = lib.ggml_mul(ctx, ce, lib.ggml_view_1d(ctx, self.weights, 1, 4 * b))
            loss = term if loss is None else lib.ggml_add(ctx, loss, term)
        return loss

    def prepare_sequences(self, targets: np.ndarray, pad_id: int | None,
                          weights: np.ndarray | None = None) -> None:
        """Labels for block-laid ``targets`` (checked as ``check_labels`` does) and the
        per-sequence weights of the loss (None: a forward-only graph, which has no loss)."""
        self.set_targets(targets)
        self.build_labels()
        self._check_pad_column(targets.reshape(-1) >= 0, pad_id)
        if weights is not None:
            ggml.from_numpy(self.weights, np.asarray(weights, np.float32))

    def log_probs(self) -> np.ndarray:
        """Each sequence's summed target log-probability (float64 [n_seqs]) after a compute."""
        ce = np.array([float(ggml.to_numpy(t).reshape(-1)[0]) for t in self.seq_ce])
        return -ce * self.rows_per_seq


def build(runtime, ctx, logits, n_vocab: int, n_rows: int, row_mask,
          measure_only: bool = False) -> MaskedCE:
    """The masked loss over logits [V, N] made by a head masked with ``row_mask``; see
    ``MaskedCE``.  ``measure_only``: for a graph that is only measured (``Runtime.alloc``),
    its small persistent tensor is not allocated."""
    return MaskedCE(runtime, ctx, logits, n_vocab, n_rows, row_mask, measure_only)


def read_column(labels, col: int) -> np.ndarray:
    """labels[:, col] for an F32 [V, N] tensor in one strided backend read."""
    n_rows = int(labels.ne[1])
    out = np.empty(n_rows, np.float32)
    lib.ggml_backend_tensor_get_2d(labels, ffi.from_buffer(out), col * 4, 4, n_rows,
                                   labels.nb[1], 4)
    return out
