"""Where records come from: a JSONL file, a Parquet file or folder (pyarrow), or a folder
written by ``datasets.Dataset.save_to_disk``, read in record batches, never whole; and the
column layouts people's data is in, mapped onto pytrain's three record formats.

Every row says where it is (``file:line`` for JSONL, ``file:row N`` for Parquet and datasets,
N counted from 0 as pandas and ``datasets`` do), so a bad row is named wherever it lives.

Column layouts (a row is mapped before its format is detected):

- ``messages`` (OpenAI chat): as is;
- ``conversations`` (ShareGPT): ``{"from", "value"}`` turns, speakers mapped to roles
  (``SHAREGPT_ROLES``);
- ``instruction`` / ``input`` / ``output`` (Alpaca): a chat of one user turn (the instruction,
  then the input on the next line when there is one, as LLaMA-Factory joins them) and the
  answer, after an optional ``system``;
- ``prompt`` / ``completion``, ``text``: as is (and ``prompt`` / ``chosen`` / ``rejected``
  preference records).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from pytrain.data.examples import DataError

BATCH_ROWS = 1024          # rows read at a time from Parquet and datasets folders
# ShareGPT's speakers (and the role names some exports use instead) -> chat roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "model": "assistant",
                  "system": "system", "tool": "tool", "function": "tool", "observation": "tool"}
EXTRA = "pip install 'pytrain[datasets]'"


class RecordError(Exception):
    """What is wrong with one record; ``reason`` is the count it goes under when skipped."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Row:
    """One record as read, parsed and mapped by ``record()`` (which raises RecordError)."""

    __slots__ = ("where", "raw")

    def __init__(self, where: str, raw: bytes | dict) -> None:
        self.where, self.raw = where, raw

    def record(self) -> dict[str, Any]:
        obj = parse_json_line(self.raw) if isinstance(self.raw, bytes) else _no_nulls(self.raw)
        return map_columns(obj)


def _no_nulls(v: Any) -> Any:
    """A columnar row as the JSON record it stands for: Arrow gives every row every column of
    the table (and every struct field of the union of a column's objects), null where the
    record has none; those keys are left out, as the record would leave them."""
    if isinstance(v, dict):
        return {k: _no_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_no_nulls(x) for x in v]
    return v


def read_rows(path: str | os.PathLike[str]) -> Iterator[Row]:
    """The rows of a JSONL file, a Parquet file or folder, or a ``save_to_disk`` folder."""
    if not os.fspath(path).strip():     # Path("") is ".": the working folder, read whole
        raise DataError("an empty path names no data")
    p = Path(path)
    if p.is_dir():
        if (p / "dataset_dict.json").exists():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
            raise DataError(f"{p}: a datasets.DatasetDict folder (splits: "
                            f"{', '.join(splits)}): name one split's folder, e.g. "
                            f"{p / (splits[0] if splits else 'train')}")
        if (p / "state.json").exists() and (p / "dataset_info.json").exists():
            return _dataset_rows(p)
        files = parquet_files(p)
        if not files:
            raise DataError(f"{p}: a folder with no .parquet file (names starting with "
                            f"\".\" or \"_\", virtualenvs and site-packages are not searched) "
                            f"that is not a datasets.save_to_disk folder either")
        return (row for f in files for row in _parquet_rows(f))
    if p.suffix == ".parquet":
        return _parquet_rows(p)
    return _jsonl_rows(p)


def parquet_files(folder: Path) -> list[Path]:
    """The ``.parquet`` files of a Parquet folder, at any depth, in path order, as pyarrow's
    dataset discovery finds them: a file or folder whose name starts with "." or "_" is
    skipped (caches, checkpoints, ``_temporary``, ``__pycache__``; ``datasets`` skips the
    hidden ones and ``__*`` too).  A folder of installed Python packages is never walked: a
    virtualenv (a folder holding ``pyvenv.cfg``) or a ``site-packages`` / ``dist-packages``
    folder carries Parquet files of its own (pyarrow's test data) that are no one's training
    data.  The folder given is read whatever its own name."""
    found = []
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        dirs[:] = [d for d in dirs if not _skipped_folder(here / d)]
        found += [here / n for n in names if n.endswith(".parquet") and not _hidden(n)]
    return sorted(found)


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def _skipped_folder(path: Path) -> bool:
    return (_hidden(path.name) or path.name in ("site-packages", "dist-packages")
            or (path / "pyvenv.cfg").exists())


def _jsonl_rows(path: Path) -> Iterator[Row]:
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read dataset: {e.strerror or e}") from e
    with f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield Row(f"{path}:{n}", line)


