"""``native/build.py`` as a module, for the scripts that need the pinned archive, its cache
and its verified fetch (the libllama build, the model fetch, the GPU carry, the reference
converter): one definition of each, never a copy."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BUILD_PY = Path(__file__).resolve().parent.parent / "native" / "build.py"


def load():
    """The module, loaded once per process under one name (dataclasses look it up there)."""
    name = "_pytrain_native_build"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BUILD_PY)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]
