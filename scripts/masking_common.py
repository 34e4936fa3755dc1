"""What the masking experiments share: their configs, data files, adapters, gradients, tables
and plots.  Apart so that each experiment's module (scripts/masking_seed003.py,
scripts/masking_seed000.py, scripts/masking_widths.py) reads as its own procedure."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from pytrain.config import Config, load_config
from pytrain.data import pad_token_id
from pytrain.models import lora as lora_mod
from pytrain.models.lora_targets import select_targets

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = ROOT / "config" / "experiments"
FIXTURE = ROOT / "tests" / "fixtures" / "qwen35" / "gqa-f32.gguf"
CONFIGS = {"seed003": "seed003_sft.toml", "seed000": "seed000_padding.toml",
           "padwidth": "padding_width.toml", "accum": "grad_accum.toml", "packing": "packing.toml",
           "real": "seed000_real.toml"}
EXPERIMENTS = tuple(CONFIGS)
SYSTEM = "You are a helpful assistant."


# ============================================================================ shared helpers
def quiet(*_a, **_k) -> None:
    pass


def config(name: str, overrides=(), **values) -> Config:
    """The experiment's config with ``overrides`` (strings, as --set) and then ``values``
    (``section__key=value``, set by the script: data paths, output dir, the varied knob)."""
    ov = list(overrides) + [f"{k.replace('__', '.')}={json.dumps(v)}" for k, v in values.items()]
    return load_config(CONFIG_DIR / CONFIGS[name], ov)


def model_path(cfg: Config) -> str:
    """The config's model, or the converter-made gqa fixture when that file does not exist."""
    if cfg.model.path and Path(cfg.model.path).exists():
        return cfg.model.path
    print(f"  note: {cfg.model.path} does not exist; using the gqa test fixture instead",
          file=sys.stderr)
    return str(FIXTURE)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(q: str, a: str, system: str | None = None) -> dict:
    msgs = [{"role": "system", "content": system}] if system else []
    return {"messages": msgs + [{"role": "user", "content": q},
                                {"role": "assistant", "content": a}]}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def batch_logits(model, examples, lora=None, batch_size: int = 32) -> list[np.ndarray]:
    """Log-probabilities [len, V] of each example (right-padded batches, padding isolated)."""
    out = []
    pad = pad_token_id(model.tokenizer)
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        T = max(len(e) for e in chunk)
        tok = np.full((len(chunk), T), pad, np.int64)
        seg = np.full((len(chunk), T), -1, np.int64)
        for b, e in enumerate(chunk):
            tok[b, :len(e)] = e.tokens
            seg[b, :len(e)] = 0
        lg = model.logits(tok, seg=seg, lora=lora)
        out += [log_softmax(lg[b, :len(e)]) for b, e in enumerate(chunk)]
    return out


def make_adapter(model, cfg: Config, b_std: float = 0.0, seed: int = 0):
    """A LoRA as the config describes; ``b_std`` > 0 draws B ~ N(0, b_std²) instead of zeros,
    so that A receives gradient too (for the gradient comparisons of part c)."""
    names = select_targets(model.config, cfg.lora.targets, cfg.lora.skip_ssm)
    ad = lora_mod.create(model.runtime, model.config, names, cfg.lora.rank, cfg.lora.alpha,
                         seed=seed, init=cfg.lora.init)
    if b_std > 0:
        rng = np.random.default_rng(seed + 1)
        vals = ad.get()
        for k in vals:
            if k.endswith("lora_b"):
                vals[k] = rng.normal(0.0, b_std, vals[k].shape).astype(np.float32)
        ad.set(vals)
    return ad


def flat(grads: dict) -> np.ndarray:
    return np.concatenate([grads[k].ravel().astype(np.float64) for k in sorted(grads)])


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖ / ‖b‖."""
    nb = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / nb if nb > 0 else float("nan")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def md_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            if not math.isfinite(v):
                return "–"
            return f"{v:.3g}" if abs(v) < 1e-3 and v != 0 else f"{v:.3f}"
        return str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    return pyplot


def save_plot(p, fig, png: Path) -> None:
    """Lay the figure out, write it at the experiments' resolution and free it."""
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    p.close(fig)


def xy_plot(png: Path, xlabel: str, ylabel: str, series: list[tuple], logx: bool = False) -> None:
    """One axis of lines, ``series`` = [(x, y, matplotlib format, label)], written to ``png``."""
    p = plt()
    fig, ax = p.subplots(figsize=(6, 4))
    for x, y, style, label in series:
        (ax.semilogx if logx else ax.plot)(x, y, style, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    ax.grid(alpha=0.3)
    save_plot(p, fig, png)


def save_results(folder: Path, name: str, res: dict, markdown: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.md").write_text(markdown + "\n")
    (folder / "results.json").write_text(json.dumps(res, indent=1, default=float) + "\n")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    return sorted((int(p.name.split("-")[1]), p / "adapter.gguf")
                  for p in (run_dir / "checkpoints").glob("step-*"))


def load_adapter_into(model, ad, path: Path):
    """``ad`` (created once) set to the tensors of the adapter file ``path``."""
    from pytrain.formats.adapter_gguf import read_lora_gguf
    if ad is None:
        from pytrain.cli import _load_adapter
        return _load_adapter(model, path)
    ad.set(read_lora_gguf(path)[2])
    return ad


# random filler words (seed 003's context, seed 000's long turns)
WORDS = ("the cat sat on a red mat and the dog ran to the big green tree while a small bird "
         "sang in the warm sun near the old house by the river").split()
