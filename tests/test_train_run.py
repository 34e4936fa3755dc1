"""`pytrain train` end to end on the converter-made gqa model with a small chat dataset:
files written, validation loss lowered, NaN stops with the last good adapter kept."""
import json
from pathlib import Path

import numpy as np
import pytest

from pytrain.formats.adapter_gguf import read_lora_gguf
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


def write_config(folder: Path, model: Path = FIX / "gqa-f32.gguf", device: str = "cpu",
                 **train) -> Path:
    t = {"max_steps": 30, "batch_size": 8, "lr": 5e-3, "schedule": "constant", "eval_every": 10,
         **train}
    formats = t.pop("formats", ["gguf", "peft"])
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in t.items())
    cfg = folder / "run.toml"
    cfg.write_text(f'[model]\npath = "{model}"\ndevice = "{device}"\nthreads = 2\n'
                   f'[data]\ntrain = "train.jsonl"\nvalidation = "valid.jsonl"\n'
                   f'[lora]\nrank = 8\nalpha = 16.0\n[train]\n{body}\n'
                   f'[output]\ndir = "out"\nformats = {json.dumps(formats)}\n')
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
    from pytrain.formats.adapter_peft import read_peft_adapter
    peft, p_alpha, rank, _ = read_peft_adapter(out / "peft")
    assert p_alpha == 16.0 and rank == 8
    for k, v in tensors.items():
        np.testing.assert_array_equal(peft[k], v)
    printed = capsys.readouterr().out
    assert "adapter:" in printed and "validation: loss" in printed
    # `pytrain eval` with the written adapter reproduces the run's final validation
    assert main(["eval", str(cfg), "--adapter", str(out / "adapter.gguf")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"{valid[-1]['n_valid']} target tokens" in line
    assert f"loss {valid[-1]['loss']:.4f}" in line and f"accuracy {valid[-1]['accuracy']:.3f}" in line


def test_nan_stops_the_run_and_keeps_the_last_good_adapter(tmp_path, capsys):
    """lr 1e30 without clipping: the first step's update is huge but finite, a later step's
    loss is not.  The run stops naming that step N, and the adapter it keeps equals, exactly,
    the adapter of the same run stopped by max_steps at N - 1."""
    import re
    write_data(tmp_path)
    cfg = write_config(tmp_path, lr=1e30, max_grad_norm=0.0, eval_every=0, formats=["gguf"])
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err
    m = re.search(r"stopped at step (\d+): .*kept the adapter from step (\d+)", err)
    assert m and "adapter.gguf" in err, err
    bad, good = int(m.group(1)), int(m.group(2))
    assert good == bad - 1 >= 1
    kept = adapter_of(tmp_path / "out")
    assert max(float(np.abs(v).max()) for v in kept.values()) > 1e20   # the huge update
    assert any(r.get("stopped") for r in records(tmp_path / "out"))
    assert main(["train", str(cfg), "--no-progress", "--set", f"train.max_steps={good}",
                 "--set", f"output.dir={tmp_path / 'good'}"]) == 0
    want = adapter_of(tmp_path / "good")
    assert kept.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_array_equal(kept[k], v, err_msg=k)


def test_unknown_config_key_is_one_line_error(tmp_path, capsys):
    write_data(tmp_path)
    cfg = write_config(tmp_path, learning_rate=1.0)
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.learning_rate" in err[0] and "run.toml" in err[0]


def adapter_of(out: Path):
    return read_lora_gguf(out / "adapter.gguf")[2]


def interrupted_and_resumed(tmp_path, monkeypatch, capsys, skip: int = 0):
    """10 steps straight, and a run that gets SIGINT during step 5 (it finishes the step,
    writes a checkpoint, exits 130) resumed to step 10, crossing an epoch boundary (4 steps
    per epoch).  ``skip``: a planted fault, the resumed run starts that many batches late.
    Returns (straight adapter, resumed adapter, resumed run's step numbers)."""
    import dataclasses
    import os
    import signal
    from pytrain.run import checkpoint as ckpt
    from pytrain.step.trainer import Trainer
    sigint_before = signal.getsignal(signal.SIGINT)
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=10, eval_every=0, schedule="cosine", warmup=2)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    straight = adapter_of(tmp_path / "out")
    out2 = f"output.dir={tmp_path / 'out2'}"
    real_step = Trainer.step
    calls = []

    def step_then_sigint(self, micro, lr):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self, micro, lr)
    monkeypatch.setattr(Trainer, "step", step_then_sigint)
    assert main(["train", str(cfg), "--no-progress", "--set", out2]) == 130
    assert "interrupted by SIGINT after step 5" in capsys.readouterr().err
    monkeypatch.setattr(Trainer, "step", real_step)
    if skip:
        real_load = ckpt.load

        def load_late(*a, **k):
            state, tensors, moments = real_load(*a, **k)
            return dataclasses.replace(state, position=state.position + skip), tensors, moments
        monkeypatch.setattr(ckpt, "load", load_late)
    assert main(["train", str(cfg), "--no-progress", "--set", out2, "--resume"]) == 0
    steps = [r["step"] for r in records(tmp_path / "out2") if "loss" in r and "split" not in r]
    # the run's own handlers are gone again: SIGINT is handled as before the run (Python's
    # default, or SIG_IGN when the tests were started in the background)
    assert signal.getsignal(signal.SIGINT) is sigint_before
    return straight, adapter_of(tmp_path / "out2"), steps


