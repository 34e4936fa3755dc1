"""`pytrain train` end to end for what docs/training.md promises about a run and docs/runs.md about "runs that lose
nothing": SIGTERM and a second Ctrl-C on a real subprocess, checkpoint pruning
(output.keep_checkpoints), gradient accumulation, packing and data.on_error = "skip".

All runs use the converter-made gqa fixture on the CPU with a small chat dataset; each takes a
second or two."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pytrain.run import checkpoint as ckpt
from pytrain.formats.adapter_gguf import read_lora_gguf
from pytrain.cli import main

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "fixtures" / "qwen35" / "gqa-f32.gguf"
ANIMALS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"),
           ("pig", "oink"), ("owl", "hoot"), ("frog", "ribbit")]

pytestmark = pytest.mark.slow   # whole `pytrain train` runs: tens of seconds


# ------------------------------------------------------------------------------- helpers
def chat(animal: str, sound: str) -> dict:
    return {"messages": [{"role": "user", "content": f"What does the {animal} say?"},
                         {"role": "assistant", "content": f"The {animal} says {sound}."}]}


def write_jsonl(path: Path, recs) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return path


def write_data(folder: Path, copies: int = 4) -> None:
    """train.jsonl: the 8 animals ``copies`` times (examples of a few different lengths);
    valid.jsonl: each animal once."""
    write_jsonl(folder / "train.jsonl", [chat(a, s) for a, s in ANIMALS * copies])
    write_jsonl(folder / "valid.jsonl", [chat(a, s) for a, s in ANIMALS])


def toml_table(values: dict) -> str:
    return "\n".join(f"{k} = {json.dumps(v)}" for k, v in values.items())


def write_config(folder: Path, name: str = "run.toml", *, data=None, output=None, threads=1,
                 **train) -> Path:
    """A config in ``folder`` (data paths relative to it), output.dir ``folder/out`` unless
    ``output`` says otherwise."""
    t = {"batch_size": 8, "lr": 5e-3, "schedule": "constant", "eval_every": 0, **train}
    d = {"train": "train.jsonl", "validation": "valid.jsonl", **(data or {})}
    o = {"dir": "out", "formats": ["gguf"], **(output or {})}
    cfg = folder / name
    cfg.write_text(f'[model]\npath = "{MODEL}"\ndevice = "cpu"\nthreads = {threads}\n'
                   f'[data]\n{toml_table(d)}\n[lora]\nrank = 8\nalpha = 16.0\n'
                   f'[train]\n{toml_table(t)}\n[output]\n{toml_table(o)}\n')
    return cfg


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def step_records(out: Path) -> list[dict]:
    return [r for r in records(out) if "loss" in r and r.get("split") != "valid"]


def valid_records(out: Path) -> list[dict]:
    return [r for r in records(out) if r.get("split") == "valid"]


def data_stats(out: Path) -> dict:
    return json.loads((out / "data_stats.json").read_text())


def adapter_of(path: Path) -> dict:
    return read_lora_gguf(path)[2]


def assert_same_adapter(a: dict, b: dict, atol=1e-6, rtol=1e-4) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=rtol, err_msg=k)


def count_step_lines(metrics: Path) -> int:
    """Complete per-step lines of a metrics.jsonl another process is writing."""
    if not metrics.exists():
        return 0
    n = 0
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:      # a line being written
            continue
        n += "loss" in r and r.get("split") != "valid"
    return n


def at_a_terminal() -> None:
    """``preexec_fn`` for a process a test sends SIGINT: SIGINT at its default, as under a
    terminal's Ctrl-C.  A test run started in the background of a non-interactive shell
    (``cmd &``, nohup) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
    handler: `pytrain generate` went on after the test's SIGINT (pytrain train installs its
    own handler, so only the commands relying on Python's own failed)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(cond, proc: subprocess.Popen, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (status {proc.returncode}) before {what}:\n{err[-3000:]}")
        if time.monotonic() > end:
            proc.kill()
            proc.communicate()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)


