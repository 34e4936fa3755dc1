"""Smoke tests of the benchmark scripts the README's speed and memory figures come from: each
runs its own code, at the smallest size, so that a rename in pytrain (or a typo on the
reference side) breaks a test instead of the next benchmark run.

One toy model ("toy" in scripts/bench_common.py's SPECS: hidden 64, 4 layers, vocabulary 512)
is generated once for the module by ``bench_common.ensure_model`` under the reference
interpreter (tests/reference_env.py), exactly as a benchmark makes its models; every
benchmark's workers then run one step (or one forward) of each side on it.  Nothing here is
timed: the figures are the benchmarks' job.
"""
from __future__ import annotations

import json
import sys

import pytest

from scripts import bench_common as bc
from tests import reference_env

pytestmark = pytest.mark.slow

BATCH = ("1", "32")


@pytest.fixture(scope="module")
def ref_python() -> str:
    return reference_env.require()


@pytest.fixture(scope="module")
def toy(ref_python, tmp_path_factory) -> dict:
    """The toy benchmark model (HF checkpoint + F32 GGUF), made as the benchmarks make theirs."""
    d = bc.ensure_model("toy", tmp_path_factory.mktemp("bench"), ref_python, "bench_train")
    assert d is not None, "bench_common.ensure_model('toy') failed (its output is above)"
    done = json.loads((d / "done.json").read_text())
    return dict(dir=d, gguf=str(d / done["gguf"]), hf=str(d / "hf"), n_params=done["n_params"])


def worker(python: str, script: str, side: str, *args: str) -> dict:
    """One worker process of ``scripts.SCRIPT`` (one thread); its RESULT, or a failure showing
    the end of its output."""
    res, r = bc.run_result([python, "-m", f"scripts.{script}", "--worker", side, *args],
                           bc.worker_env(1), timeout=600)
    assert r.returncode == 0 and res is not None, (
        f"scripts.{script} --worker {side} exited {r.returncode}:\n{r.stdout[-2000:]}\n"
        f"{r.stderr[-4000:]}")
    return res


def test_bench_train_one_step_each_side(toy, ref_python):
    """python -m scripts.bench_train's two workers, one clean timed step each after one
    warm-up: the same batch and mask (16 targets of 32 tokens) and the same LoRA size."""
    common = ["--threads", "1", "--runs", "1", "--warmup", "1", "--batch", *BATCH,
              "--vocab", "512"]
    p = worker(sys.executable, "bench_train", "pytrain", *common, "--gguf", toy["gguf"])
    h = worker(ref_python, "bench_train", "hf", *common, "--hf", toy["hf"])
    for r in (p, h):
        assert r["tokens"] == 32 and r["n_targets"] == 16, r
        assert all(x == x and 0 < x < 100 for x in r["losses"]), r["losses"]
        assert r["n_clean"] + (len(r["times"]) - r["n_clean"]) >= 1
    assert p["lora_params"] == h["lora_params"], (p["lora_params"], h["lora_params"])
    assert p["lora_names"] == h["lora_names"] == 8      # q/k/v/o of the 2 attention layers
