#!/usr/bin/env python3
"""Pack what ``scripts/gpu_check.sh`` needs on a GPU machine that reaches no package index and
may have no compiler, into ``.gpu/`` (git-ignored; the device tool's ``carry`` takes it along):

  .gpu/native.tar.xz   a finished ``pytrain/_native`` (the libraries, the cffi extension built
                       for the limited API as ``_ggml.abi3.so``, ``build_info.json``): the GPU
                       machine unpacks it and compiles nothing.  ``--build-native`` builds it
                       here with CUDA (arch 90, every x86-64 level of ggml-cpu, no BLAS: a GPU
                       run does not use it); ``--native DIR`` carries one built earlier.  Either
                       is checked first: built from this archive, patch set and cffi
                       definitions, and needing nothing of this machine's folders
                       (``native/build.py``'s ``portability_problems``, with readelf).
  .gpu/src.tar.xz      the pinned, verified, patched source in the cache layout native/build.py
                       expects (its marker says which archive and patch set): with a carried
                       native only the converter and its gguf-py (the GPU benchmark converts
                       its models there); without one, also what the CUDA ggml build reads
  .gpu/commit          the commit the tree was at (the copy that travels has no .git)
  .gpu/whl/            wheels of what the GPU machine's Python lacks: cffi for CPython 3.10 to
                       3.14 (the extension is abi3; cffi's backend is not), pycparser, gguf

Usage:  python -m scripts.gpu_carry [--build-native | --native DIR] [--out DIR]
        (or: make gpu-carry)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from scripts import native_build  # native/build.py as a module

ROOT = Path(__file__).resolve().parent.parent

PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
PER_PYTHON = ["cffi==2.1.1"]                           # a compiled backend per version
ANY_PYTHON = ["pycparser==2.23", "gguf==0.19.0"]       # pure Python, 3.10 and up
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE", "licenses")
BUILD = ("CMakeLists.txt", "cmake", "ggml", "src", "include", "vendor")
# ggml backends the CUDA build does not configure (kept out to stay under the carry limit)
SKIP = ("ggml-vulkan", "ggml-sycl", "ggml-metal", "ggml-opencl", "ggml-cann", "ggml-webgpu",
        "ggml-zdnn", "ggml-hexagon", "ggml-musa", "ggml-blas", "ggml-zendnn",
        "ggml-virtgpu", "ggml-openvino")


def pack_source(nb, dest: Path, converter_only: bool) -> Path:
    root = nb.extract_source()
    llama = Path("vendor") / "llama.cpp"

    def keep(info: tarfile.TarInfo):
        parts = Path(info.name).parts
        if any(p in SKIP for p in parts) or any(p in ("docs", "examples", ".git") for p in parts):
            return None
        return info

    with tarfile.open(dest, "w:xz") as tar:
        base = Path(root.name)
        tar.add(root / ".pytrain-extracted", base / ".pytrain-extracted")
        for name in CONVERTER + (() if converter_only else BUILD):
            p = root / llama / name
            if p.exists():
                tar.add(p, base / llama / name, filter=keep)
    return dest


def fetch_wheels(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--implementation", "cp", "--quiet", "-d", str(d)]
    for plat in PLATFORMS:
        base += ["--platform", plat]
    for version in PYTHONS:
        subprocess.run(base + ["--python-version", version] + PER_PYTHON, check=True)
    subprocess.run(base + ["--python-version", PYTHONS[0]] + ANY_PYTHON, check=True)
    return d


def check_native(nb, native: Path) -> dict:
    """The build stamp of ``native``, after checking it is this checkout's build and portable."""
    try:
        info = json.loads((native / "build_info.json").read_text())
    except (OSError, ValueError) as e:
        raise nb.BuildError(f"{native} is not a pytrain/_native made by native/build.py ({e})")
    want = dict(archive_sha256=nb.ARCHIVE_SHA256, patches_sha256=nb.patches_digest(),
                ffi_sha256=nb.ffi_digest())
    stale = [k for k, v in want.items() if info.get(k) != v]
    if stale:
        raise nb.BuildError(f"{native} was built from another {', '.join(stale)} than this "
                            f"checkout's; rebuild it (--build-native)")
    bad = nb.portability_problems(native)
    if bad:
        raise nb.BuildError(f"{native} would not load on another machine: {'; '.join(bad)}")
    return info


def pack_native(native: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w:xz") as tar:
        for p in sorted(native.iterdir()):
            if p.name != "__pycache__" and not p.name.startswith("."):
                tar.add(p, p.name)
    return dest


def build_native(nb, jobs: int | None) -> Path:
    """A portable CUDA pytrain/_native, built in the cache (its CMake tree is reused)."""
    os.environ.pop("PYTRAIN_GGML_NATIVE", None)        # portable: every CPU variant
    os.environ["PYTRAIN_BLAS"] = "0"     # a GPU run never uses BLAS; one library less to carry
    os.environ.setdefault("PYTRAIN_CUDA_ARCH", "90")
    out = nb.cache_dir() / "carry-native-cuda"
    nb.build(cuda=True, jobs=jobs, out_dir=out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--native", type=Path, help="a finished pytrain/_native to carry")
    how.add_argument("--build-native", action="store_true",
                     help="build a portable CUDA pytrain/_native here first, and carry it")
    ap.add_argument("--out", type=Path, default=ROOT / ".gpu")
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args()
    nb = native_build.load()
    try:
        if a.build_native:
            a.native = build_native(nb, a.jobs)
        info = check_native(nb, a.native) if a.native else None
    except nb.BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    a.out.mkdir(parents=True, exist_ok=True)
    for old in ("native.tar.xz", "prefix.tar.xz"):
        (a.out / old).unlink(missing_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           text=True, capture_output=True).stdout.strip()
    (a.out / "commit").write_text(commit + ("+changes" if dirty else "") + "\n")
    made = [pack_source(nb, a.out / "src.tar.xz", converter_only=info is not None),
            fetch_wheels(a.out / "whl")]
    if info is not None:
        made.append(pack_native(a.native, a.out / "native.tar.xz"))
        print(f"native: {'cpu+cuda' if info['cuda'] else 'cpu'}, "
              f"{len(info.get('cpu_variants', []))} ggml-cpu variants")
    total = 0
    for p in made:
        size = sum(f.stat().st_size for f in ([p] if p.is_file() else p.iterdir()))
        total += size
        print(f"{p}: {size / 2**20:.1f} MiB")
    print(f"total {total / 2**20:.1f} MiB (the device tool carries 64 MiB with the working tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