def assert_resumed_equals_straight(straight: dict, resumed: dict) -> None:
    """Bound: zero.  The resumed run performs the same float32 operations in the same order
    on the same values as the straight one: the adapter and AdamW moments come back from
    the checkpoint bit for bit, the same batches make the same graphs, the thread count is
    the same, and ggml and OpenBLAS split work among threads deterministically.  So the
    adapters are equal bit for bit, on any CPU (the CPU-variant matrix runs this under
    several kernels, with and without BLAS)."""
    assert sorted(resumed) == sorted(straight)
    for k, v in straight.items():
        np.testing.assert_array_equal(resumed[k], v, err_msg=k)


def test_resume_ends_with_the_same_adapter(tmp_path, monkeypatch, capsys):
    straight, resumed, steps = interrupted_and_resumed(tmp_path, monkeypatch, capsys)
    assert_resumed_equals_straight(straight, resumed)
    assert steps == list(range(1, 11))


def test_resume_comparison_catches_a_skipped_step(tmp_path, monkeypatch, capsys):
    """The planted fault: the resumed run starts one batch late (the step count is right,
    one batch of the epoch is never trained, one trained twice)."""
    straight, resumed, steps = interrupted_and_resumed(tmp_path, monkeypatch, capsys, skip=1)
    assert steps == list(range(1, 11))                # nothing else gives it away
    with pytest.raises(AssertionError):
        assert_resumed_equals_straight(straight, resumed)


def test_resume_refuses_a_changed_base_model(tmp_path, capsys):
    import shutil
    write_data(tmp_path)
    base = tmp_path / "base.gguf"
    shutil.copy(FIX / "gqa-f32.gguf", base)
    cfg = write_config(tmp_path, max_steps=2, eval_every=0)
    cfg.write_text(cfg.read_text().replace(str(FIX / "gqa-f32.gguf"), str(base)))
    assert main(["train", str(cfg), "--no-progress"]) == 0
    shutil.copy(FIX / "untied-f32.gguf", base)
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume"]) == 1
    err = capsys.readouterr().err
    assert "base model changed" in err and "refusing to resume" in err


def test_a_few_demo_steps_lower_the_validation_loss(tmp_path):
    """config/demo.toml on the embedded model and data, shortened to 12 steps."""
    root = Path(__file__).resolve().parent.parent
    assert main(["train", str(root / "config" / "demo.toml"), "--no-progress",
                 "--set", f"output.dir={tmp_path / 'demo'}", "--set", "train.max_steps=12",
                 "--set", "train.eval_every=0", "--set", "train.warmup=2",
                 "--set", "model.device=cpu"]) == 0
    valid = [r for r in records(tmp_path / "demo") if r.get("split") == "valid"]
    assert [r["step"] for r in valid] == [0, 12]
    # measured (lr 5e-3 constant, seeds 0-3): 3.28 -> 0.74-0.79 (accuracy 0.525 -> 0.78);
    # margin half the smallest drop
    assert valid[1]["loss"] < valid[0]["loss"] - 1.2, valid


def write_uneven_data(folder: Path) -> None:
    """Chats of 4 different lengths, so batches of 4 (length-bucketed) differ in width."""
    def rec(i, animal, sound):
        q = f"What does the {animal} say?" + " Tell me, please." * (i % 4) * 3
        return {"messages": [{"role": "user", "content": q},
                             {"role": "assistant", "content": f"The {animal} says {sound}."}]}
    recs = [rec(i, a, s) for i, (a, s) in enumerate(ANIMALS * 4)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (folder / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:8]))


