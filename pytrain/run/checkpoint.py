"""Checkpoints that survive being killed mid-write, and resume that continues exactly.

A checkpoint is a folder ``checkpoints/step-NNNNNNN`` holding the adapter (llama.cpp GGUF),
the AdamW moments and step count (``optimizer.npz``) and ``state.json`` (step, epoch, position
in the epoch's batch order, the base model's fingerprint).  It is written into a temporary
folder, every file fsync'ed, then renamed into place and the parent fsync'ed: a crash at any
moment leaves either the old set of checkpoints or the new one, never a half-written one.
A checkpoint that replaces one of the same step (a run resumed from an earlier checkpoint
passes that step again) moves the old one aside first and deletes it only once the new one is
in place; a kill in between is repaired by the next ``latest`` or ``save``.

``state.json`` also records what the saved data position means (``resume_key``: the training
examples' digest, batch size, accumulation, packing, seeds, adapter shapes), so a resume with
other batches is refused instead of silently continuing somewhere else, and the run's id: a
run prunes only its own checkpoints (``folder``).  Each checkpoint keeps the run's resolved
``config.toml`` as well.

Which checkpoint is newest goes by save order (``TrainState.saved``, one more than any
checkpoint already in the folder), not by step: a run resumed from an earlier checkpoint saves
lower steps after higher ones.  Such a resume moves the later checkpoints, another timeline
that the resumed run abandons, aside (``set_aside_after``) instead of leaving them for
``latest`` to jump back to.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pytrain.errors import PytrainError
from pytrain.formats.adapter_gguf import read_lora_gguf, write_lora_gguf
from pytrain.formats.atomic import fsync_dir, named
from pytrain.formats.gguf_tensors import open_reader
from pytrain.run.folder import run_file

FORMAT = 5          # 5: stopped_early; 4: saved (save order); 3: run_id, config.toml;
                    # 2: total_steps and resume_key; 1 to 4 still load


FOLDER = run_file("checkpoints", "the checkpoints (output.keep_checkpoints)")
BEST = "best.gguf"      # in a checkpoint: the best validation's adapter, when not its own


class CheckpointError(PytrainError, RuntimeError):
    """A checkpoint that cannot be used; the message names it and says why."""


@dataclass
class TrainState:
    step: int            # optimizer steps done
    epoch: int           # epoch of the next step
    position: int        # index of the next step in that epoch's step order
    adam_t: int          # AdamW's step counter (bias correction)
    base_fingerprint: dict
    total_steps: int | None = None   # the run's length when saved (the LR schedule's horizon)
    resume_key: dict | None = None   # what the position means (see pytrain.run.loop.Session)
    run_id: str | None = None        # the run the checkpoint belongs to (folder.py)
    format: int = FORMAT
    saved: int | None = None         # save order in its folder (set by ``save``)
    best: dict | None = None         # the best validation and early-stopping count (train.best)
    # whether the run stopped early here (None: saved before it was recorded; the count says)
    stopped_early: bool | None = None


def base_fingerprint(path: str | os.PathLike) -> dict:
    """Size plus sha256 of the header and tensor index: a changed or different base model is
    caught without hashing gigabytes of weights."""
    p = Path(path)
    head = open_reader(p).data_offset
    with open(p, "rb") as f:
        digest = hashlib.sha256(f.read(head)).hexdigest()
    return {"name": p.name, "size": p.stat().st_size, "header_sha256": digest}


def save(folder: Path, step: int, adapter, moments: dict[str, np.ndarray], state: TrainState,
         keep: int = 3, *, arch: str, config_toml: str | None = None,
         best: dict[str, np.ndarray] | None = None, metadata: dict | None = None) -> Path:
    """Write checkpoint ``step`` under ``folder`` atomically; keep the newest ``keep`` (0: all)
    of this run's (``state.run_id``) checkpoints, never another run's.  ``arch``: the base
    model's architecture, written into the adapter GGUF; ``config_toml``: the run's resolved
    config, kept beside it; ``best``: the best validation's adapter when it is not this step's
    (``best.gguf``), so that a resume from here restores the best of this timeline;
    ``metadata``: keys of both adapter files (the run's ``loop.adapter_metadata``)."""
    folder.mkdir(parents=True, exist_ok=True)
    recover(folder)
    state.saved = 1 + max((order(p)[0] for p in folder.glob("step-*")), default=0)
    final = folder / f"step-{step:07d}"
    aside = folder / f".replaced-{final.name}"
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".tmp-"))
    try:
        alpha = getattr(adapter, "plain_alpha", adapter.alpha)     # llama.cpp's scale
        write_lora_gguf(tmp / "adapter.gguf", arch, alpha, adapter.get(), metadata)
        if best is not None:
            write_lora_gguf(tmp / BEST, arch, alpha, best, metadata)
        with open(tmp / "optimizer.npz", "wb") as f:
            np.savez(f, **moments)
            f.flush()
            os.fsync(f.fileno())
        files = {"state.json": json.dumps(asdict(state), indent=2)}
        if config_toml is not None:
            files["config.toml"] = config_toml
        for name, text in files.items():
            with open(tmp / name, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():
            os.replace(final, aside)       # kept until the new one is in place
        os.replace(tmp, final)
        fsync_dir(folder)
        shutil.rmtree(aside, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        recover(folder)
        # a failed write names the checkpoint's file, not the temporary folder's
        if isinstance(e, OSError) and (new := named(e, final, tmp)) is not e:
            raise new from e
        raise
    if keep:
        own = sorted((p for p in folder.glob("step-*") if run_id_of(p) == state.run_id),
                     key=order)
        for old in own[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _state_of(path: Path) -> dict:
    try:
        got = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def run_id_of(path: Path) -> str | None:
    """The run id a checkpoint records (None for one that predates run ids, or unreadable)."""
    return _state_of(path).get("run_id")


def order(path: Path) -> tuple[int, int]:
    """(save order, step) of checkpoint ``path``, what sorts it among its folder's: one saved
    before save orders were recorded comes before any that has one, by step."""
    saved = _state_of(path).get("saved")
    return (saved if isinstance(saved, int) else 0, step_of(path))


def step_of(path: Path) -> int:
    try:
        return int(path.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def set_aside_after(folder: Path, step: int) -> Path | None:
    """Move every checkpoint of ``folder`` past ``step`` into ``folder/abandoned-TIME/``: a
    run resumed from ``step`` goes another way, and these must neither be taken by a later
    ``--resume`` nor pruned as old.  Returns that folder, or None when there were none."""
    later = sorted((p for p in folder.glob("step-*") if step_of(p) > step), key=step_of)
    if not later:
        return None
    aside = folder / time.strftime("abandoned-%Y%m%d-%H%M%S")
    n = 1
    while aside.exists():
        n += 1
        aside = folder / time.strftime(f"abandoned-%Y%m%d-%H%M%S-{n}")
    aside.mkdir()
    for p in later:
        os.replace(p, aside / p.name)
    fsync_dir(aside)
    fsync_dir(folder)
    return aside


def recover(folder: Path) -> None:
    """Finish what a killed ``save`` left: a checkpoint moved aside whose replacement never
    arrived goes back; one whose replacement is in place, and temporary folders, go."""
    for aside in folder.glob(".replaced-step-*"):
        final = folder / aside.name[len(".replaced-"):]
        if (final / "state.json").exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            if final.exists():
                shutil.rmtree(final)
            os.replace(aside, final)
    for tmp in folder.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(folder)


def latest(folder: Path) -> Path | None:
    """The checkpoint saved last in ``folder`` (save order, not the highest step)."""
    if folder.is_dir():
        recover(folder)
    done = sorted((p for p in folder.glob("step-*") if (p / "state.json").exists()), key=order)
    return done[-1] if done else None


def load(path: Path, model_path: str) -> tuple[TrainState, dict, dict]:
    """(state, adapter tensors, optimizer moments) of checkpoint ``path``, after checking it
    was made from this base model."""
    try:
        state = TrainState(**json.loads((path / "state.json").read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: not a usable checkpoint ({e})") from e
    if state.format not in (1, 2, 3, 4, FORMAT):
        raise CheckpointError(f"{path}: checkpoint format {state.format}, expected {FORMAT}")
    now = base_fingerprint(model_path)
    if now != state.base_fingerprint:
        raise CheckpointError(
            f"{path}: the base model changed since this checkpoint was made "
            f"({state.base_fingerprint.get('name')}, {state.base_fingerprint.get('size')} bytes, "
            f"header {state.base_fingerprint.get('header_sha256', '')[:12]} vs {model_path}, "
            f"{now['size']} bytes, header {now['header_sha256'][:12]}); refusing to resume")
    _arch, _alpha, tensors, _meta = read_lora_gguf(path / "adapter.gguf")
    return state, tensors, _read_moments(path / "optimizer.npz", tensors)


def load_best(path: Path, state: TrainState, tensors: dict) -> dict | None:
    """The best validation's adapter as of checkpoint ``path`` (``tensors``: its own adapter,
    the best when the best is its step), or None before any validation."""
    if not state.best or state.best.get("step") is None:
        return None
    if state.best["step"] == state.step:
        return tensors
    try:
        return read_lora_gguf(path / BEST)[2]
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / BEST}: the best adapter (step {state.best['step']}) "
                              f"is missing or unreadable ({e})") from None


def _read_moments(npz: Path, tensors: dict) -> dict[str, np.ndarray]:
    """AdamW's two moments per adapter tensor, each of its tensor's shape: a file cut short,
    not a zip or without a moment is a ``CheckpointError`` naming it, never a numpy or zip
    traceback."""
    try:
        with np.load(npz, allow_pickle=False) as z:
            moments = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{npz}: not a usable checkpoint ({type(e).__name__}: {e})"
                              ) from None
    for name, t in tensors.items():
        for key in ("m." + name, "v." + name):
            if key not in moments:
                raise CheckpointError(f"{npz}: not a usable checkpoint: moment {key!r} is "
                                      f"missing")
            if moments[key].shape != np.shape(t):
                raise CheckpointError(f"{npz}: not a usable checkpoint: moment {key!r} has "
                                      f"shape {moments[key].shape}, the adapter's tensor "
                                      f"{np.shape(t)}")
    return moments