def checkpoint_steps(folder: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*"))


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# ------------------------------------------------------------------------------- signals
def test_sigterm_finishes_the_step_checkpoints_exits_130_and_resume_continues(tmp_path, capsys):
    """`python -m pytrain train` gets SIGTERM once a step line is in metrics.jsonl (so the
    signal lands during training, never during start-up): the step in flight completes, a
    checkpoint of exactly that step is written, the exit status is 130 and stderr names
    SIGTERM; `--resume` then continues from that checkpoint to the last step, and its first
    step equals the same step of a run that was never interrupted."""
    write_data(tmp_path)
    total = 20          # 0.5-1 s of steps: the signal lands long before the run could end
    cfg = write_config(tmp_path, max_steps=total, threads=1)
    out = tmp_path / "out"
    metrics = out / "metrics.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "pytrain", "train", str(cfg), "--no-progress"],
                            cwd=tmp_path, env=subprocess_env(), preexec_fn=at_a_terminal,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: count_step_lines(metrics) >= 1, proc, 120, "the first step line")
    before = count_step_lines(metrics)
    proc.send_signal(signal.SIGTERM)
    after = count_step_lines(metrics)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    done = count_step_lines(metrics)
    # the step in flight when the signal came was finished, and no other one was started
    assert before <= done <= after + 1 and done < total, (before, after, done)
    assert f"interrupted by SIGTERM after step {done}" in err, err
    ckdir = out / "checkpoints"
    assert checkpoint_steps(ckdir) == [done]     # save_every = 0: only the interruption's
    where = ckpt.latest(ckdir)
    assert where == ckdir / f"step-{done:07d}" and str(where) in err
    state, tensors, moments = ckpt.load(where, str(MODEL))
    assert state.step == done and state.adam_t == done and moments
    assert_same_adapter(tensors, adapter_of(out / "adapter.gguf"), atol=0, rtol=0)
    assert not list(ckdir.glob(".tmp-*"))

    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume"]) == 0
    assert f"resuming from {where} at step {done}" in capsys.readouterr().out
    steps = step_records(out)
    assert [r["step"] for r in steps] == list(range(1, total + 1))
    assert ckpt.latest(ckdir) == ckdir / f"step-{total:07d}"
    # the first resumed step is step done+1 of an uninterrupted run (constant lr: the schedule
    # does not depend on the run's length): same data, same optimizer state, the same float32
    # operations in the same order, so equal bit for bit (test_train_run's
    # assert_resumed_equals_straight says why)
    straight = write_config(tmp_path, "straight.toml", max_steps=done + 1, threads=1,
                            output={"dir": "straight"})
    assert main(["train", str(straight), "--no-progress"]) == 0
    ref = step_records(tmp_path / "straight")
    for a, b in zip(ref, steps[:done + 1]):
        assert a["step"] == b["step"] and a["n_valid"] == b["n_valid"] and a["tokens"] == b["tokens"]
        assert b["loss"] == a["loss"], (a, b)
        assert b["grad_norm"] == a["grad_norm"], (a, b)


# The second-Ctrl-C test steers the run inside a step: this wrapper runs the `pytrain` command
# exactly as `python -m pytrain` does, after making every micro-batch's forward + backward
# (GradGraph.accumulate) append its number to MARKS when it returns, and, at the numbers in
# PAUSE, write "paused N" and wait for the test to create GO-N: the test acts at known points
# of the run, never racing it.
WRAPPER = r"""
import os, sys, time
from pytrain.step import graphs as grad_graph
marks = open(sys.argv[1], "a", buffering=1)
pause = {int(n) for n in os.environ["PAUSE"].split(",")}
real = grad_graph.GradGraph.accumulate
count = [0]
def accumulate(self, *a, **k):
    r = real(self, *a, **k)
    count[0] += 1
    marks.write(f"{count[0]}\n")
    if count[0] in pause:
        marks.write(f"paused {count[0]}\n")
        go = os.path.join(os.path.dirname(sys.argv[1]), f"go-{count[0]}")
        while not os.path.exists(go):
            time.sleep(0.01)
    return r
grad_graph.GradGraph.accumulate = accumulate
from pytrain.cli import main
sys.argv = ["pytrain"] + sys.argv[2:]
raise SystemExit(main())
"""


