"""`pytrain train`: config → data → batches → graphs → loss → optimizer → adapter files.

Writes into the run folder: config.toml (resolved), data_stats.json, metrics.jsonl (one line
per step and per validation), loss.png, adapter.gguf (llama.cpp --lora), checkpoints/.  A NaN
or inf loss stops the run naming the step and keeps the last good adapter.

``train`` reads top to bottom as the run's phases: set up, start fresh or resume, the step
loop (validation and the checkpoint policy inside it), the finish.  Its parts beside it:
``resume`` (the checkpoint continued from, the folder cut back), ``log`` (metrics.jsonl,
samples.jsonl and the callbacks), ``signals`` (Ctrl-C and SIGTERM), ``errors``.  What a
run opens goes on one ``ExitStack`` as it opens, closed in reverse on every way out.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from pytrain import ggml
from pytrain.formats import atomic
from pytrain.run import checkpoint as ckpt
from pytrain.run import resume as resume_mod
from pytrain.run import log as run_log
from pytrain.run import samples as samples_mod
from pytrain.run import signals
from pytrain.run import tensorboard as _tensorboard  # noqa: F401  (declares its event files)
from pytrain.run.best import Best
from pytrain.step.distributed import (RanksDisagree, World, agree, check_agreement,
                                       forget_messages, on_main, world as get_world)
from pytrain.run.interrupt import Interrupt
from pytrain.run.folder import RunDir, RunDirError, SetAside, drop_replaced, run_file
from pytrain.run.log import RunLog
from pytrain.models import lora as lora_mod
from pytrain.formats.adapter_gguf import write_lora_gguf
from pytrain.config import Config
from pytrain.data import DataSplits, load_data, make_batches
from pytrain.data.preference import load_pair_data, make_pair_batches
from pytrain.models.lora_targets import LoraTargetError, select_targets
from pytrain.models.model import Model, load_model
from pytrain.models.precision import ComputeTypeError
from pytrain.step.optimizer import AdamWSettings, schedule
from pytrain.step.graph_memory import context_warning
from pytrain.step.preference import REFERENCE_FILE, PreferenceSettings, PreferenceTrainer
from pytrain.step.trainer import NonFiniteLoss, Trainer
from pytrain.run.type_choice import ADAPTER_KEY, for_training, weights_record
from pytrain.run.resume import MICRO_BATCHES
# the errors, still importable from here (the command line catches run.Interrupted)
from pytrain.run.errors import Interrupted, NonFiniteStop, RunError  # noqa: F401


@dataclass
class RunResult:
    out_dir: Path
    adapter: Path
    steps: int
    final_eval: dict | None
    best: dict | None = None          # {"step", "loss", "adapter"} of the best validation
    early_stop: str | None = None     # why the run stopped early, if it did


# the files this module writes into the run folder, and those its parts write there (declared
# here for them: they take the folder from the run)
ADAPTER = run_file("adapter.gguf", "the adapter (llama.cpp GGUF)")
PEFT = run_file("peft", "the adapter in PEFT's format (output.formats)")
BEST_ADAPTER = run_file("adapter.best.gguf", "the best validation's adapter")
BEST_PEFT = run_file("peft-best", "the best validation's adapter in PEFT's format")
CONFIG = run_file("config.toml", "the run's resolved config")
DATA_STATS = run_file("data_stats.json", "what the data loading kept and skipped")
PROBE = run_file(".write-test", "output_dir's check that the folder is writable")
run_file(REFERENCE_FILE, "the reference log-probabilities of a DPO run (PreferenceTrainer)")
run_file("error.log", "the error a run of several ranks ended with (distributed)")
run_file("error-rank-*.log", "the error one rank aborted with (distributed)")


def run_folder(cfg: Config) -> Path:
    """The run's output folder (``output.dir``), whether or not it exists yet."""
    return Path(cfg.output.dir or Path("runs") / "run")


def output_dir(cfg: Config) -> Path:
    out = run_folder(cfg)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / PROBE
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RunError(f"output.dir {out}: not writable ({e.strerror or e})") from e
    return out


def save_adapter(model: Model, adapter, path: Path, formats=("gguf",), tensors=None,
                 peft_dir: str = PEFT) -> Path:
    """The adapter in each requested format: llama.cpp GGUF at ``path``, and a PEFT folder
    (adapter_config.json + adapter_model.safetensors) beside it in ``peft_dir``.
    ``tensors``: other values of the adapter's tensors (the best validation's)."""
    tensors = adapter.get() if tensors is None else tensors
    if "peft" in formats:
        from pytrain.formats.adapter_peft import write_peft_adapter
        write_peft_adapter(path.parent / peft_dir, tensors, adapter.alpha, adapter.rank,
                           use_rslora=adapter.rslora,
                           base_model_name_or_path=Path(model.path).name,
                           model_config=model.config, arch=model.arch.name)
    return write_lora_gguf(path, model.arch.name, adapter.plain_alpha, tensors,
                           base_metadata=adapter_metadata(model))


