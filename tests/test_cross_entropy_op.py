"""ggml-cpu's CROSS_ENTROPY_LOSS and its backward as native patch 0019 computes them (each row
read once per pass in L1-sized chunks, an online softmax, sums in double, denormals flushed):
the loss and the gradient against a float64 numpy reference within the float32 bound derived
in tests/bounds.py (``cross_entropy_bounds``), for one-hot and soft labels whose rows sum to
anything (zero included), logits spread far into exp's denormal range, row lengths that are not
multiples of the SIMD width or of the chunk, the row max in a late chunk, and the full
vocabulary; on 1 and 2 threads (scripts/test_cpu_matrix.py runs it under every ggml-cpu
variant it tests)."""
import graph_harness
import numpy as np
import pytest

from bounds import F32_MIN, cross_entropy_bounds
from pytrain.ggml import lib

CHUNK = 2048          # the patch's chunk (CE_CHUNK): 4100 = two chunks and a 4-element tail
D = 0.75              # the loss's upstream gradient: not 1, so its scaling is checked


def ce_op(logits: np.ndarray, labels: np.ndarray, threads: int) -> tuple[float, np.ndarray]:
    """(the op's loss, its gradient for the logits under upstream gradient D)."""
    out, grads = graph_harness.run(
        lambda c, t: lib.ggml_cross_entropy_loss(c, t["x"], t["y"]),
        {"x": logits.astype(np.float32), "y": labels.astype(np.float32)},
        grad_of=("x",), seed_grad=np.array([D], np.float32), threads=threads)
    return float(out.reshape(-1)[0]), grads["x"]


