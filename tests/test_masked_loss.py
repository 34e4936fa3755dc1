"""The loss contract (docs/training.md, "What is trained") on the real converter-made gqa model with
LoRA on the attention layers (so gradients cross the DeltaNet layers above them)."""
from pathlib import Path

import numpy as np
import pytest

import pytrain
import step_rounding
from pytrain.step import loss as L
from pytrain.models import lora
from pytrain.step.graphs import GradGraph
from pytrain.models.lora_targets import select_targets


def label_rows(targets: np.ndarray, n_vocab: int) -> np.ndarray:
    """One-hot float32 label rows [N, V]; IGNORE rows are all zero: the reference the
    device-built labels are tested against."""
    flat = targets.reshape(-1)
    out = np.zeros((flat.size, n_vocab), np.float32)
    ok = flat >= 0
    out[np.nonzero(ok)[0], flat[ok]] = 1.0
    return out

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"


@pytest.fixture(scope="module")
def setup():
    m = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu", threads=2)
    names = select_targets(m.config)
    ad = lora.create(m.runtime, m.config, names, rank=4, alpha=8, seed=0)
    rng = np.random.default_rng(0)
    vals = ad.get()
    for k in vals:   # B != 0 so that A receives gradient too
        if k.endswith("lora_b"):
            vals[k] = rng.normal(0, 0.05, vals[k].shape).astype(np.float32)
    ad.set(vals)
    yield m, ad
    m.close()


# Two computations of the same float32 step (another padding width, micro-batches against one
# batch, the head on selected rows) differ only in how their sums are grouped: they are
# compared within the rounding measured on the same input (tests/step_rounding.py).
def batch(lengths, T, seed=0, vocab=480):
    rng = np.random.default_rng(seed)
    B = len(lengths)
    tokens = rng.integers(0, vocab, (B, T))
    seg = np.full((B, T), -1)
    for b, n in enumerate(lengths):
        seg[b, :n] = 0
        tokens[b, n:] = 480     # the pad token
    return tokens, seg


def test_valid_count_follows_shifted_lengths():
    tokens, seg = batch([5, 3, 8, 1], 8)
    tgt = L.shift_targets(tokens, np.ones_like(tokens), seg)
    assert int((tgt >= 0).sum()) == 4 + 2 + 7 + 0
    # position t predicts token t+1; the last real position of each row predicts nothing
    np.testing.assert_array_equal(tgt[0, :4], tokens[0, 1:5])
    assert (tgt[0, 4:] == L.IGNORE).all() and (tgt[3] == L.IGNORE).all()


def test_prompt_and_boundaries_are_not_targets():
    tokens = np.arange(10)[None]
    seg = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, -1]])
    train = np.array([[0, 0, 1, 1, 0, 0, 1, 1, 1, 0]])   # prompt tokens are 0
    tgt = L.shift_targets(tokens, train, seg)
    # targets: t=1->2, t=2->3, t=5->6, t=6->7, t=7->8; 3->4 crosses samples; 8->9 is padding
    np.testing.assert_array_equal(np.nonzero(tgt[0] >= 0)[0], [1, 2, 5, 6, 7])


def test_loss_is_the_token_mean_over_valid_targets(setup):
    m, ad = setup
    tokens, seg = batch([9, 4, 12], 12, seed=1)
    train = np.ones_like(tokens)
    train[:, :3] = 0          # a 3-token prompt
    tgt = L.shift_targets(tokens, train, seg)
    g = GradGraph(m, ad, B=3, T=12)
    out = g.run(tokens, seg, tgt)
    g.close()
    logits = m.logits(tokens, lora=ad.hook).astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ok = tgt >= 0
    ref = -logp[ok, tgt[ok]].mean()
    assert out["n_valid"] == ok.sum() == 6 + 1 + 9   # targets t+1 in [3, length)
    assert abs(out["loss"] - ref) < 2e-5


