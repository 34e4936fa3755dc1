"""Run configuration: a TOML file (plus ``--set section.key=value`` overrides) as dataclasses.

Why strict: a misspelt key (``learning_rate`` for ``lr``) or a quoted number silently falling
back to a default is the same class of quiet bug as an unmasked loss, so every unknown key and
every wrong type is an error that names the key, the file and, when it can be found, the line.
Each field carries its help text in ``metadata["help"]`` (:func:`describe` prints them all).

Paths written in a file resolve against that file's folder, so a config and its data can move
together; paths given as overrides resolve against the working directory, as a shell user
expects.  Seeds left unset (``data.shuffle_seed``, ``lora.seed``) follow ``train.seed`` and are
stored resolved, so the saved config (:meth:`Config.to_toml`) reproduces the run.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union, get_args, get_origin, get_type_hints
import types

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from pytrain.errors import PytrainError
from pytrain.models.lora_targets import DEFAULT_TARGETS, VALID_TARGETS

FORMATS = ("chat", "completion", "text", "auto")
MASKS = ("assistant_only", "completion_only", "all")
# Which masks make sense for which record format; the first is the format's default.
MASKS_FOR_FORMAT = {"chat": ("assistant_only", "all"),
                    "completion": ("completion_only", "all"),
                    "text": ("all",)}
OUTPUT_FORMATS = ("gguf", "peft")


class ConfigError(PytrainError, ValueError):
    """A config file or override that is not valid; the message names key, file and line."""


def _opt(default: Any = None, help: str = "", *, choices: Sequence[Any] | None = None,
         check: Callable[[Any], str | None] | None = None, path: bool = False,
         factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with help text, allowed values, a range check and a path flag."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "check": check,
            "path": path}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _positive(v: Any) -> str | None:
    return None if v is None or v > 0 else "must be > 0"


def _non_negative(v: Any) -> str | None:
    return None if v is None or v >= 0 else "must be >= 0"


def _unit_interval(v: float) -> str | None:
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


# ------------------------------------------------------------------------------- sections
@dataclass
class ModelConfig:
    """The frozen base model."""

    path: str | None = _opt(None, "GGUF model file (required)", path=True)
    device: str = _opt("auto", "compute device: cpu, cuda, or auto (cuda when available)",
                       choices=("cpu", "cuda", "auto"))
    threads: int | None = _opt(None, "CPU threads (unset: ggml's default)", check=_positive)
    type_policy: str = _opt("auto", "types the frozen weights are loaded as: auto (what every "
                            "op of the training graph supports on the device), f32, or keep "
                            "(as stored; may be unsupported)", choices=("auto", "f32", "keep"))


@dataclass
class DataConfig:
    """Training and validation data (JSONL) and how it becomes batches."""

    train: str | None = _opt(None, "training JSONL file (required)", path=True)
    validation: str | None = _opt(None, "validation JSONL file (unset or \"none\": no file)",
                                  path=True)
    split: float = _opt(0.0, "fraction of the training examples held out for validation when "
                        "there is no validation file (0: none)", check=_unit_interval)
    format: str = _opt("auto", "record format: chat ({\"messages\": [...]}), completion "
                       "({\"prompt\", \"completion\"}), text ({\"text\"}), or auto (decided per "
                       "file from its first valid record)", choices=FORMATS)
    max_seq_len: int = _opt(1024, "longest example in tokens (and the packed row length)",
                            check=lambda v: None if v >= 2 else "must be >= 2")
    truncation: str = _opt("right", "longer examples: right (keep the start), left (keep the "
                           "end) or drop (skip them); counted either way",
                           choices=("right", "left", "drop"))
    packing: bool = _opt(False, "pack several examples into each row of max_seq_len tokens "
                         "(each keeps its own sample id, so no target crosses a sample)")
    mask: str | None = _opt(None, "which tokens are targets: assistant_only, completion_only "
                            "or all (unset: follows the format: assistant_only for chat, "
                            "completion_only for completion, all for text)", choices=MASKS)
    shuffle_seed: int | None = _opt(None, "seed of the batch order and the validation split "
                                    "(unset: train.seed)")
    on_error: str = _opt("stop", "bad records (malformed JSON, wrong types, unknown roles): stop "
                         "with an error naming file:line, or skip and count them",
                         choices=("stop", "skip"))

    def mask_for(self, fmt: str) -> str:
        """The mask used for records of format ``fmt`` (``mask`` or the format's default)."""
        return self.mask if self.mask is not None else MASKS_FOR_FORMAT[fmt][0]


@dataclass
class LoraConfig:
    """The LoRA adapter: which tensors, what size, how initialised."""

    rank: int = _opt(16, "adapter rank r", check=_positive)
    alpha: float = _opt(32.0, "scale numerator: the update is (alpha / rank) * B A",
                        check=_positive)
    dropout: float = _opt(0.0, "dropout on the adapter input; only 0 for now (ggml has no "
                          "random op to draw masks in the graph)", check=_unit_interval)
    targets: list[str] = _opt(help="short tensor names to adapt (attn_q, attn_k, attn_v, "
                              "attn_output, ffn_*, ...)", factory=lambda: list(DEFAULT_TARGETS))
    skip_ssm: bool = _opt(True, "never adapt the DeltaNet (linear-attention) layers; adapting "
                          "the recurrence destabilises sequential hybrids such as Qwen3.5")
    init: str = _opt("peft", "initialisation: peft (A Kaiming-uniform, B zero) or gaussian "
                     "(A ~ N(0, 1/rank), B zero); B = 0 so training starts at the base model",
                     choices=("peft", "gaussian"))
    seed: int | None = _opt(None, "seed of the adapter initialisation and dropout "
                            "(unset: train.seed)")


@dataclass
class TrainConfig:
    """Optimisation: steps, batch, AdamW, schedule, evaluation and saving cadence."""

    epochs: int = _opt(1, "passes over the training data (ignored when max_steps is set)",
                       check=_positive)
    max_steps: int | None = _opt(None, "optimizer steps to run; overrides epochs",
                                 check=_positive)
    batch_size: int = _opt(4, "examples (or packed rows) per micro-batch", check=_positive)
    grad_accum: int = _opt(1, "micro-batches per optimizer step; the loss is the token mean "
                           "over all of them", check=_positive)
    lr: float = _opt(1e-4, "peak learning rate", check=_positive)
    schedule: str = _opt("constant", "learning-rate schedule after warmup",
                         choices=("constant", "linear", "cosine"))
    warmup: int = _opt(0, "linear warmup steps from 0 to lr", check=_non_negative)
    weight_decay: float = _opt(0.0, "AdamW decoupled weight decay", check=_non_negative)
    max_grad_norm: float = _opt(1.0, "clip the global gradient norm to this (0 disables)",
                                check=_non_negative)
    seed: int = _opt(0, "run seed (also the default for data.shuffle_seed and lora.seed)")
    eval_every: int = _opt(0, "validate every N optimizer steps (0: only at the end)",
                           check=_non_negative)
    save_every: int = _opt(0, "checkpoint every N optimizer steps (0: only at the end)",
                           check=_non_negative)
    log_every: int = _opt(1, "log training loss every N optimizer steps", check=_positive)
    adam_beta1: float = _opt(0.9, "AdamW beta1", check=_unit_interval)
    adam_beta2: float = _opt(0.999, "AdamW beta2", check=_unit_interval)
    adam_eps: float = _opt(1e-8, "AdamW epsilon", check=_positive)
    recompute: str = _opt("auto", "activation memory: off (one graph per step keeps every "
                          "activation), layers (keep each layer's input only and recompute the "
                          "layer in the backward: a second forward, a fraction of the memory), "
                          "auto (layers when the one-graph step would need over 1/8 of the "
                          "device's memory)", choices=("auto", "off", "layers"))
    loss_bug_repro: bool = _opt(False, "reproduces the unfixed masking bug for the regression "
                                "experiments ONLY: pad labels trained, division by all rows, "
                                "prompt not masked; never for real training")


@dataclass
class OutputConfig:
    """Where the run writes adapters, checkpoints, logs and the resolved config."""

    dir: str | None = _opt(None, "run folder (unset: runs/<config name> under the working "
                           "directory)", path=True)
    formats: list[str] = _opt(help="adapter formats written: gguf (llama.cpp --lora) and/or "
                              "peft (adapter_model.safetensors + adapter_config.json)",
                              factory=lambda: ["gguf"])
    keep_checkpoints: int = _opt(3, "periodic checkpoints kept (0: keep all)",
                                 check=_non_negative)


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "lora": LoraConfig,
                             "train": TrainConfig, "output": OutputConfig}