def adapter_metadata(model: Model) -> dict[str, str]:
    """Keys of the adapters a run writes: a name, and the types the run loaded its base's
    weights as, so that an evaluation of the adapter loads them alike (type_choice)."""
    return {"general.name": f"pytrain LoRA for {Path(model.path).name}",
            ADAPTER_KEY: weights_record(model)}


def step_batches(batches: list, grad_accum: int) -> list[list]:
    return [batches[i:i + grad_accum] for i in range(0, len(batches), grad_accum)]


# --------------------------------------------------------------------------- setup

@dataclass
class Session:
    """Everything one run holds open, closed together on every path out of ``train``."""
    cfg: Config
    out: Path
    model: Model
    splits: DataSplits
    adapter: object
    trainer: Trainer
    stats: dict
    valid_batches: list
    log: Callable[[str], None]
    world: World = field(default_factory=World)
    _epochs: dict = field(default_factory=dict)
    _examples_digest: str | None = None        # resume_key's, computed once (see there)

    @property
    def seed(self) -> int:
        return self.cfg.data.shuffle_seed          # resolved by the config (train.seed if unset)

    @property
    def preference(self) -> bool:
        """DPO or ORPO: the splits hold pairs, the batches are PairBatches."""
        return self.cfg.train.objective != "sft"

    def epoch_steps(self, epoch: int) -> list[list]:
        """The optimizer steps of ``epoch``: its batch order (seeded by the epoch) in groups of
        ``grad_accum`` x ranks micro-batches (every rank builds the same list; each takes its
        share of a step, ``Loop.run``)."""
        if epoch not in self._epochs:
            t, d = self.cfg.train, self.cfg.data
            if self.preference:
                b = make_pair_batches(self.splits.train, t.batch_size, self.seed + epoch,
                                      pad_id=self.model.pad_id)
            else:
                b = make_batches(self.splits.train, t.batch_size, d.packing, self.seed + epoch,
                                 max_seq_len=d.max_seq_len, pad_id=self.model.pad_id)
            if epoch == 0:
                self.splits.train_stats.record_batches(
                    [x.batch for x in b] if self.preference else b)
                self.stats["train"] = self.splits.train_stats.to_dict()
            # one epoch held at a time
            self._epochs = {epoch: step_batches(b, t.grad_accum * self.world.size)}
        return self._epochs[epoch]

    def steps_from(self, epoch: int, index: int) -> Iterator[tuple[int, int, list]]:
        """(epoch, index, micro-batches) of every step from position (epoch, index) on."""
        while True:
            steps = self.epoch_steps(epoch)
            for i in range(index, len(steps)):
                yield epoch, i, steps[i]
            epoch, index = epoch + 1, 0

    def total_steps(self) -> int:
        t = self.cfg.train
        return t.max_steps if t.max_steps else t.epochs * len(self.epoch_steps(0))

    def resume_key(self) -> dict:
        """What the saved state means: a resumed run must see the same training examples cut
        into the same batches in the same order, train the same objective, and apply the
        saved adapter as it was trained (``lora_key``).  Every key is present whatever its
        value: a setting recorded only when on let a resume turn it off unseen.
        The examples' digest is computed once: they do not change during a run, and hashing
        every token again at each checkpoint cost time proportional to the data set."""
        if self._examples_digest is None:
            h = hashlib.sha256()
            for e in self.splits.train:
                parts = ((e.prompt, e.chosen, e.rejected) if self.preference
                         else (e.tokens, e.train_mask))
                for a in parts:
                    h.update(a.tobytes())
            self._examples_digest = h.hexdigest()
        c = self.cfg
        return {"training examples": self._examples_digest,
                "train.batch_size": c.train.batch_size,
                MICRO_BATCHES: c.train.grad_accum * self.world.size,
                "data.packing": c.data.packing, "data.max_seq_len": c.data.max_seq_len,
                "batch order seed": self.seed, **self.lora_key(),
                "train.loss_bug_repro": c.train.loss_bug_repro,
                "train.objective": c.train.objective}

    def lora_key(self) -> dict:
        """The resolved LoRA settings that change what the saved A and B mean: the shapes
        (rank, the adapted tensors as targets and skip_ssm resolve them), the scale (alpha,
        use_rslora: alpha/r against alpha/sqrt(r)) and the training graph (dropout).  Not
        here: init and seed (the initial A and B, replaced by the saved ones; dropout masks
        are drawn from seed and step, another stream as a changed lr is another step size),
        and loraplus_lr_ratio (B's learning rate: it may change as train.lr may)."""
        lo = self.cfg.lora
        return {"lora.rank": lo.rank, "lora.alpha": lo.alpha,
                "adapted tensors": sorted(self.adapter.names),
                "lora.use_rslora": lo.use_rslora, "lora.dropout": lo.dropout}

    def close(self) -> None:
        try:
            self.trainer.close()
        finally:
            self.model.close()