def test_extending_a_finished_run_continues_it(tmp_path, capsys):
    """max_steps 2 (save_every 2) trained to the end, then `--set train.max_steps=4 --resume`:
    steps 3 and 4 are the next batches of epoch 0, and the adapter equals that of one
    uninterrupted 4-step run (constant schedule), bit for bit (assert_resumed_equals_straight
    says why the bound is zero).  The batches have different widths."""
    from pytrain.run.checkpoint import latest
    from pytrain.data import make_batches
    write_uneven_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=4, batch_size=4, eval_every=0, formats=["gguf"])
    assert main(["train", str(cfg), "--no-progress", "--set", f"output.dir={tmp_path / 'a'}"]) == 0
    straight = adapter_of(tmp_path / "a")
    b = ["--set", f"output.dir={tmp_path / 'b'}"]
    assert main(["train", str(cfg), "--no-progress", *b, "--set", "train.max_steps=2",
                 "--set", "train.save_every=2"]) == 0
    state = json.loads((latest(tmp_path / "b" / "checkpoints") / "state.json").read_text())
    assert (state["step"], state["epoch"], state["position"]) == (2, 0, 2)
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step-0000002"]
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", *b, "--resume"]) == 0
    assert "the run now ends at step 4 (was 2)" in capsys.readouterr().out
    extended = adapter_of(tmp_path / "b")
    assert_resumed_equals_straight(straight, extended)
    recs = records(tmp_path / "b")
    assert [r["step"] for r in recs if "loss" in r and "split" not in r] == [1, 2, 3, 4]
    assert [r["epoch"] for r in recs if "epoch" in r] == [0, 0, 0, 0]
    assert [r["step"] for r in recs if r.get("split") == "valid"] == [0, 2, 4]
    # the run's 8 batches of epoch 0 do have different widths
    widths = {b.tokens.shape[1] for b in make_batches(_examples(cfg), 4, seed=0)}
    assert len(widths) > 1, widths
    # resuming a run that is already at its end trains nothing and changes nothing
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", *b, "--resume"]) == 0
    assert "nothing to train" in capsys.readouterr().out
    assert records(tmp_path / "b") == recs
    for k, v in extended.items():
        np.testing.assert_array_equal(adapter_of(tmp_path / "b")[k], v)


def _examples(cfg: Path):
    from pytrain.config import load_config
    from pytrain.data import load_data
    from pytrain.models.model import load_model
    c = load_config(cfg, [])
    m = load_model(c.model.path, "cpu", 1)
    try:
        return load_data(c.data, m.tokenizer).train
    finally:
        m.close()


@pytest.mark.parametrize("change, named", [
    (["--set", "train.batch_size=2"], "train.batch_size: 4 -> 2"),
    (["--set", "data.packing=true"], "data.packing: False -> True"),
    (["--set", "train.grad_accum=2"], "micro-batches per step (train.grad_accum x ranks): 1 -> 2"),
    (["--set", "data.train={tmp}/other.jsonl"], "training examples"),
])
def test_resume_refuses_other_batches(tmp_path, capsys, change, named):
    """A checkpoint's position means "the k-th step of this batch order": a resume whose
    batch size, accumulation, packing or training examples differ is refused, naming what
    changed, and nothing in the run folder changes."""
    write_uneven_data(tmp_path)
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    (tmp_path / "other.jsonl").write_text("\n".join(lines[1:]) + "\n")
    cfg = write_config(tmp_path, max_steps=2, batch_size=4, eval_every=0, formats=["gguf"])
    assert main(["train", str(cfg), "--no-progress"]) == 0
    before = (tmp_path / "out" / "metrics.jsonl").read_text()
    adapter = adapter_of(tmp_path / "out")
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume", "--set",
                 "train.max_steps=4", *(c.format(tmp=tmp_path) for c in change)]) == 1
    err = capsys.readouterr().err
    assert "cannot resume from" in err and named in err, err
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == before
    for k, v in adapter.items():
        np.testing.assert_array_equal(adapter_of(tmp_path / "out")[k], v)


@pytest.mark.parametrize("given", ["file", "--set"])
def test_a_target_the_model_lacks_is_a_config_error_where_it_was_given(tmp_path, capsys, given):
    """Target names are the architecture's, so they are checked when the model loads; the
    error still names the key and where it came from, before any training step."""
    write_data(tmp_path)
    cfg = write_config(tmp_path)
    args = ["train", str(cfg), "--no-progress"]
    if given == "file":
        cfg.write_text(cfg.read_text().replace("[lora]\n", '[lora]\ntargets = ["attn_q", "mlp"]\n'))
        line = cfg.read_text().splitlines().index('targets = ["attn_q", "mlp"]') + 1
        where = f"{cfg}:{line}: "
    else:
        args += ["--set", "lora.targets=attn_q,mlp"]
        where = "--set lora.targets=attn_q,mlp: "
    assert main(args) != 0
    err = capsys.readouterr().err
    assert where + "lora.targets: unknown LoRA target 'mlp' for qwen35; valid: attn_q" in err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_log_every_prints_the_mean_loss_of_its_steps(tmp_path, capsys):
    """train.log_every 4 over 10 steps: lines at steps 4, 8 and the last, each the mean of the
    losses metrics.jsonl holds for its steps."""
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=10, eval_every=0, log_every=4, formats=["gguf"])
    assert main(["train", str(cfg), "--no-progress"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")
             and "loss" in ln and "validation" not in ln]
    assert [ln.split(":")[0] for ln in lines] == ["step 4/10", "step 8/10", "step 10/10"]
    losses = [r["loss"] for r in records(tmp_path / "out") if "loss" in r and "split" not in r]
    for line, (a, b) in zip(lines, [(0, 4), (4, 8), (8, 10)]):
        printed = float(line.split("loss ")[1].split()[0])
        assert abs(printed - np.mean(losses[a:b])) <= 5e-5, line    # printed to 4 decimals
        assert f"(mean of {b - a})" in line