@pytest.mark.parametrize("save_every", [0, 2])
def test_second_ctrl_c_drops_the_step_in_flight_and_saves_the_finished_ones(tmp_path, capsys,
                                                                             save_every):
    """A subprocess run (100 steps of 8 micro-batches) gets its first SIGINT while paused
    after micro-batch 26 (step 3 done, step 4 two micro-batches in), which the handler records
    as soon as the run goes on; the second while paused after micro-batch 29, still inside
    step 4.  The run must stop there, dropping step 4 (no step line 4, no further micro-batch),
    and still write the checkpoint of step 3, exit status 130, saying so.  With save_every = 0
    (the default) it lost every step: it exited with no checkpoint at all, saying "the newest
    checkpoint in checkpoints/ is intact", and the folder could then be neither resumed nor
    started again.  Were the second signal ignored, the run would finish step 4 and write
    step-0000004.  `--resume` then continues from step 3 and ends, bit for bit, with the
    adapter of a straight run (test_train_run's assert_resumed_equals_straight says why).
    (A second signal during a graph compute: test_interrupt.py.)"""
    texts = [{"text": "Tom went to the farm and the cow said moo. " * 8}] * 16   # equal lengths
    write_jsonl(tmp_path / "train.jsonl", texts)
    write_jsonl(tmp_path / "valid.jsonl", texts[:1])
    ga, total = 8, 100
    cfg = write_config(tmp_path, max_steps=total, batch_size=1, grad_accum=ga,
                       save_every=save_every, threads=1)
    out = tmp_path / "out"
    metrics, marks, ckdir = out / "metrics.jsonl", tmp_path / "marks", out / "checkpoints"
    marks.touch()
    first, second = 3 * ga + 2, 3 * ga + 5
    proc = subprocess.Popen([sys.executable, "-c", WRAPPER, str(marks), "train", str(cfg),
                             "--no-progress"], cwd=tmp_path,
                            env={**subprocess_env(), "PAUSE": f"{first},{second}"},
                            preexec_fn=at_a_terminal,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def paused_at(n):
        return f"paused {n}" in marks.read_text()
    wait_for(lambda: paused_at(first), proc, 120, f"micro-batch {first}")
    assert count_step_lines(metrics) == 3
    assert checkpoint_steps(ckdir) == ([2] if save_every else [])
    proc.send_signal(signal.SIGINT)
    (tmp_path / f"go-{first}").touch()
    wait_for(lambda: paused_at(second), proc, 60, f"micro-batch {second}")
    assert count_step_lines(metrics) == 3                 # still inside step 4
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the run went on after the second SIGINT")
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "interrupted by SIGINT after step" not in err, err[-2000:]
    assert (f"stopped at once by a second interrupt (SIGINT) after step 3: the step in flight "
            f"was dropped; checkpoint {ckdir / 'step-0000003'}") in err, err[-2000:]
    assert "intact" not in err and "Traceback" not in err, err[-2000:]
    assert count_step_lines(metrics) == 3               # step 4 was never finished
    assert marks.read_text().split()[-1] == str(second)  # nor another micro-batch run
    assert checkpoint_steps(ckdir) == ([2, 3] if save_every else [3])
    assert not list(ckdir.glob(".tmp-*"))
    where = ckpt.latest(ckdir)
    assert where == ckdir / "step-0000003"
    state, tensors, moments = ckpt.load(where, str(MODEL))
    assert state.step == 3 and state.adam_t == 3 and (state.epoch, state.position) == (1, 1)
    assert_same_adapter(tensors, adapter_of(out / "adapter.gguf"), atol=0, rtol=0)

    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--resume", "--set",
                 "train.max_steps=5"]) == 0
    assert f"resuming from {where} at step 3" in capsys.readouterr().out
    assert [r["step"] for r in step_records(out)] == [1, 2, 3, 4, 5]
    straight = write_config(tmp_path, "straight.toml", max_steps=5, batch_size=1, grad_accum=ga,
                            threads=1, output={"dir": "straight"})
    assert main(["train", str(straight), "--no-progress"]) == 0
    assert_same_adapter(adapter_of(out / "adapter.gguf"),
                        adapter_of(tmp_path / "straight" / "adapter.gguf"), atol=0, rtol=0)


