"""The best validation's adapter (adapter.best.gguf, peft-best/) and early stopping, on a run
that overfits: the tiny converter-made model trained on animal sounds and validated on
unrelated questions, whose validation loss falls while the shared chat format is learned and
then rises as the sounds are memorised."""
import json
import os
import signal
from pathlib import Path

import numpy as np

from pytrain.cli import main
from pytrain.formats.adapter_gguf import read_lora_gguf
from test_train_run import ANIMALS, records, write_config

QUESTIONS = [("What color is the sky?", "Blue, mostly."),
             ("How many legs has a spider?", "Eight legs."),
             ("Where does rain come from?", "From clouds."), ("What is ice?", "Frozen water."),
             ("Which is larger, sun or moon?", "The sun."), ("What do bees make?", "Honey and wax."),
             ("Why do we sleep?", "To rest."), ("What is two plus two?", "Four.")]
PATIENCE, EVERY = 3, 2


def write_overfitting_run(folder: Path, **train) -> Path:
    def rec(q, a):
        return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    (folder / "train.jsonl").write_text("".join(
        json.dumps(rec(f"What does the {a} say?", f"The {a} says {s}.")) + "\n"
        for a, s in ANIMALS * 4))
    (folder / "valid.jsonl").write_text("".join(json.dumps(rec(q, a)) + "\n"
                                                for q, a in QUESTIONS))
    return write_config(folder, **{"max_steps": 60, "lr": 0.02, "eval_every": EVERY,
                                   "early_stopping_patience": PATIENCE, **train})


def tensors(path: Path) -> dict:
    return read_lora_gguf(path)[2]


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def valid_records(out: Path) -> list[dict]:
    return [r for r in records(out) if r.get("split") == "valid"]


def test_early_stopping_keeps_the_best_adapter(tmp_path, capsys):
    cfg = write_overfitting_run(tmp_path)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "out"
    valid = valid_records(out)
    # each validation record names the best so far: the lowest loss up to it (the first of
    # equal ones), as transformers' best_metric
    for i, r in enumerate(valid):
        upto = [v["loss"] for v in valid[:i + 1]]
        j = int(np.argmin(upto))
        assert (r["best_step"], r["best_loss"]) == (valid[j]["step"], upto[j])
    best = valid[-1]["best_step"]
    # stopped after PATIENCE validations without improvement, well before max_steps
    last = valid[-1]["step"]
    assert last == best + PATIENCE * EVERY < 60, [(v["step"], v["loss"]) for v in valid]
    assert [v["step"] for v in valid[-PATIENCE:]] == [best + EVERY * k for k in (1, 2, 3)]
    assert all(v["loss"] >= valid[-1]["best_loss"] for v in valid[-PATIENCE:])
    steps = [r["step"] for r in records(out) if "loss" in r and "split" not in r]
    assert steps == list(range(1, last + 1))
    assert records(out)[-1] == {"step": last, "early_stop": records(out)[-1]["early_stop"]}
    assert f"stopped:  early stopping: {PATIENCE} validations" in printed
    assert f"adapter.best.gguf (step {best}, validation loss" in printed
    # the best adapter is the adapter of that step: equal, bit for bit, to a run stopped
    # there by max_steps (same batches, constant schedule)
    assert main(["train", str(cfg), "--no-progress", "--set", f"output.dir={tmp_path / 'b'}",
                 "--set", f"train.max_steps={best}", "--set", "train.eval_every=0",
                 "--set", "train.early_stopping_patience=0"]) == 0
    assert_same(tensors(out / "adapter.best.gguf"), tensors(tmp_path / "b" / "adapter.gguf"))
    from pytrain.formats.adapter_peft import read_peft_adapter
    assert_same(read_peft_adapter(out / "peft-best", arch="qwen35")[0], tensors(out / "adapter.best.gguf"))
    # the final adapter is the last step's (what a resume continues from), not the best
    assert not np.array_equal(tensors(out / "adapter.gguf")["blk.1.attn_q.weight.lora_b"],
                              tensors(out / "adapter.best.gguf")["blk.1.attn_q.weight.lora_b"])
    # `pytrain eval` of the best adapter gives its recorded loss
    capsys.readouterr()
    assert main(["eval", str(cfg), "--adapter", str(out / "adapter.best.gguf")]) == 0
    assert f"loss {valid[-1]['best_loss']:.4f}" in capsys.readouterr().out.splitlines()[-1]
    # the last checkpoint holds the best (not its own step's) and the early-stopping count
    ck = out / "checkpoints" / f"step-{last:07d}"
    state = json.loads((ck / "state.json").read_text())
    assert state["best"] == {"step": best, "loss": valid[-1]["best_loss"], "bad_evals": PATIENCE}
    assert_same(tensors(ck / "best.gguf"), tensors(out / "adapter.best.gguf"))

    # a resume of the stopped run stays stopped and changes nothing ...
    before = records(out)
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume"]) == 0
    assert "the run stopped early" in capsys.readouterr().out
    assert records(out) == before
    # ... unless the patience grows: then it goes on from where it stopped
    assert main(["train", str(cfg), "--no-progress", "--resume",
                 "--set", f"train.early_stopping_patience={PATIENCE + 1}"]) == 0
    steps = [r["step"] for r in records(out) if "loss" in r and "split" not in r]
    assert steps[:last] == list(range(1, last + 1)) and steps[last] == last + 1


