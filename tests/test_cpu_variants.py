"""ggml-cpu is built once per x86-64 instruction-set level and pytrain loads, at import, the best
one this CPU runs (as llama.cpp's portable builds do), or the one ``PYTRAIN_CPU_VARIANT``
names.  A variant the CPU cannot execute is refused before it is loaded (it would die with
SIGILL in the first matmul)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytrain import ggml

ROOT = Path(__file__).resolve().parent.parent


def variant_report(env_variant: str | None) -> dict | str:
    """What a fresh process loads under ``PYTRAIN_CPU_VARIANT=env_variant`` (its stderr when
    the import fails)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTRAIN_CPU_VARIANT"}
    if env_variant is not None:
        env["PYTRAIN_CPU_VARIANT"] = env_variant
    code = ("import json; from pytrain import ggml; v = ggml.CPU_VARIANT; "
            "print(json.dumps({'name': v.name, 'path': str(v.path), 'by': v.chosen_by, "
            "'features': ggml.cpu_features()}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    return json.loads(r.stdout) if r.returncode == 0 else r.stderr


def test_the_best_runnable_variant_is_loaded():
    scores = ggml.cpu_variant_scores()
    runnable = {n: s for n, (_, s) in scores.items() if s > 0}
    assert runnable, scores
    got = variant_report(None)
    assert isinstance(got, dict), got
    if "native" in scores:
        assert got["name"] == "native"
    else:
        assert runnable[got["name"]] == max(runnable.values()), (got, runnable)
        assert got["by"] == "best for this CPU"
    assert Path(got["path"]).parent == ggml.LIB_DIR


def test_a_named_variant_is_loaded_and_reports_its_instruction_sets():
    scores = ggml.cpu_variant_scores()
    if scores.get("haswell", (None, 0))[1] == 0:
        pytest.skip("this build or CPU has no runnable haswell (AVX2) variant")
    got = variant_report("haswell")
    assert isinstance(got, dict), got
    assert got["name"] == "haswell" and got["by"] == "PYTRAIN_CPU_VARIANT"
    assert "avx2" in got["features"] and "avx512" not in got["features"]
    x64 = variant_report("x64")
    assert x64["name"] == "x64" and "avx" not in x64["features"], x64


def test_unknown_and_unrunnable_variants_are_refused():
    err = variant_report("pentium4")
    assert isinstance(err, str) and "PYTRAIN_CPU_VARIANT=pentium4: this build has no such" in err
    scores = ggml.cpu_variant_scores()
    too_new = [n for n, (_, s) in scores.items() if s == 0]
    if not too_new:
        pytest.skip("this CPU runs every variant of the build")
    err = variant_report(too_new[0])
    assert isinstance(err, str) and "lacks instructions that variant needs" in err, err
    assert "SIGILL" in err


def test_choice_rules():
    p = Path("/x")
    scores = {"x64": (p, 1), "haswell": (p, 63), "zen4": (p, 2047), "sapphirerapids": (p, 0)}
    assert ggml.choose_cpu_variant(scores, None).name == "zen4"
    assert ggml.choose_cpu_variant(scores, "x64").name == "x64"
    with pytest.raises(ggml.CpuVariantError, match="variants this CPU runs: x64, haswell, zen4"):
        ggml.choose_cpu_variant(scores, "sapphirerapids")
    assert ggml.choose_cpu_variant({**scores, "native": (p, 1)}, None).name == "native"
    with pytest.raises(ggml.CpuVariantError, match="none of this build's ggml-cpu variants"):
        ggml.choose_cpu_variant({"sapphirerapids": (p, 0)}, None)
