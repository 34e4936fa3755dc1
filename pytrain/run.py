"""`pytrain train`: config → data → batches → graphs → loss → optimizer → adapter files.

Writes into the run folder: config.toml (resolved), data_stats.json, metrics.jsonl (one line
per step and per validation), loss.png, adapter.gguf (llama.cpp --lora).  A NaN or inf loss
stops the run naming the step and keeps the last good adapter.
"""
from __future__ import annotations

import json
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path


from pytrain import checkpoint as ckpt
from pytrain import lora as lora_mod
from pytrain.adapter_gguf import write_lora_gguf
from pytrain.config import Config
from pytrain.data import load_data, make_batches, pad_token_id
from pytrain.lora_targets import select_targets
from pytrain.model import Model, load_model
from pytrain.optimizer import AdamW, schedule
from pytrain.trainer import NonFiniteLoss, Trainer


class RunError(RuntimeError):
    """A run that cannot start or had to stop; the message says why and what was kept."""


@dataclass
class RunResult:
    out_dir: Path
    adapter: Path
    steps: int
    final_eval: dict | None
    stopped: str | None = None


def output_dir(cfg: Config) -> Path:
    out = Path(cfg.output.dir or Path("runs") / "run")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise RunError(f"output.dir {out}: not writable ({e.strerror or e})") from e
    return out


def save_adapter(model: Model, adapter, path: Path, formats=("gguf",)) -> Path:
    """The adapter in each requested format: llama.cpp GGUF at ``path``, and a PEFT folder
    (adapter_config.json + adapter_model.safetensors) beside it in ``peft/``."""
    tensors = adapter.get()
    if "peft" in formats:
        from pytrain.adapter_peft import write_peft_adapter
        write_peft_adapter(path.parent / "peft", tensors, adapter.alpha, adapter.rank,
                           base_model_name_or_path=Path(model.path).name,
                           model_config=model.config)
    return write_lora_gguf(path, "qwen35", adapter.alpha, tensors,
                           base_metadata={"general.name": f"pytrain LoRA for {Path(model.path).name}"})


def step_batches(batches: list, grad_accum: int) -> list[list]:
    return [batches[i:i + grad_accum] for i in range(0, len(batches), grad_accum)]