REQUIRED = ("model.path", "data.train")


@dataclass
class Config:
    """A whole, validated run configuration; ``source`` is the file it came from, if any."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    source: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (JSON-ready; unset values are None), one entry per section."""
        return {name: {f.name: _copy(getattr(getattr(self, name), f.name))
                       for f in dataclasses.fields(cls)}
                for name, cls in SECTIONS.items()}

    def to_toml(self) -> str:
        """The config as TOML that :func:`load_config` reads back to an equal Config (paths
        are absolute; unset values are left out, TOML having no null)."""
        lines = [f"# resolved pytrain config{f' (from {self.source})' if self.source else ''}"]
        for name, values in self.to_dict().items():
            lines.append(f"\n[{name}]")
            for k, v in values.items():
                if v is not None:
                    lines.append(f"{k} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: str | Path | None = None,
                  *, partial: bool = False) -> "Config":
        """Validate a nested dict as if it were a TOML file in ``base_dir`` (default: cwd)."""
        base = Path(base_dir) if base_dir is not None else Path.cwd()
        return _build(data, "<dict>", None, base, [], partial=partial)


def _copy(v: Any) -> Any:
    return list(v) if isinstance(v, list) else v


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


# ------------------------------------------------------------------------------- loading
def load_config(path: str | Path | None, overrides: Iterable[str] = (), *,
                partial: bool = False) -> Config:
    """Read ``path`` (TOML), apply ``overrides`` (``section.key=value``, values parsed as TOML
    literals, else taken as a bare string) and validate everything.

    ``path`` None starts from the defaults (overrides must then name the required keys).
    ``partial`` skips the required-key check (for commands that need only some sections).
    Raises :class:`ConfigError`.
    """
    if path is not None:
        p = Path(path).expanduser()
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from e
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
            where = f"{path}:{m.group(1)}" if m else str(path)
            msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(e))
            raise ConfigError(f"{where}: invalid TOML: {msg}"
                              + (f" (column {m.group(2)})" if m else "")) from e
        source, base = str(path), p.resolve().parent
    else:
        text, raw, source, base = None, {}, "<defaults>", Path.cwd()
    parsed = [_parse_override(o) for o in overrides]
    cfg = _build(raw, source, text, base, parsed, partial=partial)
    cfg.source = str(Path(path).expanduser().resolve()) if path is not None else None
    if cfg.output.dir is None:
        stem = Path(path).stem if path is not None else "run"
        cfg.output.dir = str((Path.cwd() / "runs" / stem).resolve())
    return cfg