def test_padded_and_masked_rows_get_exactly_zero_gradient(setup):
    m, ad = setup
    tokens, seg = batch([7, 3], 10, seed=2)
    train = np.ones_like(tokens)
    train[0, :4] = 0
    tgt = L.shift_targets(tokens, train, seg)
    g = GradGraph(m, ad, B=2, T=10, keep_logit_grad=True)
    out = g.run(tokens, seg, tgt)
    g.close()
    lg = out["logit_grad"][:, :10]
    ignored = tgt < 0
    assert ignored.sum() > 5 and (~ignored).sum() > 3
    assert np.all(lg[ignored] == 0.0), "an ignored row has a non-zero gradient"
    assert np.all(np.abs(lg[~ignored]).sum(-1) > 0)
    # the bug reproduction trains pad rows: their gradient is not zero
    g = GradGraph(m, ad, B=2, T=10, keep_logit_grad=True)
    bug = g.run(tokens, seg, L.buggy_targets(tokens, seg, 480), buggy=True)
    g.close()
    assert np.abs(bug["logit_grad"][:, :10][seg[:, :10] < 0]).sum() > 0


def test_an_ignored_row_changes_no_bit_of_loss_or_gradients(setup):
    """The padding positions' tokens reach the LM head as hidden states of their own (the head
    runs on every row here); their rows are ignored, so whatever those tokens are, the loss and
    every LoRA gradient are the same numbers — not close: equal.  The row mask on the head's
    input guarantees it on any backend, whatever the CE op's backward hands an ignored row."""
    m, ad = setup
    tokens, seg = batch([7, 4], 10, seed=4)
    tgt = L.shift_targets(tokens, np.ones_like(tokens), seg)
    other = tokens.copy()
    other[seg < 0] = np.random.default_rng(9).integers(0, 480, int((seg < 0).sum()))
    assert (other != tokens).sum() >= 5
    outs = []
    for t in (tokens, other):
        g = GradGraph(m, ad, B=2, T=10, keep_logit_grad=True)
        outs.append(g.run(t, seg, tgt))
        g.close()
    a, b = outs
    assert a["loss"] == b["loss"] and a["n_valid"] == b["n_valid"]
    for k, v in a["grads"].items():
        assert np.array_equal(v, b["grads"][k]), k
        assert np.abs(v).max() > 0, k


def padding_widths(m, ad, leak: float = 0.0) -> tuple[list[dict], list[dict]]:
    """The step of one batch at widths 11, 37 and 90 (37 and 90 pad to 64 and 96: 2 and 3
    DeltaNet chunks of 32), and the rounding of the step at each width.  ``leak``: a planted
    fault, the padded positions past width 11 leak into the loss with their pad-token
    target at that weight (the valid count unchanged)."""
    tokens, seg = batch([11, 6], 11, seed=3)
    tgt = L.shift_targets(tokens, np.ones_like(tokens), seg)
    outs = []
    real_prepare = L.MaskedCE.prepare

    def leaky(self, targets, pad_id, *a, **k):
        n = real_prepare(self, targets, pad_id, *a, **k)
        flat = targets.reshape(-1)
        rows = np.nonzero(flat < 0)[0]
        mask = np.ones(flat.size, np.float32)
        mask[flat < 0] = 0.0
        mask[rows[rows % targets.shape[-1] >= 11]] = 1.0     # padding past the batch's width
        from pytrain import ggml
        from pytrain.ggml import ffi, lib
        ggml.from_numpy(self.inputs.row_mask, mask.reshape(-1, 1))
        w = np.full(1, leak, np.float32)
        for r in rows[rows % targets.shape[-1] >= 11]:
            lib.ggml_backend_tensor_set(self.inputs.labels, ffi.from_buffer(w),
                                        int(r) * self.inputs.labels.nb[1] + 480 * 4, 4)
        return n
    roundings = []
    for width in (11, 37, 90):
        padded = [np.pad(x, ((0, 0), (0, width - 11)), constant_values=v)
                  for x, v in ((tokens, 480), (seg, -1), (tgt, L.IGNORE))]
        roundings.append(step_rounding.measure(m, ad, 2, width, *padded))
        if leak and width > 11:
            L.MaskedCE.prepare = leaky
        try:
            g = GradGraph(m, ad, B=2, T=width)
            outs.append(g.run(tokens, seg, tgt))
            g.close()
        finally:
            L.MaskedCE.prepare = real_prepare
    return outs, roundings


def test_padding_width_does_not_change_loss_or_lora_gradients(setup):
    """Each width's step against width 11's, within the step's rounding measured at all three
    widths: they are three estimates of one step's float32 rounding, and the narrowest may
    not reach the kernels (BLAS or ggml-cpu) the wider ones use, so its own estimate can be
    several times too small (on the sandybridge variant with BLAS, width 11 measured 3e-7
    where the widths' steps differ by 5e-6 and width 37 measured 2e-6)."""
    m, ad = setup
    outs, roundings = padding_widths(m, ad)
    pooled = step_rounding.worst(*roundings)
    for o in outs[1:]:
        step_rounding.assert_step_close(o, outs[0], pooled)
    assert max(np.abs(v).max() for v in outs[0]["grads"].values()) > 1e-4


