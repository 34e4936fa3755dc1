"""ggml-cpu's CROSS_ENTROPY_LOSS with the log-softmax sum vectorised (native/patches/0006): the
loss of ggml's own op must equal a float64 log-softmax cross-entropy computed by numpy, for
one-hot and soft labels, logits spread over a wide range, a row whose maximum sits in the
scalar tail, and row lengths that are and are not multiples of the SIMD width."""
import graph_harness
import numpy as np
import pytest

from pytrain.ggml import lib


def ggml_cross_entropy(logits: np.ndarray, labels: np.ndarray, threads: int) -> float:
    out = graph_harness.run(lambda c, t: lib.ggml_cross_entropy_loss(c, t["x"], t["y"]),
                            {"x": logits, "y": labels}, threads=threads)
    return float(out.reshape(-1)[0])


def reference(logits: np.ndarray, labels: np.ndarray) -> float:
    """-mean over rows of sum(labels * log_softmax(logits)), in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-(labels.astype(np.float64) * logp).sum(axis=1).mean())


@pytest.mark.parametrize("V", [1003, 4096, 151936])
@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_cross_entropy_equals_float64_log_softmax(V, soft, threads):
    rng = np.random.default_rng(V)
    R = 5                                   # uneven split over 2 threads
    logits = (rng.normal(size=(R, V)) * 30).astype(np.float32)
    logits[1, -1] = 400.0                   # the row's max in the last (scalar-tail) element
    logits[2] = rng.uniform(-1e-3, 1e-3, V)  # near-uniform: the sum is ~V
    if soft:
        labels = rng.random((R, V)).astype(np.float32)
        labels /= labels.sum(axis=1, keepdims=True)
    else:
        labels = np.zeros((R, V), np.float32)
        labels[np.arange(R), rng.integers(0, V, R)] = 1.0
        labels[1, -1] = 0.0
        labels[1, 0] = 1.0                  # far below that row's max: a loss of ~400
    got = ggml_cross_entropy(logits, labels, threads)
    want = reference(logits, labels)
    assert np.isfinite(got)
    np.testing.assert_allclose(got, want, rtol=2e-6)