def _parse_override(item: str) -> tuple[str, str, Any, str]:
    """``section.key=value`` -> (section, key, value, label)."""
    label = f"--set {item}"
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or key.count(".") != 1 or not all(key.split(".")):
        raise ConfigError(f"{label}: expected section.key=value (for example train.lr=1e-4)")
    section, name = key.split(".")
    value = value.strip()
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return section, name, parsed, label


def _find_line(text: str | None, section: str, key: str | None = None) -> int | None:
    """Best-effort line of ``[section] key = ...`` (or of the section header) in TOML text;
    tomllib reports lines only for syntax errors."""
    if text is None:
        return None
    current = ""
    header_line = None
    qkey = r'(?:{0}|"{0}"|\'{0}\')'
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        m = re.match(r"^\[\s*([^\[\]]+?)\s*\]", s)
        if m:
            current = m.group(1).strip().strip('"\'')
            if current == section and header_line is None:
                header_line = n
            continue
        if key is None:
            if current == "" and re.match(qkey.format(re.escape(section)) + r"\s*[.=]", s):
                return n
            continue
        if current == section and re.match(qkey.format(re.escape(key)) + r"\s*=", s):
            return n
        if current == "" and re.match(qkey.format(re.escape(section)) + r"\s*\.\s*"
                                      + qkey.format(re.escape(key)) + r"\s*=", s):
            return n
    return header_line if key is None else None


