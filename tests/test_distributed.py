"""Data-parallel training over MPI (pytrain/step/distributed.py): `mpiexec -n N pytrain train`
is one process with ``grad_accum x N`` micro-batches per step.

Runs MPICH's mpiexec from the environment (the ``mpi`` extra, which `make build` installs) on
the embedded model, one thread per rank.  Where the two sides sum the same gradients in the
same order (two ranks against two micro-batches: a + b = b + a in floating point) the runs
are equal bit for bit; where the order differs (four micro-batches as (a + b) + (c + d)
against ((a + b) + c) + d) by the rounding of that regrouping, and the adapter by AdamW's
own bound (tests/bounds.py)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bounds import U32, assert_adamw_close
from pytrain.formats.adapter_gguf import read_lora_gguf

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "pytrain" / "assets" / "default-model.gguf"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
ANIMALS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"),
           ("pig", "oink"), ("owl", "hoot"), ("frog", "ribbit")]

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no {MPIEXEC}: run `make build` "
                                "(it installs the mpi extra: mpi4py and MPICH)")
pytestmark = [pytestmark, pytest.mark.slow]   # mpiexec training runs: tens of seconds

# Runs `pytrain` as `python -m pytrain` does, after the changes a test asks for by env:
# FAIL_AT="rank:step:how" makes that rank raise (how = raise) or SIGKILL itself (kill) when
# it starts that step, after writing the time to FAIL_STAMP; MASK_AT="rank:step:index" masks
# every target of that rank's index-th micro-batch of that step; RANK_DATA="rank:file" gives
# that rank another training file.
WRAPPER = r"""
import dataclasses, os, signal, sys, time
import numpy as np
from pytrain.step import distributed, trainer as tr_mod
from pytrain import config as config_mod
w = distributed.world()
real_step, calls = tr_mod.Trainer.step, [0]
def step(self, micro, lr):
    calls[0] += 1
    fail, mask = os.environ.get("FAIL_AT"), os.environ.get("MASK_AT")
    if fail:
        rank, at, how = fail.split(":")
        if w.rank == int(rank) and calls[0] == int(at):
            with open(os.environ["FAIL_STAMP"], "w") as f:
                f.write(repr(time.time()))
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"planted failure at step {at}")
    if mask:
        rank, at, i = map(int, mask.split(":"))
        if w.rank == rank and calls[0] == at:
            micro = list(micro)
            micro[i] = dataclasses.replace(micro[i], train_mask=np.zeros_like(micro[i].train_mask))
    return real_step(self, micro, lr)
tr_mod.Trainer.step = step
other = os.environ.get("RANK_DATA")
if other and w.rank == int(other.split(":")[0]):
    real_load = config_mod.load_config
    def load_config(*a, **k):
        cfg = real_load(*a, **k)
        cfg.data.train = other.split(":", 1)[1]
        return cfg
    config_mod.load_config = load_config
from pytrain.cli import main
sys.argv = ["pytrain"] + sys.argv[1:]
raise SystemExit(main())
"""


def write_run(folder: Path, name: str, **train) -> Path:
    recs = [{"messages": [{"role": "user", "content": f"What does the {a} say?"},
                          {"role": "assistant", "content": f"The {a} says {s}."}]}
            for a, s in ANIMALS * 4]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (folder / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:8]))
    t = {"max_steps": 5, "batch_size": 4, "lr": 5e-3, "eval_every": 0, "save_every": 0,
         "grad_accum": 1, **train}
    cfg = folder / f"{name}.toml"
    cfg.write_text(f'[model]\npath = "{MODEL}"\ndevice = "cpu"\nthreads = 1\n'
                   f'[data]\ntrain = "train.jsonl"\nvalidation = "valid.jsonl"\n'
                   f'[lora]\nrank = 4\nalpha = 8.0\n[train]\n'
                   + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items() if v is not None)
                   + f'[output]\ndir = "{name}"\n')
    return cfg


def run(folder: Path, n: int, *args, env=None, timeout=300, check=True, hosts=None):
    """``hosts``: the README's several-hosts launch, ``mpiexec -f HOSTFILE -n N``."""
    cmd = ([str(MPIEXEC)] + (["-f", str(hosts)] if hosts else []) + ["-n", str(n)]
           if n > 1 else []) + [
        sys.executable, "-c", WRAPPER, "train", *map(str, args), "--no-progress"]
    r = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def steps(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r and r.get("split") != "valid"]


