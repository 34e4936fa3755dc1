"""`pytrain train` end to end on the converter-made gqa model with a small chat dataset:
files written, validation loss lowered, NaN stops with the last good adapter kept."""
import json
from pathlib import Path

import numpy as np
import pytest

from pytrain.adapter_gguf import read_lora_gguf
from pytrain.cli import main

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"
ANIMALS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"),
           ("pig", "oink"), ("owl", "hoot"), ("frog", "ribbit")]


def write_data(folder: Path) -> None:
    def rec(animal, sound):
        return {"messages": [{"role": "user", "content": f"What does the {animal} say?"},
                             {"role": "assistant", "content": f"The {animal} says {sound}."}]}
    (folder / "train.jsonl").write_text("".join(json.dumps(rec(a, s)) + "\n" for a, s in ANIMALS * 4))
    (folder / "valid.jsonl").write_text("".join(json.dumps(rec(a, s)) + "\n" for a, s in ANIMALS))


def write_config(folder: Path, **train) -> Path:
    t = {"max_steps": 30, "batch_size": 8, "lr": 5e-3, "schedule": "constant", "eval_every": 10,
         **train}
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in t.items())
    cfg = folder / "run.toml"
    cfg.write_text(f'[model]\npath = "{FIX / "gqa-f32.gguf"}"\ndevice = "cpu"\nthreads = 2\n'
                   f'[data]\ntrain = "train.jsonl"\nvalidation = "valid.jsonl"\n'
                   f'[lora]\nrank = 8\nalpha = 16.0\n[train]\n{body}\n'
                   f'[output]\ndir = "out"\n')
    return cfg


def records(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_adapter_metrics_plot_and_lowers_validation_loss(tmp_path, capsys):
    write_data(tmp_path)
    cfg = write_config(tmp_path)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    for f in ("adapter.gguf", "metrics.jsonl", "loss.png", "config.toml", "data_stats.json"):
        assert (out / f).exists(), f
    recs = records(out)
    steps = [r for r in recs if "loss" in r and r.get("split") != "valid"]
    valid = [r for r in recs if r.get("split") == "valid"]
    assert len(steps) == 30 and len(valid) == 4 and valid[0]["step"] == 0
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.5
    assert all(r["n_valid"] > 0 and np.isfinite(r["grad_norm"]) for r in steps)
    assert steps[-1]["drift"] > steps[0]["drift"] > 0
    arch, alpha, tensors, _ = read_lora_gguf(out / "adapter.gguf")
    assert arch == "qwen35" and alpha == 16.0 and "blk.1.attn_q.weight.lora_a" in tensors
    printed = capsys.readouterr().out
    assert "adapter:" in printed and "validation: loss" in printed


def test_nan_stops_the_run_and_keeps_the_last_good_adapter(tmp_path, capsys):
    write_data(tmp_path)
    cfg = write_config(tmp_path, lr=1e30, max_grad_norm=0.0, eval_every=0)
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "stopped at step" in err and "adapter.gguf" in err
    _, _, tensors, _ = read_lora_gguf(tmp_path / "out" / "adapter.gguf")
    assert all(np.isfinite(v).all() for v in tensors.values())
    assert any("stopped" in r for r in records(tmp_path / "out"))


def test_unknown_config_key_is_one_line_error(tmp_path, capsys):
    write_data(tmp_path)
    cfg = write_config(tmp_path, learning_rate=1.0)
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.learning_rate" in err[0] and "run.toml" in err[0]