def runtime_summary(model: Model) -> str:
    """One line saying what the run computes on, for the log and for bug reports: the device
    (a GPU's name, or Mesa's lavapipe, as ggml lists it), the ggml-cpu variant (which
    instruction sets its kernels use), threads, BLAS."""
    rt, v = model.runtime, ggml.CPU_VARIANT
    named = f" ({rt.device_label()})" if rt.gpu is not None else ""
    return (f"device {rt.device}{named}: ggml-cpu variant {v.name} ({v.chosen_by}), {rt.threads} "
            f"threads{', BLAS backend' if rt.blas is not None else ''}")


def open_session(cfg: Config, out: Path, log: Callable[[str], None],
                 world: World | None = None) -> Session:
    w = world or World()
    threads = cfg.model.threads
    if threads is None and w.local_size > 1:      # the CPUs of this host, shared by its ranks
        threads = max(1, ggml.default_threads() // w.local_size)
    try:
        model = load_model(cfg.model.path, cfg.model.device, threads, cfg.model.type_policy,
                           device_index=w.local_rank,
                           dequantize=for_training(cfg.model.type_policy, cfg.train.memory_gib,
                                                   log, w.local_size, cfg.train.compute_type),
                           compute_type=cfg.train.compute_type)
    except ComputeTypeError as e:
        raise cfg.error("train", "compute_type", str(e)) from None
    # closed here unless the session is made: then the caller owns them (Session.close)
    with ExitStack() as made:
        made.callback(model.close)
        log(runtime_summary(model) + (f"; {w.size} data-parallel ranks" if w.size > 1 else ""))
        log(model.compute)
        too_long = context_warning(model.config, cfg.data.max_seq_len)
        if too_long:
            log(too_long)
        t = cfg.train
        preference = t.objective != "sft"
        splits = (load_pair_data if preference else load_data)(cfg.data, model.tokenizer)
        log(splits.train_stats.summary())
        if t.early_stopping_patience and not splits.valid:
            raise cfg.error("train", "early_stopping_patience", "early stopping needs "
                            "validation examples: set data.validation or data.split")
        try:
            names = select_targets(model.config, cfg.lora.targets, cfg.lora.skip_ssm)
        except LoraTargetError as e:
            raise cfg.error("lora", "targets", str(e)) from None
        adapter = lora_mod.create(
            model.runtime, model.config, names, cfg.lora.rank, cfg.lora.alpha,
            seed=cfg.lora.seed,                   # resolved by the config (train.seed if unset)
            init=cfg.lora.init, rslora=cfg.lora.use_rslora, dropout=cfg.lora.dropout)
        hp = AdamWSettings(lr=t.lr, beta1=t.adam_beta1, beta2=t.adam_beta2, eps=t.adam_eps,
                           weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
                           b_lr_ratio=cfg.lora.loraplus_lr_ratio or 1.0)
        if preference:
            trainer = PreferenceTrainer(model, adapter, hp, PreferenceSettings(
                t.objective, t.beta, t.loss_type, t.label_smoothing), world=w)
        else:
            trainer = Trainer(model, adapter, hp, buggy_loss=t.loss_bug_repro,
                              recompute=t.recompute,
                              memory_bytes=int(t.memory_gib * 2**30) if t.memory_gib else None,
                              world=w)
        made.callback(trainer.close)
        if not splits.valid:
            valid = []
        elif preference:
            valid = make_pair_batches(splits.valid, t.batch_size, shuffle=False,
                                      pad_id=model.pad_id)
        else:
            valid = make_batches(splits.valid, t.batch_size, cfg.data.packing, 0, shuffle=False,
                                 max_seq_len=cfg.data.max_seq_len, pad_id=model.pad_id)
        stats = {"train": splits.train_stats.to_dict(),
                 "valid": splits.valid_stats.to_dict() if splits.valid_stats else None}
        s = Session(cfg, out, model, splits, adapter, trainer, stats, valid, log, w)
        made.pop_all()
    return s


# --------------------------------------------------------------------------- the loop

class Loop:
    """The step loop's state and the things it writes: metrics, checkpoints, validation."""

    def __init__(self, s: Session, total: int, start: resume_mod.Start, stack: ExitStack,
                 progress: bool = False, replaced: SetAside | None = None):
        """Opens what the loop writes to (the run log, its callbacks, the progress bar), each
        on the run's ``stack`` as it opens, so that an error from here on closes them.
        ``replaced``: an earlier run moved aside (``--overwrite``), deleted once this run
        has a checkpoint."""
        self.s, self.total, self.step, self.run_id = s, total, start.step, start.run_id
        self.replaced = replaced
        self.main = s.world.is_main                # one writer: rank 0
        self.ckpt_dir = s.out / ckpt.FOLDER
        self.adapter_path = s.out / ADAPTER
        self.fingerprint = ckpt.base_fingerprint(s.cfg.model.path)
        # step of the newest checkpoint written (a resumed run's exists: not written again)
        self.saved_step: int | None = start.step if start.checkpoint is not None else None
        self.position = (0, 0)                   # (epoch, index) of the next step
        self.adapter_step: int | None = None     # the step adapter.gguf holds, once written
        self.last_eval: dict | None = None
        self.tokens_seen = 0
        self.best = Best()                       # the best validation (train.best)
        self.best_tensors: dict | None = None    # its adapter
        self.early_stop: str | None = None       # why the run stops early, once it does
        self.signalled_at_end: str | None = None  # a signal came during the run's last step
        self.bar = None
        stack.callback(self.say_replaced_kept)   # the last of the loop's to close
        self.records = RunLog(s.out, s.log, self.main)      # metrics.jsonl, the callbacks
        stack.callback(self.records.close)
        if self.main and s.cfg.output.tensorboard:
            from pytrain.run.tensorboard import TensorBoard
            resumed = start.checkpoint is not None     # its first step purges later events
            self.records.add(TensorBoard(s.out, resume_step=self.step + 1 if resumed else None))
        if progress and sys.stderr.isatty():     # a log file gets the periodic lines only
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=self.step, unit="step", dynamic_ncols=True,
                            file=sys.stderr)
            stack.callback(self.close_bar)
        t = s.cfg.train
        self.prompts = samples_mod.prompts_for(s.cfg, s.model, s.splits) \
            if t.sample_every and self.main else []
        self.sampled_step: int | None = None
        self.t_start = time.perf_counter()
        self.recent: list[float] = []          # losses since the last log line

    def record(self, rec: dict) -> None:
        self.records.record(rec)

    def sample(self) -> None:
        """Greedy generations of the sample prompts (rank 0), into samples.jsonl, above the
        progress bar (the first one), and to the callbacks."""
        if not self.prompts or self.sampled_step == self.step:
            return
        s = self.s
        got = samples_mod.generate(s.model, s.adapter, self.prompts,
                                   s.cfg.train.sample_max_tokens)
        self.records.samples(self.step, got)
        first = got[0]["completion"].replace("\n", " ")
        self.say(f"step {self.step}: sample 1/{len(got)}: "
                 f"{first[:100] + ('…' if len(first) > 100 else '')}")
        self.sampled_step = self.step

    def validate(self) -> dict | None:
        s = self.s
        if not s.valid_batches:
            return None
        ev = s.trainer.evaluate(s.valid_batches)
        t = s.cfg.train
        new_best = self.best.update(self.step, ev["loss"], t.early_stopping_min_delta)
        if new_best:
            self.keep_best(s.adapter.get())
        self.record({"step": self.step, "split": "valid", **ev, "best_step": self.best.step,
                     "best_loss": self.best.loss, "drift": s.adapter.drift()})
        # the patience spent at the last step stops nothing: the run ends there anyway (the
        # count goes into the checkpoint; a resume that extends the run carries it on)
        if self.best.exhausted(t.early_stopping_patience) and self.step < self.total:
            self.early_stop = self.best.why(t.early_stopping_patience,
                                            t.early_stopping_min_delta)
        if s.preference:
            msg = (f"step {self.step}: validation loss {ev['loss']:.4f}  reward accuracy "
                   f"{ev['rewards/accuracies']:.3f}  margin {ev['rewards/margins']:.4f}  "
                   f"({ev['pairs']} pairs)")
        else:
            msg = (f"step {self.step}: validation loss {ev['loss']:.4f}  accuracy "
                   f"{ev['accuracy']:.3f}  perplexity {ev['perplexity']:.2f}  "
                   f"({ev['n_valid']} targets)")
        self.say(msg + ("  (best)" if new_best else ""))
        self.last_eval = ev
        return ev

    def keep_best(self, tensors: dict) -> None:
        """The best validation's adapter: held for the checkpoints, written (rank 0) as
        adapter.best.gguf and, with the peft format, peft-best/ (each replaced atomically)."""
        self.best_tensors = tensors
        s = self.s
        if self.main:
            save_adapter(s.model, s.adapter, s.out / BEST_ADAPTER, s.cfg.output.formats,
                         tensors, peft_dir=BEST_PEFT)

    def say(self, msg: str) -> None:
        """A line for the user, above the progress bar when there is one."""
        if self.bar is not None:
            self.bar.write(msg)
        else:
            self.s.log(msg)

    def log_steps(self, r, lr: float) -> None:
        """Every ``train.log_every`` steps: the mean loss of the steps since the last line."""
        self.recent.append(r.loss)
        if self.step % self.s.cfg.train.log_every and self.step != self.total:
            return
        el = time.perf_counter() - self.t_start
        pref = (f"  margin {r.extra['rewards/margins']:.4f}  reward accuracy "
                f"{r.extra['rewards/accuracies']:.3f}" if r.extra else "")
        self.say(f"step {self.step}/{self.total}: loss {sum(self.recent) / len(self.recent):.4f}"
                 f" (mean of {len(self.recent)}){pref}  lr {lr:.2e}  grad norm "
                 f"{r.grad_norm:.3g}  {self.tokens_seen / el:.0f} tokens/s")
        self.recent.clear()

    def checkpoint(self) -> Path:
        """Adapter files of the run plus checkpoint ``step-N`` recording the next position.
        With several ranks, every rank's adapter must be the same (AdamW runs identically
        everywhere on the summed gradients): compared by digest, then rank 0 writes."""
        s = self.s
        where = self.ckpt_dir / f"step-{self.step:07d}"
        if s.world.size > 1:
            digest = hashlib.sha256(b"".join(v.tobytes() for _, v in sorted(
                s.adapter.get().items()))).hexdigest()
            digests = s.world.allgather((s.world.name, digest))
            differ = [n for n, d in digests if d != digests[0][1]]
            if differ:
                raise RanksDisagree(f"the adapter of {', '.join(differ)} differs from rank 0's "
                                    f"at step {self.step}: the ranks went apart (a bug); not "
                                    f"saved")
        if not self.main:
            self.saved_step = self.step
            return where
        save_adapter(s.model, s.adapter, self.adapter_path, s.cfg.output.formats)
        self.adapter_step = self.step
        epoch, index = self.position
        state = ckpt.TrainState(self.step, epoch, index, s.trainer.opt.t, self.fingerprint,
                                total_steps=self.total, resume_key=s.resume_key(),
                                run_id=self.run_id, best=self.best.to_dict(),
                                stopped_early=self.early_stop is not None)
        own = self.best.step in (None, self.step)        # the best is this step's adapter
        where = ckpt.save(self.ckpt_dir, self.step, s.adapter, s.trainer.opt_state.moments(),
                          state, keep=s.cfg.output.keep_checkpoints, arch=s.model.arch.name,
                          config_toml=s.cfg.to_toml(), metadata=adapter_metadata(s.model),
                          best=None if own else self.best_tensors)
        self.saved_step = self.step              # only once it is on disk
        if self.replaced is not None:
            drop_replaced(self.replaced, s.log)
            self.replaced = None
        return where

    def done(self, epoch: int) -> bool:
        t = self.s.cfg.train
        return self.step >= self.total or (not t.max_steps and epoch >= t.epochs)

    def run(self, start: tuple[int, int], interrupt: Interrupt) -> None:
        """Steps from position ``start`` to the end; after each one (skipped ones too), the
        stop every rank agrees on when any of them was asked to (Ctrl-C, SIGTERM)."""
        s, t, w = self.s, self.s.cfg.train, self.s.world
        self.position = start
        for epoch, index, micro in s.steps_from(*start):
            if self.done(epoch) or self.early_stop:
                return
            lr = schedule(t.schedule, self.step, self.total, t.lr, t.warmup)
            # this rank's share of the step (possibly none: it still joins the collectives)
            with interrupt.interruptible():             # a second signal drops it whole
                r = s.trainer.step(micro[w.rank::w.size], lr)   # NonFiniteLoss: no change
            self.position = (epoch, index + 1)
            if r is None:                              # no valid target: skipped, counted
                self.record({"step": self.step + 1, "skipped": "no valid targets"})
            else:
                self.finished(r, epoch, lr)
            if signals.requested(interrupt, w):     # every rank stops after this step
                if self.step >= self.total or self.early_stop:
                    # the step was the run's last: it ends as finished, not interrupted
                    self.signalled_at_end = signals.name(interrupt)
                else:
                    raise signals.after_step(interrupt, self.step, self.saved())
            if self.early_stop:
                self.record({"step": self.step, "early_stop": self.early_stop})
                self.say(self.early_stop)
                return

    def finished(self, r, epoch: int, lr: float) -> None:
        """A step done: its metrics, the progress line, validation and the periodic checkpoint
        when they are due."""
        s, t, w = self.s, self.s.cfg.train, self.s.world
        self.step += 1
        self.tokens_seen += r.tokens
        self.record({"step": self.step, "epoch": epoch, "loss": r.loss, "n_valid": r.n_valid,
                     "lr": lr, "grad_norm": r.grad_norm, "clip": r.clip, "tokens": r.tokens,
                     "tokens_per_s": r.tokens / r.seconds if r.seconds > 0 else None,
                     **({"allreduce_s": r.allreduce_seconds} if w.size > 1 else {}),
                     **(r.extra or {}), "drift": s.adapter.drift()})
        if self.bar is not None:
            el = time.perf_counter() - self.t_start
            pref = ({"margin": f"{r.extra['rewards/margins']:.3f}",
                     "acc": f"{r.extra['rewards/accuracies']:.2f}"} if r.extra else {})
            self.bar.set_postfix(loss=f"{r.loss:.4f}", **pref,
                                 tok_s=f"{self.tokens_seen / el:.0f}", lr=f"{lr:.2e}")
            self.bar.update(1)
        self.log_steps(r, lr)
        if t.eval_every and self.step % t.eval_every == 0 and self.step < self.total:
            self.validate()
        if t.sample_every and self.step % t.sample_every == 0 and self.step < self.total:
            self.sample()
        # the last step's checkpoint comes after its validation (in _train), so that it holds
        # the best that validation may set: written here, a resume would restore an older one
        if t.save_every and self.step % t.save_every == 0 and self.step < self.total:
            self.checkpoint()

    def saved(self) -> Path:
        """The checkpoint of the last finished step, written now if it has none yet."""
        if self.saved_step != self.step:
            return self.checkpoint()
        return self.ckpt_dir / f"step-{self.step:07d}"

    def stop_at_once(self, interrupt: Interrupt) -> None:
        """A second Ctrl-C / SIGTERM dropped the step in flight: write the checkpoint of the
        last finished step (if it has none yet) and stop."""
        ggml.request_abort(False)                # saving computes nothing, but be sure
        raise signals.at_once(interrupt, self.step, self.saved())

    def close_bar(self) -> None:
        self.bar.close()
        self.bar = None                          # later lines go to the log

    def say_replaced_kept(self) -> None:
        """On the way out: an earlier run moved aside (``--overwrite``) and not yet deleted
        (this run wrote no checkpoint) is kept, and where."""
        if self.replaced is not None and self.main:
            self.s.log(f"{self.replaced.why}: this run stopped before its first checkpoint; "
                       f"the earlier run is kept in {self.replaced.path}")
            self.replaced = None