def plot_losses(metrics_path: Path, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, valid = [], []
    for line in metrics_path.read_text().splitlines():
        r = json.loads(line)
        if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]):
            (valid if r.get("split") == "valid" else train).append((r["step"], r["loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train (valid tokens)", lw=1)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation", lw=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy per target token")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


class Interrupt:
    """First Ctrl-C / SIGTERM: finish the current step, write a checkpoint, stop.  Second:
    stop at once (the previous checkpoint is intact: checkpoints are written atomically)."""

    def __init__(self):
        self.requested = None
        self.old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.old[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame):
        if self.requested is not None:
            self.__exit__()
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, h in self.old.items():
            signal.signal(sig, h)
        self.old = {}


def train(cfg: Config, progress: bool = True, log=print, resume: str | bool | None = None
          ) -> RunResult:
    """``resume``: True for the newest checkpoint of the run folder, or a checkpoint path."""
    if cfg.lora.dropout > 0:
        raise RunError("lora.dropout > 0 is not supported yet (ggml has no random op to draw "
                       "dropout masks inside the graph); set lora.dropout = 0")
    out = output_dir(cfg)
    (out / "config.toml").write_text(cfg.to_toml())
    model = load_model(cfg.model.path, cfg.model.device, cfg.model.threads, cfg.model.type_policy)
    tok = model.tokenizer
    splits = load_data(cfg.data, tok)
    stats = {"train": splits.train_stats.to_dict(),
             "valid": splits.valid_stats.to_dict() if splits.valid_stats else None}
    log(splits.train_stats.summary())
    names = select_targets(model.config, cfg.lora.targets, cfg.lora.skip_ssm)
    adapter = lora_mod.create(model.runtime, model.config, names, cfg.lora.rank, cfg.lora.alpha,
                              seed=cfg.lora.seed if cfg.lora.seed is not None else cfg.train.seed,
                              init=cfg.lora.init)
    t = cfg.train
    hp = AdamW(lr=t.lr, beta1=t.adam_beta1, beta2=t.adam_beta2, eps=t.adam_eps,
               weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm)
    trainer = Trainer(model, adapter, hp, buggy_loss=t.loss_bug_repro)
    pad = pad_token_id(tok)
    seed = cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else t.seed
    valid_batches = make_batches(splits.valid, t.batch_size, cfg.data.packing, seed, shuffle=False,
                                 max_seq_len=cfg.data.max_seq_len, pad_id=pad) if splits.valid else []

    def epoch_steps(epoch: int) -> list[list]:
        b = make_batches(splits.train, t.batch_size, cfg.data.packing, seed + epoch,
                         max_seq_len=cfg.data.max_seq_len, pad_id=pad)
        if epoch == 0:
            splits.train_stats.record_batches(b)
            stats["train"] = splits.train_stats.to_dict()
        return step_batches(b, t.grad_accum)

    first = epoch_steps(0)
    total = t.max_steps if t.max_steps else t.epochs * len(first)
    (out / "data_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    fingerprint = ckpt.base_fingerprint(cfg.model.path)
    ckpt_dir = out / "checkpoints"
    step, epoch, position = 0, 0, 0
    if resume:
        where = ckpt.latest(ckpt_dir) if resume is True else Path(resume)
        if where is not None and where.is_dir() and not (where / "state.json").exists():
            where = ckpt.latest(where)
        if where is None or not (where / "state.json").exists():
            raise RunError(f"no checkpoint to resume from in {ckpt_dir if resume is True else resume}")
        state, tensors, moments = ckpt.load(where, cfg.model.path)
        adapter.set(tensors)
        trainer.acc.set_moments(moments)
        trainer.opt.t = state.adam_t
        step, epoch, position = state.step, state.epoch, state.position
        log(f"resuming from {where} at step {step}")
    metrics_path = out / "metrics.jsonl"
    metrics = open(metrics_path, "a" if resume else "w")
    adapter_path = out / "adapter.gguf"
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)

    def validate(step: int) -> dict | None:
        if not valid_batches:
            return None
        ev = trainer.evaluate(valid_batches)
        rec = {"step": step, "split": "valid", **ev, "drift": adapter.drift()}
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()
        if bar is not None:
            bar.write(f"step {step}: validation loss {ev['loss']:.4f}  accuracy {ev['accuracy']:.3f}  "
                      f"perplexity {ev['perplexity']:.2f}  ({ev['n_valid']} targets)")
        return ev

    def checkpoint(pos_epoch: int, pos: int) -> Path:
        state = ckpt.TrainState(step, pos_epoch, pos, trainer.opt.t, fingerprint)
        save_adapter(model, adapter, adapter_path, cfg.output.formats)
        return ckpt.save(ckpt_dir, step, adapter, trainer.acc.moments(), state,
                         keep=cfg.output.keep_checkpoints)

    stopped, last_eval = None, None
    if not resume:
        validate(0)   # the base model's validation metrics: the "before" of the run
    schedule_steps = first if epoch == 0 else epoch_steps(epoch)
    if bar is not None:
        bar.update(step)
    t_start = time.perf_counter()
    tokens_seen = 0
    interrupt = Interrupt().__enter__()
    try:
        while step < total:
            for pos in range(position, len(schedule_steps)):
                micro = schedule_steps[pos]
                if step >= total:
                    break
                lr = schedule(t.schedule, step, total, t.lr, t.warmup)
                try:
                    r = trainer.step(micro, lr)
                except NonFiniteLoss as e:
                    stopped = f"stopped at step {step + 1}: {e}; kept the adapter from step {step}"
                    raise
                if r is None:   # no valid target in this step: skipped, counted
                    metrics.write(json.dumps({"step": step + 1, "skipped": "no valid targets"}) + "\n")
                    continue
                step += 1
                tokens_seen += r.tokens
                rec = {"step": step, "epoch": epoch, "loss": r.loss, "n_valid": r.n_valid, "lr": lr,
                       "grad_norm": r.grad_norm, "clip": r.clip, "tokens": r.tokens,
                       "tokens_per_s": r.tokens / r.seconds if r.seconds > 0 else None,
                       "drift": adapter.drift()}
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
                if bar is not None:
                    el = time.perf_counter() - t_start
                    bar.set_postfix(loss=f"{r.loss:.4f}", tok_s=f"{tokens_seen / el:.0f}", lr=f"{lr:.2e}")
                    bar.update(1)
                if t.eval_every and step % t.eval_every == 0 and step < total:
                    last_eval = validate(step)
                at_end_of_epoch = pos + 1 == len(schedule_steps)
                nxt = (epoch + 1, 0) if at_end_of_epoch else (epoch, pos + 1)
                if t.save_every and step % t.save_every == 0:
                    checkpoint(*nxt)
                if interrupt.requested:
                    where = checkpoint(*nxt)
                    raise RunError(f"interrupted by {interrupt.requested} after step {step}; "
                                   f"checkpoint {where} (resume with --resume)")
            epoch += 1
            position = 0
            if step < total:
                schedule_steps = epoch_steps(epoch)
    except NonFiniteLoss:
        save_adapter(model, adapter, adapter_path, cfg.output.formats)   # still the last good ones
        metrics.write(json.dumps({"step": step + 1, "stopped": stopped}) + "\n")
        metrics.close()
        if bar is not None:
            bar.close()
        plot_losses(metrics_path, out / "loss.png")
        raise RunError(f"{stopped}: {adapter_path}")
    except RunError:
        metrics.close()
        if bar is not None:
            bar.close()
        plot_losses(metrics_path, out / "loss.png")
        raise
    finally:
        interrupt.__exit__()
    if bar is not None:
        bar.close()
    last_eval = validate(step)
    checkpoint(epoch, 0)
    metrics.close()
    plot_losses(metrics_path, out / "loss.png")
    trainer.close()
    return RunResult(out, adapter_path, step, last_eval, stopped)
