"""`--resume`: which checkpoint a run continues from, the refusal of one whose data position
would mean other batches now, the state restored from it (adapter, AdamW moments and count,
the best validation and its files), and the run folder cut back to its step (metrics and
samples past it dropped, a later timeline's checkpoints moved aside).

The run's module only asks ``start`` where its step loop begins; ``s`` below is its
``Session`` (not imported: the run imports this module).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pytrain.formats import atomic
from pytrain.run import checkpoint as ckpt
from pytrain.run import samples as samples_mod
from pytrain.run.best import Best
from pytrain.step.distributed import on_main
from pytrain.run.metrics import read_metrics
from pytrain.step.optimizer import schedule
from pytrain.run.folder import RunDir, new_run_id
from pytrain.run.errors import RunError

# the resume key's name for the micro-batches of one step (a single process's train.grad_accum
# before data-parallel runs): a run may resume with other ranks if the product is the same
MICRO_BATCHES = "micro-batches per step (train.grad_accum x ranks)"
# resume-key entries that earlier checkpoints recorded only when not at these values (the
# LoRA options when on, the objective when not SFT): a key missing from a checkpoint's
# resume key had this value when it was saved
UNRECORDED_DEFAULTS = {"lora.use_rslora": False, "lora.dropout": 0.0, "train.objective": "sft"}
# entries whose change means the saved adapter would be applied otherwise than it was trained
ADAPTER_KEYS = ("lora.", "adapted tensors")


@dataclass
class Start:
    """Where the step loop begins: step 0 of a fresh run, or a checkpoint's position."""
    step: int = 0
    position: tuple[int, int] = (0, 0)          # (epoch, index) of the next step
    run_id: str | None = None
    checkpoint: Path | None = None              # the checkpoint resumed from (None: fresh)
    best: Best = field(default_factory=Best)    # its best validation
    best_tensors: dict | None = None            # that validation's adapter, when kept apart
    stopped_early: bool | None = None           # the run stopped early there (None: unknown)


def start(s, resume: str | bool | None, total: int) -> Start:
    """The checkpoint ``resume`` names loaded into session ``s`` (checked against the run
    before anything of the run is rewritten), or a fresh start with a new run id."""
    where = None
    if resume:
        where = on_main(s.world, lambda: find_checkpoint(s.out, resume, s.log))
    if where is None:
        return Start(run_id=s.world.bcast(new_run_id() if s.world.is_main else None))
    state, best_tensors = resume_from(s, where, total)
    if state.step >= total:
        s.log(f"the run is already at step {state.step} of {total}: nothing to train (raise "
              f"train.max_steps or train.epochs to continue it)")
    return Start(state.step, (state.epoch, state.position), state.run_id, where,
                 Best.from_dict(state.best), best_tensors, state.stopped_early)


def find_checkpoint(out: Path, resume: str | bool, log: Callable[[str], None]) -> Path | None:
    """The checkpoint ``--resume`` continues from, or None for an earlier run in ``out`` that
    stopped before it wrote one (killed at once): that run starts again from step 0."""
    ckpt_dir = out / "checkpoints"
    where = ckpt.latest(ckpt_dir) if resume is True else Path(resume)
    if where is not None and where.is_dir() and not (where / "state.json").exists():
        where = ckpt.latest(where)
    if where is None or not (where / "state.json").exists():
        earlier = RunDir(out).earlier_run() if resume is True else None
        if earlier is not None:
            log(f"{out} holds an earlier run that stopped before writing a checkpoint "
                f"({earlier}): starting it again from step 0")
            return None
        raise RunError(f"no checkpoint to resume from in {ckpt_dir if resume is True else resume}")
    return where


def resume_from(s, where: Path, total: int) -> tuple[ckpt.TrainState, dict | None]:
    """Load checkpoint ``where`` into the session; refuse one whose data position would mean
    other batches; drop metrics past its step.  (state, the best validation's adapter)."""
    # loaded and checked on rank 0, its verdict on every rank
    state, tensors, moments, best = on_main(s.world, lambda: _load_checkpoint(s, where))
    if state.total_steps is not None and state.total_steps != total:
        t = s.cfg.train
        before = schedule(t.schedule, state.step, state.total_steps, t.lr, t.warmup)
        after = schedule(t.schedule, state.step, total, t.lr, t.warmup)
        s.log(f"the run now ends at step {total} (was {state.total_steps}): the "
              f"{t.schedule} schedule is recomputed over {total} steps; lr at step "
              f"{state.step + 1}: {before:.3g} -> {after:.3g}")
    s.adapter.set(tensors)
    s.trainer.opt_state.set_moments(moments)
    s.trainer.opt.t = state.adam_t
    if s.world.is_main:
        cut_back(s, where, state.step)
    s.log(f"resuming from {where} at step {state.step}")
    return state, best


