"""Host work done at every step or checkpoint stays small: the LoRA drift is computed from r x r
products (never the dense n_out x n_in B·A), and the digest of the training examples in the
resume key is computed once per run."""
import hashlib
import json
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import pytrain
from pytrain.models import lora
from pytrain.models.lora_targets import select_targets

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"
MODEL = FIX / "gqa-f32.gguf"
U64 = 2.0 ** -53      # float64 unit roundoff


def gamma(k: int) -> float:
    """The classic bound k·u / (1 - k·u) on the relative error of k float64 roundings."""
    return k * U64 / (1 - k * U64)


def dense_sq(a: np.ndarray, b: np.ndarray) -> float:
    """‖B·A‖²_F the way drift computed it before: the dense float64 product, then its norm."""
    return float(np.linalg.norm(b.astype(np.float64) @ a)) ** 2


def sq_bound(a: np.ndarray, b: np.ndarray) -> float:
    """How far the two float64 evaluations of ‖B·A‖²_F may be apart.  Both err by at most
    γ_K·S, S = ‖|B|·|A|‖²_F (every term each sums is bounded by a term of S):
      tr((BᵀB)(AAᵀ)): BᵀB sums n_out products, AAᵀ n_in, the trace r² products: K = n_out +
      n_in + r² + 1;
      dense: each entry of B·A sums r products, its square and the sum over n_out·n_in
      squares, then the norm's square root and our squaring: K = r + n_out·n_in + 4."""
    r, n_in = a.shape
    n_out = b.shape[0]
    s = float(np.sum((np.abs(b).astype(np.float64) @ np.abs(a)) ** 2))
    return (gamma(n_out + n_in + r * r + 1) + gamma(r + n_out * n_in + 4)) * s


@pytest.mark.parametrize("r, n_in, n_out", [(1, 7, 5), (4, 64, 128), (16, 300, 200),
                                            (64, 32, 48)])
def test_product_norm_equals_the_dense_formula(r, n_in, n_out):
    rng = np.random.default_rng(r * 1000 + n_in)
    a = rng.normal(0, 1, (r, n_in)).astype(np.float32)
    b = rng.normal(0, 1, (n_out, r)).astype(np.float32)
    got = lora.product_sq_norm(a, b)
    assert abs(got - dense_sq(a, b)) <= sq_bound(a, b)
    # B = 0 (an adapter at its start) gives exactly 0, never the root of a rounded negative
    assert lora.product_sq_norm(a, np.zeros_like(b)) == 0.0


@pytest.fixture(scope="module")
def model():
    m = pytrain.load_model(MODEL, device="cpu", threads=1)
    yield m
    m.close()


def test_drift_equals_the_dense_formula_and_forms_no_dense_product(model):
    ad = lora.create(model.runtime, model.config, select_targets(model.config), 4, 8, seed=0)
    rng = np.random.default_rng(5)
    vals = {k: rng.normal(0, 0.1, v.shape).astype(np.float32) for k, v in ad.get().items()}
    ad.set(vals)
    want, bound = 0.0, 0.0
    for n in ad.names:
        a, b = vals[n + ".lora_a"], vals[n + ".lora_b"]
        d = dense_sq(a, b)
        want += np.sqrt(d) * ad.scale_of(n)
        # |√x - √y| = |x - y| / (√x + √y) <= |x - y| / √y
        bound += sq_bound(a, b) / np.sqrt(d) * ad.scale_of(n)
    bound += len(ad.names) * 4 * U64 * want          # the root, the scale, the running sum
    tracemalloc.start()
    try:
        got = ad.drift()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert abs(got - want) <= bound
    largest = max(vals[n + ".lora_b"].shape[0] * vals[n + ".lora_a"].shape[1] for n in ad.names)
    assert peak < largest * 8, (f"drift allocated {peak} bytes at its peak: a dense float64 "
                                f"B·A of the largest pair alone is {largest * 8}")


# --------------------------------------------------------------------------- resume key

ANIMALS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack")]


def test_the_training_examples_are_hashed_once_per_run(tmp_path, monkeypatch):
    from pytrain.config import load_config
    from pytrain.run import loop as run_mod
    rec = [{"messages": [{"role": "user", "content": f"What does the {a} say?"},
                         {"role": "assistant", "content": f"The {a} says {s}."}]}
           for a, s in ANIMALS]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rec))
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(f'[model]\npath = "{MODEL}"\ndevice = "cpu"\nthreads = 1\n'
                        f'[data]\ntrain = "train.jsonl"\n[output]\ndir = "out"\n')
    cfg = load_config(cfg_path)
    s = run_mod.open_session(cfg, tmp_path / "out", lambda msg: None)
    try:
        # the digest as resume_key has always defined it: every example's tokens, then mask
        h = hashlib.sha256()
        for e in s.splits.train:
            h.update(e.tokens.tobytes())
            h.update(e.train_mask.tobytes())
        made = []
        real = hashlib.sha256

        def counting(*args):
            made.append(args)
            return real(*args)

        monkeypatch.setattr(run_mod, "hashlib", SimpleNamespace(sha256=counting))
        keys = [s.resume_key() for _ in range(3)]      # three checkpoints of one run
        assert keys[0]["training examples"] == h.hexdigest()
        assert keys[1] == keys[0] and keys[2] == keys[0]
        assert len(made) <= 1, f"the training examples were hashed {len(made)} times"
    finally:
        s.close()