def valid(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r.get("split") == "valid"]


def adapter(out: Path) -> dict:
    return read_lora_gguf(out / "adapter.gguf")[2]


def test_two_ranks_equal_one_process_accumulating_two(tmp_path):
    """grad_accum 1 on 2 ranks and grad_accum 2 in one process: every step's loss, target
    count and gradient norm, the evaluations and the adapter, bit for bit (each step's
    gradient is the sum of the same two micro-batch gradients, in either order).  Launched
    as across hosts, with a hostfile (naming this one)."""
    write_run(tmp_path, "one", grad_accum=2, eval_every=2)
    write_run(tmp_path, "two", grad_accum=1, eval_every=2)
    (tmp_path / "hosts").write_text("localhost:2\n")
    run(tmp_path, 1, "one.toml")
    run(tmp_path, 2, "two.toml", hosts=tmp_path / "hosts")
    a, b = steps(tmp_path / "one"), steps(tmp_path / "two")
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        for k in ("loss", "n_valid", "grad_norm", "tokens"):
            assert x[k] == y[k], (k, x, y)
    for x, y in zip(valid(tmp_path / "one"), valid(tmp_path / "two")):
        assert x["n_valid"] == y["n_valid"] and x["accuracy"] == y["accuracy"]
        assert abs(x["loss"] - y["loss"]) <= 4 * U32 * x["loss"]   # shards summed otherwise
    ad_one, ad_two = adapter(tmp_path / "one"), adapter(tmp_path / "two")
    for k, v in ad_one.items():
        np.testing.assert_array_equal(ad_two[k], v, err_msg=k)
    # rank 0 alone wrote: one metrics file, one adapter, no stray files
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(
        p.name for p in (tmp_path / "one").iterdir())


def test_two_ranks_accumulating_two_equal_one_process_accumulating_four(tmp_path):
    """(a + b) + (c + d) against ((a + b) + c) + d: regrouping a float32 sum of k positive
    terms moves it by at most (k - 1) ulps of the sum, so the losses agree to 3 ulps, the
    gradient norms to a few, and the adapter to AdamW's bound against a calibration: the
    one-process run with the matmuls on the other kernels (BLAS toggled)."""
    write_run(tmp_path, "one", grad_accum=4)
    write_run(tmp_path, "two", grad_accum=2)
    write_run(tmp_path, "calib", grad_accum=4)
    run(tmp_path, 1, "one.toml")
    run(tmp_path, 2, "two.toml")
    blas = os.environ.get("PYTRAIN_BLAS", "1") not in ("", "0")
    run(tmp_path, 1, "calib.toml", env={"PYTRAIN_BLAS": "0" if blas else "1"})
    a, b = steps(tmp_path / "one"), steps(tmp_path / "two")
    assert [x["n_valid"] for x in a] == [x["n_valid"] for x in b]
    assert abs(a[0]["loss"] - b[0]["loss"]) <= 3 * 2 * U32 * a[0]["loss"]
    assert abs(a[0]["grad_norm"] - b[0]["grad_norm"]) <= 16 * U32 * a[0]["grad_norm"]
    assert_adamw_close(adapter(tmp_path / "two"), adapter(tmp_path / "one"), [5e-3] * 5,
                       calib=adapter(tmp_path / "calib"))


def test_a_rank_without_a_micro_batch_and_the_bug_reproduction(tmp_path):
    """One epoch of the 32 examples in batches of 5 is 7 micro-batches, 4 steps of 2: the last
    step has one, so rank 1 has none and still joins every collective.  And the bug
    reproduction (every row trained, a mean of per-micro-batch means), which divides by the
    step's micro-batch count across ranks."""
    for repro in (False, True):
        extra = {"loss_bug_repro": True} if repro else {}
        write_run(tmp_path, f"one{repro}", grad_accum=2, batch_size=5, max_steps=None, epochs=1,
                  **extra)
        write_run(tmp_path, f"two{repro}", grad_accum=1, batch_size=5, max_steps=None, epochs=1,
                  **extra)
        run(tmp_path, 1, f"one{repro}.toml")
        run(tmp_path, 2, f"two{repro}.toml")
        a, b = steps(tmp_path / f"one{repro}"), steps(tmp_path / f"two{repro}")
        assert len(a) == len(b) == 4, (len(a), len(b))
        for x, y in zip(a, b):
            assert (x["loss"], x["n_valid"], x["grad_norm"]) == (y["loss"], y["n_valid"],
                                                                  y["grad_norm"]), (x, y)


