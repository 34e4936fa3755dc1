"""Re-running a config never loses a run (pytrain/run/folder.py): a fresh run into a folder
that holds an earlier run is refused unless resumed or explicitly replaced, two runs cannot
share a folder, a run prunes only its own checkpoints, and a refused resume rewrites nothing."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pytrain.cli import main
from pytrain.run import checkpoint as ckpt
from pytrain.run.folder import RunDir

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "fixtures" / "qwen35" / "gqa-f32.gguf"


def write_run(folder: Path, **train) -> Path:
    rec = {"messages": [{"role": "user", "content": "What does the cow say?"},
                        {"role": "assistant", "content": "The cow says moo."}]}
    (folder / "train.jsonl").write_text((json.dumps(rec) + "\n") * 8)
    t = {"max_steps": 4, "batch_size": 4, "lr": 1e-3, "eval_every": 0, "save_every": 2, **train}
    cfg = folder / "run.toml"
    cfg.write_text(f'[model]\npath = "{MODEL}"\ndevice = "cpu"\nthreads = 1\n'
                   f'[data]\ntrain = "train.jsonl"\n[lora]\nrank = 4\nalpha = 8.0\n[train]\n'
                   + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items())
                   + '[output]\ndir = "out"\n')
    return cfg


def steps_of(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step-*"))


def test_a_fresh_run_into_an_earlier_runs_folder_is_refused(tmp_path, capsys):
    cfg = write_run(tmp_path)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".pytrain.lock"}
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--set", "train.max_steps=2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds an earlier run (checkpoints up to step-0000004" in err[0]
    assert "--resume" in err[0] and "--overwrite" in err[0]
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".pytrain.lock"}
    assert after == before                                    # nothing of it touched


def test_overwrite_replaces_the_earlier_run_and_says_so(tmp_path, capsys):
    cfg = write_run(tmp_path)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    old_id = ckpt.run_id_of(out / "checkpoints" / "step-0000004")
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--overwrite", "--set",
                 "train.max_steps=2"]) == 0
    said = capsys.readouterr().out
    assert "--overwrite: deleted the earlier run" in said and "checkpoints" in said
    assert steps_of(out) == ["step-0000002"]                  # the old step 4 is gone
    new_id = ckpt.run_id_of(out / "checkpoints" / "step-0000002")
    assert new_id and old_id and new_id != old_id
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(x)]
    assert steps == [1, 2]
    assert main(["train", str(cfg), "--no-progress", "--overwrite", "--resume"]) == 1


def test_a_run_prunes_only_its_own_checkpoints(tmp_path):
    """The reproduced defect: an old run's steps 280/290/300 and a new run's step 10 in one
    folder; with keep = 3, saving step 10 deleted step 10 itself (pruning sorted by step across
    both runs).  Now each run prunes only checkpoints with its own id."""
    from pytrain.models import lora
    import pytrain
    m = pytrain.load_model(MODEL, device="cpu", threads=1)
    try:
        ad = lora.create(m.runtime, m.config, ["blk.1.attn_q.weight"], 2, 4.0)
        fp = ckpt.base_fingerprint(MODEL)
        folder = tmp_path / "checkpoints"

        def save(step, run_id):
            st = ckpt.TrainState(step, 0, step, step, fp, total_steps=300, run_id=run_id)
            return ckpt.save(folder, step, ad, {}, st, keep=3, arch="qwen35")
        for step in (280, 290, 300):
            save(step, "old")
        save(10, "new")
        assert steps_of(tmp_path) == ["step-0000010", "step-0000280", "step-0000290",
                                      "step-0000300"]
        for step in (20, 30, 40):
            save(step, "new")
        assert steps_of(tmp_path) == ["step-0000020", "step-0000030", "step-0000040",
                                      "step-0000280", "step-0000290", "step-0000300"]
    finally:
        m.close()


def test_two_runs_cannot_share_a_folder(tmp_path, capsys):
    cfg = write_run(tmp_path)
    (tmp_path / "out").mkdir()
    with RunDir(tmp_path / "out"):                            # a run holding the folder
        assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"is in use by another pytrain run (pid {os.getpid()})" in err
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert main(["train", str(cfg), "--no-progress"]) == 0   # free again once it ended


def test_the_lock_is_held_across_processes(tmp_path):
    """flock is per open file: a second process sees the first one's lock."""
    out = tmp_path / "out"
    out.mkdir()
    code = ("import sys; sys.path.insert(0, %r); from pytrain.run.folder import RunDir, "
            "RunDirError\ntry:\n    RunDir(%r).__enter__()\nexcept RunDirError as e:\n"
            "    print(e)\n" % (str(ROOT), str(out)))
    with RunDir(out):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
    assert "in use by another pytrain run" in r.stdout, r.stdout + r.stderr


