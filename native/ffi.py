"""cffi bindings (API, out-of-line mode) compiled against the pinned ggml headers.

The declarations are not written by hand: the installed headers are run through the C
preprocessor with empty stand-ins for the system headers, so cffi sees exactly the pinned
API and a ggml upgrade cannot silently leave a stale signature behind.  The extension is
linked with an ``$ORIGIN/lib`` rpath, so it finds the shared libraries in the package without
LD_LIBRARY_PATH.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

MODULE = "pytrain._native._ggml"
HEADERS = ["ggml.h", "ggml-alloc.h", "ggml-backend.h", "ggml-cpu.h", "ggml-opt.h", "gguf.h"]

# Types cffi knows natively; everything else the system headers would bring must not appear.
_STUB_HEADERS = {"stdbool.h": "", "stddef.h": "", "stdint.h": "", "stdio.h": "",
                 "stdarg.h": ""}

# Constants the preprocessor would erase but callers need.
_EXTRA_CDEF = """
#define GGML_MAX_DIMS 4
#define GGML_MAX_NAME 64
#define GGML_MAX_SRC 10
#define GGML_MAX_OP_PARAMS 64
#define GGML_DEFAULT_GRAPH_SIZE 2048
#define GGML_ROPE_TYPE_NEOX 2
#define GGML_ROPE_TYPE_MROPE 8
#define GGML_ROPE_TYPE_IMROPE 40
"""


def _compiler() -> str:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or "cc"


def cdef_source(include_dir: Path, cuda: bool) -> str:
    headers = HEADERS + (["ggml-cuda.h"] if cuda else [])
    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp) / "stub"
        stub.mkdir()
        for name, text in _STUB_HEADERS.items():
            (stub / name).write_text(text)
        src = Path(tmp) / "all.h"
        src.write_text("".join(f'#include "{h}"\n' for h in headers))
        cmd = [_compiler(), "-E", "-P", "-nostdinc", f"-I{stub}", f"-I{include_dir}",
               "-D__attribute__(x)=", "-D__declspec(x)=", "-D_Noreturn=", "-D__restrict=",
               "-D__restrict__=", "-DGGML_RESTRICT=", str(src)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    out = out.replace("va_list", "void *")  # only in log-callback typedefs we never call
    out = re.sub(r"\bextern\s+", "", out)
    # Array lengths computed with sizeof: let the C compiler fill them in (API mode).
    out = re.sub(r"\[[^\]]*sizeof[^\]]*\]", "[...]", out)
    return _EXTRA_CDEF + _drop_repeated_typedefs(out)


def _drop_repeated_typedefs(text: str) -> str:
    """C11 allows repeating a typedef (ggml-alloc.h and ggml-backend.h do); cffi does not."""
    seen, lines = set(), []
    for line in text.splitlines():
        key = line.strip()
        if key.startswith("typedef") and key.endswith(";"):
            if key in seen:
                continue
            seen.add(key)
        lines.append(line)
    return "\n".join(lines) + "\n"


def make_builder(include_dir: Path, lib_dir: Path, cuda: bool):
    import cffi

    ffibuilder = cffi.FFI()
    ffibuilder.cdef(cdef_source(include_dir, cuda))
    libs = ["ggml", "ggml-base", "ggml-cpu"] + (["ggml-cuda"] if cuda else [])
    includes = "".join(f'#include "{h}"\n' for h in HEADERS + (["ggml-cuda.h"] if cuda else []))
    ffibuilder.set_source(
        MODULE, includes,
        include_dirs=[str(include_dir)],
        library_dirs=[str(lib_dir)],
        libraries=libs,
        extra_compile_args=["-Wno-deprecated-declarations"],
        extra_link_args=["-Wl,-rpath,$ORIGIN/lib"],
    )
    return ffibuilder


def compile_module(include_dir: Path, lib_dir: Path, out_dir: Path, cuda: bool) -> str:
    """Build the extension into ``out_dir`` (the package's ``_native`` folder)."""
    ffibuilder = make_builder(include_dir, lib_dir, cuda)
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(ffibuilder.compile(tmpdir=tmp, verbose=False))
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        dest = out_dir / f"_ggml{suffix}"
        tmp_dest = dest.with_name(dest.name + ".tmp")
        shutil.copy2(built, tmp_dest)
        tmp_dest.replace(dest)
    return dest.name
