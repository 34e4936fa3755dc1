"""Smoke tests of the scripts that made the committed references: each runs as
``python -m scripts.NAME`` into a temporary folder, at the smallest size its options offer,
and what it writes is compared with the committed file it once made.  So a generator that no
longer runs (a renamed pytrain or torch name, a changed converter) fails here, and so does a
committed fixture that its generator no longer reproduces.

The generators that need torch, transformers or PEFT run under the reference interpreter
(tests/reference_env.py: ``make test`` provides it; elsewhere they skip without it).

Bounds, where a value is recomputed rather than copied (tests/bounds.py):

* float64 references stored as float32: two float64 evaluations of the same forward differ by
  a few hundred units of 2^-53 relative, far below half a float32 step, so their float32
  roundings are equal or adjacent: at most 1 float32 ulp, 2^-23·|x|.
* float32 values made by the same float32 torch code on another CPU: ``f32_bound`` of this
  run's own float32 error, measured against the float64 run the same file stores.
* float64 values from that float64 run: the same operations rounded at 2^-53 instead of
  2^-24, so the float32 error scaled by 2^-29 (times F32_SPREAD, as for float32).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bounds import F32_SPREAD, f32_bound
from tests import reference_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
ULP32 = 2.0 ** -23        # one float32 step relative to the value (|x| in [1, 2) -> 2^-23)


@pytest.fixture(scope="module")
def ref_python() -> str:
    return reference_env.require()


def run(python: str, *argv: str, timeout: float = 900) -> str:
    r = subprocess.run([python, "-m", *argv], cwd=str(ROOT), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, (f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                               f"{r.stderr[-5000:]}")
    return r.stdout


def test_make_qwen35_f64_golden_reproduces_its_file(tmp_path):
    """scripts/make_qwen35_f64_golden.py (numpy alone) on gqa-f32: the committed golden to
    1 float32 ulp."""
    run(sys.executable, "scripts.make_qwen35_f64_golden", "--files", "gqa-f32", "--out",
        str(tmp_path))
    new = np.load(tmp_path / "gqa-f32.f64.npz")["logprobs"].astype(np.float64)
    old = np.load(FIX / "qwen35" / "gqa-f32.f64.npz")["logprobs"].astype(np.float64)
    assert new.shape == old.shape and np.abs(new).max() > 1
    assert (np.abs(new - old) <= ULP32 * np.abs(old)).all(), float(np.abs(new - old).max())


def test_make_chat_template_golden_reproduces_its_file(ref_python, tmp_path):
    """scripts/make_chat_template_golden.py: transformers renders the pinned template to the
    committed golden, character for character."""
    out = tmp_path / "golden.json"
    run(ref_python, "scripts.make_chat_template_golden", "--out", str(out))
    new, old = (json.loads(p.read_text()) for p in (out, FIX / "chat_template_golden.json"))
    assert len(new["cases"]) == len(old["cases"]) > 5
    assert new == old


def test_make_peft_golden_reproduces_its_file(ref_python, tmp_path):
    """scripts/make_peft_golden.py: the rebuilt gqa model passes its own check against the
    committed gqa.npz, PEFT's float32 and float64 gradients come out, and equal the
    committed peft_grads.npz to rounding (module docstring)."""
    out = tmp_path / "peft_grads.npz"
    log = run(ref_python, "scripts.make_peft_golden", "--out", str(out))
    assert "rebuilt gqa vs committed golden" in log
    new, old = np.load(out), np.load(FIX / "qwen35" / "peft_grads.npz")
    assert sorted(new.files) == sorted(old.files)
    grads = [k for k in old.files if k.endswith(".grad")]
    assert len(grads) == 16
    for k in old.files:
        if not k.endswith((".grad", ".grad64", "loss", "loss64")):   # inputs: exactly
            assert np.array_equal(new[k], old[k]), k
    for k in grads + ["loss"]:
        exact = new[k + "64"]
        e32 = float(np.abs(new[k] - exact).max())
        assert np.abs(new[k] - old[k]).max() <= f32_bound(e32, exact), k
        e64 = F32_SPREAD * max(e32, 8 * 2.0 ** -24 * float(np.abs(exact).max())) * 2.0 ** -29
        assert np.abs(new[k + "64"] - old[k + "64"]).max() <= e64, (k, e64)
