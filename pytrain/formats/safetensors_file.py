"""The safetensors file of a PEFT adapter: written with the ``safetensors`` package, read by
the small parser here so that bfloat16 files (PEFT's usual output for bf16 training) load
without torch, and a malformed or truncated file is refused by name.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import numpy as np

from pytrain.formats.hf_layout import PeftAdapterError

# safetensors dtype → (numpy dtype of the stored bytes, bytes per element)
ST_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2), "F64": ("<f8", 8)}


def safetensors_bytes(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """The bytes of a safetensors file holding ``arrays`` and ``__metadata__`` ``metadata``."""
    from safetensors.numpy import save
    return save(dict(arrays), metadata=dict(metadata))


def read_safetensors(p: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors (as float32) and ``__metadata__`` of a safetensors file.  Parsed here so that
    bfloat16 files (PEFT's usual output for bf16 training) load without torch."""
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise PeftAdapterError(f"{p}: cannot read: {e.strerror or e}") from None
    if len(raw) < 8:
        raise PeftAdapterError(f"{p}: not a safetensors file ({len(raw)} bytes)")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8 or n > 100_000_000:
        raise PeftAdapterError(f"{p}: not a safetensors file (header length {n} for a "
                               f"{len(raw)}-byte file)")
    try:
        header = json.loads(raw[8:8 + n])
        assert isinstance(header, dict)
    except (ValueError, AssertionError):
        raise PeftAdapterError(f"{p}: not a safetensors file (unreadable JSON header)") from None
    meta = header.pop("__metadata__", None) or {}
    data = memoryview(raw)[8 + n:]
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise PeftAdapterError(f"{p}: tensor {name!r}: malformed header entry") from None
        if dtype not in ST_DTYPES:
            raise PeftAdapterError(f"{p}: tensor {name!r} has dtype {dtype}; pytrain reads "
                                   f"{', '.join(ST_DTYPES)}")
        np_dtype, size = ST_DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        if not (0 <= start <= end <= len(data)) or end - start != count * size:
            raise PeftAdapterError(f"{p}: tensor {name!r}: data offsets [{start}, {end}) do not "
                                   f"fit shape {shape} {dtype} in the file (truncated?)")
        x = np.frombuffer(data[start:end], dtype=np_dtype).reshape(shape)
        if dtype == "BF16":
            x = (x.astype(np.uint32) << 16).view(np.float32)
        out[name] = np.array(x, dtype=np.float32)
    return out, {str(k): str(v) for k, v in meta.items()}