def test_a_refused_resume_rewrites_nothing_and_checkpoints_keep_the_config(tmp_path, capsys):
    """A resume refused for a changed setting left config.toml and data_stats.json of the run
    it told you to restore from overwritten with the new settings.  Now the checks come
    first; and each checkpoint holds the resolved config it was made with."""
    cfg = write_run(tmp_path)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    config, stats = (out / "config.toml").read_bytes(), (out / "data_stats.json").read_bytes()
    assert (out / "checkpoints" / "step-0000004" / "config.toml").read_bytes() == config
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume", "--set",
                 "train.batch_size=2"]) == 1
    assert "cannot resume" in capsys.readouterr().err
    assert (out / "config.toml").read_bytes() == config
    assert (out / "data_stats.json").read_bytes() == stats
    assert b"batch_size = 4" in config


# ------------------------------------------------------------------ resume from an earlier one
def tree_bytes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".pytrain.lock"}


def loss_steps(out: Path) -> list[int]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in recs if "loss" in r and r.get("split") != "valid"]


def test_resuming_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path, capsys):
    """The reproduced defect: a run with step-2/4/6 resumed from step-2 with keep = 1.  Pruning
    kept the highest step names, so the new step-3 was deleted right after it was written,
    and a later plain --resume took the abandoned step-6 (metrics.jsonl already cut at 2).
    Now pruning and `latest` go by save order, and the later checkpoints (another timeline)
    are moved aside whole, with that timeline's metrics; a later --resume continues from
    step 3 and ends with the adapter of a straight run, bit for bit (constant lr: the same
    float32 operations in the same order, test_train_run's assert_resumed_equals_straight)."""
    cfg = write_run(tmp_path, max_steps=6)
    out, ckdir = tmp_path / "out", tmp_path / "out" / "checkpoints"
    assert main(["train", str(cfg), "--no-progress", "--set", "output.keep_checkpoints=0"]) == 0
    assert steps_of(out) == ["step-0000002", "step-0000004", "step-0000006"]
    later = {n: tree_bytes(ckdir / n) for n in ("step-0000004", "step-0000006")}
    metrics_before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume", str(ckdir / "step-0000002"),
                 "--set", "train.max_steps=3", "--set", "output.keep_checkpoints=1"]) == 0
    said = capsys.readouterr().out
    assert steps_of(out) == ["step-0000003"]               # the resumed run's own, kept
    aside = [p for p in ckdir.iterdir() if p.name.startswith("abandoned-")]
    assert len(aside) == 1, sorted(p.name for p in ckdir.iterdir())
    assert str(aside[0]) in said and "(step-0000004, step-0000006)" in said, said
    assert {n: tree_bytes(aside[0] / n) for n in later} == later      # nothing of them lost
    assert (aside[0] / "metrics.jsonl").read_text() == metrics_before
    assert loss_steps(out) == [1, 2, 3]
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume",
                 "--set", "train.max_steps=5"]) == 0
    assert f"resuming from {ckdir / 'step-0000003'} at step 3" in capsys.readouterr().out
    assert loss_steps(out) == [1, 2, 3, 4, 5]
    straight = write_run(tmp_path, max_steps=5)
    assert main(["train", str(straight), "--no-progress", "--set",
                 f"output.dir={tmp_path / 'straight'}"]) == 0
    a, b = ckpt.load(ckdir / "step-0000005", str(MODEL))[1], \
        ckpt.load(tmp_path / "straight" / "checkpoints" / "step-0000005", str(MODEL))[1]
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    # going back to the abandoned timeline sets this one aside the same way: none of its
    # checkpoints is on the way to step 6
    assert steps_of(out) == ["step-0000003", "step-0000004", "step-0000005"]
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume",
                 str(aside[0] / "step-0000006"), "--set", "train.max_steps=7"]) == 0
    said = capsys.readouterr().out
    assert steps_of(out) == ["step-0000007"]
    again = [p for p in ckdir.iterdir() if p.name.startswith("abandoned-") and p != aside[0]]
    assert len(again) == 1 and "(step-0000003, step-0000004, step-0000005)" in said, said
    assert sorted(p.name for p in again[0].glob("step-*")) == \
        ["step-0000003", "step-0000004", "step-0000005"]
    assert ckpt.latest(ckdir) == ckdir / "step-0000007"