# --------------------------------------------------------------------------- train

def train(cfg: Config, progress: bool = True, log=print, resume: str | bool | None = None,
          overwrite: bool = False) -> RunResult:
    """``resume``: True for the newest checkpoint of the run folder, or a checkpoint path.
    ``overwrite``: a fresh run may replace an earlier run left in ``output.dir`` (folder.py).
    Under an MPI launcher every rank calls this; rank 0 alone writes (distributed).
    Ctrl-C and SIGTERM are handled as ``pytrain.run.signals`` says, on the main thread
    only: called from another thread, the run handles no signal (and says so).

    Everything the run opens goes on one ``ExitStack`` as it opens: the signal handlers, the
    folder's lock, the model and trainer, the run log and its callbacks, the progress bar;
    any way out closes them in reverse.  (The MPI communicator is the process's, not the
    run's: the command line still needs it to end the job.)"""
    w = get_world()
    agree(w, lambda: _refuse_unsupported(cfg, resume, overwrite))
    if not w.is_main:
        log, progress = (lambda *a, **k: None), False
    try:
        with ExitStack() as stack:
            interrupt = stack.enter_context(signals.handling(log, w))
            return _claim_and_train(cfg, w, log, progress, resume, overwrite, interrupt, stack)
    except KeyboardInterrupt:            # the signal that stops whatever runs, closing too
        if w.size > 1:
            raise
        raise signals.further(run_folder(cfg)) from None


