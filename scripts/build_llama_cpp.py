#!/usr/bin/env python3
"""Build llama.cpp's ``libllama`` (CPU, Release) from the pinned source, plus ``llama_logits``
and ``llama_generate``.

Why: an adapter that pytrain writes is only useful if llama.cpp loads it with ``--lora`` and
computes the same function with it.  The only authority for that is llama.cpp itself, so the
cross-check test (``tests/test_llama_cpp_adapter.py``) runs llama.cpp's own loader and graph on
our adapter through ``scripts/llama_logits.c``, a tiny program that prints nothing but logits;
``scripts/llama_generate.c`` runs llama.cpp's tokenizer, chat template and greedy generation
(with ``--lora``'s adapter loading) for the checks on a real model.

What is built is as small as llama.cpp allows: the ``llama`` library target only (which pulls
in ggml and ggml-cpu), no common/tools/examples/tests/server/app, no OpenSSL/curl, no OpenMP.
The source is the same pinned, verified, patched archive ``native/build.py`` uses; the subset
CMake needs is copied under the cache lock into the build cache, so a concurrent re-extraction
by ``native/build.py`` cannot change files under a running compiler.  Everything lives outside
git in ``$PYTRAIN_CACHE/llama.cpp-build`` (default ``~/.cache/pytrain/llama.cpp-build``).
``build_info.json`` is written last, so a half-finished build never looks usable.

Usage:  python -m scripts.build_llama_cpp [--jobs N] [--force]
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts import native_build  # native/build.py as a module

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = {name: Path(__file__).resolve().parent / f"{name}.c"
            for name in ("llama_logits", "llama_generate")}
# What the `llama` target's CMake configure reads; models/, tools/, tests/ etc. are not needed.
SOURCE_SUBSET = ("CMakeLists.txt", "cmake", "ggml", "src", "include", "vendor", "LICENSE",
                 "licenses")
CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=OFF", "-DGGML_CCACHE=OFF",
    "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_SUBPROCESS=OFF",
]



def build_root() -> Path:
    return Path(os.environ.get("PYTRAIN_CACHE", Path.home() / ".cache" / "pytrain")) \
        / "llama.cpp-build"


def binary_path(name: str = "llama_logits") -> Path:
    return build_root() / "bin" / name


def _program_digest() -> str:
    h = hashlib.sha256()
    for name, src in sorted(PROGRAMS.items()):
        h.update(name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()


def built_binary(name: str = "llama_logits") -> Path | None:
    """The executable ``name`` if a complete build of the current programs exists.

    A stale build (a program's source changed since) counts as absent, so the test skips with
    the rebuild hint instead of running an old binary."""
    stamp = build_root() / "build_info.json"
    exe = binary_path(name)
    if not (stamp.exists() and exe.exists()):
        return None
    try:
        info = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    return exe if info.get("program_sha256") == _program_digest() else None


def log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-30:])
        log(tail)
        raise RuntimeError(f"{what} failed (exit {r.returncode}); the last lines are above. "
                           f"Remove {build_root()} and retry if the tree is stale")


def copy_source(nb, want: str) -> Path:
    """Copy the CMake-relevant subset of the pinned llama.cpp into the build cache.

    Runs under the cache lock of ``native/build.py`` (the caller holds it), and records which
    archive + patch set it came from, so a changed patch set copies (and rebuilds) afresh."""
    dest = build_root() / "src"
    marker = dest / ".pytrain-source"
    if marker.exists() and marker.read_text() == want:
        return dest
    src = nb.extract_source() / "vendor" / "llama.cpp"
    if dest.exists():
        shutil.rmtree(dest)
    tmp = build_root() / ".src-tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name in SOURCE_SUBSET:
        p = src / name
        if p.is_dir():
            shutil.copytree(p, tmp / name, symlinks=True)
        elif p.exists():
            shutil.copy2(p, tmp / name)
    os.replace(tmp, dest)
    marker.write_text(want)
    return dest


def build(jobs: int | None = None, force: bool = False) -> dict:
    nb = native_build.load()
    jobs = jobs or max(1, os.cpu_count() or 1)
    root = build_root()
    root.mkdir(parents=True, exist_ok=True)
    stamp = root / "build_info.json"
    want = f"{nb.ARCHIVE_SHA256} {nb.patches_digest()}\n"
    if stamp.exists() and not force:
        info = json.loads(stamp.read_text())
        if (info.get("source") == want.strip() and all(binary_path(n).exists() for n in PROGRAMS)
                and info.get("program_sha256") == _program_digest()):
            log(f"already built: {binary_path()} (--force rebuilds)")
            return info
    stamp.unlink(missing_ok=True)
    nb.check_tools(cuda=False)
    t0 = time.monotonic()
    nb.cache_dir().mkdir(parents=True, exist_ok=True)
    with open(nb.cache_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # same lock as native/build.py: extraction is shared
        src = copy_source(nb, want)
    bdir = root / "build"
    if force and bdir.exists():
        shutil.rmtree(bdir)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    log(f"configuring llama.cpp in {bdir}")
    _run(["cmake", "-S", str(src), "-B", str(bdir)] + gen + CMAKE_ARGS, "cmake configure")
    log(f"building libllama with {jobs} jobs (a few minutes on 2 cores)")
    _run(["cmake", "--build", str(bdir), "--target", "llama", "-j", str(jobs)], "cmake build")
    t_lib = time.monotonic() - t0
    libs = sorted({p.parent for p in bdir.rglob("libllama.so*")})
    if not libs:
        raise RuntimeError(f"no libllama.so under {bdir} after the build")
    lib_dirs = sorted({p.parent for pat in ("libllama.so", "libggml*.so")
                       for p in bdir.rglob(pat)})
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    for name, program in PROGRAMS.items():
        exe = binary_path(name)
        exe.parent.mkdir(parents=True, exist_ok=True)
        cmd = [cc, "-O2", "-std=gnu11", "-Wall", "-o", str(exe) + ".tmp", str(program),
               f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}"]
        for d in lib_dirs:
            cmd += [f"-L{d}", f"-Wl,-rpath,{d}"]
        cmd += ["-lllama", "-lggml", "-lggml-base", "-lm"]
        log(f"compiling {name}")
        _run(cmd, f"compiling scripts/{name}.c")
        os.replace(str(exe) + ".tmp", exe)
    info = {
        "source": want.strip(),
        "archive": nb.ARCHIVE_NAME,
        "cmake_args": CMAKE_ARGS,
        "programs": [str(binary_path(n)) for n in PROGRAMS],
        "program_sha256": _program_digest(),
        "lib_dirs": [str(d) for d in lib_dirs],
        "build_seconds": round(time.monotonic() - t0, 1),
        "libllama_seconds": round(t_lib, 1),
        "jobs": jobs,
    }
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, stamp)
    log(f"done in {info['build_seconds']} s: {', '.join(info['programs'])}")
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=None, help="parallel build jobs")
    ap.add_argument("--force", action="store_true", help="rebuild from a clean build tree")
    a = ap.parse_args(argv)
    try:
        build(jobs=a.jobs, force=a.force)
    except RuntimeError as e:   # BuildError of native/build.py is a RuntimeError too
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
