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

Under ``train.compute_type = "bf16"`` the float matrices become BF16 for oneDNN's bf16 matmul
(``pytrain.models.precision``), and the same rule decides for each quantized type whether a
BF16 copy (dequantized, then rounded to nearest even) replaces it: ``BF16_STEP_RATIO`` holds a
bf16 step's time with the type kept over its time with BF16 copies (the same benchmark, its
bf16 sides: bench_results/type_policy_bf16.md); a type ``FASTER`` so becomes BF16 when the
BF16 weights fit in half of the budget, else the file's types are kept (F32 copies would
leave the products to BLAS's sgemm: that is compute f32).  ``model.type_policy = "keep"``
keeps the quantized types under bf16.

Inference (``pytrain.load_model``, ``pytrain.load`` without an adapter) keeps ``auto``'s plain
rule: the figures are a training step's, and one token at a time the quantized kernels read a
fraction of F32's bytes.  An adapter a run wrote records the types that run loaded
(``ADAPTER_KEY``), and ``pytrain.load``, ``pytrain eval`` and ``pytrain generate`` load the base
so for it: its run's validation loss, and its samples, are then what they compute.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping

from pytrain import ggml
from pytrain.ggml import lib
from pytrain.formats.gguf_meta import GGUFError, metadata_from_reader, open_gguf
from pytrain.formats.gguf_tensors import TensorInfo, is_elementwise
from pytrain.models.weights import BF16, F16, F32, load_type
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
# under train.compute_type = "bf16" (only with ggml's BLAS backend: oneDNN is in it), per file
# type: a bf16 training step's time with the type kept over its time with the matrices as BF16
# copies (python -m scripts.bench_type_policy --sides f32,bf16-keep,bf16 --name
# type_policy_bf16: bench_results/type_policy_bf16.md, 3 rounds, and the types whose rounds
# disagreed again in type_policy_bf16_rerun.md, 5 rounds).  Both were measured on 2 threads of
# a 2-core machine under load from other work (single steps varied by up to 10x), so each
# figure is the lower of the runs' medians of per-round ratios: a type goes to BF16 only where
# every run measured it FASTER.  Q8_0 (1.49 then 1.00) and Q5_1 (0.95 then 1.95) are kept for
# that reason; the K-quants but Q4_K were measured faster kept.  That caution has a price
# where the measurement was noise: with this table Gemma 3 270M's demo step (Q8_0, Q6_K kept)
# ran at 40.0 tokens/s against 54.0 with every type copied (type_policy_bf16_real.md, same
# load).  A type not listed keeps its type.
BF16_STEP_RATIO: dict[str, dict[str, float]] = {
    "cpu+blas": {
        "Q8_0": 1.0,
        "Q4_0": 2.64,
        "Q4_1": 1.98,
        "Q5_0": 1.64,
        "Q5_1": 0.95,
        "Q2_K": 0.72,
        "Q3_K": 0.81,
        "Q4_K": 4.2,
        "Q5_K": 0.54,
        "Q6_K": 0.63,
        "IQ4_NL": 1.43,
        "IQ4_XS": 1.59,
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
    compute_type: str = "f32"     # bf16: the choice is between kept and BF16 copies

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
           dequantize: Mapping[int, int], policy: str = "auto") -> int:
    total = 0
    for n, shape in shapes.items():
        lt = load_type(n, tuple(shape), infos[n].type, device, policy, dequantize)
        total += int(lib.ggml_row_size(lt, shape[-1])) * (infos[n].n_elements // shape[-1])
    return total


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _ratios(measured: Mapping[str, tuple | None]) -> str:
    x = lambda v: "?" if v is None else f"{v:.2f}x"
    return ", ".join(f"{k} {'?' if v is None else f'{x(v[0])} F32, {x(v[1])} F16'}"
                     for k, v in measured.items())


def choose(key: str, infos: Mapping[str, TensorInfo], shapes: Mapping, policy: str,
           budget: int | None, source: str, compute_type: str = "f32") -> TypeChoice:
    """``auto``'s choice for a training run of the tensors ``shapes`` (of the file whose index
    is ``infos``) on a device of kind ``key`` (``device_key``) with ``budget`` bytes: the types
    whose kept step is ``FASTER`` times an F32 one become F32 when the F32 weights fit in half
    the budget; else those ``FASTER`` times an F16 one become F16 when that fits; else kept.
    Under ``compute_type`` bf16, ``choose_bf16``'s."""
    if compute_type == "bf16":
        return choose_bf16(key, infos, shapes, policy, budget, source)
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


def _n(count: int) -> str:
    return f"{count} matri{'x' if count == 1 else 'ces'}"


def choose_bf16(key: str, infos: Mapping[str, TensorInfo], shapes: Mapping, policy: str,
                budget: int | None, source: str) -> TypeChoice:
    """bf16 compute's choice (``policy``: the run's model.type_policy, auto or keep): the
    quantized matrix types whose bf16 step was measured ``FASTER`` kept than as BF16 copies
    (``BF16_STEP_RATIO``) become BF16 when the BF16 weights fit in half the budget (the F32
    rule's margin); else kept.  The reason names each type's outcome and its matrix count."""
    counts: dict[int, int] = {}
    for n, s in shapes.items():
        if load_type(n, tuple(s), infos[n].type, "cpu", "bf16") not in (F32, BF16):
            counts[infos[n].type] = counts.get(infos[n].type, 0) + 1
    table = BF16_STEP_RATIO.get(key, {})
    name = ggml.type_name
    measured = {name(t): table.get(name(t)) for t in sorted(counts)}
    kept = _bytes(infos, shapes, "cpu", {}, "bf16")
    fast = {t: BF16 for t in counts if (table.get(name(t)) or 0) >= FASTER}
    need = _bytes(infos, shapes, "cpu", fast, "bf16") if fast else kept
    fits = budget is not None and need <= budget // 2
    head = f'compute bf16, type_policy = "{policy}": '

    def why_kept(t: int) -> str:
        if policy != "auto":
            return f'model.type_policy = "{policy}"'
        if t in fast:
            return (f"BF16 weights {_size(need)} over half of the {_size(budget or 0)} budget "
                    f"({source}), though a bf16 step measured {table[name(t)]:.2f}x faster so")
        r = table.get(name(t))
        if not table:
            return f"no bf16 measurement on {key}"
        if r is None:
            return "not measured"
        return (f"a bf16 step measured {r:.2f}x as fast with BF16 copies: not {FASTER:.2f}x "
                f"faster")

    chosen = fast if policy == "auto" and fits else {}
    parts = [f"{name(t)} -> BF16 ({_n(counts[t])}: a bf16 step measured "
             f"{table[name(t)]:.2f}x faster)" for t in sorted(chosen)]
    parts += [f"kept {name(t)} ({_n(counts[t])}: {why_kept(t)})" for t in sorted(counts)
              if t not in chosen]
    if not counts:
        why = head + "every matrix is F32, F16 or BF16 in the file: all BF16"
    elif chosen:
        why = (head + "; ".join(parts) + f"; BF16 weights {_size(need)} (kept: {_size(kept)}) "
               f"within half of the {_size(budget or 0)} budget ({source})")
    else:
        why = head + "; ".join(parts)
    return TypeChoice(policy, key, chosen, measured, kept, {"BF16": need} if fast else {},
                      need if chosen else kept, budget, source, why, "bf16")


def for_training(policy: str, memory_gib: float | None, log: Callable[[str], None],
                 share: int = 1, compute_type: str = "f32") -> Callable[..., dict[int, int]]:
    """The ``dequantize`` function ``load_model`` calls for a training run once its device is
    known: ``choose``'s types, the reason logged."""
    def choose_for(rt, infos, shapes) -> dict[int, int]:
        budget, source = runtime_budget(rt, memory_gib, share)
        c = choose(device_key(rt.device, rt.blas is not None), infos, shapes, policy, budget,
                   source, compute_type)
        log(f"weights: {c.reason}")
        return c.dequantize
    return choose_for


# --------------------------------------------------------------------------- the adapter's record

# Why a record: a run's validation loss is computed on the weights as the run loaded them
# (``auto`` may dequantize, bf16 compute rounds to BF16), and an evaluation of its adapter on
# the file's own types gives another number (SmolLM2 Q4_1: 3.6914 against the run's 3.6741).
# The run's choice depends on its device and the memory it had, so it is recorded in the
# adapters the run writes, not chosen again: ``pytrain eval`` and ``pytrain.load`` read it.
ADAPTER_KEY = "pytrain.base_weights"


def matrix_types(model) -> dict[str, str]:
    """File type -> loaded type of the weight matrices of ``model`` (the element-wise tensors
    are F32 under every policy but ``keep``)."""
    out: dict[str, str] = {}
    for r in model.weights.report.values():
        if not is_elementwise(r.name, r.shape) and not r.note:
            out.setdefault(r.file_type, r.loaded_type)
    return dict(sorted(out.items()))


def compute_type_of(model) -> str:
    return "bf16" if model.compute.startswith("compute bf16") else "f32"


def weights_record(model) -> str:
    """The value of ``ADAPTER_KEY`` for adapters trained on ``model``: its compute type and
    the type each matrix file type was loaded as (JSON)."""
    return json.dumps({"compute_type": compute_type_of(model), "matrices": matrix_types(model)},
                      separators=(",", ":"))


def read_record(adapter: str | os.PathLike[str]) -> dict | None:
    """The record of an adapter GGUF written by a pytrain run; None for a PEFT folder, an
    adapter without it, or a file that does not read (loading it says why)."""
    p = Path(adapter)
    if not p.is_file():
        return None
    try:
        rec = json.loads(metadata_from_reader(open_gguf(p)).get(ADAPTER_KEY, "null"))
    except (GGUFError, OSError, ValueError, TypeError):
        return None
    if not isinstance(rec, dict) or rec.get("compute_type") not in ("f32", "bf16") \
            or not isinstance(rec.get("matrices"), dict):
        return None
    names = {ggml.type_name(t) for t in ggml.TYPES.values()}
    if not all(k in names and v in names for k, v in rec["matrices"].items()):
        return None
    return rec


def _types(types: Mapping[str, str]) -> str:
    return ", ".join(k if k == v else f"{k} -> {v}" for k, v in types.items())


def as_recorded(rec: Mapping, say: Callable[[str], None]) -> Callable[..., dict[int, int]]:
    """The ``dequantize`` function ``load_model`` calls to load matrices as the run of ``rec``
    did: its F32/F16 targets (a bf16 run's: the quantized types it copied to BF16), while
    those weights fit in half of the memory available now (``for_training``'s rule); else the
    file's types, and ``say`` tells why."""
    ids = {ggml.type_name(t): t for t in ggml.TYPES.values()}
    # BF16 from a quantized type: a bf16 run's copies (load_model drops them under f32)
    want = {ids[k]: ids[v] for k, v in rec["matrices"].items()
            if k != v and (v in ("F32", "F16") or v == "BF16" and k not in ("F32", "F16"))}
    policy = "bf16" if rec["compute_type"] == "bf16" else "auto"

    def choose_for(rt, infos, shapes) -> dict[int, int]:
        present = {i.type for i in infos.values()}
        chosen = {k: v for k, v in want.items() if k in present}
        if not chosen:
            return {}
        need = _bytes(infos, shapes, rt.device, chosen, policy)
        budget, source = runtime_budget(rt, None)
        if need > budget // 2:
            say(f"its types need {_size(need)} of weights, over half of the {_size(budget)} "
                f"of {source}")
            return {}
        return chosen
    return choose_for


def difference(rec: Mapping, model) -> str | None:
    """How ``model``'s weights differ from those of the run that recorded ``rec`` (the file
    types both hold, and the compute type); None when they are loaded alike."""
    now = matrix_types(model)
    shared = [k for k in rec["matrices"] if k in now]
    then = {k: rec["matrices"][k] for k in shared}
    here = {k: now[k] for k in shared}
    ct = compute_type_of(model)
    if then == here and ct == rec["compute_type"]:
        return None
    if ct == rec["compute_type"]:
        return f"its run loaded the base's matrices as {_types(then)}, here they are {_types(here)}"
    return (f"its run loaded the base's matrices as {_types(then)} with compute "
            f"{rec['compute_type']}, here as {_types(here)} with compute {ct}")


def matching_settings(rec: Mapping) -> str:
    """The settings that load the weights as the run of ``rec`` did."""
    default = 'leave type_policy unset in pytrain.load (model.type_policy = "auto" in a config)'
    if rec["compute_type"] == "bf16":
        return default + " on a CPU with bf16 compute (pytrain doctor)"
    if set(rec["matrices"].values()) == {"F32"}:
        return default + ', or set type_policy "f32" (model.type_policy = "f32"), which ' \
                         'loads them so whatever the memory'
    return default
