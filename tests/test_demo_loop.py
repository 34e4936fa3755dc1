"""scripts/demo_loop.py (``make demo-loop``): its generated data and form check, and the whole
demo at toy size (SmolLM2-135M-Instruct, a few questions, a handful of steps) so the script and
its result file cannot rot.  bench_results/demo_loop.* are the full run's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import demo_loop

ROOT = Path(__file__).resolve().parent.parent


def test_data_keeps_validation_countries_out_of_training(tmp_path):
    """Chat records whose answers have the form, no country in both files, same seed = same
    files."""
    data = demo_loop.write_data(tmp_path, 32, 16)
    country = lambda r: r["messages"][1]["content"].split(" is ")[0][len("The capital of "):]
    train = {country(r) for r in data["train"]}
    valid = {country(r) for r in data["valid"]}
    assert len(train) == 32 and len(valid) == 16 and not train & valid
    for r in data["train"] + data["valid"]:
        assert demo_loop.in_form(r["messages"][1]["content"], r["messages"][0]["content"])
    assert demo_loop.write_data(tmp_path / "again", 32, 16) == data
    assert [len(demo_loop.read_jsonl(tmp_path / f"{k}.jsonl")) for k in ("train", "valid")] \
        == [32, 16]


def test_in_form():
    p = "What is the capital of Tanmiro?"
    assert demo_loop.in_form("The capital of Tanmiro is Kalo.", p)
    assert demo_loop.in_form(" The capital of Tanmiro is Kalo.\n", p)
    for c in ("The capital of Vesko is Kalo.", "The capital of Tanmiro is Kalo",
              "The capital of Tanmiro is Kalo. It is big.", "Kalo.", "",
              "The capital of Tanmiro is kalo."):
        assert not demo_loop.in_form(c, p), c
    assert not demo_loop.in_form("The capital of Tanmiro is Kalo.", "Hello")


@pytest.mark.slow
def test_demo_loop_toy_size(tmp_path):
    """python -m scripts.demo_loop at toy size with early stopping after 1 bad evaluation: the
    run stops by itself or runs out, keeps adapter.best.gguf whose eval is the best validation
    loss, and writes samples, TensorBoard files and the result files."""
    from llama_cpp_check import fetched_model
    fetched_model("smollm2", "93 MB")
    run, res = tmp_path / "run", tmp_path / "results"
    r = subprocess.run([sys.executable, "-m", "scripts.demo_loop", "--train", "8", "--valid", "4",
                        "--out", str(run), "--results", str(res),
                        "--set", "train.max_steps=6", "--set", "train.batch_size=4",
                        "--set", "train.eval_every=2", "--set", "train.sample_every=2",
                        "--set", "train.sample_count=2", "--set", "train.sample_max_tokens=8",
                        "--set", "train.early_stopping_patience=1"],
                       cwd=str(ROOT), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (f"demo_loop exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                               f"{r.stderr[-5000:]}")
    j = json.loads((res / "demo_loop.json").read_text())
    steps = [v["step"] for v in j["valid"]]
    assert steps[0] == 0 and steps == list(range(0, j["steps"] + 1, 2))
    best = min(j["valid"], key=lambda v: (v["loss"], v["step"]))
    assert j["best"] == best and j["valid"][-1]["best_step"] == best["step"]
    # the best adapter file is that step's adapter: evaluated again, the same loss (printed to
    # 4 decimals by `pytrain eval`: +-5e-5; float32 sums of a few hundred token losses: ~1e-6)
    assert j["best_adapter_eval_loss"] == pytest.approx(best["loss"], abs=5e-5 + 1e-5)
    if j["early_stop"]:                 # one bad evaluation stops it (patience 1)
        assert j["valid"][-1]["loss"] >= best["loss"] and j["steps"] < 6
    else:
        assert j["steps"] == 6
    assert [s["step"] for s in j["samples"]] == steps
    assert all(s["of"] == 2 and 0 <= s["in_form"] <= 2 for s in j["samples"])
    assert j["tensorboard"] is True and (run / "adapter.best.gguf").exists()
    md = (res / "demo_loop.md").read_text()
    assert "Best validation loss" in md and f"| {best['step']} |" in md
