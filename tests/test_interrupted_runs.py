"""Stopping a run, or any other command, never loses work or says something untrue.

* A Ctrl-C while a run loads its model or tokenizes stops it at once and says nothing was
  trained (it said "stopped at once by a second interrupt; the newest checkpoint is intact").
* A run killed before its first checkpoint leaves a folder that `--resume` starts again from
  step 0, and a fresh run says so (the folder was stuck: refused as an earlier run to resume,
  and `--resume` found no checkpoint).
* SIGTERM during a stretch of skipped steps (no target) stops the run after the step it came in.
* A run started off the main thread (a notebook's worker, a service) trains, without signal
  handling, and says so (it failed in ``signal.signal``).
* A loss plot that cannot be drawn never replaces the error the run stopped with.
* Ctrl-C during `pytrain generate` or `pytrain eval` is one line and exit status 130 (it was a
  KeyboardInterrupt traceback and status -2).

The subprocess tests act at observable states (a line in a marks file, a step in
metrics.jsonl), never after a sleep, so they hold on a loaded machine."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pytrain.cli import main
from pytrain.run import checkpoint as ckpt
from test_train_cli import (MODEL, at_a_terminal, checkpoint_steps, count_step_lines, step_records,
                            subprocess_env, wait_for, write_config, write_data)

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "pytrain" / "assets" / "default-model.gguf"

# runs `python -m pytrain ARGS` after replacing HOLD_AT ("module:attribute" or
# "module:Class.method") with a function that writes "holding" to the marks file (argv[1])
# and then, with HOLD_MODE=wait, waits forever, or with HOLD_MODE=repeat, calls the real one
# over and over: the test signals the process once it is there
WRAPPER = r"""
import faulthandler, importlib, os, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)   # where it is, if it hangs
marks = open(sys.argv[1], "a", buffering=1)
module, _, name = os.environ["HOLD_AT"].partition(":")
owner = importlib.import_module(module)
*path, attr = name.split(".")
for p in path:
    owner = getattr(owner, p)
real = getattr(owner, attr)
def held(*a, **k):
    marks.write("holding\n")
    while True:
        if os.environ["HOLD_MODE"] == "wait":
            time.sleep(0.01)
        else:
            real(*a, **k)
