"""Open a model GGUF: architecture check, metadata, tensor index and hyperparameters.

One entry point so every command (train, inspect, export) refuses the same files with the
same messages, before anything is allocated.  ``general.architecture`` picks the registry entry
(``pytrain.models.get``), which reads the config from the GGUF keys.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from pytrain.formats.gguf_meta import GGUFError, metadata_from_reader
from pytrain import models
from pytrain.formats.gguf_tensors import TensorInfo, open_reader, tensor_infos


class ModelFileError(GGUFError):
    """A GGUF that is not a model pytrain can train; names the file."""


def open_model(path: str | os.PathLike[str], reader: GGUFReader | None = None
               ) -> tuple[str, dict[str, Any], dict[str, TensorInfo], models.ModelConfig]:
    """``(arch, metadata, tensor_infos, config)`` of the model at ``path``.

    ``config.n_vocab`` comes from ``token_embd.weight`` (the converter writes no vocabulary
    size key, and the token list may be padded differently from the embedding).  ``reader``:
    the file already open (gguf's reader takes seconds on a large vocabulary: 10 s for
    Gemma 3's 262144 tokens here), so a caller reading the tensors next opens it once.
    """
    p = Path(path)
    reader = reader or open_reader(p)
    meta = metadata_from_reader(reader)
    infos = tensor_infos(reader)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{p}: no general.architecture key; supported: "
                             f"{', '.join(models.names())}")
    try:
        entry = models.get(arch, str(p))
    except ValueError as e:
        raise ModelFileError(str(e)) from e
    if meta.get("general.type", "model") != "model":
        raise ModelFileError(f"{p}: general.type is {meta['general.type']!r}, not a base model "
                             f"(an adapter file?)")
    embd = infos.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        raise ModelFileError(f"{p}: no 2-D token_embd.weight tensor")
    try:
        config = entry.config_from_metadata(meta, set(infos), n_vocab=embd.shape[0],
                                            source=str(p))
    except KeyError as e:
        raise ModelFileError(e.args[0] if e.args else f"{p}: incomplete metadata") from e
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelFileError(f"{p}: bad {arch} metadata: {e}") from e
    return arch, meta, infos, config
