"""ggml-cpu's binary ops with src1 broadcast from one element per row (native/patches/0007: the
per-row loop for ne10 == 1, as in the loss's row mask [1, N] against logits [V, N]).  Each
element is one IEEE op, so the result must equal numpy's float32 op exactly, for every op, for
rows that are and are not multiples of the SIMD width, with 1 and 2 threads, and for src1
broadcast along more dimensions too."""
import graph_harness
import numpy as np
import pytest

from pytrain.ggml import lib

OPS = {"add": (lib.ggml_add, np.add), "sub": (lib.ggml_sub, np.subtract),
       "mul": (lib.ggml_mul, np.multiply), "div": (lib.ggml_div, np.divide)}


def run(op, a: np.ndarray, b: np.ndarray, threads: int) -> np.ndarray:
    out = graph_harness.run(lambda c, t: OPS[op][0](c, t["a"], t["b"]), {"a": a, "b": b},
                            threads=threads)
    return out.reshape(a.shape)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("V", [1, 7, 64, 1003])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_element_per_row_broadcast_is_exact(op, V, threads):
    rng = np.random.default_rng(V)
    a = rng.normal(size=(5, V)).astype(np.float32)              # ggml ne [V, 5]
    b = rng.normal(size=(5, 1)).astype(np.float32)              # ne [1, 5]: one value per row
    b[2] = 0.0 if op != "div" else 3.0                          # a masked row
    got = run(op, a, b, threads)
    np.testing.assert_array_equal(got, OPS[op][1](a, b))


@pytest.mark.parametrize("op", ["mul", "add"])
def test_one_element_broadcast_over_rows_and_batches(op):
    rng = np.random.default_rng(1)
    a = rng.normal(size=(3, 4, 37)).astype(np.float32)          # ne [37, 4, 3]
    b = rng.normal(size=(3, 1, 1)).astype(np.float32)           # ne [1, 1, 3]
    np.testing.assert_array_equal(run(op, a, b, 2), OPS[op][1](a, b))
