"""``train.compute_type``: the precision of the products with the frozen weight matrices.

``f32`` (the default) is pytrain's reference path: weights as the type policy loads them,
products in float32 (ggml-blas's sgemm, or ggml-cpu's kernels for F16 and quantized
weights, which round the activations to the weight's dot type as llama.cpp does).

``bf16`` is what HF + PEFT users on a CPU with bf16 units pick for speed: the weight matrices
are stored as BF16 (rounded to nearest even from F32 or F16, as ``model.to(torch.bfloat16)``
rounds them) and ggml-blas multiplies them with oneDNN's bf16 x bf16 -> f32 matmul, in the
forward (``MUL_MAT``) and in the backward (``OUT_PROD``), on AMX tiles (``amx_bf16``) or with
``vdpbf16ps`` (``avx512_bf16``).  The other operand (the activations; in the backward the
gradient) is rounded to bf16 at each such product, once, as torch's bf16 autocast rounds a
``Linear``'s input; the products accumulate in float32, and everything else (the LoRA
matrices and their gradients, norms, attention, the DeltaNet recurrence, the loss, AdamW)
stays float32, so a bf16 run rounds no more often than HF's bf16 run and usually less.

It is opt-in because it changes the numbers: each rounding costs up to 2^-9 relative
(tests/test_compute_bf16.py bounds a step's loss and LoRA gradients by that per rounding
times the depth of the graph).  CPU only: a GPU backend runs its own kernels.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterable

from pytrain import ggml
from pytrain.errors import PytrainError

COMPUTE_TYPES = ("f32", "bf16")
BF16_UNITS = ("amx_bf16", "avx512_bf16")       # /proc/cpuinfo flags of bf16 matmul units


class ComputeTypeError(PytrainError, ValueError):
    """A compute type this build, device or type policy cannot run."""


def cpu_bf16_units(cpuinfo: str | Path = "/proc/cpuinfo") -> list[str]:
    """Which of ``BF16_UNITS`` this CPU has (empty on a CPU without bf16 instructions)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return [u for u in BF16_UNITS if u in flags]


def type_policy_for(compute_type: str, type_policy: str) -> str:
    """The weights' type policy of a run: ``bf16`` compute loads them with the ``bf16``
    policy, which a run's own ``type_policy`` other than ``auto`` would contradict."""
    if compute_type not in COMPUTE_TYPES:
        raise ComputeTypeError(f"must be one of {', '.join(COMPUTE_TYPES)}; got {compute_type!r}")
    if compute_type == "f32":
        return type_policy
    if type_policy != "auto":
        raise ComputeTypeError(f"bf16 stores the weight matrices as BF16 itself; "
                               f"model.type_policy must stay auto (it is {type_policy!r})")
    return "bf16"


def check_runtime(compute_type: str, runtime) -> str:
    """Refuse a runtime that cannot run ``compute_type``; else the line a run logs."""
    return check(compute_type, runtime.device, runtime.blas is not None)


def check(compute_type: str, device: str, blas: bool) -> str:
    """Refuse a device (cpu, cuda, ...) that cannot run ``compute_type``, or a CPU run
    without ggml's BLAS backend (``blas``); else the line a run logs and ``pytrain plan``
    prints: for bf16, the oneDNN kernel and the CPU's bf16 units, or a warning that it has
    none."""
    if compute_type == "f32":
        return "compute f32"
    if device != "cpu":
        raise ComputeTypeError(f"bf16 is for CPU training; this run's device is {device} (set "
                               f"model.device = \"cpu\", or leave train.compute_type at f32 on "
                               f"a GPU)")
    kernel = ggml.bf16_kernel() if blas else ""
    if not kernel and blas and ggml.build_info().get("onednn"):
        raise ComputeTypeError("bf16 needs a CPU with AVX-512 (avx512_bf16 or AMX for speed): "
                               "oneDNN 3.2 has no bf16 matmul for this one (AVX2 only); leave "
                               "train.compute_type at f32")
    if not kernel:
        raise ComputeTypeError("bf16 needs ggml's BLAS backend with oneDNN (patch 0018), "
                               "which this build or this run lacks (PYTRAIN_BLAS=0?); "
                               "rebuild with `make build`")
    units = cpu_bf16_units()
    line = f"compute bf16: BF16 weight matrices through oneDNN's {kernel}"
    if units:
        return line + f" ({', '.join(units)})"
    return line + (" -- WARNING: this CPU has no bf16 units (avx512_bf16, amx_bf16): oneDNN "
                   "emulates the bf16 products, far slower than f32")


def with_matrices(line: str, loads: Iterable[tuple[str, str]]) -> str:
    """``line`` (``check``'s, for bf16) with what the weight matrices became, when some of them
    are not BF16: ``loads`` holds (file type, loaded type) per matrix.  bf16 compute rounds
    F32/F16/BF16 matrices to BF16; a quantized matrix keeps its type (no type policy loads it
    as BF16) and is multiplied by ggml-cpu's quantized kernels, as under f32: a run on a
    quantized model gets little or none of bf16's speed, and the line must not claim it."""
    loads = list(loads)
    kept = Counter(lt for _ft, lt in loads if lt != "BF16")
    if not kept:
        return line
    into = Counter(ft for ft, lt in loads if lt == "BF16")
    n = sum(into.values())
    bf16 = f"{n} BF16"
    if len(into) == 1:
        bf16 += f" (from {next(iter(into))})"
    elif into:
        bf16 += " (" + ", ".join(f"{c} from {t}" for t, c in sorted(into.items())) + ")"
    types = "/".join(sorted(kept))
    return (f"{line}; weight matrices: {bf16}, "
            + ", ".join(f"{c} kept {t}" for t, c in sorted(kept.items()))
            + f"\nwarning: bf16 compute does not apply to the {sum(kept.values())} matrices "
            f"kept as {types}: ggml-cpu's {types} kernels multiply them, as with "
            f"train.compute_type = \"f32\" (no type policy loads a quantized matrix as BF16); "
            f"for bf16 products on every matrix, train on an F32, F16 or BF16 GGUF of the "
            f"model; with this file, train.compute_type = \"f32\" lets model.type_policy = "
            f"\"auto\" load the types measured faster as F32 (pytrain plan shows which)")