def _claim_and_train(cfg: Config, w: World, log, progress: bool, resume, overwrite: bool,
                     interrupt: Interrupt, stack: ExitStack) -> RunResult:
    """The folder claimed, the run checked whole (config, data, model, targets), only then an
    earlier run moved aside (``--overwrite``), and trained."""
    def claim():            # rank 0: the folder, its lock, and what an earlier run left
        out = output_dir(cfg)
        run_dir = stack.enter_context(RunDir(out))
        return out, run_dir, not resume and run_dir.check_fresh(overwrite)
    try:
        claimed = on_main(w, claim)
    except RunDirError as e:
        raise RunError(str(e)) from None
    replace = claimed[2]
    out, run_dir = claimed[:2] if w.is_main else (run_folder(cfg), None)
    if w.is_main:
        forget_messages(out)        # an earlier attempt's error.log is not this run's
    s = agree(w, lambda: _open_fitting(cfg, out, log, w), undo=Session.close)
    stack.callback(s.close)
    if w.size > 1:
        check_agreement(w, _run_facts(s))
    why = "--overwrite" if overwrite else "new run"
    replaced = on_main(w, lambda: run_dir.set_aside(log, why)) if replace else None
    return _train(s, progress, resume, interrupt, stack, replaced)


def _open_fitting(cfg: Config, out: Path, log, w: World) -> Session:
    """The session, once the largest micro-batch the config allows is known to fit its
    memory: the rule ``pytrain plan`` applies (pytrain/step/step_memory.py)."""
    from pytrain.step.step_memory import check_run_fits
    s = open_session(cfg, out, log, w)
    try:
        check_run_fits(cfg, s.model, s.adapter, s.trainer.opt_state,
                       s.splits.train + (s.splits.valid or []))
    except BaseException:
        s.close()
        raise
    return s