def test_an_interrupted_run_stops_early_and_keeps_the_best_as_the_straight_run(
        tmp_path, monkeypatch, capsys):
    """SIGINT after the best validation: the checkpoint carries the best adapter and count,
    so the resumed run stops at the same step with the same best adapter, even when the
    run folder's adapter.best.gguf was replaced meanwhile."""
    from pytrain.step.trainer import Trainer
    cfg = write_overfitting_run(tmp_path)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    straight = valid_records(tmp_path / "out")
    best, last = straight[-1]["best_step"], straight[-1]["step"]
    stop_in = best + EVERY + 1        # after one validation without improvement
    assert stop_in < last
    out2 = ["--set", f"output.dir={tmp_path / 'out2'}"]
    real_step, calls = Trainer.step, []

    def step_then_sigint(self, micro, lr):
        calls.append(1)
        if len(calls) == stop_in:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self, micro, lr)
    monkeypatch.setattr(Trainer, "step", step_then_sigint)
    assert main(["train", str(cfg), "--no-progress", *out2]) == 130
    monkeypatch.setattr(Trainer, "step", real_step)
    assert f"after step {stop_in}" in capsys.readouterr().err
    o2 = tmp_path / "out2"
    (o2 / "adapter.best.gguf").write_bytes((o2 / "adapter.gguf").read_bytes())
    assert main(["train", str(cfg), "--no-progress", *out2, "--resume"]) == 0
    resumed = valid_records(o2)
    assert [(r["step"], r["loss"], r["best_step"]) for r in resumed] == \
           [(r["step"], r["loss"], r["best_step"]) for r in straight]
    assert_same(tensors(o2 / "adapter.best.gguf"), tensors(tmp_path / "out" / "adapter.best.gguf"))
    assert_same(tensors(o2 / "adapter.gguf"), tensors(tmp_path / "out" / "adapter.gguf"))


def test_a_resume_from_an_earlier_checkpoint_restores_that_timelines_best(tmp_path, capsys):
    """The run folder's best may come from steps that a resume from an earlier checkpoint
    abandons: that checkpoint's own best comes back."""
    cfg = write_overfitting_run(tmp_path, early_stopping_patience=0, max_steps=12,
                                save_every=4, formats=["gguf"])
    cfg.write_text(cfg.read_text().replace("[output]", "[output]\nkeep_checkpoints = 0"))
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    valid = valid_records(out)
    best_at_4 = next(r for r in valid if r["step"] == 4)["best_step"]
    assert valid[-1]["best_step"] != best_at_4, [(v["step"], v["loss"]) for v in valid]
    early = tmp_path / "early"
    assert main(["train", str(cfg), "--no-progress", "--set", f"output.dir={early}",
                 "--set", "train.max_steps=4"]) == 0
    assert main(["train", str(cfg), "--no-progress", "--set", "train.max_steps=4",
                 "--resume", str(out / "checkpoints" / "step-0000004")]) == 0
    assert_same(tensors(out / "adapter.best.gguf"), tensors(early / "adapter.best.gguf"))