# ------------------------------------------------------------------ --overwrite checks first
def cli_train(cfg: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "pytrain", "train", str(cfg), "--no-progress",
                           *args], cwd=cfg.parent, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("setting, named", [
    ("data.train=nope.jsonl", "nope.jsonl: cannot read"),
    ("lora.targets=attn_q,mlp", "lora.targets: unknown LoRA target 'mlp'")])
def test_overwrite_checks_the_new_run_before_touching_the_earlier_one(tmp_path, setting, named):
    """`python -m pytrain train --overwrite` with a missing data file, or a target the model
    lacks, deleted the earlier run first ("--overwrite: deleted the earlier run") and then
    failed, leaving the folder empty.  Now the new run is checked whole first: it fails
    naming the problem, and every file of the earlier run is as it was."""
    cfg = write_run(tmp_path)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    before = tree_bytes(out)
    r = cli_train(cfg, "--overwrite", "--set", setting)
    assert r.returncode == 1, r.stdout + r.stderr
    assert named in r.stderr and "--overwrite" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert tree_bytes(out) == before


def test_overwrite_keeps_the_earlier_run_until_the_new_one_has_a_checkpoint(
        tmp_path, capsys, monkeypatch):
    """The earlier run is moved to out/replaced-TIME once the new run is checked, and deleted
    only when the new run has written its first checkpoint: a new run that stops before one
    (here a NaN loss at its first step) leaves the earlier one whole, and says where."""
    from pytrain.step.trainer import NonFiniteLoss, Trainer
    cfg = write_run(tmp_path)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    before = tree_bytes(out)

    def nan_step(self, micro, lr):
        raise NonFiniteLoss("loss is nan")
    monkeypatch.setattr(Trainer, "step", nan_step)
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--overwrite"]) == 1
    said = capsys.readouterr()
    aside = sorted(out.glob("replaced-*"))
    assert len(aside) == 1 and tree_bytes(aside[0]) == before
    assert "stopped at step 1" in said.err and f"kept in {aside[0]}" in said.out, said
    assert steps_of(out) == []
    monkeypatch.undo()
    assert main(["train", str(cfg), "--no-progress", "--overwrite"]) == 0
    said = capsys.readouterr().out
    assert "--overwrite: deleted the earlier run" in said
    assert sorted(out.glob("replaced-*")) == aside          # the failed run's went, not that
    assert steps_of(out) == ["step-0000002", "step-0000004"]


# ------------------------------------------------------------------ every file of a run
PAIR = {"prompt": [{"role": "user", "content": "What does the cow say?"}],
        "chosen": [{"role": "assistant", "content": "The cow says moo."}],
        "rejected": [{"role": "assistant", "content": "The cow says woof."}]}