def _refuse_unsupported(cfg: Config, resume, overwrite: bool) -> None:
    if cfg.output.tensorboard:
        from pytrain.run.tensorboard import available
        if available() is not None:
            raise cfg.error("output", "tensorboard", available())
    if resume and overwrite:
        raise RunError("--overwrite starts a new run and --resume continues one: pass one")


def _run_facts(s: Session) -> dict[str, str]:
    """What every rank of a run must agree on: config, training data, base model, the types
    its weights were loaded as (auto chooses by each rank's memory), build."""
    info = ggml.build_info()
    return {"config": hashlib.sha256(s.cfg.to_toml().encode()).hexdigest()[:16],
            "training data": s.resume_key()["training examples"][:16],
            "base model": ckpt.base_fingerprint(s.cfg.model.path)["header_sha256"][:16],
            "weight types": ", ".join(sorted({f"{r.file_type}->{r.loaded_type}"
                                              for r in s.model.weights.report.values()})),
            "build": hashlib.sha256(json.dumps([info["archive_sha256"], info["patches_sha256"],
                                               info.get("ffi_sha256")]).encode()).hexdigest()[:16]}


def reference_key(s: Session, fingerprint: dict) -> dict:
    """What the cached reference log-probabilities depend on besides the pairs: the model
    file's content (its fingerprint, and its modification time: a file rewritten in place
    with other weights keeps its header and size), the types its weights were loaded as, the
    objective, and the adapter's initial state (the policy the reference stands for at step
    0).  A cache made for anything else is recomputed (``PreferenceTrainer``)."""
    c = s.cfg
    return {"model file": {**fingerprint, "mtime_ns": os.stat(c.model.path).st_mtime_ns},
            "weight types": sorted({f"{r.file_type}->{r.loaded_type}"
                                    for r in s.model.weights.report.values()}),
            "objective": c.train.objective,
            "adapter": {"init": c.lora.init, "seed": c.lora.seed, "rank": c.lora.rank,
                        "alpha": c.lora.alpha, "tensors": sorted(s.adapter.names)}}


