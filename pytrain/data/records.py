"""Records to examples: validation, encoding with the target mask, truncation, and the
train/validation split (see the package docstring for what is skipped and why; ``sources``
for the files records come from)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from pytrain.config import MASKS, MASKS_FOR_FORMAT, mask_for
from pytrain.data.chat_template import ChatTemplateError, TemplateSecurityError, encode_chat
from pytrain.data.examples import ROLES, DataError, DataStats, Example
from pytrain.data.sources import RecordError as _RecordError, read_rows
from pytrain.data.template_files import no_template_hint, read_template

if TYPE_CHECKING:
    from pytrain.config import DataConfig
    from pytrain.data.tokenizer import Tokenizer


# ------------------------------------------------------------------------------- reading
def _detect(obj: dict[str, Any]) -> str | None:
    """The record's format from its keys, or None when it matches none or several."""
    keys = (("chat", ("messages",)), ("completion", ("prompt", "completion")), ("text", ("text",)))
    found = [fmt for fmt, names in keys if any(k in obj for k in names)]
    return found[0] if len(found) == 1 else None


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type", "text") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return
    raise _RecordError("bad_field", f"{where}: content must be a string or a list of "
                                    f"{{\"type\": \"text\", \"text\": ...}} parts")


def _check_chat(obj: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise _RecordError("bad_field", "\"messages\" must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _RecordError("bad_field", f"messages[{i}] must be an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise _RecordError("bad_field", f"messages[{i}] needs a string \"role\"")
        if role not in ROLES:
            raise _RecordError("unknown_role", f"messages[{i}]: unknown role {role!r} (valid: "
                                               f"{', '.join(ROLES)})")
        if "content" not in m and not (role == "assistant" and m.get("tool_calls")):
            raise _RecordError("bad_field", f"messages[{i}] ({role}) has no \"content\"")
        _check_content(m.get("content"), f"messages[{i}]")
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
            raise _RecordError("bad_field", f"messages[{i}] ({role}): content is null")
        if "tool_calls" in m and not isinstance(m["tool_calls"], list):
            raise _RecordError("bad_field", f"messages[{i}]: \"tool_calls\" must be a list")
    tools = obj.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise _RecordError("bad_field", "\"tools\" must be a list of objects")
    return messages, tools


def _check_str(obj: dict[str, Any], key: str) -> str:
    if key not in obj:
        raise _RecordError("bad_field", f"missing \"{key}\"")
    if not isinstance(obj[key], str):
        raise _RecordError("bad_field", f"\"{key}\" must be a string, got "
                                        f"{type(obj[key]).__name__}")
    return obj[key]


# ------------------------------------------------------------------------------- encoding
def _plain_ids(tokenizer: "Tokenizer", text: str) -> list[int]:
    """Tokens of raw text; special-token strings are parsed, as transformers' tokenizer does."""
    return tokenizer.encode(text, add_special=False, parse_special=True)


def _eos(tokenizer: "Tokenizer") -> int:
    if tokenizer.eos_id is None:
        raise DataError("the model's tokenizer has no EOS token; completion and text records "
                        "end with one")
    return tokenizer.eos_id


def encode_record(tokenizer: "Tokenizer", obj: dict[str, Any], fmt: str, mask: str,
                  template: str | None = None) -> tuple[list[int], list[bool]]:
    """Token ids and per-token target flags of one validated record.

    chat: the template render; assistant_only -> ``encode_chat``'s mask, all -> every token.
    completion: [BOS] + prompt + completion + EOS, tokenized part by part so the boundary is
    exact; completion_only trains completion + EOS.  text: [BOS] + text + EOS, all trained.
    BOS only when the GGUF asks for it (``add_bos_token``).
    """
    if fmt == "chat":
        messages, tools = _check_chat(obj)
        try:
            enc = encode_chat(tokenizer, messages, template, tools=tools)
        except TemplateSecurityError:
            raise                           # the template's fault, not this record's
        except ChatTemplateError as e:
            raise _RecordError("template_error", str(e)) from None
        return enc.ids, (enc.mask if mask == "assistant_only" else [True] * len(enc.ids))
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    if fmt == "completion":
        prompt, completion = _check_str(obj, "prompt"), _check_str(obj, "completion")
        head = bos + _plain_ids(tokenizer, prompt)
        tail = _plain_ids(tokenizer, completion) + [_eos(tokenizer)]
        train_head = mask == "all"
        return head + tail, [train_head] * len(head) + [True] * len(tail)
    if fmt == "text":
        ids = bos + _plain_ids(tokenizer, _check_str(obj, "text")) + [_eos(tokenizer)]
        return ids, [True] * len(ids)
    raise ValueError(f"unknown format {fmt!r}")


def _truncate(ids: list[int], flags: list[bool], max_len: int, policy: str
              ) -> tuple[list[int], list[bool]] | None:
    if len(ids) <= max_len:
        return ids, flags
    if policy == "right":
        return ids[:max_len], flags[:max_len]
    if policy == "left":
        return ids[-max_len:], flags[-max_len:]
    if policy == "drop":
        return None
    raise ValueError(f"unknown truncation {policy!r}")


def load_examples(path: str | os.PathLike[str], tokenizer: "Tokenizer", *, format: str = "auto",
                  mask: str | None = None, max_seq_len: int = 1024, truncation: str = "right",
                  on_error: str = "stop", template: str | None = None,
                  template_source: str | None = None) -> tuple[list[Example], DataStats]:
    """Read one JSONL file into examples (see the module docstring for what is skipped).

    ``template_source``: the file ``template`` came from, named when the sandbox refuses the
    template (default: the model file the tokenizer's template came from).
    ``mask`` None follows the file's format.  Raises :class:`DataError` for a record error
    (a record of another format than the file's among them) with ``on_error="stop"``, a mask
    that does not fit the format, and a file with no usable example.
    """
    path = os.fspath(path)
    if format not in ("auto", *MASKS_FOR_FORMAT):
        raise ValueError(f"unknown format {format!r}")
    if mask is not None and mask not in MASKS:
        raise ValueError(f"unknown mask {mask!r}")
    if on_error not in ("stop", "skip"):
        raise ValueError(f"on_error must be 'stop' or 'skip', got {on_error!r}")
    stats = DataStats(path=path)
    examples: list[Example] = []
    fmt = None if format == "auto" else format
    fmt_line = None  # the record (file:line) that decided the format in auto mode

    def set_format(f: str, line: str | None) -> None:
        nonlocal fmt, fmt_line
        fmt, fmt_line = f, line
        m = mask_for(f, mask)
        if m not in MASKS_FOR_FORMAT[f]:
            raise DataError(f"{path}: mask {m!r} does not apply to {f} records (valid: "
                            f"{', '.join(MASKS_FOR_FORMAT[f])})")
        if f == "chat" and not (template or tokenizer.chat_template):
            raise DataError(f"{path}: chat records need a chat template and the model has "
                            f"none: {no_template_hint('data.chat_template')}")
        stats.format, stats.mask, stats.templated = f, m, f == "chat"

    if fmt is not None:
        set_format(fmt, None)

    for row in read_rows(path):
        stats.records += 1
        where = row.where
        try:
            obj = row.record()
            kind = _detect(obj)
            if kind is None:
                raise _RecordError("unrecognised_record", "record has none (or several) of the "
                                   "keys \"messages\", \"prompt\"/\"completion\", \"text\"")
            if fmt is None:
                set_format(kind, where)
            elif kind != fmt:
                why = fmt_line.rsplit(":", 1)[-1] if fmt_line else "data.format"
                why = f"line {why}" if why.isdigit() else why
                raise _RecordError("other_format", f"a {kind} record in a file of {fmt} records "
                                                   f"(decided by {why}); one file holds one format")
            ids, flags = encode_record(tokenizer, obj, fmt, stats.mask, template)
        except TemplateSecurityError as e:
            source = template_source if template else getattr(tokenizer, "source", None)
            raise DataError(f"{where}: the chat template of {source or 'the model'}: {e}"
                            ) from None
        except _RecordError as e:
            if on_error == "stop":
                raise DataError(f"{where}: {e}") from None
            stats.skip(e.reason, f"{where}: {e}")
            continue
        ex = _example(obj, ids, flags, fmt, stats, where, max_seq_len, truncation)
        if ex is not None:
            examples.append(ex)
            stats.examples += 1
            stats.tokens += len(ex)
            stats.target_tokens += ex.n_targets
    if not examples:
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(stats.skipped.items()))
        raise DataError(f"{path}: no usable examples ({stats.records} records read"
                        + (f"; skipped: {skipped}" if skipped else "") + ")")
    return examples, stats


def _example(obj: dict[str, Any], ids: list[int], flags: list[bool], fmt: str,
             stats: DataStats, where: str, max_seq_len: int, truncation: str
             ) -> Example | None:
    """The encoded record as an Example, or None when it has nothing to train (counted)."""
    if fmt == "chat" and stats.mask == "assistant_only" and not any(flags):
        if not any(m.get("role") == "assistant" for m in obj["messages"]):
            stats.skip("no_assistant_turn", f"{where}: no assistant turn to train")
        else:
            stats.skip("no_targets", f"{where}: the template renders no assistant turn")
        return None
    cut = _truncate(ids, flags, max_seq_len, truncation)
    if cut is None:
        stats.skip("too_long", f"{where}: {len(ids)} tokens > max_seq_len {max_seq_len}")
        return None
    if len(cut[0]) < len(ids):
        stats.truncated += 1
    ex = Example(np.asarray(cut[0], np.int32), np.asarray(cut[1], bool), where)
    if ex.n_targets == 0:
        stats.skip("no_targets", f"{where}: no target token"
                   + (" after truncation" if len(cut[0]) < len(ids) else ""))
        return None
    return ex


# ------------------------------------------------------------------------------- splits
def split_examples(examples: Sequence[Example], fraction: float, seed: int
                   ) -> tuple[list[Example], list[Example]]:
    """(train, validation): a seeded random ``fraction`` held out, at least one example each
    side when ``fraction`` > 0; order within each side is the original order."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"split fraction must be in [0, 1), got {fraction}")
    n = len(examples)
    if fraction == 0.0:
        return list(examples), []
    if n < 2:
        raise DataError(f"cannot hold out a validation split from {n} example(s)")
    k = min(max(1, round(fraction * n)), n - 1)
    held = set(np.random.default_rng(seed).permutation(n)[:k].tolist())
    return ([e for i, e in enumerate(examples) if i not in held],
            [e for i, e in enumerate(examples) if i in held])


@dataclass
class DataSplits:
    train: list[Example]
    valid: list[Example]
    train_stats: DataStats
    valid_stats: DataStats | None   # None when there is no validation set


def load_data(cfg: "DataConfig", tokenizer: "Tokenizer", template: str | None = None
              ) -> DataSplits:
    """Training and validation examples as ``cfg`` ([data] section) describes them; chat
    records rendered with ``template``, else ``data.chat_template``'s file, else the model's."""
    source = None
    if template is None and cfg.chat_template:
        try:
            template, source = read_template(cfg.chat_template, "data.chat_template")
        except ChatTemplateError as e:
            raise DataError(str(e)) from None
    kw = dict(format=cfg.format, mask=cfg.mask, max_seq_len=cfg.max_seq_len,
              truncation=cfg.truncation, on_error=cfg.on_error, template=template,
              template_source=source)
    if cfg.train is None:
        raise DataError("data.train is not set")
    train, tstats = load_examples(cfg.train, tokenizer, **kw)
    if cfg.validation is not None:
        valid, vstats = load_examples(cfg.validation, tokenizer, **kw)
        return DataSplits(train, valid, tstats, vstats)
    if cfg.shuffle_seed is None:
        raise DataError("data.shuffle_seed is unset: load the config with load_config, which "
                        "fills it from train.seed")
    seed = cfg.shuffle_seed
    train, valid = split_examples(train, cfg.split, seed)
    if not valid:
        return DataSplits(train, valid, tstats, None)
    tstats.held_out = len(valid)
    return DataSplits(train, valid, tstats, DataStats.of_split(valid, tstats))