def reference(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """The mean over rows of -Σ labels·log softmax(logits) and its gradient
    (softmax·Σ labels - labels)·D/N, in float64 from the float32 values."""
    x = logits.astype(np.float32).astype(np.float64)
    y = labels.astype(np.float32).astype(np.float64)
    z = x - x.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = float(-(y * logp).sum(axis=1).mean())
    grad = (np.exp(logp) * y.sum(axis=1, keepdims=True) - y) * D / x.shape[0]
    return loss, grad


def check(logits: np.ndarray, labels: np.ndarray, threads: int) -> tuple[float, np.ndarray]:
    got_loss, got_grad = ce_op(logits, labels, threads)
    want_loss, want_grad = reference(logits, labels)
    loss_bound, grad_bound = cross_entropy_bounds(logits.astype(np.float32),
                                                  labels.astype(np.float32), D)
    assert abs(got_loss - want_loss) <= loss_bound, (got_loss, want_loss, loss_bound)
    err = np.abs(got_grad.astype(np.float64) - want_grad)
    worst = np.unravel_index(np.argmax(err - grad_bound), err.shape)
    assert (err <= grad_bound).all(), (worst, err[worst], grad_bound[worst], want_grad[worst])
    # FTZ|DAZ and the flushed exps: the gradient holds no denormal (a slow operand downstream)
    tiny = (got_grad != 0) & (np.abs(got_grad) < F32_MIN)
    assert not tiny.any(), f"{int(tiny.sum())} denormal gradient elements"
    return got_loss, got_grad


def one_hot(rng, n_rows: int, n_vocab: int) -> np.ndarray:
    y = np.zeros((n_rows, n_vocab), np.float32)
    y[np.arange(n_rows), rng.integers(0, n_vocab, n_rows)] = 1.0
    return y


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("V", [1, 13, 1003, CHUNK, 4100])
def test_one_hot_and_soft_labels_of_any_sum(V, threads):
    """One-hot rows, soft rows summing to 0.3 and 2.5, an all-zero row (whose gradient must be
    exactly 0: upstream's softmax - label gave it softmax·d/N), at lengths that are and are not
    multiples of 4, 8, 16 and the chunk."""
    rng = np.random.default_rng(V)
    R = 7
    x = (rng.normal(size=(R, V)) * 4).astype(np.float32)
    y = one_hot(rng, R, V)
    for r, total in ((1, 0.3), (2, 2.5)):
        soft = rng.random(V)
        y[r] = soft / soft.sum() * total
    y[3] = 0.0
    loss, grad = check(x, y, threads)
    assert np.all(grad[3] == 0.0), "an all-zero label row has a non-zero gradient"


@pytest.mark.parametrize("threads", [1, 2])
def test_spread_beyond_exps_normal_range(threads):
    """Rows whose logits spread over 100 to 400 below their max (a loss of ~100 means this):
    exp(x - m) is denormal or 0 for most of them.  The loss is still within the float32 bound
    (the target far below the max), and no gradient element is denormal."""
    rng = np.random.default_rng(7)
    R, V = 4, 5003
    x = rng.uniform(-400.0, 0.0, (R, V)).astype(np.float32)
    x[0, 17] = 0.0
    x[1] = rng.uniform(-100.0, -80.0, V)     # every exp in or near the denormal range...
    x[1, 4000] = 0.0                          # ...but for the max
    x[2, :] = rng.uniform(-1e-3, 1e-3, V)     # near-uniform: S ~ V
    x[3, :] = rng.uniform(-110.0, -85.0, V)
    x[3, -1] = 0.5                            # the max in the last (scalar-tail) element
    y = np.zeros((R, V), np.float32)
    y[0, 1] = y[1, 5] = y[2, 9] = y[3, 0] = 1.0
    loss, grad = check(x, y, threads)
    assert loss > 50.0                        # the targets sit far below their max
    assert np.count_nonzero(grad[0]) < V      # flushed: those exps are 0, not denormals


@pytest.mark.parametrize("threads", [1, 2])
def test_row_max_rising_chunk_by_chunk(threads):
    """The row's max grows in every chunk (the running sum is rescaled each time), or sits in
    the last chunk only, or in the first only."""
    V = 3 * CHUNK + 37
    ramp = np.linspace(-30.0, 30.0, V, dtype=np.float32)
    rng = np.random.default_rng(3)
    x = np.stack([ramp, ramp[::-1].copy(), rng.normal(size=V).astype(np.float32)])
    x[2, -5] = 50.0
    y = one_hot(rng, 3, V)
    y[0, V // 2] = 0.5                         # a row summing to 1.5
    check(x, y, threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_full_vocabulary(threads):
    """V = 151936 (Qwen's vocabulary), a few rows, one-hot and soft labels."""
    rng = np.random.default_rng(11)
    R, V = 3, 151936
    x = (rng.normal(size=(R, V)) * 3).astype(np.float32)
    y = one_hot(rng, R, V)
    y[2] = rng.random(V).astype(np.float32) / V
    check(x, y, threads)


def test_row_longer_than_the_backwards_chunk_count():
    """A row of more than 512 chunks of 2048 (CE_MAX_CHUNKS: the backward keeps one max per
    chunk on the stack, so its chunks grow for such rows), the max in its last element."""
    rng = np.random.default_rng(13)
    V = 512 * CHUNK + 4099
    x = (rng.normal(size=(2, V)) * 3).astype(np.float32)
    x[0, -1] = 40.0
    y = one_hot(rng, 2, V)
    check(x, y, 2)


def test_ignored_rows_change_no_bit():
    """The masked loss's guarantee (pytrain/step/loss.py): an ignored row (all-zero labels)
    adds exactly 0, whatever its logits, so the loss and every other row's gradient keep
    every bit, and its own gradient is exactly 0."""
    rng = np.random.default_rng(5)
    R, V = 6, 1003
    x = (rng.normal(size=(R, V)) * 4).astype(np.float32)
    y = one_hot(rng, R, V)
    y[[1, 4]] = 0.0
    base_loss, base_grad = ce_op(x, y, 2)
    x2 = x.copy()
    x2[[1, 4]] = (rng.normal(size=(2, V)) * 50).astype(np.float32)
    loss, grad = ce_op(x2, y, 2)
    assert loss == base_loss
    np.testing.assert_array_equal(grad, base_grad)
    assert np.all(grad[[1, 4]] == 0.0)
