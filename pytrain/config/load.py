"""A TOML file plus ``--set`` overrides to a checked ``Config``: every unknown key and wrong
type is an error naming the key, the file and, when found, the line."""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import os
import types
from pathlib import Path
from typing import Any, Iterable, Mapping, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from pytrain.config.schema import (MASKS_FOR_FORMAT, OUTPUT_FORMATS, REQUIRED, SECTIONS, Config,
                                   ConfigError, _toml_value)

# ------------------------------------------------------------------------------- loading
def load_config(path: str | Path | Mapping[str, Any] | None,
                overrides: Iterable[str] | Mapping[str, Any] = (), *,
                partial: bool = False) -> Config:
    """Read ``path`` (TOML), apply ``overrides`` and validate everything.

    ``overrides``: the command line's ``section.key=value`` strings (values parsed as TOML
    literals, else taken as text: for a list key, the list it stands for), or a mapping
    ``{"section.key": value}`` of Python values (the Python API's form: no parsing, so ``"5"``
    stays a string, ``"attn_q"`` is no list; paths may be ``os.PathLike``).  ``path`` None
    starts from the defaults (overrides must then name the required keys); a mapping is the
    file's tables as a dict (relative paths resolve against the working directory).
    ``partial`` skips the required-key check (for commands that need only some sections).
    Raises :class:`ConfigError`.
    """
    if isinstance(path, Mapping):
        text, raw, source, base = None, _plain(dict(path)), "<dict>", Path.cwd()
        path = None
    elif path is not None:
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
    if isinstance(overrides, Mapping):
        parsed = [_mapped_override(k, v) for k, v in overrides.items()]
    else:
        if isinstance(overrides, str):          # one string is not a list of its letters
            overrides = [overrides]
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
        parsed = _bare_word(section, name, value)
    return section, name, parsed, label


def _bare_word(section: str, name: str, value: str) -> Any:
    """A ``--set`` value that is no TOML literal, as its key takes it: text, or for a list
    key the list it stands for (``lora.targets=attn_q,attn_v``; one prompt for
    ``train.sample_prompts``, whose commas and spaces are its own).  Only here: in a file, and
    as a quoted TOML string here, a string for a list is a type error."""
    cls = SECTIONS.get(section)
    hint = get_type_hints(cls).get(name) if cls else None     # unknown: refused later
    if hint is None or not _is_list(hint) or value.lower() in ("none", "null"):
        return value
    if next(f for f in dataclasses.fields(cls) if f.name == name).metadata.get("names"):
        return [s for s in re.split(r"[,\s]+", value) if s]
    return [value] if value else []


def _is_list(tp: Any) -> bool:
    if get_origin(tp) in (Union, types.UnionType):
        return any(_is_list(a) for a in get_args(tp))
    return get_origin(tp) is list


def _mapped_override(key: Any, value: Any) -> tuple[str, str, Any, str]:
    """``{"section.key": value}``'s entry -> (section, key, value, label); the value is taken
    as given (a path-like becomes its string, a tuple a list)."""
    label = f"overrides[{key!r}]"
    if not isinstance(key, str) or key.count(".") != 1 or not all(key.split(".")):
        raise ConfigError(f"{label}: expected a \"section.key\" name (for example "
                          f"\"train.lr\")")
    section, name = key.split(".")
    return section, name, _plain(value), label


def _plain(v: Any) -> Any:
    """A Python value as the TOML reader would give it: path-likes as strings, tuples as
    lists, nested mappings as dicts."""
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    return v


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

    def locate(self, section: str, key: str | None) -> str:
        line = _find_line(self.text, section, key)
        return f"{self.source}:{line}" if line else self.source

    def error(self, section: str, key: str | None, msg: str) -> ConfigError:
        name = f"{section}.{key}" if key else section
        return ConfigError(f"{self.locate(section, key)}: {name}: {msg}")


def _build(raw: dict[str, Any], source: str, text: str | None, base: Path,
           overrides: list[tuple[str, str, Any, str]], *, partial: bool) -> Config:
    """The file's tables, then the ``--set`` overrides, checked key by key (each value
    remembers where it came from, for error messages), then the checks across keys."""
    where = _Where(source, text)
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    origin: dict[tuple[str, str], tuple[_Where, Path]] = {}
    for section, table in raw.items():
        if section not in SECTIONS:
            raise where.error(section, None, f"unknown section;{_did_you_mean(section, SECTIONS)}"
                                             f" valid sections: {', '.join(SECTIONS)}")
        if not isinstance(table, dict):
            raise where.error(section, None, f"expected a table [{section}], got "
                                             f"{_describe(table)}")
        for key, value in table.items():
            _take(values, origin, section, key, value, where, base)
    for section, key, value, label in overrides:
        w = _Where(label, None)
        if section not in SECTIONS:
            raise w.error(section, None, f"unknown section;{_did_you_mean(section, SECTIONS)} "
                                         f"valid sections: {', '.join(SECTIONS)}")
        _take(values, origin, section, key, value, w, Path.cwd())
    cfg = Config(**{section: _section(cls, section, values[section], origin)
                    for section, cls in SECTIONS.items()})
    cfg.origins = {f"{s}.{k}": w.locate(s, k) for (s, k), (w, _base) in origin.items()}
    return _resolve(cfg, origin, where, base, partial)


