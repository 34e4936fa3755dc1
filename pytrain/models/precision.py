"""``train.compute_type``: the precision of the products with the frozen weight matrices.

``f32`` (the default) is pytrain's reference path: weights as the type policy loads them,
products in float32 (ggml-blas's sgemm, or ggml-cpu's kernels for F16 and quantized
weights, which round the activations to the weight's dot type as llama.cpp does).

``bf16`` is what HF + PEFT users on a CPU with bf16 units pick for speed: the weight matrices
are stored as BF16 (rounded to nearest even from F32 or F16, as ``model.to(torch.bfloat16)``
rounds them; a quantized type dequantized and rounded so where a bf16 step was measured
faster that way and the copies fit, ``pytrain.run.type_choice.choose_bf16``) and ggml-blas
multiplies them with oneDNN's bf16 x bf16 -> f32 matmul, in the forward (``MUL_MAT``) and
in the backward (``OUT_PROD``), on AMX tiles (``amx_bf16``) or with ``vdpbf16ps``
(``avx512_bf16``).  The other operand (the activations; in the backward the
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
    policy, which ``f32`` would contradict; ``auto`` and ``keep`` differ there only in the
    quantized matrices (``keep``: never BF16 copies; the training run's choice says so)."""
    if compute_type not in COMPUTE_TYPES:
        raise ComputeTypeError(f"must be one of {', '.join(COMPUTE_TYPES)}; got {compute_type!r}")
    if compute_type == "f32":
        return type_policy
    if type_policy not in ("auto", "keep"):
        raise ComputeTypeError(f"bf16 stores the weight matrices as BF16 itself; "
                               f"model.type_policy must be auto or keep (it is {type_policy!r})")
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
    are not BF16: ``loads`` holds (file type, loaded type) per matrix.  A quantized matrix is
    BF16 only where the run's type choice made it so (``type_choice.choose_bf16``, whose
    reason the run logs and ``pytrain plan`` prints); a kept one is multiplied by ggml-cpu's
    kernels as under f32, and the line must not claim bf16 products for it.  When no matrix
    is BF16, the line says bf16 applies to none."""
    loads = list(loads)
    kept = Counter(lt for _ft, lt in loads if lt != "BF16")
    if not kept:
        return line
    into = Counter(ft for ft, lt in loads if lt == "BF16")
    n_kept = sum(kept.values())
    types = "/".join(sorted(kept))
    them = "it" if n_kept == 1 else "them"
    made = ", ".join(f"{c} {t} -> BF16" for t, c in sorted(into.items()))
    held = ", ".join(f"{c} kept {t}" for t, c in sorted(kept.items()))
    if not into:
        head = line.split(":", 1)[0]          # "compute bf16"
        return (f"{head}: no weight matrix is BF16 ({held}): ggml-cpu's {types} kernels "
                f"multiply {them}, as with train.compute_type = \"f32\"; bf16 applies to none "
                f"of the products with the frozen weights\nwarning: bf16 compute does not apply "
                f"to this model's {n_kept} matrices kept as {types} (the run's weights: line, "
                f"pytrain plan's types:, says why); "
                f"train.compute_type = \"f32\" lets model.type_policy = \"auto\" load the types "
                f"measured faster as F32, and an F32, F16 or BF16 GGUF of the model gets bf16 "
                f"on every matrix")
    return (f"{line}; weight matrices: {made}, {held} (ggml-cpu's {types} kernels multiply "
            f"{them}, as under f32)")