# ------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("keep, kept", [(2, [4, 5]), (0, [1, 2, 3, 4, 5]), (None, [3, 4, 5])])
def test_keep_checkpoints_prunes_to_the_newest(tmp_path, keep, kept):
    """save_every = 1, max_steps = 5: output.keep_checkpoints = 2 leaves step 4 and 5; 0 means
    "keep all" (config help: "periodic checkpoints kept (0: keep all)"); unset, the default 3.
    Every kept checkpoint loads and records its own step."""
    from pytrain.config import OutputConfig
    if keep is None:
        assert OutputConfig().keep_checkpoints == 3
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=5, save_every=1,
                       output={} if keep is None else {"keep_checkpoints": keep})
    assert main(["train", str(cfg), "--no-progress"]) == 0
    ckdir = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in ckdir.iterdir()) == [f"step-{s:07d}" for s in kept]
    for s in kept:
        state, tensors, moments = ckpt.load(ckdir / f"step-{s:07d}", str(MODEL))
        assert state.step == s and state.adam_t == s and tensors and moments
    assert ckpt.latest(ckdir) == ckdir / "step-0000005"
    # the newest checkpoint holds the run's final adapter
    _, tensors, _ = ckpt.load(ckpt.latest(ckdir), str(MODEL))
    assert_same_adapter(tensors, adapter_of(tmp_path / "out" / "adapter.gguf"), atol=0, rtol=0)


def test_the_final_checkpoint_resumes_where_the_run_stopped(tmp_path, capsys):
    """4 steps per epoch; a 5-step run ends one step into epoch 1.  Its final checkpoint must
    point at step 2 of epoch 1, so a longer run resumed from it (constant lr, no warmup: the
    schedule does not depend on the length) equals a straight 10-step run bit for bit (the same
    float32 operations in the same order: test_train_run's assert_resumed_equals_straight).
    (Until a64fb50 the
    end-of-run checkpoint was written after the loop's `epoch += 1` as (epoch + 1, 0),
    overwriting step-5's correct position, and the resumed run skipped 3 batches.)"""
    write_data(tmp_path)
    cfg = write_config(tmp_path, max_steps=5)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    state, _, _ = ckpt.load(ckpt.latest(tmp_path / "out" / "checkpoints"), str(MODEL))
    assert (state.step, state.epoch, state.position) == (5, 1, 1)
    assert main(["train", str(cfg), "--no-progress", "--resume",
                 "--set", "train.max_steps=10"]) == 0
    straight = write_config(tmp_path, "straight.toml", max_steps=10, output={"dir": "straight"})
    assert main(["train", str(straight), "--no-progress"]) == 0
    a, b = step_records(tmp_path / "out"), step_records(tmp_path / "straight")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 11))
    assert [r["n_valid"] for r in a] == [r["n_valid"] for r in b]
    assert_same_adapter(adapter_of(tmp_path / "out" / "adapter.gguf"),
                        adapter_of(tmp_path / "straight" / "adapter.gguf"), atol=0, rtol=0)