def _load_checkpoint(s, where: Path) -> tuple:
    """(state, adapter tensors, moments, the best validation's adapter or None)."""
    state, tensors, moments = _check_resume_key(s, where, ckpt.load(where, s.cfg.model.path))
    return state, tensors, moments, ckpt.load_best(where, state, tensors)


def cut_back(s, where: Path, step: int) -> None:
    """The run folder as it was at ``step``: metrics past it dropped; checkpoints past it (a
    resume from an earlier checkpoint: the run goes another way from there) moved aside with
    the metrics of their timeline, so that nothing is lost and a later ``--resume`` continues
    this timeline, not that one."""
    metrics = s.out / "metrics.jsonl"
    recs = read_metrics(metrics)
    folder = s.out / "checkpoints"
    # a checkpoint from elsewhere (another folder, an abandoned timeline): none of this
    # folder's checkpoints is on the way to it
    own = folder.is_dir() and where.parent.resolve() == folder.resolve()
    aside = ckpt.set_aside_after(folder, step if own else -1)
    if aside is not None:
        atomic.write_bytes(aside / "metrics.jsonl",
                           "".join(json.dumps(r) + "\n" for r in recs).encode())
        names = ", ".join(sorted(p.name for p in aside.glob("step-*")))
        s.log(f"{where} is not the newest checkpoint: the run continues from step {step}, and "
              f"the checkpoints of the timeline it leaves ({names}) and that timeline's "
              f"metrics were moved to {aside}")
    kept = [r for r in recs if r.get("step", 0) <= step]
    atomic.write_bytes(metrics, "".join(json.dumps(r) + "\n" for r in kept).encode())
    sampled = s.out / samples_mod.SAMPLES_FILE
    if sampled.exists():
        kept = [r for r in read_metrics(sampled) if r.get("step", 0) <= step]
        atomic.write_bytes(sampled, "".join(json.dumps(r) + "\n" for r in kept).encode())


def _check_resume_key(s, where: Path, loaded: tuple):
    """``loaded`` (a checkpoint's state, tensors, moments), or a RunError where its data
    position would mean other batches now."""
    state = loaded[0]
    if state.resume_key is not None and "train.grad_accum" in state.resume_key:
        key = dict(state.resume_key)          # saved by a single process before ranks existed
        key[MICRO_BATCHES] = key.pop("train.grad_accum")
        state.resume_key = key
    if state.resume_key is None:
        s.log(f"warning: {where} predates resume checks; the data and batch settings cannot "
              f"be compared with the checkpoint's")
    else:
        saved = {**UNRECORDED_DEFAULTS, **state.resume_key}
        now = s.resume_key()
        changed = [k for k in now if saved.get(k) != now[k]]
        if changed:
            what = "; ".join(f"{k}: {_short(saved.get(k))} -> {_short(now[k])}"
                             for k in changed)
            adapter = [k for k in changed if k.startswith(ADAPTER_KEYS)]
            why = []
            if len(adapter) < len(changed):
                why.append("The checkpoint's position in the data would point at other "
                           "batches.")
            if adapter:
                why.append("The checkpoint's adapter was trained with the earlier LoRA "
                           "settings: resumed with these, its scale, shapes or training "
                           "graph would change.")
            raise RunError(
                f"cannot resume from {where}: {what}. {' '.join(why)} Restore the setting, "
                f"or start a new run (another output.dir)")
    return loaded


def _short(v) -> str:
    return f"{v[:12]}…" if isinstance(v, str) and len(v) == 64 else repr(v)


def restore_best(s, loop, start: Start) -> None:
    """The checkpoint's best validation, its adapter written again (the files may hold a
    later best of a timeline the resume abandons), and early stopping when the run stopped
    early there (like TRL's callback state: it stays stopped unless the patience grows).  A
    run that reached its last step with the patience spent did not stop early: extended, it
    goes on.  A checkpoint saved before the stop was recorded: the count decides, as then."""
    loop.best = start.best
    if start.best_tensors is not None:
        loop.keep_best(start.best_tensors)
    t = s.cfg.train
    stopped = start.stopped_early is not False      # None: not recorded
    if stopped and start.best.exhausted(t.early_stopping_patience):
        loop.early_stop = start.best.why(t.early_stopping_patience, t.early_stopping_min_delta)
        s.log(f"the run stopped early at step {loop.step}: {loop.early_stop}; nothing to "
              f"train (raise train.early_stopping_patience to continue it)")
