"""``model.type_policy = "auto"`` for a training run: which of the file's weight types are
loaded as F32 (or F16) instead of kept, from measured step costs and the memory budget.

Why: the frozen weights' type decides which kernels a training step runs.  On a CPU with
ggml's BLAS backend, F32 matmuls go to the BLAS GEMM; a kept quantized or F16 weight stays on
ggml-cpu's kernels forward (activations rounded to the weight's dot type) and is converted
slab by slab for every backward OUT_PROD.  Which is faster depends on the type and the device,
so it is measured, not guessed: ``STEP_RATIO`` holds, per device kind and file type, a training
step's time with the type kept over its time with the weights dequantized to F32, from
``python -m scripts.bench_type_policy`` (bench_results/type_policy.md, which says on what
machine).  F32 costs 4 bytes a weight where Q4_1 costs 0.75, so a type is dequantized only
when that pays (``FASTER``) and the F32 weights fit in half of the memory the run may use (the
other half for the step, as ``recompute = "auto"`` keeps a margin).  When they do not, F16 is
the middle option (2 bytes; where measured faster than kept and it fits); else the file's
types are kept.  As F32 the values are the file's, so the function trained is the same (kept
types also round the activations of the forward, as llama.cpp does; F32 does not); as F16
they are rounded to 11 bits, and the load report counts the values that changed.

Inference (``pytrain generate``/``eval``, ``pytrain.load_model``) keeps ``auto``'s plain rule:
the figures are a training step's, and one token at a time the quantized kernels read a
fraction of F32's bytes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Mapping

from pytrain import ggml
from pytrain.ggml import lib
from pytrain.formats.gguf_tensors import TensorInfo
from pytrain.models.weights import F16, F32, load_type
from pytrain.step.free_memory import available_bytes

# dequantize when the kept type's step takes at least this much longer: a step's time is a sum
# over its matmuls, so a file whose types are each kept below FASTER steps within FASTER of
# the all-F32 step (and a type near the line costs little either way: the figures move by
# several percent between runs)
FASTER = 1.10
# per device kind ("cpu+blas": ggml's BLAS backend, as built by default; "cpu": PYTRAIN_BLAS=0
# or a build without it) and file type: a training step's time with the type kept over its
# time with the matrices as F32, and as F16 (None: not measured); a type or device not listed
# (CUDA: not measured yet) keeps the file's types
STEP_RATIO: dict[str, dict[str, tuple[float, float | None]]] = {
    "cpu+blas": {
        "Q4_1": (1.78, 1.58),
        "Q5_0": (1.25, 1.11),
        "Q8_0": (1.03, 1.0),
        "Q4_K": (0.86, 0.73),
        "Q6_K": (0.92, 0.84),
        "F16": (1.14, None),
        "BF16": (1.05, 0.97),
        "Q4_0": (1.11, 1.0),
        "Q5_1": (2.01, 1.73),
        "Q2_K": (0.86, 0.83),
        "Q3_K": (0.92, 0.79),
        "Q5_K": (0.83, 0.76),
        "IQ4_NL": (1.29, 1.06),
        "IQ4_XS": (0.87, 0.84),
    },
    "cpu": {
        "F16": (6.74, None),
        "BF16": (6.13, None),
        "Q8_0": (1.5, None),
        "Q4_0": (3.29, None),
        "Q4_1": (4.09, None),
        "Q5_0": (5.49, None),
        "Q5_1": (6.16, None),
        "Q2_K": (5.47, None),
        "Q3_K": (6.1, None),
        "Q4_K": (1.39, None),
        "Q5_K": (1.58, None),
        "Q6_K": (6.07, None),
        "IQ4_NL": (5.64, None),
        "IQ4_XS": (5.61, None),
    },
}
_TARGETS = ((F32, "F32"), (F16, "F16"))     # preferred first: F32 is exact and at least as fast


@dataclass(frozen=True)
class TypeChoice:
    """What ``auto`` decided for a training run, and why (``pytrain plan`` shows it)."""
    policy: str
    device: str                   # the table's key: cpu+blas, cpu, cuda, rpc
    dequantize: dict[int, int]    # file type -> F32 or F16, for ``load_model``
    measured: dict[str, tuple | None]   # per matrix file type: its STEP_RATIO (None: none)
    kept_bytes: int               # the weights with the file's types (auto's plain rule)
    option_bytes: dict[str, int]  # "F32"/"F16": the weights with the slower types so converted
    chosen_bytes: int
    budget: int | None
    source: str
    reason: str

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dequantize"] = {ggml.type_name(k): ggml.type_name(v) for k, v in self.dequantize.items()}
        return d


def device_key(device: str, blas: bool) -> str:
    """The row of ``STEP_RATIO`` a run on ``device`` reads."""
    return "cpu+blas" if device == "cpu" and blas else device


def runtime_budget(rt, memory_gib: float | None, share: int = 1) -> tuple[int, str]:
    """(bytes, where from) a run on ``rt`` may use: train.memory_gib, or what is available now
    (a GPU's free memory; on a CPU the least of the system's and the cgroup's), split between
    ``share`` ranks of one host."""
    if memory_gib:
        return int(memory_gib * 2**30), "train.memory_gib"
    where = "the device's free memory" if rt.gpu is not None else "available memory"
    return available_bytes(rt) // max(1, share), where


def _bytes(infos: Mapping[str, TensorInfo], shapes: Mapping, device: str,
           dequantize: Mapping[int, int]) -> int:
    total = 0
    for n, shape in shapes.items():
        lt = load_type(n, tuple(shape), infos[n].type, device, "auto", dequantize)
        total += int(lib.ggml_row_size(lt, shape[-1])) * (infos[n].n_elements // shape[-1])
    return total


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _ratios(measured: Mapping[str, tuple | None]) -> str:
    x = lambda v: "?" if v is None else f"{v:.2f}x"
    return ", ".join(f"{k} {'?' if v is None else f'{x(v[0])} F32, {x(v[1])} F16'}"
                     for k, v in measured.items())


def choose(key: str, infos: Mapping[str, TensorInfo], shapes: Mapping, policy: str,
           budget: int | None, source: str) -> TypeChoice:
    """``auto``'s choice for a training run of the tensors ``shapes`` (of the file whose index
    is ``infos``) on a device of kind ``key`` (``device_key``) with ``budget`` bytes: the types
    whose kept step is ``FASTER`` times an F32 one become F32 when the F32 weights fit in half
    the budget; else those ``FASTER`` times an F16 one become F16 when that fits; else kept."""
    device = "cpu" if key.startswith("cpu") else key
    kept_types = {infos[n].type for n, s in shapes.items()
                  if load_type(n, tuple(s), infos[n].type, device, "auto") != F32}
    table = STEP_RATIO.get(key, {})
    measured = {ggml.type_name(t): table.get(ggml.type_name(t)) for t in sorted(kept_types)}
    kept = _bytes(infos, shapes, device, {})
    options = []                          # (target name, types -> target, bytes, ratios)
    for i, (target, tname) in enumerate(_TARGETS):
        slow = {t: target for t in kept_types if t != target
                and ((table.get(ggml.type_name(t)) or (None, None))[i] or 0) >= FASTER}
        if slow:
            options.append((tname, slow, _bytes(infos, shapes, device, slow), ", ".join(
                f"{ggml.type_name(t)} {table[ggml.type_name(t)][i]:.2f}x" for t in sorted(slow))))
    sizes = {name: n for name, _slow, n, _r in options}
    fits = [o for o in options if budget is not None and o[2] <= budget // 2]
    auto = 'type_policy = "auto": '
    if policy != "auto":
        why, chosen = f'model.type_policy = "{policy}"', {}
    elif not kept_types:
        why, chosen = auto + "every matrix is F32 already", {}
    elif not table:
        why, chosen = auto + f"the file's types kept (no measurement on {key})", {}
    elif not options:
        why, chosen = (auto + f"the file's types kept: a training step on {key} measured "
                       f"within {FASTER - 1:.0%} of its time dequantized, or faster (kept over "
                       f"dequantized step time: {_ratios(measured)})"), {}
    elif fits:
        tname, chosen, n, ratios = fits[0]
        over = "".join(f"{o[0]} weights {_size(o[2])} over half the budget; " for o in options
                       if o[0] != tname and o[2] > n)
        why = (auto + f"{', '.join(sorted(ggml.type_name(t) for t in chosen))} dequantized to "
               f"{tname}: a training step on {key} measured {ratios} slower kept than as "
               f"{tname}; {over}{tname} weights {_size(n)} (kept: {_size(kept)}) within half "
               f"of the {_size(budget)} budget ({source})")
    else:
        why, chosen = (auto + "the file's types kept: " + "; ".join(
            f"{o[0]} weights {_size(o[2])} (a step {o[3]} faster)" for o in options)
            + f" over half of the {_size(budget or 0)} budget ({source}); kept: "
            f"{_size(kept)}"), {}
    return TypeChoice(policy, key, chosen, measured, kept, sizes,
                      _bytes(infos, shapes, device, chosen), budget, source, why)


def for_training(policy: str, memory_gib: float | None, log: Callable[[str], None],
                 share: int = 1) -> Callable[..., dict[int, int]]:
    """The ``dequantize`` function ``load_model`` calls for a training run once its device is
    known: ``choose``'s types, the reason logged."""
    def choose_for(rt, infos, shapes) -> dict[int, int]:
        budget, source = runtime_budget(rt, memory_gib, share)
        c = choose(device_key(rt.device, rt.blas is not None), infos, shapes, policy, budget,
                   source)
        log(f"weights: {c.reason}")
        return c.dequantize
    return choose_for
