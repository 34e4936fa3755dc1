#!/usr/bin/env python3
"""Fetch, verify, build and bind the pinned ggml.

ggml is not on PyPI by itself, so we take the copy vendored in llama-cpp-python's source
archive: one pinned file whose sha256 we check before anything is extracted.  The archive,
its extracted tree and the CMake build live in a cache outside the git tree
(``$PYTRAIN_CACHE`` or ``~/.cache/pytrain``) so a rebuild does not download again.  What the
package needs at run time (the shared libraries and the cffi extension) is installed into
``pytrain/_native/`` and stamped with ``build_info.json`` written last: a half-finished build
never looks valid, because the stamp is removed first and written only on success.

Usage:  python native/build.py [--cuda] [--jobs N] [--force]
        PYTRAIN_CUDA=1 python native/build.py
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
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG_NATIVE = ROOT / "pytrain" / "_native"

ARCHIVE_PROJECT = "llama-cpp-python"
ARCHIVE_VERSION = "0.3.36"
ARCHIVE_NAME = "llama_cpp_python-0.3.36.tar.gz"
ARCHIVE_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SRC_DIRNAME = "llama_cpp_python-0.3.36"
PATCH_DIR = Path(__file__).resolve().parent / "patches"


class BuildError(RuntimeError):
    """A failure with a one-line, actionable message."""


def cache_dir() -> Path:
    return Path(os.environ.get("PYTRAIN_CACHE", Path.home() / ".cache" / "pytrain"))


def source_root() -> Path:
    """The extracted archive (llama.cpp lives under vendor/llama.cpp)."""
    return cache_dir() / "src" / SRC_DIRNAME


def llama_cpp_dir() -> Path:
    return source_root() / "vendor" / "llama.cpp"


def ggml_dir() -> Path:
    return llama_cpp_dir() / "ggml"


def log(msg: str) -> None:
    print(f"[native] {msg}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_command() -> list[str]:
    try:
        import pip  # noqa: F401
        return [sys.executable, "-m", "pip"]
    except ImportError:
        exe = shutil.which("pip3") or shutil.which("pip")
        if exe is None:
            raise BuildError("pip is needed to fetch the pinned ggml source: install pip "
                             "(apt-get install python3-pip) and retry")
        return [exe]


def fetch_archive() -> Path:
    """The pinned source archive, downloaded once with pip and verified by hash."""
    dest = cache_dir() / "dl" / ARCHIVE_NAME
    if dest.exists():
        if sha256_of(dest) == ARCHIVE_SHA256:
            return dest
        log(f"cached {dest} has the wrong sha256: removing it and downloading again")
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".dl-") as tmp:
        log(f"downloading {ARCHIVE_PROJECT}=={ARCHIVE_VERSION} source archive with pip")
        cmd = _pip_command() + ["download", "--no-deps", "--no-binary", ":all:",
                                "--quiet",
                                f"{ARCHIVE_PROJECT}=={ARCHIVE_VERSION}", "-d", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / ARCHIVE_NAME
        if not got.exists():
            # pip may fail to prepare metadata yet still have saved the file; only the
            # file matters.  Without it, report pip's last line.
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise BuildError(f"could not download {ARCHIVE_NAME} with pip ({last}); check the "
                             f"package index is reachable, or place the file in {dest.parent}")
        digest = sha256_of(got)
        if digest != ARCHIVE_SHA256:
            raise BuildError(f"sha256 mismatch for {ARCHIVE_NAME}: got {digest}, pinned "
                             f"{ARCHIVE_SHA256}; refusing to build from it")
        os.replace(got, dest)
    return dest


def patches() -> list[Path]:
    """Our fixes to the vendored ggml, applied in name order (each says why in its body)."""
    return sorted(PATCH_DIR.glob("*.patch"))


def patches_digest() -> str:
    h = hashlib.sha256()
    for p in patches():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _apply_patch(patch: Path, llama_dir: Path) -> None:
    git = shutil.which("git")
    cmd = ([git, "apply", "-p1", str(patch)] if git else ["patch", "-p1", "-i", str(patch)])
    r = subprocess.run(cmd, cwd=llama_dir, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildError(f"patch {patch.name} does not apply to the pinned source ({last})")


def extract_source() -> Path:
    """Extract the archive once and apply native/patches; the marker, written last, records
    the archive hash and the patch set, so a changed patch set extracts afresh."""
    root = source_root()
    marker = root / ".pytrain-extracted"
    want = f"{ARCHIVE_SHA256} {patches_digest()}\n"
    if marker.exists() and marker.read_text() == want:
        return root
    archive = fetch_archive()
    parent = root.parent
    parent.mkdir(parents=True, exist_ok=True)
    if root.exists():
        log(f"removing half-extracted {root}")
        shutil.rmtree(root)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=".extract-"))
    try:
        log(f"extracting {archive.name}")
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data")
        # The vendored ggml lacks ggml.pc.in; CMake's configure_file fails without it.
        llama_dir = tmp / SRC_DIRNAME / "vendor" / "llama.cpp"
        pc = llama_dir / "ggml" / "ggml.pc.in"
        if not pc.exists():
            pc.write_text("")
        for patch in patches():
            log(f"applying {patch.name}")
            _apply_patch(patch, llama_dir)
        os.replace(tmp / SRC_DIRNAME, root)
        marker.write_text(want)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def check_tools(cuda: bool) -> None:
    missing = [t for t in ("cmake",) if shutil.which(t) is None]
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        missing.append("a C compiler")
    if not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        missing.append("a C++ compiler")
    if missing:
        raise BuildError(f"missing {', '.join(missing)}: install them "
                         f"(apt-get install cmake build-essential) and retry")
    if cuda:
        if shutil.which("nvcc") is None:
            raise BuildError("CUDA requested (PYTRAIN_CUDA=1) but nvcc is not on PATH: install "
                             "the CUDA toolkit or build without PYTRAIN_CUDA")
        if not _find_cublas():
            raise BuildError("CUDA requested (PYTRAIN_CUDA=1) but cuBLAS was not found next to "
                             "nvcc or in the linker path: install the CUDA toolkit's cuBLAS "
                             "(or the nvidia-cublas wheel) or build without PYTRAIN_CUDA")


def _find_cublas() -> bool:
    nvcc = Path(shutil.which("nvcc")).resolve()
    cands = [nvcc.parent.parent / d for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
    for d in cands:
        if any(d.glob("libcublas.so*")):
            return True
    r = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True)
    return "libcublas.so" in r.stdout


# ggml's own CMake defaults leave GGML_LLAMAFILE off when ggml is built alone (llama.cpp's
# CMake turns it on): its tinyBLAS F32/F16/BF16 matmul made pytrain's forward 1.6-2.4x faster
# on this project's machines (bench_results/forward.md).
GGML_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON",
                "-DGGML_LLAMAFILE=ON", "-DGGML_BUILD_TESTS=OFF", "-DGGML_BUILD_EXAMPLES=OFF",
                "-DGGML_CCACHE=OFF"]


def cmake_build(cuda: bool, jobs: int) -> Path:
    """Configure and build ggml as shared libraries; returns an install prefix."""
    variant = "cuda" if cuda else "cpu"
    bdir = cache_dir() / "build" / f"{SRC_DIRNAME}-{variant}"
    prefix = cache_dir() / "install" / f"{SRC_DIRNAME}-{variant}"
    args = GGML_OPTIONS + [f"-DCMAKE_INSTALL_PREFIX={prefix}", "-DCMAKE_INSTALL_LIBDIR=lib"]
    if cuda:
        args += ["-DGGML_CUDA=ON", "-DGGML_CUDA_FA=OFF", "-DGGML_CUDA_NCCL=OFF",
                 f"-DCMAKE_CUDA_ARCHITECTURES={os.environ.get('PYTRAIN_CUDA_ARCH', 'native')}"]
    log(f"configuring ggml ({variant}) in {bdir}")
    _run(["cmake", "-S", str(ggml_dir()), "-B", str(bdir)] + args, "cmake configure")
    log(f"building ggml with {jobs} jobs")
    _run(["cmake", "--build", str(bdir), "-j", str(jobs)], "cmake build")
    if prefix.exists():
        shutil.rmtree(prefix)
    _run(["cmake", "--install", str(bdir)], "cmake install")
    return prefix


def _run(cmd: list[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-25:])
        log(tail)
        raise BuildError(f"{what} failed (exit {r.returncode}); the last lines are above. "
                         f"Remove {cache_dir() / 'build'} and retry if the tree is stale")


def install_libs(prefix: Path, out_dir: Path) -> list[str]:
    """Copy the shared libraries into the package (swapped in as a whole directory)."""
    lib_dir = out_dir / "lib"
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".lib-"))
    names = []
    tmp.chmod(0o755)
    for so in sorted((prefix / "lib").glob("libggml*.so*")):
        shutil.copy2(so, tmp / so.name, follow_symlinks=False)  # keep soname links as links
        names.append(so.name)
    if lib_dir.exists():
        shutil.rmtree(lib_dir)
    os.replace(tmp, lib_dir)
    return names


def build(cuda: bool = False, jobs: int | None = None, force: bool = False,
          out_dir: Path = PKG_NATIVE) -> dict:
    jobs = jobs or max(1, os.cpu_count() or 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = out_dir / "build_info.json"
    if stamp.exists() and not force:
        info = json.loads(stamp.read_text())
        if (info.get("cuda") == cuda and info.get("archive_sha256") == ARCHIVE_SHA256
                and info.get("patches_sha256") == patches_digest()
                and info.get("options") == GGML_OPTIONS):
            log(f"ggml already built ({'cuda' if cuda else 'cpu'}); --force rebuilds")
            return info
    stamp.unlink(missing_ok=True)  # from here on, an interrupted build is visibly incomplete
    check_tools(cuda)
    extract_source()
    prefix = cmake_build(cuda, jobs)
    libs = install_libs(prefix, out_dir)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ffi  # noqa: E402  (native/ffi.py, next to this file)
    module = ffi.compile_module(include_dir=prefix / "include", lib_dir=out_dir / "lib",
                                out_dir=out_dir, cuda=cuda)
    version = _ggml_version()
    info = {
        "ggml_version": version,
        "archive": ARCHIVE_NAME,
        "archive_project": f"{ARCHIVE_PROJECT}=={ARCHIVE_VERSION}",
        "archive_sha256": ARCHIVE_SHA256,
        "patches": [p.name for p in patches()],
        "patches_sha256": patches_digest(),
        "source": str(source_root()),
        "cuda": cuda,
        "options": GGML_OPTIONS,
        "libs": libs,
        "module": module,
    }
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, stamp)
    log(f"done: ggml {version} ({'cpu+cuda' if cuda else 'cpu'}) in {out_dir}")
    return info


def _ggml_version() -> str:
    text = (ggml_dir() / "CMakeLists.txt").read_text()
    parts = {}
    for key in ("MAJOR", "MINOR", "PATCH"):
        tag = f"set(GGML_VERSION_{key} "
        i = text.index(tag) + len(tag)
        parts[key] = text[i:text.index(")", i)].strip()
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true",
                    default=os.environ.get("PYTRAIN_CUDA", "0") not in ("", "0"),
                    help="also build the CUDA backend (or set PYTRAIN_CUDA=1)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel build jobs")
    ap.add_argument("--force", action="store_true", help="rebuild even if already built")
    ap.add_argument("--out", type=Path, default=PKG_NATIVE,
                    help="where the libraries and the cffi module go (default: the package)")
    ap.add_argument("--source-only", action="store_true",
                    help="only fetch, verify and extract the pinned source; print its path")
    a = ap.parse_args(argv)
    cache_dir().mkdir(parents=True, exist_ok=True)
    lock = open(cache_dir() / ".lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)   # one build at a time per cache (tests, make, helpers)
    try:
        if a.source_only:
            print(extract_source())
            return 0
        build(cuda=a.cuda, jobs=a.jobs, force=a.force, out_dir=a.out)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