def test_a_micro_batch_without_targets_on_one_rank(tmp_path):
    """Step 2's second micro-batch with every target masked, as rank 1's only micro-batch
    against the second of one process's two: that rank contributes no loss, no target and a
    zero gradient but joins the sums, and both runs are equal bit for bit."""
    write_run(tmp_path, "one", grad_accum=2, max_steps=3)
    write_run(tmp_path, "two", grad_accum=1, max_steps=3)
    run(tmp_path, 1, "one.toml", env={"MASK_AT": "0:2:1"})
    run(tmp_path, 2, "two.toml", env={"MASK_AT": "1:2:0"})
    write_run(tmp_path, "plain", grad_accum=2, max_steps=3)
    run(tmp_path, 1, "plain.toml")
    a, b, p = steps(tmp_path / "one"), steps(tmp_path / "two"), steps(tmp_path / "plain")
    assert 0 < a[1]["n_valid"] < p[1]["n_valid"]       # the mask took effect
    for x, y in zip(a, b):
        assert (x["loss"], x["n_valid"], x["grad_norm"]) == (y["loss"], y["n_valid"],
                                                              y["grad_norm"]), (x, y)
    ad_one, ad_two = adapter(tmp_path / "one"), adapter(tmp_path / "two")
    for k, v in ad_one.items():
        np.testing.assert_array_equal(ad_two[k], v, err_msg=k)


def test_resume_with_other_ranks_and_a_changed_product(tmp_path, capsys):
    """A run of 2 ranks stopped at step 3 (save_every 3) and resumed on 2 ranks, or on 1 rank
    with grad_accum doubled, ends where the straight run ends; resuming with another
    product of grad_accum and ranks is refused, naming both."""
    write_run(tmp_path, "straight", max_steps=6)
    run(tmp_path, 2, "straight.toml")
    want = adapter(tmp_path / "straight")
    for name, n, accum in (("r2", 2, 1), ("r1", 1, 2)):
        cfg = write_run(tmp_path, name, max_steps=3, save_every=3)
        run(tmp_path, 2, cfg)
        r = run(tmp_path, n, cfg, "--resume", "--set", "train.max_steps=6", "--set",
                f"train.grad_accum={accum}")
        assert "resuming from" in r.stdout + r.stderr
        got = adapter(tmp_path / name)
        assert [s["step"] for s in steps(tmp_path / name)] == list(range(1, 7))
        for k, v in want.items():        # the same micro-batches: equal up to a + b = b + a
            np.testing.assert_array_equal(got[k], v, err_msg=(name, k))
    r = run(tmp_path, 1, "r1.toml", "--resume", "--set", "train.max_steps=8", check=False)
    assert r.returncode == 1
    assert "micro-batches per step (train.grad_accum x ranks): 2 -> 1" in r.stderr


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_ends_the_job(tmp_path, how):
    """Rank 1 fails at step 4 (an exception, or SIGKILL): the whole job ends non-zero within
    10 s of the failure, naming the rank; the checkpoint of step 2 is intact and a resume
    finishes."""
    cfg = write_run(tmp_path, "run", max_steps=6, save_every=2)
    stamp = tmp_path / "failed-at"
    r = run(tmp_path, 2, cfg, env={"FAIL_AT": f"1:4:{how}", "FAIL_STAMP": str(stamp)},
            check=False, timeout=120)
    took = time.time() - float(stamp.read_text())
    text = r.stdout + r.stderr
    assert r.returncode != 0, text[-2000:]
    kept = tmp_path / "run" / "error-rank-1.log"
    if how == "raise":       # said on stderr, and kept where no launcher can lose it
        assert "[rank 1 on" in text and "planted failure at step 4" in text, text[-2000:]
        assert "planted failure at step 4" in kept.read_text()
        assert named_file(r.stderr) == kept.resolve(), r.stderr[-2000:]
        assert r.stderr.count("planted failure at step 4") == 1, r.stderr[-3000:]  # said once
    else:
        assert "rank 1" in text.lower() or "killed" in text.lower(), text[-2000:]
    assert took < 10, (took, text[-2000:])
    assert (tmp_path / "run" / "checkpoints" / "step-0000002" / "state.json").exists(), \
        sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    run(tmp_path, 2, cfg, "--resume")
    assert [s["step"] for s in steps(tmp_path / "run")] == list(range(1, 7))
    assert not kept.exists()         # the run that failed is not the one that finished


