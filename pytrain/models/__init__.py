"""Model architectures, one module each (like llama.cpp's src/models/).

``ARCHITECTURES`` maps a GGUF ``general.architecture`` to its module; the loader refuses any
other architecture and lists these.
"""
from __future__ import annotations

from importlib import import_module

ARCHITECTURES = {"qwen35": "pytrain.models.qwen35"}


def architecture_module(arch: str, path: str = "") -> object:
    if arch not in ARCHITECTURES:
        where = f"{path}: " if path else ""
        raise ValueError(f"{where}unsupported architecture {arch!r}; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return import_module(ARCHITECTURES[arch])