setattr(owner, attr, held)
from pytrain.cli import main
sys.argv = ["pytrain"] + sys.argv[2:]
raise SystemExit(main())
"""


def held_run(tmp_path: Path, hold_at: str, mode: str, *args: str) -> subprocess.CompletedProcess:
    """`pytrain ARGS` held at ``hold_at``, sent SIGINT once it is there."""
    marks = tmp_path / "marks"
    marks.write_text("")
    proc = subprocess.Popen([sys.executable, "-c", WRAPPER, str(marks), *args], cwd=tmp_path,
                            env={**subprocess_env(), "HOLD_AT": hold_at, "HOLD_MODE": mode},
                            preexec_fn=at_a_terminal,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: "holding" in marks.read_text(), proc, 120, f"{hold_at} to be called")
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)        # faulthandler: every thread's stack on stderr
        time.sleep(2)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process went on after SIGINT; its stderr:\n{err[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("hold_at", ["pytrain.run.loop:load_model",
                                     "pytrain.run.loop:load_data"])
def test_ctrl_c_while_a_run_starts_stops_it_and_says_nothing_was_trained(tmp_path, hold_at):
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=2)
    r = held_run(tmp_path, hold_at, "wait", "train", str(cfg), "--no-progress")
    assert r.returncode == 130, r.stderr[-3000:]
    assert r.stderr.splitlines() == ["error: interrupted by SIGINT before training started: "
                                     "nothing was trained, nothing needed saving"], r.stderr
    # the folder is free for a fresh run: nothing of a run was left there
    assert main(["train", str(cfg), "--no-progress"]) == 0


def test_a_run_killed_before_its_first_checkpoint_starts_again_from_step_0(tmp_path, capsys):
    """save_every = 0: a run killed (SIGKILL, or a third Ctrl-C) after 2 steps leaves
    metrics.jsonl and no checkpoint.  A fresh run is refused with one line saying that
    `--resume` starts it again from step 0; `--resume` does, saying so."""
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=500)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "pytrain", "train", str(cfg), "--no-progress"],
                            cwd=tmp_path, env=subprocess_env(), preexec_fn=at_a_terminal,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: count_step_lines(out / "metrics.jsonl") >= 2, proc, 120, "2 step lines")
    proc.kill()
    proc.communicate()
    assert checkpoint_steps(out / "checkpoints") == []
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--set", "train.max_steps=3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped before writing a checkpoint" in err[0], err
    assert "start it again from step 0 with --resume" in err[0], err
    assert main(["train", str(cfg), "--no-progress", "--resume", "--set",
                 "train.max_steps=3"]) == 0
    assert "stopped before writing a checkpoint (metrics.jsonl): starting it again from step 0" \
        in capsys.readouterr().out
    assert [r["step"] for r in step_records(out)] == [1, 2, 3]
    assert checkpoint_steps(out / "checkpoints") == [3]


def test_sigterm_during_skipped_steps_stops_after_the_step_it_came_in(tmp_path, monkeypatch,
                                                                      capsys):
    """Every step skipped (no target: planted), SIGTERM during the third of 32.  The skipped
    steps went past the interrupt check, so the run went through the whole epoch and ended
    with status 0.  Now it stops after that step, with a checkpoint of its position."""
    from pytrain.step.trainer import Trainer
    write_data(tmp_path)                                        # 32 examples: 32 steps
    cfg = write_config(tmp_path, batch_size=1, epochs=1)
    calls = []

    def skipped(self, micro, lr):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return None
    monkeypatch.setattr(Trainer, "step", skipped)
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress"]) == 130
    where = tmp_path / "out" / "checkpoints" / "step-0000000"
    assert f"interrupted by SIGTERM after step 0; checkpoint {where}" in capsys.readouterr().err
    assert len(calls) == 3
    state, _, _ = ckpt.load(where, str(MODEL))
    assert (state.step, state.epoch, state.position) == (0, 0, 3)


def test_a_run_off_the_main_thread_trains_and_says_signals_are_not_handled(tmp_path):
    from pytrain.config import load_config
    from pytrain.run.loop import train
    write_data(tmp_path)
    cfg = load_config(write_config(tmp_path, max_steps=2), [])
    said, results, errors = [], [], []
    before = signal.getsignal(signal.SIGINT)

    def work():
        try:
            results.append(train(cfg, progress=False, log=said.append))
        except BaseException as e:        # noqa: BLE001 - reported by the assertion below
            errors.append(e)
    t = threading.Thread(target=work)
    t.start()
    t.join(600)
    assert not t.is_alive() and not errors, errors
    assert results[0].steps == 2 and checkpoint_steps(tmp_path / "out" / "checkpoints") == [2]
    assert any("not on the main thread, so it does not handle Ctrl-C or SIGTERM" in m
               for m in said), said
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("stop", ["nan", "sigint"])
def test_a_loss_plot_that_fails_never_replaces_the_error(tmp_path, monkeypatch, capsys, stop):
    """loss.png cannot be written (a full disk, planted) while the run stops for a NaN loss
    or a Ctrl-C at step 2: the plot was drawn on the error path, and its OSError replaced
    the real error ("error: [Errno 28] No space left on device", status 1).  Now the real
    error is the one reported, and the plot a warning."""
    from pytrain.run import log as run_log
    from pytrain.step.trainer import NonFiniteLoss, Trainer
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=5)

    def no_space(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(run_log, "plot_losses", no_space)
    real, calls = Trainer.step, []

    def step(self, micro, lr):
        calls.append(1)
        if len(calls) == 2:
            if stop == "nan":
                raise NonFiniteLoss("loss is nan")
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, micro, lr)
    monkeypatch.setattr(Trainer, "step", step)
    capsys.readouterr()
    rc = main(["train", str(cfg), "--no-progress"])
    said = capsys.readouterr()
    if stop == "nan":
        assert rc == 1 and "error: stopped at step 2: loss is nan; kept the adapter from step 1" \
            in said.err, said.err
    else:
        assert rc == 130 and "error: interrupted by SIGINT after step 2; checkpoint" in said.err, \
            said.err
    assert "loss.png not drawn: [Errno 28] No space left on device" in said.out, said.out


@pytest.mark.parametrize("command, hold_at", [
    ("generate", "pytrain.models.model:Model.generate"),
    ("eval", "pytrain.data:load_data")])
def test_ctrl_c_during_generate_or_eval_is_one_line_and_status_130(tmp_path, command, hold_at):
    if command == "generate":
        args = ["generate", str(DEMO), "--prompt", "What does the cow say?", "--device", "cpu",
                "--threads", "1"]
    else:
        write_data(tmp_path)
        args = ["eval", str(write_config(tmp_path))]
    r = held_run(tmp_path, hold_at, "repeat", *args)
    assert r.returncode == 130, (r.returncode, r.stderr[-3000:])
    assert r.stderr.splitlines() == [f"error: pytrain {command} interrupted"], r.stderr[-3000:]


def test_sigterm_during_the_last_step_ends_the_run_as_finished(tmp_path, monkeypatch, capsys):
    """SIGTERM during the last of 3 steps: the step finished, and with it the run, yet it
    said "interrupted by SIGTERM after step 3 ... (resume with --resume)" with status 130,
    beside a written adapter and plot.  Now it ends as finished: status 0, the normal
    report, a line saying the signal came at the end; the final validation (which a signal
    asks not to wait for) is skipped and the last checkpoint written."""
    from pytrain.step.trainer import Trainer
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=3, eval_every=1)
    real, calls = Trainer.step, []

    def step(self, micro, lr):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, micro, lr)
    monkeypatch.setattr(Trainer, "step", step)
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress"]) == 0
    said = capsys.readouterr()
    assert "interrupted" not in said.err + said.out and "resume with" not in said.err, said
    assert "SIGTERM came during the last step: the run is complete at step 3" in said.out, \
        said.out
    assert "adapter:" in said.out and "plot:" in said.out
    out = tmp_path / "out"
    assert checkpoint_steps(out / "checkpoints") == [3]
    assert [r["step"] for r in step_records(out)] == [1, 2, 3]
    assert ckpt.load(out / "checkpoints" / "step-0000003", str(MODEL))[0].step == 3


# ------------------------------------------------------------------ a full disk
@pytest.mark.parametrize("target", ["adapter", "checkpoint"])
def test_a_full_disk_names_the_file_the_run_and_what_was_kept(tmp_path, monkeypatch, capsys,
                                                             target):
    """The disk fills at step 4's save (save_every 2): the write of the run's adapter.gguf,
    or of the checkpoint's own adapter, fails with ENOSPC (planted in the atomic writes).
    The run said "error: [Errno 28] No space left on device": neither the file nor the run,
    nor what was kept.  Now the one line names the file, the run folder, the last complete
    checkpoint (step 2, intact: it resumes) and which step adapter.gguf holds."""
    import errno
    from pytrain.formats import atomic
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=6, save_every=2)
    out = tmp_path / "out"
    real, seen = atomic.new_temp_file, []

    def full_disk(p):
        ours = p.name == "adapter.gguf" and \
            (p.parent == out if target == "adapter" else p.parent.name.startswith(".tmp-"))
        if ours:
            seen.append(p)
            if len(seen) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(p)
    monkeypatch.setattr(atomic, "new_temp_file", full_disk)
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    monkeypatch.undo()
    assert len(err) == 1, err
    failed = out / "adapter.gguf" if target == "adapter" else \
        out / "checkpoints" / "step-0000004" / "adapter.gguf"
    kept = out / "checkpoints" / "step-0000002"
    assert f"could not write {failed}: No space left on device" in err[0], err
    assert f"(run folder {out}). The run trained to step 4" in err[0], err
    assert f"the last complete checkpoint is {kept} (step 2)" in err[0], err
    holds = 2 if target == "adapter" else 4
    assert f"{out / 'adapter.gguf'} holds step {holds}" in err[0], err
    assert checkpoint_steps(out / "checkpoints") == [2]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert main(["train", str(cfg), "--no-progress", "--resume"]) == 0
    assert f"resuming from {kept} at step 2" in capsys.readouterr().out
    assert checkpoint_steps(out / "checkpoints") == [2, 4, 6]
    assert [r["step"] for r in step_records(out)] == [1, 2, 3, 4, 5, 6]


def test_a_write_past_the_file_size_limit_is_reported_the_same_way(tmp_path, capsys):
    """A real failing write, in a process whose file size limit (ulimit -f) is below the
    adapter's size: resuming a run saved at step 2 fails at its first adapter write (the
    best validation's, restored from the checkpoint; EFBIG, which numpy reports as "1024
    requested and 0 written"), and says which file, which run and what was kept; the step 2
    checkpoint stays whole."""
    import resource
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=2, save_every=2)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    limit = (out / "adapter.gguf").stat().st_size // 2
    assert (out / "config.toml").stat().st_size < limit

    def small_files():
        at_a_terminal()
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    r = subprocess.run([sys.executable, "-m", "pytrain", "train", str(cfg), "--no-progress",
                        "--resume", "--set", "train.max_steps=3"], cwd=tmp_path,
                       env=subprocess_env(), preexec_fn=small_files, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and \
        f"could not write {out / 'adapter.best.gguf'}: File too large" in err[0], r.stderr
    kept = out / "checkpoints" / "step-0000002"
    assert f"the last complete checkpoint is {kept} (step 2)" in err[0], err
    assert checkpoint_steps(out / "checkpoints") == [2]
    assert main(["train", str(cfg), "--no-progress", "--resume", "--set",
                 "train.max_steps=3"]) == 0
    assert checkpoint_steps(out / "checkpoints") == [2, 3]
