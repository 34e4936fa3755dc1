"""Float64 golden log-probabilities for the parity fixtures, from the independent numpy
forward pass over the GGUF tensors in scripts/qwen35_gguf.py (token-by-token DeltaNet,
no ggml, no torch).  HF's own float32 run carries ~6e-5 of rounding error on these random
nets, as much as pytrain's; this golden lets the parity test hold pytrain to 1e-4 of the
exact answer.  For the BF16 and Q8_0 files the reference runs on their own dequantized
weights, so the test separates pytrain's arithmetic error from the weights' rounding.
Writes tests/fixtures/qwen35/<file>.f64.npz (float32 storage of the float64 result).

    python -m scripts.make_qwen35_f64_golden [--files gqa-f32,untied-f32] [--out DIR]
"""
import argparse
from pathlib import Path

import numpy as np

from scripts.qwen35_gguf import numpy_forward_gguf

FIX = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen35"


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


FILES = {"gqa-f32": "gqa", "gqa-bf16": "gqa", "gqa-q8_0": "gqa", "untied-f32": "untied"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default=",".join(FILES), help="the GGUFs (comma-separated)")
    ap.add_argument("--out", type=Path, default=FIX, help="where the .f64.npz files go")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.files.split(","):
        d = np.load(FIX / f"{FILES[name]}.npz")
        out = np.zeros(d["logprobs"].shape, np.float32)
        for i, (toks, n) in enumerate(zip(d["tokens"], d["lengths"])):
            out[i, :n] = log_softmax(numpy_forward_gguf(FIX / f"{name}.gguf", list(toks[:n])))
        np.savez_compressed(a.out / f"{name}.f64.npz", logprobs=out)
        print(name, "max |HF f32 - numpy f64| =", float(np.abs(out - d["logprobs"]).max()))


if __name__ == "__main__":
    main()
