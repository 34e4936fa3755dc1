#!/usr/bin/env python3
"""Pack what ``scripts/gpu_check.sh`` needs on a GPU machine that reaches no package index,
into ``.gpu/`` (git-ignored; the device tool's ``carry`` takes it along):

  .gpu/src.tar.xz      the pinned, verified, patched source, only the parts the CUDA ggml and
                       llama.cpp's libllama builds read, and the converter with its gguf-py
                       (the GPU benchmark converts its models there), in the cache layout
                       native/build.py expects (its marker says which archive and patch set)
  .gpu/commit          the commit the tree was at (the copy that travels has no .git)
  .gpu/whl/            wheels for the GPU machine's Python (3.12) of the dependencies its
                       image lacks: cffi, pycparser, gguf
  .gpu/prefix.tar.xz   optional: a CUDA ggml install prefix, so the GPU machine only compiles
                       the cffi module (``native/build.py --prebuilt``, seconds) instead of
                       spending ~6 of its 15 device minutes on the build.  ``--build-prefix``
                       builds it here, portable as every build is (each x86-64 level of
                       ggml-cpu, loaded at run time: the GPU machine's CPU is not this one)
                       and for CUDA arch 90: about 20 minutes on 2 cores
                       (bench_results/cuda_build-amd.md, measured before the CPU variants).
                       ``--prefix DIR`` packs one built earlier; either is checked to come
                       from this archive and patch set.

Usage:  python scripts/gpu_carry.py [--build-prefix | --prefix DIR]      (or: make gpu-carry)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import native_build  # noqa: E402  (native/build.py as a module)
OUT = ROOT / ".gpu"
WHEELS = ["cffi==2.1.1", "pycparser==3.12", "gguf==0.19.0"]   # PyYAML, requests: in the image
# ggml backends the CUDA build does not configure (kept out to stay under the carry limit)
SKIP = ("ggml-vulkan", "ggml-sycl", "ggml-metal", "ggml-opencl", "ggml-cann", "ggml-webgpu",
        "ggml-zdnn", "ggml-hexagon", "ggml-musa", "ggml-blas", "ggml-zendnn",
        "ggml-virtgpu", "ggml-openvino")



def pack_source(nb) -> Path:
    root = nb.extract_source()
    llama = Path("vendor") / "llama.cpp"
    dest = OUT / "src.tar.xz"

    def keep(info: tarfile.TarInfo):
        parts = Path(info.name).parts
        if any(p in SKIP for p in parts) or any(p in ("docs", "examples", ".git") for p in parts):
            return None
        return info

    with tarfile.open(dest, "w:xz") as tar:
        base = Path(root.name)
        tar.add(root / ".pytrain-extracted", base / ".pytrain-extracted")
        for name in ("CMakeLists.txt", "cmake", "ggml", "src", "include", "vendor", "LICENSE",
                     "licenses", "convert_hf_to_gguf.py", "conversion", "gguf-py"):
            p = root / llama / name
            if p.exists():
                tar.add(p, base / llama / name, filter=keep)
    return dest


def fetch_wheels() -> Path:
    d = OUT / "whl"
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "--quiet"]
    for plat in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "any"):
        cmd += ["--platform", plat]
    subprocess.run(cmd + ["-d", str(d)] + WHEELS, check=True)
    return d


def pack_prefix(prefix: Path) -> Path:
    dest = OUT / "prefix.tar.xz"
    with tarfile.open(dest, "w:xz") as tar:
        tar.add(prefix, "prefix")
    return dest


def build_prefix(nb, jobs: int | None) -> Path:
    """A portable CUDA ggml install prefix, built in the cache (the cffi module the build also
    makes goes to a temporary folder: the GPU machine compiles its own for its Python)."""
    os.environ.pop("PYTRAIN_GGML_NATIVE", None)        # portable: every CPU variant
    # no BLAS backend: a GPU run never uses it (Runtime leaves it out beside a GPU), and its
    # OpenBLAS library would be one more file to carry and find on the GPU machine
    os.environ["PYTRAIN_BLAS"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        nb.build(cuda=True, jobs=jobs, out_dir=Path(tmp))
    return nb.cache_dir() / "install" / f"{nb.SRC_DIRNAME}-cuda"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--prefix", type=Path, help="a CUDA ggml install prefix to carry")
    how.add_argument("--build-prefix", action="store_true",
                     help="build a portable CUDA ggml prefix here first, and carry it")
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args()
    nb = native_build.load()
    try:
        if a.build_prefix:
            a.prefix = build_prefix(nb, a.jobs)
        if a.prefix:
            nb.check_prebuilt(a.prefix)
    except nb.BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    OUT.mkdir(exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           text=True, capture_output=True).stdout.strip()
    (OUT / "commit").write_text(commit + ("+changes" if dirty else "") + "\n")
    made = [pack_source(nb), fetch_wheels()]
    if a.prefix:
        made.append(pack_prefix(a.prefix))
    total = 0
    for p in made:
        size = sum(f.stat().st_size for f in ([p] if p.is_file() else p.iterdir()))
        total += size
        print(f"{p.relative_to(ROOT)}: {size / 2**20:.1f} MiB")
    print(f"total {total / 2**20:.1f} MiB (the device tool carries 64 MiB with the working tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