def test_padding_comparison_catches_a_leak_of_1e_3(setup):
    """The planted fault: padded positions enter the loss at weight 1e-3."""
    m, ad = setup
    outs, roundings = padding_widths(m, ad, leak=1e-3)
    assert outs[1]["n_valid"] == outs[0]["n_valid"]
    with pytest.raises(AssertionError):
        step_rounding.assert_step_close(outs[1], outs[0], step_rounding.worst(*roundings))


def test_gradient_accumulation_is_a_token_mean_over_the_step(setup):
    """One batch of 4, and four micro-batches of 1 with different valid counts each scaled by
    the step's valid count, give the same summed gradient and loss, within the rounding
    measured on the batch of 4 (tests/step_rounding.py)."""
    m, ad = setup
    tokens, seg = batch([12, 3, 8, 5], 12, seed=4)
    tgt = L.shift_targets(tokens, np.ones_like(tokens), seg)
    n_step = int((tgt >= 0).sum())
    rounding = step_rounding.measure(m, ad, 4, 12, tokens, seg, tgt)
    full = rounding["ref"]
    g = GradGraph(m, ad, B=1, T=12)
    acc_loss, acc = 0.0, None
    for b in range(4):
        o = g.run(tokens[b:b + 1], seg[b:b + 1], tgt[b:b + 1], n_valid_step=n_step)
        acc_loss += o["loss"]
        acc = o["grads"] if acc is None else {k: acc[k] + v for k, v in o["grads"].items()}
    g.close()
    step_rounding.assert_step_close({"loss": acc_loss, "grads": acc, "n_valid": n_step},
                                    full, rounding)
    # a micro-batch dropped from the accumulation (the planted fault) is far outside it
    short = {k: acc[k] - v for k, v in o["grads"].items()}
    with pytest.raises(AssertionError):
        step_rounding.assert_step_close({"loss": acc_loss - o["loss"], "grads": short,
                                         "n_valid": n_step}, full, rounding)
    # mean of per-micro-batch means would differ (valid counts 11, 2, 7, 4)
    g = GradGraph(m, ad, B=1, T=12)
    mean_of_means = np.mean([g.run(tokens[b:b + 1], seg[b:b + 1], tgt[b:b + 1])["loss"]
                             for b in range(4)])
    g.close()
    assert abs(mean_of_means - full["loss"]) > 1e-3


def test_pad_id_equal_to_eos_keeps_real_eos_targets(setup):
    m, ad = setup
    eos = 480   # use the pad token as the EOS too
    tokens, seg = batch([6, 4], 8, seed=5)
    tokens[0, 5] = eos            # a real EOS as the last real token of row 0
    tgt = L.shift_targets(tokens, np.ones_like(tokens), seg)
    assert tgt[0, 4] == eos
    g = GradGraph(m, ad, B=2, T=8, keep_logit_grad=True)
    out = g.run(tokens, seg, tgt)
    g.close()
    assert out["n_valid"] == 5 + 3
    assert np.abs(out["logit_grad"][0, 4]).sum() > 0          # the real EOS is trained
    assert np.all(out["logit_grad"][0, 5:8] == 0)              # padding is not
    assert np.all(out["logit_grad"][1, 3:8] == 0)


def test_zero_valid_targets_gives_zero_loss_not_nan(setup):
    m, ad = setup
    tokens, seg = batch([1, 1], 4, seed=6)
    tgt = L.shift_targets(tokens, np.ones_like(tokens), seg)
    g = GradGraph(m, ad, B=2, T=4)
    out = g.run(tokens, seg, tgt)
    g.close()
    assert out["n_valid"] == 0 and out["loss"] == 0.0
    assert all(np.all(v == 0) for v in out["grads"].values())


