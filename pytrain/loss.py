"""The masked cross-entropy: which positions are targets, and how the loss is averaged.

The bug this project exists for (seeds 000 and 004): ggml's fused CROSS_ENTROPY_LOSS divides
by every row and trains on whatever the label rows say, so padded and prompt positions become
targets.  Here, by construction:

  * targets are shifted (position t predicts token t+1) and carry IGNORE (-100) where the
    target is padding, prompt, or another packed sample — the pad *token id* never marks
    anything, so pad id == eos id keeps real EOS targets;
  * an ignored row has an all-zero label row, and its logits row is multiplied by 0 before the
    CE op, so its gradient is exactly 0 (not softmax/n as in the seed's fix);
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


@dataclass
class LossInputs:
    labels: object       # F32 [V, N] one-hot rows, zero rows for ignored targets
    row_mask: object     # F32 [1, N] 1 for a valid target row, 0 otherwise
    loss_scale: object   # F32 [1]   n_rows / n_valid_step


@dataclass
class MaskedCE:
    loss: object         # scalar: Σ valid CE / n_valid_step
    inputs: LossInputs
    n_rows: int


def build(ctx, logits, n_vocab: int, n_rows: int) -> MaskedCE:
    """The loss graph over logits [V, N] (N = T·B rows)."""
    f32 = lib.GGML_TYPE_F32
    inp = LossInputs(labels=lib.ggml_new_tensor_2d(ctx, f32, n_vocab, n_rows),
                     row_mask=lib.ggml_new_tensor_2d(ctx, f32, 1, n_rows),
                     loss_scale=lib.ggml_new_tensor_1d(ctx, f32, 1))
    for t in (inp.labels, inp.row_mask, inp.loss_scale):
        lib.ggml_set_input(t)
    logits = lib.ggml_reshape_2d(ctx, logits, n_vocab, n_rows)
    masked = lib.ggml_mul(ctx, logits, inp.row_mask)      # zero rows -> zero gradient there
    ce = lib.ggml_cross_entropy_loss(ctx, masked, inp.labels)   # Σ / n_rows
    loss = lib.ggml_mul(ctx, ce, inp.loss_scale)
    return MaskedCE(loss, inp, n_rows)


def label_rows(targets: np.ndarray, n_vocab: int) -> np.ndarray:
    """One-hot float32 label rows [N, V]; IGNORE rows are all zero."""
    flat = targets.reshape(-1)
    out = np.zeros((flat.size, n_vocab), np.float32)
    ok = flat >= 0
    out[np.nonzero(ok)[0], flat[ok]] = 1.0
    return out


def set_labels(ce: MaskedCE, targets: np.ndarray, n_vocab: int, pad_id: int | None,
               n_valid_step: int | None = None, buggy: bool = False) -> int:
    """Fill the loss inputs for one micro-batch; returns this micro-batch's valid count.

    After the label tensor is written, ONE bulk strided read of its pad-token column finds any
    row labelled with the pad token that is not a real target (a stray pad label, the bug
    class this guards against); those entries are zeroed and the valid-row count is taken from
    the same read.  ``n_valid_step`` is the valid count of the whole optimizer step (defaults
    to this micro-batch's)."""
    flat = targets.reshape(-1)
    n = flat.size
    ggml.from_numpy(ce.inputs.labels, label_rows(flat, n_vocab))
    real = flat >= 0
    if buggy:   # every row trained, CE's division by all rows kept; n_valid_step = micro-batches
        ggml.from_numpy(ce.inputs.row_mask, np.ones((n, 1), np.float32))
        ggml.from_numpy(ce.inputs.loss_scale, np.array([1.0 / (n_valid_step or 1)], np.float32))
        return n
    if pad_id is not None:
        col = read_column(ce.inputs.labels, pad_id)
        stray = (col != 0) & ~real                    # cannot happen with IGNORE targets
        if stray.any():
            zero_column_rows(ce.inputs.labels, pad_id, np.nonzero(stray)[0])
        has_label = (col != 0) | (real & (flat != pad_id))
    else:
        has_label = real
    n_valid = int(has_label.sum())
    step = n_valid if n_valid_step is None else n_valid_step
    ggml.from_numpy(ce.inputs.row_mask, has_label.astype(np.float32).reshape(n, 1))
    ggml.from_numpy(ce.inputs.loss_scale,
                    np.array([n / step if step > 0 else 0.0], np.float32))
    return n_valid


def read_column(labels, col: int) -> np.ndarray:
    """labels[:, col] for an F32 [V, N] tensor in one strided backend read."""
    n_rows = int(labels.ne[1])
    out = np.empty(n_rows, np.float32)
    lib.ggml_backend_tensor_get_2d(labels, ffi.from_buffer(out), col * 4, 4, n_rows,
                                   labels.nb[1], 4)
    return out


def zero_column_rows(labels, col: int, rows: np.ndarray) -> None:
    zero = np.zeros(1, np.float32)
    for r in rows:   # only stray rows: normally none
        lib.ggml_backend_tensor_set(labels, ffi.from_buffer(zero), int(r) * labels.nb[1] + col * 4, 4)