class _Where:
    """Formats ``file:line: key: message`` for one source (file or override)."""

    def __init__(self, source: str, text: str | None) -> None:
        self.source, self.text = source, text

    def error(self, section: str, key: str | None, msg: str) -> ConfigError:
        line = _find_line(self.text, section, key)
        loc = f"{self.source}:{line}" if line else self.source
        name = f"{section}.{key}" if key else section
        return ConfigError(f"{loc}: {name}: {msg}")


def _build(raw: dict[str, Any], source: str, text: str | None, base: Path,
           overrides: list[tuple[str, str, Any, str]], *, partial: bool) -> Config:
    where = _Where(source, text)
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    origin: dict[tuple[str, str], tuple[_Where, Path]] = {}

    def take(section: str, key: str, value: Any, w: _Where, base_dir: Path) -> None:
        cls = SECTIONS[section]
        names = {f.name for f in dataclasses.fields(cls)}
        if key not in names:
            raise w.error(section, key, f"unknown key; valid keys of [{section}]: "
                                        f"{', '.join(sorted(names))}")
        values[section][key] = value
        origin[(section, key)] = (w, base_dir)

    for section, table in raw.items():
        if section not in SECTIONS:
            raise where.error(section, None, f"unknown section; valid sections: "
                                             f"{', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise where.error(section, None, f"expected a table [{section}], got "
                                             f"{_describe(table)}")
        for key, value in table.items():
            take(section, key, value, where, base)
    for section, key, value, label in overrides:
        w = _Where(label, None)
        if section not in SECTIONS:
            raise w.error(section, None, f"unknown section; valid sections: {', '.join(SECTIONS)}")
        take(section, key, value, w, Path.cwd())

    built: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in values[section]:
                continue
            w, base_dir = origin[(section, f.name)]
            try:
                v = _coerce(values[section][f.name], hints[f.name])
            except _TypeMismatch as e:
                raise w.error(section, f.name, str(e)) from None
            meta = f.metadata
            if v is not None and meta.get("choices") and v not in meta["choices"]:
                raise w.error(section, f.name, f"{v!r} is not one of "
                                               f"{', '.join(map(repr, meta['choices']))}")
            problem = meta["check"](v) if meta.get("check") and v is not None else None
            if problem:
                raise w.error(section, f.name, f"{problem}, got {v!r}")
            if meta.get("path") and v is not None:
                v = str((base_dir / Path(v).expanduser()).resolve())
            kwargs[f.name] = v
        built[section] = cls(**kwargs)
    cfg = Config(**built)

    def err(section: str, key: str, msg: str) -> ConfigError:
        w = origin.get((section, key), (where, base))[0]
        return w.error(section, key, msg)

    if not partial:
        for name in REQUIRED:
            section, key = name.split(".")
            if getattr(getattr(cfg, section), key) is None:
                raise ConfigError(f"{source}: {name}: required key missing")
    d = cfg.data
    if d.validation is not None and d.split > 0:
        raise err("data", "split", "a validation split is only taken when there is no "
                                   "data.validation file; set one or the other")
    if d.mask is not None and d.format != "auto" and d.mask not in MASKS_FOR_FORMAT[d.format]:
        raise err("data", "mask", f"{d.mask!r} does not apply to format {d.format!r} (valid: "
                                  f"{', '.join(MASKS_FOR_FORMAT[d.format])})")
    targets = []
    for t in cfg.lora.targets:
        t = t.strip().removesuffix(".weight")
        if t not in VALID_TARGETS:
            raise err("lora", "targets", f"unknown target {t!r}; valid: {', '.join(VALID_TARGETS)}")
        if t not in targets:
            targets.append(t)
    if not targets:
        raise err("lora", "targets", "no targets given")
    cfg.lora.targets = targets
    fmts = list(dict.fromkeys(cfg.output.formats))
    bad = [f for f in fmts if f not in OUTPUT_FORMATS]
    if bad or not fmts:
        what = f"{bad[0]!r} is not an adapter format" if bad else "no formats given"
        raise err("output", "formats", f"{what}; valid: {', '.join(OUTPUT_FORMATS)}")
    cfg.output.formats = fmts
    if d.shuffle_seed is None:
        d.shuffle_seed = cfg.train.seed
    if cfg.lora.seed is None:
        cfg.lora.seed = cfg.train.seed
    return cfg