def write_full_run(folder: Path) -> Path:
    """A DPO run that writes everything a run can: validation and the best adapter, samples,
    TensorBoard events, the PEFT format, the reference log-probabilities' cache."""
    (folder / "pairs.jsonl").write_text((json.dumps(PAIR) + "\n") * 4)
    cfg = folder / "full.toml"
    cfg.write_text(f'[model]\npath = "{MODEL}"\ndevice = "cpu"\nthreads = 1\n'
                   f'[data]\ntrain = "pairs.jsonl"\nvalidation = "pairs.jsonl"\n'
                   f'[lora]\nrank = 4\nalpha = 8.0\n[train]\nobjective = "dpo"\nmax_steps = 2\n'
                   f'batch_size = 2\nlr = 1e-3\neval_every = 1\nsave_every = 1\n'
                   f'sample_every = 1\nsample_max_tokens = 2\n'
                   f'[output]\ndir = "out"\nformats = ["gguf", "peft"]\ntensorboard = true\n')
    return cfg


def top_names(out: Path) -> set[str]:
    return {p.name for p in out.iterdir()} - {".pytrain.lock"}


def test_overwrite_leaves_only_the_new_runs_files(tmp_path, capsys):
    """A full-featured run replaced by a plain one (no validation, samples, TensorBoard, PEFT)
    with --overwrite kept the earlier run's adapter.best.gguf, peft-best/, samples.jsonl,
    TensorBoard events and reference_logps.npz beside the new run's files.  Now every file
    of the earlier run is moved aside with it: the folder holds what the plain run writes into
    an empty folder, and nothing else.  The new run is a separate process, so that nothing
    imported by the first run helps the second know its files."""
    full = write_full_run(tmp_path)
    assert main(["train", str(full), "--no-progress"]) == 0
    out = tmp_path / "out"
    earlier = top_names(out)
    assert {"adapter.best.gguf", "peft-best", "samples.jsonl", "reference_logps.npz"} <= earlier
    assert any(n.startswith("events.out.tfevents.") for n in earlier), earlier
    plain = write_run(tmp_path)                                # output.dir "out" too
    r = cli_train(plain, "--overwrite")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "--overwrite: deleted the earlier run" in r.stdout, r.stdout
    r = cli_train(plain, "--set", f"output.dir={tmp_path / 'fresh'}")
    assert r.returncode == 0, r.stdout + r.stderr
    fresh = tmp_path / "fresh"
    assert top_names(out) == top_names(fresh), sorted(top_names(out) ^ top_names(fresh))
    assert sorted(tree_bytes(out)) == sorted(tree_bytes(fresh))


def test_every_file_a_run_writes_is_known_to_the_folder(tmp_path):
    """What --overwrite moves aside is what the run's modules declare they write
    (folder.run_file): a file a run writes without declaring it would outlive a replaced run.
    A full-featured run writes only declared files."""
    from pytrain.run import folder
    assert main(["train", str(write_full_run(tmp_path)), "--no-progress"]) == 0
    unknown = [n for n in top_names(tmp_path / "out") if not folder.is_run_file(n)]
    assert unknown == [], unknown


