"""The CPU matrix's reference cells (scripts/test_cpu_matrix.py ``--ref``,
scripts/cpu_matrix_reference.py) at toy size: one setting, one golden regenerated, one test of
each kind, and what the row must record.  The reference interpreter runs them
(tests/reference_env.py: ``make test`` provides it; elsewhere they skip without it)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import cpu_matrix_reference as ref
from tests import reference_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

# (a) the committed peft_grads.npz reproduced under the setting; (b) a parity test that reads
# the golden (its targets and names: true under any rounding, so the bounds are not what this
# checks)
ONE_OF_EACH = ("test_make_peft_golden_reproduces_its_file and peft_grads or "
               "test_golden_covers_exactly_the_default_targets and lora and width20 "
               "and not rslora")


def test_settings_are_named_variables():
    assert ref.parse_setting("plain") == {}
    assert ref.parse_setting("MKL_CBWR=COMPATIBLE+ATEN_CPU_CAPABILITY=avx2") == {
        "MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"}
    with pytest.raises(ValueError, match="'MKL_CBWR': each cell is 'plain' or NAME=VALUE"):
        ref.parse_setting("MKL_CBWR")
    r = subprocess.run([sys.executable, "-m", "scripts.test_cpu_matrix", "--variants", "none",
                        "--ref", "plain,ONEDNN_MAX_CPU_ISA"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 2 and "'ONEDNN_MAX_CPU_ISA': each cell is" in r.stderr, r.stderr


def test_auto_keeps_only_settings_that_change_float32_results():
    """``--ref auto`` probes each candidate: a variable no library reads changes no bit and
    gets no cell, and says so."""
    python = reference_env.require()
    plain = ref.probe(python, {})
    kept, probed = ref.choose(python, plain, candidates=("TZ=UTC",))
    assert kept == [] and probed[0]["setting"] == "TZ=UTC" and probed[0]["changes"] == []
    assert probed[0]["dropped"] == "changes no float32 result here"
    assert len(plain["ops"]) > 10 and plain["kernels"]["aten"] and plain["kernels"]["torch"]


def test_cpu_matrix_one_reference_cell(tmp_path):
    """python -m scripts.test_cpu_matrix --variants none --ref MKL_CBWR=COMPATIBLE, with only
    peft_grads.npz regenerated and one test of each kind: the cell passes, (a) and (b) each
    ran their test, the golden in the copy is the one regenerated there, nothing else was
    rewritten, and the row names the kernels the setting gave (MKL's CNR mode among them)."""
    reference_env.require()
    out = tmp_path / "matrix.md"
    r = subprocess.run([sys.executable, "-m", "scripts.test_cpu_matrix", "--variants", "none",
                        "--ref", "MKL_CBWR=COMPATIBLE", "--ref-goldens", "peft_golden",
                        "-k", ONE_OF_EACH, "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (cell,) = json.loads(out.with_suffix(".json").read_text())
    assert cell["kind"] == "reference" and cell["setting"] == "MKL_CBWR=COMPATIBLE"
    assert cell["exit"] == 0 and not cell["failed"] and not cell["messages"], cell
    assert cell["reproduction"]["passed"] == 1 and cell["parity"]["passed"] == 1, cell
    assert list(cell["generators"]) == ["peft_golden"] and \
        cell["generators"]["peft_golden"]["exit"] == 0
    assert list(cell["goldens"]) == ["qwen35/peft_grads.npz"] and not cell["not_reproduced"]
    k = cell["kernels"]
    assert k["aten"] and k["torch"] and cell["pytrain"].count("BLAS") == 1
    if k["sgemm_by_mkl"]:                  # torch's x86 wheels: MKL says which branch it ran
        assert k["mkl"] and k["mkl_cnr"] == "COMPATIBLE"
    text = out.read_text()
    assert "## The reference side" in text and ref.kernels_text(k) in text
    assert "**1 of 1 cells passed.**" in text
    assert "--variants none --ref MKL_CBWR=COMPATIBLE --ref-goldens peft_golden" in text