class _TypeMismatch(Exception):
    pass


def _describe(v: Any) -> str:
    return f"{type(v).__name__} {v!r}" if not isinstance(v, dict) else "a table"


def _coerce(v: Any, tp: Any) -> Any:
    """``v`` as type ``tp`` (int, float, bool, str, list[str], X | None) or _TypeMismatch.

    No lossy conversions: a bool is not an int, a float is not an int, a quoted number is not
    a number.  An int is accepted for a float.  ``"none"`` unsets an optional value.
    """
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if v is None or (isinstance(v, str) and v.strip().lower() in ("none", "null")):
            return None
        return _coerce(v, args[0])
    if origin is list:
        (item,) = get_args(tp)
        if isinstance(v, str):  # "attn_q, attn_v" from a CLI override
            v = [s for s in re.split(r"[,\s]+", v) if s]
        if not isinstance(v, list):
            raise _TypeMismatch(f"expected a list of {item.__name__}s, got {_describe(v)}")
        return [_coerce(x, item) for x in v]
    if tp is bool:
        if isinstance(v, bool):
            return v
        raise _TypeMismatch(f"expected true or false, got {_describe(v)}")
    if tp is int:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        raise _TypeMismatch(f"expected an integer, got {_describe(v)}")
    if tp is float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if not math.isfinite(v):
                raise _TypeMismatch(f"expected a finite number, got {v!r}")
            return float(v)
        raise _TypeMismatch(f"expected a number, got {_describe(v)}")
    if tp is str:
        if isinstance(v, str):
            return v
        raise _TypeMismatch(f"expected a string, got {_describe(v)}")
    raise TypeError(f"unsupported config type {tp!r}")  # a bug in this module


# ------------------------------------------------------------------------------- help
def describe() -> str:
    """Every section and key with its type, default and help text (for ``--help`` output)."""
    out = []
    for section, cls in SECTIONS.items():
        out.append(f"[{section}]  {(cls.__doc__ or '').strip()}")
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tname = re.sub(r"<class '(\w+)'>|typing\.", r"\1", str(hints[f.name]))
            dflt = "unset" if default is None else _toml_value(default)
            out.append(f"  {f.name} ({tname}, default {dflt}): {f.metadata['help']}")
            if f.metadata.get("choices"):
                out.append(f"      one of: {', '.join(map(str, f.metadata['choices']))}")
        out.append("")
    return "\n".join(out)