# ------------------------------------------------------------------------------- batching
def expected_steps(folder: Path, cfg_path: Path, epochs: int):
    """Per optimizer step, (n_valid, tokens) the data implies: the run's batches (make_batches
    with seed train.seed + epoch) in consecutive groups of grad_accum micro-batches."""
    from pytrain.config import load_config
    from pytrain.data import load_data, make_batches, pad_token_id
    from pytrain.data.tokenizer import Tokenizer
    from pytrain.formats.gguf_meta import read_metadata
    cfg = load_config(cfg_path)
    tok = Tokenizer.from_metadata(read_metadata(MODEL))
    train = load_data(cfg.data, tok).train
    t = cfg.train
    out = []
    for epoch in range(epochs):
        b = make_batches(train, t.batch_size, cfg.data.packing, t.seed + epoch,
                         max_seq_len=cfg.data.max_seq_len, pad_id=pad_token_id(tok))
        for i in range(0, len(b), t.grad_accum):
            group = b[i:i + t.grad_accum]
            out.append((epoch, sum(x.n_targets for x in group), sum(x.n_tokens for x in group)))
    return out


def test_grad_accum_steps_and_n_valid_follow_the_data(tmp_path):
    """32 examples, batch_size 4 -> 8 micro-batches per epoch; grad_accum 3 -> steps of 3, 3
    and 2 micro-batches: 3 optimizer steps per epoch, 6 for 2 epochs.  Each step's n_valid
    (and real tokens) is the sum over its micro-batches; an epoch's n_valid adds up to the
    training set's target tokens in data_stats.json."""
    write_data(tmp_path)
    cfg = write_config(tmp_path, epochs=2, batch_size=4, grad_accum=3)
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    steps = step_records(out)
    assert [(r["step"], r["epoch"]) for r in steps] == [(s, (s - 1) // 3) for s in range(1, 7)]
    expected = expected_steps(tmp_path, cfg, 2)
    assert [(r["epoch"], r["n_valid"], r["tokens"]) for r in steps] == expected
    stats = data_stats(out)["train"]
    for epoch in (0, 1):
        assert sum(r["n_valid"] for r in steps if r["epoch"] == epoch) == stats["target_tokens"] == 320
        assert sum(r["tokens"] for r in steps if r["epoch"] == epoch) == stats["tokens"]
    # the last step of an epoch holds 2 micro-batches, the others 3
    for e in (0, 1):
        assert steps[3 * e + 2]["tokens"] < min(steps[3 * e]["tokens"], steps[3 * e + 1]["tokens"])


def accumulation_runs(tmp_path, monkeypatch, drop_micro_batch: bool = False) -> dict:
    """16 examples, 3 epochs: batch_size 8 x grad_accum 2 ("acc") and batch_size 16 x
    grad_accum 1 ("one") put every example in the one step of each epoch; "one" again with
    its rows in another order (another ``data.shuffle_seed`` orders equal-length examples
    differently) and the BLAS backend off ("calib": the same computation with its float32
    sums over rows regrouped and its matmuls rounded by ggml-cpu's kernels instead of
    OpenBLAS's, as another batch shape or another CPU would round it).  ``drop_micro_batch``: a planted fault,
    the accumulation never adds its second micro-batch (its targets still counted)."""
    from pytrain.config import load_config
    from pytrain.data import load_data, make_batches
    from pytrain.data.tokenizer import Tokenizer
    from pytrain.formats.gguf_meta import read_metadata
    from pytrain.step.trainer import Trainer
    write_data(tmp_path, copies=2)
    cfgs = {"acc": write_config(tmp_path, "acc.toml", epochs=3, batch_size=8, grad_accum=2,
                                output={"dir": "acc"}),
            "one": write_config(tmp_path, "one.toml", epochs=3, batch_size=16, grad_accum=1,
                                output={"dir": "one"})}
    c = load_config(cfgs["acc"])
    tok = Tokenizer.from_metadata(read_metadata(MODEL))
    halves = make_batches(load_data(c.data, tok).train, 8, seed=0)
    assert len(halves) == 2 and halves[0].n_targets != halves[1].n_targets
    if drop_micro_batch:
        real_graph = Trainer.graph

        def graph(self, *a):
            g = real_graph(self, *a)
            skip = self.__dict__.setdefault("_planted", {"n": 0})
            skip["n"] += 1
            if skip["n"] % 2 == 0:                       # every second micro-batch
                return type("Dropped", (), {"accumulate": lambda *_a, **_k: (0.0, 0)})()
            return g
        monkeypatch.setattr(Trainer, "graph", graph)
    assert main(["train", str(cfgs["acc"]), "--no-progress"]) == 0
    monkeypatch.undo()
    assert main(["train", str(cfgs["one"]), "--no-progress"]) == 0
    monkeypatch.setenv("PYTRAIN_BLAS", "0")
    assert main(["train", str(cfgs["one"]), "--no-progress", "--set", "data.shuffle_seed=1",
                 "--set", f"output.dir={tmp_path / 'calib'}"]) == 0
    monkeypatch.delenv("PYTRAIN_BLAS")
    return {k: (step_records(tmp_path / k), valid_records(tmp_path / k),
                adapter_of(tmp_path / k / "adapter.gguf")) for k in ("acc", "one", "calib")}


def assert_accumulation_equals_one_batch(runs: dict) -> None:
    """Both runs are the same computation up to float32 rounding (the loss is the token mean
    over the whole optimizer step, so the two micro-batches, which hold different numbers of
    targets, add up to the one batch; a mean of per-micro-batch means would not):

    * counts (n_valid, tokens) exactly;
    * every step's loss and gradient norm, and the validation loss, within
      ``bounds.f32_bound`` of the rounding measured on the same run: "one" against "calib";
      from step 2 on both pairs also carry AdamW's amplification of step 1's rounding, alike;
    * the adapter after the 3 AdamW steps within AdamW's own bound, and in rms within the
      spread of "calib" (``bounds.assert_adamw_close``)."""
    from bounds import assert_adamw_close, f32_bound
    (a, va, ad_a), (b, vb, ad_b), (c, vc, ad_c) = runs["acc"], runs["one"], runs["calib"]
    assert len(a) == len(b) == len(c) == 3
    for x, y, z in zip(a, b, c):
        assert x["n_valid"] == y["n_valid"] == 160 and x["tokens"] == y["tokens"]
        for key in ("loss", "grad_norm"):
            assert abs(x[key] - y[key]) <= f32_bound(abs(y[key] - z[key]), y[key]), (key, x, y, z)
    assert abs(va[-1]["loss"] - vb[-1]["loss"]) <= f32_bound(abs(vb[-1]["loss"] - vc[-1]["loss"]),
                                                             vb[-1]["loss"])
    assert_adamw_close(ad_a, ad_b, lrs=[5e-3] * 3, calib=ad_c)


def test_grad_accum_equals_one_batch_of_the_same_examples(tmp_path, monkeypatch):
    runs = accumulation_runs(tmp_path, monkeypatch)
    assert_accumulation_equals_one_batch(runs)
    valid = runs["acc"][1]
    assert valid[-1]["loss"] < valid[0]["loss"] - 0.3           # it did train


def test_accumulation_comparison_catches_a_dropped_micro_batch(tmp_path, monkeypatch):
    runs = accumulation_runs(tmp_path, monkeypatch, drop_micro_batch=True)
    assert [r["n_valid"] for r in runs["acc"][0]] == [160] * 3   # the counts do not show it
    with pytest.raises(AssertionError):
        assert_accumulation_equals_one_batch(runs)


def test_packing_fewer_rows_same_targets_lower_validation_loss(tmp_path):
    """data.packing with max_seq_len 256 and batch_size 1 (one row per step, so the steps of
    an epoch count its rows): the 32 examples (~44 tokens) go into ceil(1392/256) = 6 to 8
    rows instead of 32, each row at most 256 tokens and holding several samples, no padding;
    an epoch's n_valid equals the unpacked run's; the base model's validation loss is the same
    packed as unpacked (samples isolated from each other in a row), and training lowers it."""
    write_data(tmp_path)
    packed = write_config(tmp_path, "packed.toml", epochs=2, batch_size=1, eval_every=7,
                          data={"packing": True, "max_seq_len": 256}, output={"dir": "packed"})
    plain = write_config(tmp_path, "plain.toml", epochs=1, batch_size=4, lr=1e-9,
                         data={"max_seq_len": 256}, output={"dir": "plain"})
    assert main(["train", str(packed), "--no-progress"]) == 0
    assert main(["train", str(plain), "--no-progress"]) == 0
    p, u = step_records(tmp_path / "packed"), step_records(tmp_path / "plain")
    ps, us = data_stats(tmp_path / "packed")["train"], data_stats(tmp_path / "plain")["train"]
    assert ps["examples"] == us["examples"] == 32 and ps["tokens"] == us["tokens"] == 1392
    rows = [r for r in p if r["epoch"] == 0]
    assert 6 <= len(rows) <= 8 and len(u) == 32 // 4, (len(rows), len(u))
    assert all(r["tokens"] <= 256 for r in p)
    assert all(r["tokens"] >= 3 * 41 for r in rows[:-1])      # several samples per row
    # batching stats: a one-row batch has no padding; the plain run's is recorded as well
    assert ps["padding_share"] == 0.0 and us["padding_share"] is not None
    for epoch in (0, 1):
        assert sum(r["n_valid"] for r in p if r["epoch"] == epoch) == 320
    assert sum(r["n_valid"] for r in u) == 320 == us["target_tokens"]
    pv, uv = valid_records(tmp_path / "packed"), valid_records(tmp_path / "plain")
    assert pv[0]["step"] == uv[0]["step"] == 0 and pv[0]["n_valid"] == uv[0]["n_valid"] == 80
    np.testing.assert_allclose(pv[0]["loss"], uv[0]["loss"], rtol=1e-5)
    np.testing.assert_allclose(pv[0]["accuracy"], uv[0]["accuracy"])
    assert [r["step"] for r in pv] == [0, 7, len(p)]
    assert pv[1]["loss"] < pv[0]["loss"] - 0.5 and pv[-1]["loss"] < pv[1]["loss"], pv


# ------------------------------------------------------------------------------- bad data
def bad_training_file(folder: Path) -> Path:
    """The 32 animal chats with three bad records: line 3 malformed JSON, line 7 an object
    that is no known record shape, line 12 "messages" that is not a list."""
    recs = [json.dumps(chat(a, s)) for a, s in ANIMALS * 4]
    recs.insert(2, '{"messages": [{"role": "user", "content": "cut off')
    recs.insert(6, json.dumps({"question": "What does the cow say?", "answer": "moo"}))
    recs.insert(11, json.dumps({"messages": "What does the cow say?"}))
    path = write_jsonl(folder / "train.jsonl", recs)
    write_jsonl(folder / "valid.jsonl", [chat(a, s) for a, s in ANIMALS])
    return path


def test_on_error_skip_trains_and_counts_the_bad_lines(tmp_path):
    bad_training_file(tmp_path)
    cfg = write_config(tmp_path, epochs=1, data={"on_error": "skip"})
    assert main(["train", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "out"
    stats = data_stats(out)["train"]
    assert stats["records"] == 35 and stats["examples"] == 32
    assert stats["skipped"] == {"malformed_json": 1, "unrecognised_record": 1, "bad_field": 1}
    steps = step_records(out)
    assert len(steps) == 4 and sum(r["n_valid"] for r in steps) == stats["target_tokens"] == 320
    assert (out / "adapter.gguf").exists()


def test_on_error_stop_is_the_default_and_names_file_and_line(tmp_path, capsys):
    path = bad_training_file(tmp_path)
    cfg = write_config(tmp_path, epochs=1)
    assert main(["train", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}:3:" in err[0] and "malformed JSON" in err[0], err
    assert not (tmp_path / "out" / "adapter.gguf").exists()
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