def test_a_resume_that_starts_again_from_step_0_sets_the_earlier_files_aside(
        tmp_path, capsys, monkeypatch):
    """A run that stopped before its first checkpoint (a NaN loss at step 3, save_every = 0)
    left samples.jsonl, TensorBoard events and adapter.best.gguf; `--resume` started again
    from step 0 on top of them (samples.jsonl with both attempts' lines, two event files).
    Now they go aside as with --overwrite."""
    from pytrain.step.preference import PreferenceTrainer as Trainer
    from pytrain.step.trainer import NonFiniteLoss
    full = write_full_run(tmp_path)
    full.write_text(full.read_text().replace("save_every = 1", "save_every = 0")
                    .replace("max_steps = 2", "max_steps = 3"))
    real, calls = Trainer.step, []

    def nan_at_3(self, micro, lr):
        calls.append(1)
        if len(calls) == 3:
            raise NonFiniteLoss("loss is nan")
        return real(self, micro, lr)
    monkeypatch.setattr(Trainer, "step", nan_at_3)
    assert main(["train", str(full), "--no-progress"]) == 1
    monkeypatch.undo()
    out = tmp_path / "out"
    assert steps_of(out) == [] and (out / "samples.jsonl").exists()
    capsys.readouterr()
    assert main(["train", str(full), "--no-progress", "--resume"]) == 0
    assert "starting it again from step 0" in capsys.readouterr().out
    steps = [json.loads(x)["step"] for x in (out / "samples.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps.count(0) == steps.count(3), steps
    assert len([n for n in top_names(out) if n.startswith("events.out.tfevents.")]) == 1
    assert list(out.glob("replaced-*")) == []


def test_a_fresh_run_sets_aside_what_a_run_that_never_trained_left(tmp_path, capsys):
    """A run stopped before its first step's record (in the base validation: config.toml,
    data_stats.json, an empty metrics.jsonl, TensorBoard's first events, the reference cache)
    is no earlier run to refuse, but its files are not the new run's either: a fresh run
    moved none of them, and TensorBoard showed two event files.  Now they go aside, and a
    file of the user's in the folder stays."""
    full = write_full_run(tmp_path)
    assert main(["train", str(full), "--no-progress", "--set",
                 f"output.dir={tmp_path / 'a'}"]) == 0
    out = tmp_path / "out"
    out.mkdir()
    for name in top_names(tmp_path / "a"):
        if name.startswith("events.") or name in ("config.toml", "data_stats.json",
                                                   "reference_logps.npz"):
            (out / name).write_bytes((tmp_path / "a" / name).read_bytes())
    (out / "metrics.jsonl").write_text("")
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["train", str(full), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "moved the earlier run" in said and "deleted the earlier run" in said, said
    def but_events(names):
        return {n for n in names if not n.startswith("events.")}
    assert top_names(out) - but_events(top_names(out)) != set()
    assert len(top_names(out) - but_events(top_names(out))) == 1, top_names(out)
    assert but_events(top_names(out)) == but_events(top_names(tmp_path / "a")) | {"notes.txt"}
    assert (out / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------ the LoRA section on resume
@pytest.mark.parametrize("change, named", [
    ("lora.use_rslora=false", "lora.use_rslora: True -> False"),
    ("lora.dropout=0", "lora.dropout: 0.1 -> 0.0")])
def test_resume_refuses_turning_rslora_or_dropout_off(tmp_path, capsys, change, named):
    """rsLoRA and dropout were in the resume check only when on, so turning either off on
    resume was accepted: the scale went from alpha/sqrt(r) to alpha/r without a word (the
    validation loss jumped at lr 1e-12), and training went on without dropout.  Now the
    resolved LoRA settings are compared whole; an unchanged resume goes on."""
    cfg = write_run(tmp_path, max_steps=2)
    cfg.write_text(cfg.read_text().replace("[lora]\n", "[lora]\nuse_rslora = true\n"
                                                       "dropout = 0.1\n"))
    assert main(["train", str(cfg), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume", "--set", "train.max_steps=3",
                 "--set", change]) == 1
    err = capsys.readouterr().err
    assert "cannot resume from" in err and named in err, err
    assert main(["train", str(cfg), "--no-progress", "--resume", "--set",
                 "train.max_steps=3"]) == 0
    assert steps_of(tmp_path / "out")[-1] == "step-0000003"


def test_a_checkpoint_without_the_newer_lora_keys_had_them_at_their_defaults(tmp_path, capsys):
    """A checkpoint saved before the LoRA section was compared whole has no lora.use_rslora
    or lora.dropout in its resume key: it was made with them off, so it resumes with them
    off and is refused with rsLoRA on."""
    cfg = write_run(tmp_path, max_steps=2)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    state = tmp_path / "out" / "checkpoints" / "step-0000002" / "state.json"
    saved = json.loads(state.read_text())
    for k in ("lora.use_rslora", "lora.dropout", "train.objective"):
        saved["resume_key"].pop(k, None)
    state.write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume", "--set", "train.max_steps=3",
                 "--set", "lora.use_rslora=true"]) == 1
    assert "lora.use_rslora: False -> True" in capsys.readouterr().err
    assert main(["train", str(cfg), "--no-progress", "--resume", "--set",
                 "train.max_steps=3"]) == 0
    assert steps_of(tmp_path / "out")[-1] == "step-0000003"