def _parquet_rows(path: Path) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: {EXTRA}") from None
    try:
        f = pq.ParquetFile(path)
    except (OSError, ValueError) as e:        # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    n = 0
    with f:
        for batch in f.iter_batches(batch_size=BATCH_ROWS):
            for rec in batch.to_pylist():
                yield Row(f"{path}:row {n}", rec)
                n += 1


def _dataset_rows(folder: Path) -> Iterator[Row]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{folder}: reading a datasets.save_to_disk folder needs the datasets "
                        f"library: {EXTRA}") from None
    try:
        ds = _unformatted(folder, datasets)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{folder}: not a readable datasets folder ({e})") from None
    n = 0
    for batch in ds.iter(batch_size=BATCH_ROWS):
        cols = list(batch)
        for i in range(len(batch[cols[0]]) if cols else 0):
            yield Row(f"{folder}:row {n}", {c: batch[c][i] for c in cols})
            n += 1


def _unformatted(folder: Path, datasets):
    """The ``save_to_disk`` folder's rows as Python objects, memory-mapped, not read whole.

    Why not ``load_from_disk``: it applies the output format the dataset was saved with
    (state.json's ``_format_type``: ``.with_format("numpy")`` gives arrays for lists, "arrow"
    tables, "torch" tensors and needs torch installed just to open the folder).  The shards
    state.json lists are opened as they are, which is ``load_from_disk(...).with_format(None)``
    without the formatter."""
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    shards = [datasets.Dataset.from_file(str(folder / f["filename"]))
              for f in state["_data_files"]]
    if not shards:
        raise ValueError("state.json lists no data files")
    return shards[0] if len(shards) == 1 else datasets.concatenate_datasets(shards)


def parse_json_line(raw: bytes) -> dict[str, Any]:
    """One JSONL line's object, or a RecordError saying what is wrong with it."""
    try:
        # without the line break: an error at the end of the line is in its last column,
        # not in column 1 of a second line
        obj = json.loads(raw.decode("utf-8").rstrip("\r\n"))
    except UnicodeDecodeError as e:
        raise RecordError("malformed_json", f"not UTF-8 ({e.reason} at byte {e.start})")
    except json.JSONDecodeError as e:
        raise RecordError("malformed_json", f"malformed JSON: {e.msg} (column {e.colno})")
    if not isinstance(obj, dict):
        raise RecordError("not_an_object", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def map_columns(obj: dict[str, Any]) -> dict[str, Any]:
    """A ShareGPT or Alpaca row as a chat record; any other row as it is."""
    if "messages" in obj:
        return obj
    if "conversations" in obj:
        return _sharegpt(obj)
    if "instruction" in obj and "output" in obj:
        return _alpaca(obj)
    return obj


def _sharegpt(obj: dict[str, Any]) -> dict[str, Any]:
    turns = obj["conversations"]
    if not isinstance(turns, list) or not turns:
        raise RecordError("bad_field", "\"conversations\" must be a non-empty list")
    messages = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise RecordError("bad_field", f"conversations[{i}] must be an object")
        if "from" in t:
            speaker, content = t.get("from"), t.get("value")
            role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
            if role is None:
                raise RecordError("unknown_role", f"conversations[{i}]: unknown speaker "
                                                  f"{speaker!r} (ShareGPT's: "
                                                  f"{', '.join(SHAREGPT_ROLES)})")
        else:
            role, content = t.get("role"), t.get("content")
        if not isinstance(content, str):
            raise RecordError("bad_field", f"conversations[{i}] needs a string \"value\"")
        messages.append({"role": role, "content": content})
    out = {"messages": messages}
    if obj.get("tools") is not None:
        out["tools"] = obj["tools"]
    system = obj.get("system")
    if isinstance(system, str) and system and messages[0]["role"] != "system":
        out["messages"] = [{"role": "system", "content": system}] + messages
    return out


def _alpaca(obj: dict[str, Any]) -> dict[str, Any]:
    parts = []
    for key in ("instruction", "input", "output"):
        v = obj.get(key)
        if v is not None and not isinstance(v, str):
            raise RecordError("bad_field", f"\"{key}\" must be a string, got "
                                           f"{type(v).__name__}")
        parts.append(v or "")
    instruction, inp, output = parts
    if not instruction:
        raise RecordError("bad_field", "\"instruction\" is empty")
    user = f"{instruction}\n{inp}" if inp else instruction
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    system = obj.get("system")
    if isinstance(system, str) and system:
        messages.insert(0, {"role": "system", "content": system})
    return {"messages": messages}