def test_lora_gradients_match_finite_differences(setup):
    """LoRA gradients on the real model (adapters in attention layers 1 and 3, DeltaNet layers
    0 and 2 around them) against central differences of the loss, float32 forward with step
    1e-2: agreement to 2% of the largest gradient checked."""
    m, ad = setup
    tokens, seg = batch([10, 6], 10, seed=7)
    train = np.ones_like(tokens)
    train[:, :2] = 0
    tgt = L.shift_targets(tokens, train, seg)
    g = GradGraph(m, ad, B=2, T=10)
    base = ad.get()
    grads = g.run(tokens, seg, tgt)["grads"]
    h = 1e-2
    rng = np.random.default_rng(8)
    for name in ("blk.1.attn_q.weight.lora_a", "blk.1.attn_k.weight.lora_b",
                 "blk.3.attn_v.weight.lora_a", "blk.1.attn_output.weight.lora_b"):
        for _ in range(2):
            idx = tuple(rng.integers(0, s) for s in base[name].shape)
            vals = []
            for sign in (1, -1):
                p = {k: v.copy() for k, v in base.items()}
                p[name][idx] += sign * h
                ad.set(p)
                vals.append(g.run(tokens, seg, tgt)["loss"])
            fd = (vals[0] - vals[1]) / (2 * h)
            scale = max(np.abs(grads[name]).max(), 1e-3)
            assert abs(grads[name][idx] - fd) <= 0.02 * scale, (name, idx, grads[name][idx], fd)
    ad.set(base)
    g.close()


def test_packed_row_equals_samples_run_alone(setup):
    """A row packing two samples gives each sample's loss and gradients as when run alone
    (token mean: packed·n = a·n_a + b·n_b); the boundary target is not trained."""
    m, ad = setup
    rng = np.random.default_rng(9)
    a, b = rng.integers(0, 480, 9), rng.integers(0, 480, 6)
    tr_a, tr_b = np.r_[np.zeros(3), np.ones(6)], np.r_[np.zeros(2), np.ones(4)]
    row = np.concatenate([a, b])[None]
    seg = np.array([[0] * 9 + [1] * 6])
    tgt = L.shift_targets(row, np.concatenate([tr_a, tr_b])[None], seg)
    assert tgt[0, 8] == L.IGNORE          # last token of a must not predict the first of b
    g = GradGraph(m, ad, B=1, T=15)
    packed = g.run(row, seg, tgt)
    alone = []
    for toks, tr in ((a, tr_a), (b, tr_b)):
        s = np.zeros((1, len(toks)), np.int64)
        alone.append(g.run(toks[None], s, L.shift_targets(toks[None], tr[None], s)))
    g.close()
    na, nb = alone[0]["n_valid"], alone[1]["n_valid"]
    assert packed["n_valid"] == na + nb == 6 + 4
    assert abs(packed["loss"] * (na + nb) - (alone[0]["loss"] * na + alone[1]["loss"] * nb)) < 1e-4
    for k, v in packed["grads"].items():
        want = (alone[0]["grads"][k] * na + alone[1]["grads"][k] * nb) / (na + nb)
        np.testing.assert_allclose(v, want, atol=2e-6, rtol=1e-4, err_msg=k)


def test_head_on_target_rows_only_gives_the_same_loss_and_gradients(setup):
    """The trainer runs the LM head and the loss on the target positions only (gathered by
    GET_ROWS, padded to a bucket with masked copies of position 0): the same loss, valid count
    and LoRA gradients as the head on every row — whether the bucket is tight or mostly
    padding, and when position 0 is itself a target."""
    m, ad = setup
    tokens, seg = batch([12, 7, 10], 12, seed=5)
    train = np.ones_like(tokens)
    train[:, :4] = 0
    train[0, :] = 1                       # row 0: position 0 is a target
    tgt = L.shift_targets(tokens, train, seg)
    n = int((tgt >= 0).sum())
    g = GradGraph(m, ad, B=3, T=12)
    full = g.run(tokens, seg, tgt)
    g.close()
    for rows in (n, n + 5, 36):
        g = GradGraph(m, ad, B=3, T=12, rows=rows)
        sel = g.run(tokens, seg, tgt)
        g.close()
        assert sel["n_valid"] == full["n_valid"] == n
        assert abs(sel["loss"] - full["loss"]) < 1e-5 * abs(full["loss"])
        for k, v in full["grads"].items():
            np.testing.assert_allclose(sel["grads"][k], v, rtol=0,
                                       atol=1e-5 * np.abs(v).max() + 1e-12, err_msg=k)


