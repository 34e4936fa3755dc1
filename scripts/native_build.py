"""``native/build.py`` as a module, for the scripts that need the pinned archive, its cache
and its verified fetch (the libllama build, the model fetch, the GPU carry, the reference
converter): one definition of each, never a copy.  ``import_file`` is also how the reference
scripts reach the archive's gguf-py, which is not on sys.path."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BUILD_PY = Path(__file__).resolve().parent.parent / "native" / "build.py"


def import_file(name: str, path: Path, package: bool = False) -> ModuleType:
    """The module (or, with ``package``, the package whose ``__init__.py`` is ``path``) loaded
    once per process under ``name`` and registered in sys.modules, so later imports of the name,
    its submodules and its dataclasses resolve to it without a sys.path entry."""
    if name not in sys.modules:
        search = [str(path.parent)] if package else None
        spec = importlib.util.spec_from_file_location(name, path,
                                                      submodule_search_locations=search)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def load() -> ModuleType:
    """native/build.py, under one name (its dataclasses look it up there)."""
    return import_file("_pytrain_native_build", BUILD_PY)