def test_resuming_a_finished_run_keeps_the_best_of_its_last_validation(tmp_path, capsys):
    """The last step is a save step and its validation the best: its checkpoint must come
    after that validation, or a resume of the finished run restores the older best (and
    rewrites adapter.best.gguf with it)."""
    cfg = write_overfitting_run(tmp_path, early_stopping_patience=0, max_steps=4, lr=0.005,
                                save_every=2, formats=["gguf"])
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    valid = valid_records(out)
    assert [v["step"] for v in valid] == [0, 2, 4] and valid[-1]["best_step"] == 4, \
        [(v["step"], v["loss"]) for v in valid]
    best = (out / "adapter.best.gguf").read_bytes()
    assert best == (out / "adapter.gguf").read_bytes()
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume"]) == 0
    assert "(step 4, validation loss" in capsys.readouterr().out
    assert (out / "adapter.best.gguf").read_bytes() == best
    assert valid_records(out) == valid


def test_early_stopping_without_validations_is_a_config_error(tmp_path, capsys):
    cfg = write_overfitting_run(tmp_path, eval_every=0)
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "run.toml" in err and "train.early_stopping_patience" in err and "eval_every" in err
    cfg = write_overfitting_run(tmp_path)
    cfg.write_text(cfg.read_text().replace('validation = "valid.jsonl"\n', ""))
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "train.early_stopping_patience" in err and "data.validation or data.split" in err


def test_a_run_that_reached_its_last_step_did_not_stop_early(tmp_path, capsys):
    """Patience 2 and min_delta 100 (no validation improves enough): the validations at
    steps 0 and 2 and the final one at step 4 exhaust the patience at the last step.  The run
    printed "stopped: early stopping: ..." although it reached step 4/4 (metrics.jsonl held no
    early_stop record), and `--resume` with max_steps = 8 said "the run stopped early at step
    4 ... nothing to train".  Now the final validation stops nothing, the checkpoint records
    that the run did not stop early, and the resume trains on (its next validation, the
    count carried on, stops it)."""
    cfg = write_overfitting_run(tmp_path, max_steps=4, early_stopping_patience=2,
                                early_stopping_min_delta=100.0)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "out"
    assert "stopped:" not in printed and "early stopping" not in printed, printed
    assert not any("early_stop" in r for r in records(out))
    assert [r["step"] for r in valid_records(out)] == [0, 2, 4]
    state = json.loads((out / "checkpoints" / "step-0000004" / "state.json").read_text())
    assert state["best"]["bad_evals"] == 2 and state["stopped_early"] is False
    assert main(["train", str(cfg), "--no-progress", "--resume",
                 "--set", "train.max_steps=8"]) == 0
    printed = capsys.readouterr().out
    assert "the run stopped early" not in printed, printed
    steps = [r["step"] for r in records(out) if "loss" in r and "split" not in r]
    assert steps == [1, 2, 3, 4, 5, 6], steps
    assert records(out)[-1]["step"] == 6 and "early_stop" in records(out)[-1]
    assert "stopped:  early stopping: 3 validations" in printed, printed


def test_a_checkpoint_without_the_early_stop_record_derives_it_as_before(tmp_path, capsys):
    """A checkpoint saved before the early stop was recorded: its best's count decides, as
    it did then (a run at its patience stopped early)."""
    cfg = write_overfitting_run(tmp_path, max_steps=4, early_stopping_patience=2,
                                early_stopping_min_delta=100.0)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    path = tmp_path / "out" / "checkpoints" / "step-0000004" / "state.json"
    state = json.loads(path.read_text())
    del state["stopped_early"]
    state["format"] = 4
    path.write_text(json.dumps(state))
    before = records(tmp_path / "out")
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume",
                 "--set", "train.max_steps=8"]) == 0
    assert "the run stopped early at step 4" in capsys.readouterr().out
    assert records(tmp_path / "out") == before
