"""cffi bindings (API, out-of-line mode) compiled against the pinned ggml headers.

The declarations are not written by hand: the installed headers are run through the C
preprocessor with empty stand-ins for the system headers, so cffi sees exactly the pinned
API and a ggml upgrade cannot silently leave a stale signature behind.  The extension is
linked with an ``$ORIGIN/lib`` rpath, so it finds the shared libraries in the package without
LD_LIBRARY_PATH.

It links only ggml's core (``libggml``: the backend registry and scheduler; ``libggml-base``:
tensors, graphs, GGUF, quantization).  The backends (the ggml-cpu variant for this CPU, BLAS,
CUDA) are modules that pytrain/ggml.py loads at run time, so one extension serves every CPU
variant and the CUDA build alike.  It is compiled against CPython's limited API
(``_ggml.abi3.so``), so one build serves every Python >= 3.10.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

MODULE = "pytrain._native._ggml"
HEADERS = ["ggml.h", "ggml-alloc.h", "ggml-backend.h", "ggml-opt.h", "gguf.h"]
LINKED = ["ggml", "ggml-base"]

# Types cffi knows natively; everything else the system headers would bring must not appear.
_STUB_HEADERS = {"stdbool.h": "", "stddef.h": "", "stdint.h": "", "stdio.h": "",
                 "stdarg.h": ""}

# pytrain's own C, compiled into the extension: a process-wide "stop now" flag that ggml's
# compute checks between nodes (ggml-cpu's abort callback; the scheduler's eval callback for
# backends without one, such as CUDA), set by run.Interrupt from a thread when a second Ctrl-C
# arrives while the main thread is inside a graph compute.  The callbacks run per node on
# ggml's compute threads, so they must be C: a Python callback would take the GIL every node.
_ABORT_SOURCE = """
#include <signal.h>
static volatile sig_atomic_t pytrain_abort_requested = 0;
static bool pytrain_abort_cb(void * data) { (void) data; return pytrain_abort_requested != 0; }
static bool pytrain_eval_cb(struct ggml_tensor * t, bool ask, void * data) {
    (void) t; (void) data;
    return ask ? pytrain_abort_requested != 0 : pytrain_abort_requested == 0;
}
void pytrain_request_abort(int on) { pytrain_abort_requested = on; }
int pytrain_abort_is_requested(void) { return pytrain_abort_requested; }
ggml_abort_callback pytrain_abort_callback(void) { return pytrain_abort_cb; }
ggml_backend_sched_eval_callback pytrain_eval_callback(void) { return pytrain_eval_cb; }
"""
_ABORT_CDEF = """
void pytrain_request_abort(int on);
int pytrain_abort_is_requested(void);
ggml_abort_callback pytrain_abort_callback(void);
ggml_backend_sched_eval_callback pytrain_eval_callback(void);
"""

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


def exported_symbols(lib_dir: Path) -> set[str]:
    """Dynamic symbols defined by the libraries the extension links (not the backend
    modules: their functions are reached through the backend registry)."""
    names: set[str] = set()
    for so in (lib_dir / f"lib{name}.so" for name in LINKED):
        out = subprocess.run(["nm", "-D", "--defined-only", str(so)], check=True,
                             capture_output=True, text=True).stdout
        names.update(line.split()[-1] for line in out.splitlines() if line.strip())
    return names


def _drop_unexported(text: str, exported: set[str]) -> str:
    """Headers declare a few functions no built library defines (other backends, unbuilt
    features); API mode would fail at import on them, so they are left out."""
    from pycparser import c_ast, c_generator, c_parser

    # pycparser needs the builtin typedefs cffi knows; they are parsed, then left out again.
    builtin = ["int8_t", "int16_t", "int32_t", "int64_t", "uint8_t", "uint16_t", "uint32_t",
               "uint64_t", "size_t", "bool", "FILE", "intptr_t", "uintptr_t"]
    prelude = "".join(f"typedef int {t};\n" for t in builtin)
    ast = c_parser.CParser().parse(prelude + text)
    keep = [n for n in ast.ext[len(builtin):]
            if not (isinstance(n, c_ast.Decl) and isinstance(n.type, c_ast.FuncDecl)
                    and n.name not in exported)]
    ast.ext = keep
    return c_generator.CGenerator().visit(ast)


def cdef_source(include_dir: Path, exported: set[str] | None = None) -> str:
    headers = HEADERS
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
    # Array lengths computed with sizeof: the C compiler fills them in (API mode), below.
    out = _drop_repeated_typedefs(out)
    if exported is not None:
        out = _drop_unexported(out, exported)
    out = re.sub(r"\[[^\]]*sizeof[^\]]*\]", "[...]", out)
    return _EXTRA_CDEF + out


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


def make_builder(include_dir: Path, lib_dir: Path):
    import cffi

    ffibuilder = cffi.FFI()
    ffibuilder.cdef(cdef_source(include_dir, exported_symbols(lib_dir)) + _ABORT_CDEF)
    includes = "".join(f'#include "{h}"\n' for h in HEADERS)
    ffibuilder.set_source(
        MODULE, includes + _ABORT_SOURCE,
        include_dirs=[str(include_dir)],
        library_dirs=[str(lib_dir)],
        libraries=LINKED,
        extra_compile_args=["-Wno-deprecated-declarations"],
        extra_link_args=["-Wl,-rpath,$ORIGIN/lib"],
        py_limited_api=True,
    )
    return ffibuilder


def compile_module(include_dir: Path, lib_dir: Path, out_dir: Path) -> str:
    """Build the extension into ``out_dir`` (the package's ``_native`` folder), replacing any
    other build of it there (an older per-Python-version ``_ggml.cpython-*.so`` would be
    imported before the ``abi3`` one)."""
    ffibuilder = make_builder(include_dir, lib_dir)
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(ffibuilder.compile(tmpdir=tmp, verbose=False))
        if not built.name.endswith(".abi3.so"):
            raise RuntimeError(f"cffi built {built.name}, not a limited-API (.abi3.so) module")
        dest = out_dir / "_ggml.abi3.so"
        tmp_dest = dest.with_name(dest.name + ".tmp")
        shutil.copy2(built, tmp_dest)
        tmp_dest.replace(dest)
    for old in out_dir.glob("_ggml*.so"):
        if old != dest:
            old.unlink()
    return dest.name