def _train(s: Session, progress: bool, resume: str | bool | None, interrupt: Interrupt,
           stack: ExitStack, replaced: SetAside | None = None) -> RunResult:
    total = s.total_steps()
    main = s.world.is_main
    # checked against the checkpoint before anything of the run is rewritten
    start = resume_mod.start(s, resume, total)
    resumed = start.checkpoint is not None
    if resume and not resumed:       # an earlier run with no checkpoint, started again
        replaced = on_main(s.world, lambda: RunDir(s.out).set_aside(
            s.log, "--resume", keep=(ckpt.FOLDER,)))     # no checkpoint, maybe a timeline's
    loop = None
    try:
        if main:
            if not resumed:
                run_log.start_fresh(s.out)
            atomic.write_bytes(s.out / CONFIG, s.cfg.to_toml().encode())
            atomic.write_bytes(s.out / DATA_STATS,
                               (json.dumps(s.stats, indent=2) + "\n").encode())
        loop = Loop(s, total, start, stack, progress, replaced)
        if resumed:
            resume_mod.restore_best(s, loop, start)
        if s.preference and s.trainer.uses_reference:
            s.trainer.load_or_compute_reference(s.out, s.splits, s.cfg.train.batch_size, s.log,
                                                reference_key(s, loop.fingerprint))
        if not resumed:
            loop.validate()                    # the base model's metrics: the "before"
            loop.sample()
        interrupt.training()
        s.trainer.hold = interrupt.holding
        loop.run(start.position, interrupt)
        # a resumed run with nothing left to do writes nothing new; one stopped early has
        # just been validated; one asked to stop during its last step is complete, and
        # neither validated nor sampled again (what the signal asked not to wait for)
        if loop.signalled_at_end:
            s.log(f"{loop.signalled_at_end} came during the last step: the run is complete at "
                  f"step {loop.step}; the final validation and samples are skipped")
            loop.last_eval = None
        elif loop.step > start.step or not resumed:
            if not loop.early_stop:
                loop.validate()
            loop.sample()
        if loop.saved_step != loop.step:
            loop.checkpoint()
        elif main and not loop.adapter_path.exists():
            save_adapter(s.model, s.adapter, loop.adapter_path, s.cfg.output.formats)
            loop.adapter_step = loop.step
    except NonFiniteLoss as e:
        _stop_on_nan(s, loop, e)
    except KeyboardInterrupt:                  # a second Ctrl-C / SIGTERM dropped a step
        if loop is None or not signals.can_save(interrupt, s.world):
            raise
        try:
            loop.stop_at_once(interrupt)
        except OSError as e:
            raise _write_failed(s, loop, e) from e
    except OSError as e:                       # a full disk, the file size limit
        raise _write_failed(s, loop, e) from e
    b = loop.best
    return RunResult(s.out, loop.adapter_path, loop.step, loop.last_eval,
                     best=None if b.step is None else {"step": b.step, "loss": b.loss,
                                                       "adapter": s.out / BEST_ADAPTER},
                     early_stop=loop.early_stop)