# the names other trainers (transformers' TrainingArguments, PEFT's LoraConfig) give keys
# that pytrain calls otherwise: too far apart for a spelling match
_OTHER_NAMES = {"learning_rate": "lr", "num_train_epochs": "epochs", "max_length": "max_seq_len",
                "per_device_train_batch_size": "batch_size", "warmup_steps": "warmup",
                "gradient_accumulation_steps": "grad_accum", "lora_alpha": "alpha", "r": "rank",
                "lora_dropout": "dropout", "target_modules": "targets", "output_dir": "dir",
                "lr_scheduler_type": "schedule", "save_steps": "save_every",
                "eval_steps": "eval_every", "logging_steps": "log_every"}


def _did_you_mean(name: str, valid: Iterable[str]) -> str:
    """" did you mean `x`?" for the valid name ``name`` most likely stands for, else ""."""
    valid = list(valid)
    guess = _OTHER_NAMES.get(name)
    if guess not in valid:
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        guess = close[0] if close else None
    return f" did you mean `{guess}`?" if guess else ""


def _take(values, origin, section: str, key: str, value: Any, w: "_Where", base_dir: Path
          ) -> None:
    names = {f.name for f in dataclasses.fields(SECTIONS[section])}
    if key not in names:
        raise w.error(section, key, f"unknown key;{_did_you_mean(key, names)} valid keys of "
                                    f"[{section}]: {', '.join(sorted(names))}")
    values[section][key] = value
    origin[(section, key)] = (w, base_dir)


# an empty path resolves to the folder it is relative to: a data key would then read every
# Parquet file below it, an output folder would be the working directory itself
_EMPTY_PATH = "an empty path (it would name the folder it is relative to)"


def _section(cls, section: str, given: dict[str, Any], origin) -> Any:
    """One section's dataclass from its given values: types coerced, choices and checks
    applied, paths resolved against the folder of the file (or the working directory) that
    gave them."""
    hints = get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in given:
            continue
        w, base_dir = origin[(section, f.name)]
        try:
            v = _coerce(given[f.name], hints[f.name])
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
            if not v.strip():
                raise w.error(section, f.name, _EMPTY_PATH + (
                    "" if f"{section}.{f.name}" in REQUIRED else '; "none" unsets it'))
            resolved = (base_dir / Path(v).expanduser()).resolve()
            name = meta.get("or_name") and re.fullmatch(r"[\w-]+", v) and not resolved.exists()
            v = v if name else str(resolved)
        kwargs[f.name] = v
    return cls(**kwargs)


def _resolve(cfg: Config, origin, where: "_Where", base: Path, partial: bool) -> Config:
    """Checks across keys, normalised lists, and the defaults that follow other keys."""

    def err(section: str, key: str, msg: str) -> ConfigError:
        w = origin.get((section, key), (where, base))[0]
        return w.error(section, key, msg)

    if not partial:
        for name in REQUIRED:
            section, key = name.split(".")
            if getattr(getattr(cfg, section), key) is None:
                raise ConfigError(f"{where.source}: {name}: required key missing")
    d = cfg.data
    if d.validation is not None and d.split > 0:
        raise err("data", "split", "a validation split is only taken when there is no "
                                   "data.validation file; set one or the other")
    if d.mask is not None and d.format != "auto" and d.mask not in MASKS_FOR_FORMAT[d.format]:
        raise err("data", "mask", f"{d.mask!r} does not apply to format {d.format!r} (valid: "
                                  f"{', '.join(MASKS_FOR_FORMAT[d.format])})")
    t = cfg.train
    if t.early_stopping_patience and not t.eval_every:
        raise err("train", "early_stopping_patience", "early stopping counts validations "
                                                      "during the run: set train.eval_every")
    if t.objective != "sft":
        if d.packing:
            raise err("data", "packing", f"train.objective = {t.objective!r} batches whole "
                                         f"pairs, one sequence a row: set data.packing = false")
        if t.recompute == "layers":
            raise err("train", "recompute", f"train.objective = {t.objective!r} runs one "
                                            f"graph a step; layer-wise recompute has no "
                                            f"per-sequence loss yet: set auto or off")
        if t.loss_bug_repro:
            raise err("train", "loss_bug_repro", "the bug reproduction is SFT's only")
        if cfg.lora.dropout:
            raise err("lora", "dropout", f"train.objective = {t.objective!r} computes the "
                                         f"policy's log-probabilities twice a step; TRL's "
                                         f"trainers disable dropout for preferences "
                                         f"(disable_dropout): set lora.dropout = 0")
        if d.format not in ("auto",):
            raise err("data", "format", "preference records have their own format (prompt, "
                                        "chosen, rejected): leave data.format = auto")
    if cfg.lora.targets is not None:     # names are checked against the model when it loads
        targets = list(dict.fromkeys(t.strip().removesuffix(".weight") for t in cfg.lora.targets))
        if not targets or "" in targets:
            raise err("lora", "targets", "no targets given" if not targets else "empty name")
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


_ITEM_NAMES = {str: "string", int: "integer", float: "number"}


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
        what = f"expected a list of {_ITEM_NAMES.get(item, item.__name__)}s"
        if isinstance(v, str):      # in TOML a list of one is ["attn_q"]
            raise _TypeMismatch(f"{what}, got {_describe(v)} (a list of one: "
                                f"[{_toml_value(v)}])")
        if not isinstance(v, list):
            raise _TypeMismatch(f"{what}, got {_describe(v)}")
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