def test_row_selection_and_buckets():
    tgt = np.full((2, 5), L.IGNORE)
    tgt[0, 1], tgt[1, 3] = 7, 9
    rows, sel = L.select_rows(tgt, 4)
    np.testing.assert_array_equal(rows, [1, 8, 0, 0])      # flat t + T·b, then padding
    np.testing.assert_array_equal(sel, [7, 9, L.IGNORE, L.IGNORE])
    with pytest.raises(ValueError, match="3 targets do not fit a graph of 2 loss rows"):
        L.select_rows(np.zeros((1, 3), np.int64), 2)
    N = 512
    buckets = {L.rows_bucket(k, N) for k in range(N + 1)}
    assert buckets == {128, 256, 384, 512}                   # a few graphs per batch shape
    assert all(k <= L.rows_bucket(k, N) <= N for k in range(N + 1))
    assert L.rows_bucket(3, 8) == 8 and L.rows_bucket(0, 40) == 16


def test_labels_are_built_on_the_device_from_o_rows_uploads(setup, monkeypatch):
    """The label tensor the CE op consumes equals numpy's one-hot of the targets (IGNORE rows
    all zero; the bug reproduction's pad rows labelled with the pad token), while the host
    uploads only O(rows) values for it: no [V, N] array crosses to the device."""
    from pytrain import ggml
    m, ad = setup
    V = m.config.n_vocab
    tokens, seg = batch([9, 5, 7], 12, seed=11)
    tgt = L.shift_targets(tokens, np.ones_like(tokens), seg)
    g = GradGraph(m, ad, B=3, T=12)
    try:
        m.runtime.alloc_graph(g.graph, g.ctx)
        sent = []
        real_from_numpy = ggml.from_numpy
        monkeypatch.setattr(ggml, "from_numpy",
                            lambda t, a: (sent.append(np.asarray(a).nbytes), real_from_numpy(t, a))[1])
        n = g.ce.prepare(tgt, m.tokenizer.pad_id)
        monkeypatch.setattr(ggml, "from_numpy", real_from_numpy)
        N = tgt.size
        assert n == int((tgt >= 0).sum()) and sum(sent) <= 13 * N + 4, sent
        built = ggml.to_numpy(g.ce.inputs.labels).reshape(N, V)
        np.testing.assert_array_equal(built, label_rows(tgt, V))
        buggy = L.buggy_targets(tokens, seg, 480)
        g.ce.prepare(buggy, m.tokenizer.pad_id, n_valid_step=1, buggy=True)
        built = ggml.to_numpy(g.ce.inputs.labels).reshape(N, V)
        np.testing.assert_array_equal(built, label_rows(buggy, V))
        assert built[:, 480].sum() == (12 - 9 + 1) + (12 - 5 + 1) + (12 - 7 + 1)  # from each last token on
    finally:
        g.close()


def test_a_stray_pad_label_in_the_built_tensor_stops_the_step(setup):
    """What the ONE read of the pad-token column is for: a row labelled with the pad token
    that is not a real target (planted here after the labels were built) cannot come from the
    targets, so it is a bug: the step is refused with the row named, not silently repaired."""
    from pytrain import ggml
    from pytrain.ggml import ffi, lib
    m, ad = setup
    V, pad = m.config.n_vocab, m.tokenizer.pad_id
    tokens, seg = batch([6, 3], 8, seed=12)
    tgt = L.shift_targets(tokens, np.ones_like(tokens), seg)
    g = GradGraph(m, ad, B=2, T=8)
    try:
        m.runtime.alloc_graph(g.graph, g.ctx)
        g.ce.set_targets(tgt)
        g.ce.build_labels()
        stray_row = 8 + 5                                   # padding of row 1: IGNORE
        assert tgt.reshape(-1)[stray_row] < 0
        one = np.ones(1, np.float32)
        lib.ggml_backend_tensor_set(g.ce.inputs.labels, ffi.from_buffer(one),
                                    stray_row * V * 4 + pad * 4, 4)
        with pytest.raises(L.LabelIntegrityError, match=f"first: row {stray_row}"):
            g.ce.check_labels(tgt, pad)
        zero = np.zeros(1, np.float32)                      # without it, the same check passes
        lib.ggml_backend_tensor_set(g.ce.inputs.labels, ffi.from_buffer(zero),
                                    stray_row * V * 4 + pad * 4, 4)
        assert g.ce.check_labels(tgt, pad) == int((tgt >= 0).sum())
    finally:
        g.close()