def test_sigint_stops_every_rank_after_the_same_step(tmp_path):
    """SIGINT to mpiexec reaches every rank; they agree after each step whether any was
    interrupted, so all stop after the same step, rank 0 writes its checkpoint, and the job
    exits 130."""
    cfg = write_run(tmp_path, "run", max_steps=400, save_every=0)
    proc = subprocess.Popen([str(MPIEXEC), "-n", "2", sys.executable, "-c", WRAPPER, "train",
                             str(cfg), "--no-progress"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(steps(tmp_path / "run")) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    done = steps(tmp_path / "run")[-1]["step"]
    assert f"after step {done}" in err and done < 400
    assert (tmp_path / "run" / "checkpoints" / f"step-{done:07d}" / "state.json").exists()


def named_file(stderr: str) -> Path | None:
    """The file a message on stderr says it was also written to."""
    m = re.search(r"\(also in (.+?)\)$", stderr, re.M)
    return Path(m.group(1)).resolve() if m else None


def assert_ended_together(r, *words: str, kept: Path | None):
    """Every rank stopped at the same point and left normally, code 1: the message once
    (rank 0's), no MPI_Abort, and the message in ``kept`` (the run folder's error.log) as
    well."""
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert "MPI_Abort" not in r.stderr and "[rank" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and all(w in lines[0] for w in words), r.stderr[-3000:]
    if kept is not None:
        assert all(w in kept.read_text() for w in words), kept.read_text()
        assert named_file(r.stderr) == kept.resolve(), r.stderr[-3000:]


def test_a_rank_with_other_data_is_refused_at_start(tmp_path):
    """The ranks compare what they see (check_agreement): each gets the same answer from one
    allgather, so the job ends normally and the message cannot be lost to an abort."""
    cfg = write_run(tmp_path, "run")
    (tmp_path / "other.jsonl").write_text((tmp_path / "train.jsonl").read_text()
                                          .replace("moo", "muh"))
    r = run(tmp_path, 2, cfg, env={"RANK_DATA": f"1:{tmp_path / 'other.jsonl'}"}, check=False,
            timeout=120)
    assert_ended_together(r, "rank 1 on", "training data", kept=tmp_path / "run" / "error.log")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("what", ["config", "data on one rank", "nan"])
def test_an_error_every_rank_learns_of_ends_the_job_normally(tmp_path, what):
    """A config error (every rank loads the config, then they compare how it went), a data
    file only rank 1 cannot read (the same: the others learn it from the allgather, not by
    waiting), a NaN loss (found after the all-reduce, so by every rank): rank 0 says it once,
    every rank exits 1 through MPI_Finalize."""
    cfg = write_run(tmp_path, "run", lr=1e30 if what == "nan" else 5e-3)
    args = ["--set", "train.lr=abc"] if what == "config" else []
    env = {"RANK_DATA": f"1:{tmp_path / 'missing.jsonl'}"} if what == "data on one rank" else {}
    r = run(tmp_path, 2, cfg, *args, env=env, check=False, timeout=120)
    words, kept = {"config": (["train.lr", "abc"], None),     # no config: no run folder known
                   "data on one rank": (["rank 1 on", "missing.jsonl"], "error.log"),
                   "nan": (["stopped at step 2:", "kept the adapter from step 1"], "error.log")}[what]
    assert_ended_together(r, *words, kept=kept and tmp_path / "run" / kept)
