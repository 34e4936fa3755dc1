"""Smoke tests of the scripts the README and the committed result files name as their source
that need only pytrain (no reference stack): each runs as ``python -m scripts.NAME`` at its
smallest size, into a temporary folder, and its output is checked for what it must contain.

Covered elsewhere: the benchmarks (tests/test_scripts_bench.py), the reference generators
(tests/test_scripts_reference.py), masking_experiments' functions
(tests/test_masking_experiments.py), gpu_carry and gpu_check.sh (tests/test_bare_machine.py),
fetch_model and build_llama_cpp (``make test`` runs both before the tests), llama_ref,
gguf_models and llama_logits/llama_generate (the parity and llama.cpp tests call them).
Not run: fresh_clone (a fresh clone running ``make test`` itself) and the GPU benchmark's
device run (tests/test_gpu.py's machine)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def run(*argv: str, timeout: float = 900) -> str:
    r = subprocess.run([sys.executable, "-m", *argv], cwd=str(ROOT), capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, (f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                               f"{r.stderr[-5000:]}")
    return r.stdout


def test_cli_examples(tmp_path):
    """python -m scripts.cli_examples: `pytrain plan` and `pytrain profile` on the demo
    config, both outputs in the file."""
    out = tmp_path / "cli.md"
    run("scripts.cli_examples", "--out", str(out))
    text = out.read_text()
    assert "$ pytrain plan config/demo.toml" in text and "$ pytrain profile config/demo.toml" in text
    assert text.count("```") == 4


def test_demo_two_steps(tmp_path):
    """python -m scripts.demo (make demo), two steps: trains, writes the adapter, and prints
    the answers before and after."""
    log = run("scripts.demo", "--set", "train.max_steps=2", "--set", "train.eval_every=0",
              "--set", f"output.dir={json.dumps(str(tmp_path / 'run'))}",
              "--set", "model.device=cpu")
    assert "before → after" in log and log.count("adapted:") == 4
    assert (tmp_path / "run" / "adapter.gguf").exists()


def test_report_parity_one_test(tmp_path):
    """python -m scripts.report_parity (-k one test): runs the report's test files, writes the
    figures that test recorded with their bounds, one section per file."""
    out = tmp_path / "parity.md"
    run("scripts.report_parity", "-k", "test_causal_conv_matches_ssm_conv", "--out", str(out))
    j = json.loads(out.with_suffix(".json").read_text())
    assert j["measured"] and all(m["test"].startswith("tests/test_delta_net.py::")
                                 for m in j["measured"])
    assert out.read_text().count("\n## tests/") == 4


def test_report_measured_one_test(tmp_path):
    """python -m scripts.report_measured over one test: its recorded figures as a table."""
    out = tmp_path / "m.md"
    run("scripts.report_measured", "--title", "smoke", "--out", str(out),
        "tests/test_delta_net.py::test_causal_conv_matches_ssm_conv")
    rows = json.loads(out.with_suffix(".json").read_text())["measured"]
    assert rows and all(m["value"] <= m["bound"] for m in rows if isinstance(m["bound"], float))
    assert out.read_text().startswith("# smoke")


def test_cpu_matrix_one_cell(tmp_path):
    """python -m scripts.test_cpu_matrix, one cell (the best variant, BLAS on, 1 thread, no
    reference cell: tests/test_cpu_matrix_reference.py has those) over one test: the summary
    names the variant it loaded and the test's result."""
    out = tmp_path / "matrix.md"
    run("scripts.test_cpu_matrix", "--variants", "best", "--blas", "1", "--threads", "1",
        "--ref", "none", "-k", "test_causal_conv_matches_ssm_conv", "tests/test_delta_net.py",
        "--out", str(out))
    (cell,) = json.loads(out.with_suffix(".json").read_text())
    assert cell["exit"] == 0 and not cell["failed"] and cell["passed"] >= 1, cell