# what to do before resuming, after a write failed with this errno
_WRITE_FIX = {errno.ENOSPC: "there is space on its disk again",
              errno.EDQUOT: "there is room in your disk quota again",
              errno.EFBIG: "the file size limit (ulimit -f) allows the file",
              errno.EROFS: "its file system is writable again"}


def _write_failed(s: Session, loop: Loop | None, e: OSError) -> RunError:
    """A write of the run failed (a full disk, a quota, the file size limit): the error that
    names the file, the run folder and what is kept.  Every file is written atomically, so
    the step in flight is all that is lost: the last complete checkpoint is whole."""
    if e.errno in _WRITE_FIX or e.errno is None:     # errno None: numpy's short write
        what = (f"could not write {e.filename}: " if e.filename else "a write failed: ")
    else:
        what = f"{e.filename}: " if e.filename else ""
    what += str(e.strerror or e)
    try:
        latest = ckpt.latest(s.out / ckpt.FOLDER)
    except OSError:
        latest = None
    done = f"The run trained to step {loop.step}; " if loop is not None else ""
    fix = _WRITE_FIX.get(e.errno, "the cause is fixed")
    if latest is not None:
        kept = (f"{'t' if done else 'T'}he last complete checkpoint is {latest} (step {ckpt.step_of(latest)}): "
                f"--resume continues from it once {fix}")
    else:
        kept = f"No checkpoint was written: --resume starts the run again once {fix}"
    if loop is not None and loop.adapter_step is not None:
        kept += f"; {loop.adapter_path} holds step {loop.adapter_step}"
    return RunError(f"{what} (run folder {s.out}). {done}{kept}")


def _stop_on_nan(s: Session, loop: Loop, e: NonFiniteLoss) -> None:
    """Keep the last good adapter, record where the run stopped, raise the error that says
    so (a failure writing the adapter is added to it, never put in its place)."""
    stopped = f"stopped at step {loop.step + 1}: {e}; kept the adapter from step {loop.step}"
    try:
        if s.world.is_main:
            save_adapter(s.model, s.adapter, loop.adapter_path, s.cfg.output.formats)
            loop.adapter_step = loop.step
        loop.record({"step": loop.step + 1, "stopped": stopped})
    except Exception as err:
        stopped = f"{stopped} (but it could not be written: {err})"
    raise NonFiniteStop(f"{stopped}: {loop.adapter_path}") from None
