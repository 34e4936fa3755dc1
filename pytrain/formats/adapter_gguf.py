"""LoRA adapter GGUF files, exactly as llama.cpp's ``src/llama-adapter.cpp`` loads them.

The deliverable of a training run is a file that ``llama-cli --lora FILE`` accepts and that
computes what pytrain trained, so the writer enforces everything llama.cpp's loader checks
(and refuses early, with a message naming the file, what llama.cpp would refuse late or
silently misread):

- keys ``general.type = "adapter"``, ``general.architecture`` = the base model's arch (compared
  with the model's arch), ``adapter.type = "lora"``, ``adapter.lora.alpha`` (f32).  llama.cpp
  reads a *missing or zero* alpha as "scale 1" rather than ``alpha / rank``, so alpha must be
  present and non-zero for both programs to apply the same scale.
- every tensor name ends in ``.lora_a`` or ``.lora_b`` (llama.cpp throws on any other suffix,
  except ``*_norm.weight`` which it silently ignores), and both halves of each pair exist;
- ``<base>.lora_a`` has ne ``[n_in, r]`` (numpy ``[r, n_in]``) and ``<base>.lora_b`` ne
  ``[r, n_out]`` (numpy ``[n_out, r]``); the rank is ``lora_b`` ne[0], per pair;
- names fit ggml's 64-byte name field (63 bytes + NUL); the data is aligned to 32 bytes (no
  ``general.alignment`` key), which ``gguf.GGUFWriter`` does.

llama.cpp applies ``W·x + scale·B·(A·x)`` with ``scale = alpha / rank`` (times the user's
``--lora-scaled`` factor), the same function as :class:`pytrain.models.lora.LoraAdapter`.

Writes are atomic: a temporary file in the destination folder is written, flushed and
fsync'ed, then renamed over the final name, so an interrupted save never leaves a truncated
adapter where the previous good one was.
"""
from __future__ import annotations

import math
import os

from pathlib import Path
from typing import Any, Mapping

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, GGMLQuantizationType
from gguf.quants import dequantize

from pytrain.formats.atomic import replacing
from pytrain.formats.gguf_meta import GGUFError, metadata_from_reader, open_gguf

SUFFIX_A = ".lora_a"
SUFFIX_B = ".lora_b"
MAX_NAME_BYTES = 63             # GGML_MAX_NAME (64) minus the terminating NUL
KEY_TYPE = "general.type"
KEY_ARCH = "general.architecture"
KEY_ADAPTER_TYPE = "adapter.type"
KEY_ALPHA = "adapter.lora.alpha"
KEY_ALIGNMENT = "general.alignment"
# Keys this module owns; callers' metadata may not override them.
RESERVED_KEYS = frozenset({KEY_TYPE, KEY_ARCH, KEY_ADAPTER_TYPE, KEY_ALPHA, KEY_ALIGNMENT})


class AdapterError(GGUFError):
    """An adapter file or tensor set llama.cpp would refuse or misread; names the file."""


# --------------------------------------------------------------------------- validation

def _is_token_embd(base: str) -> bool:
    """llama.cpp applies an embedding LoRA with A and B laid out differently (see below)."""
    return base.endswith("token_embd.weight")


def lora_pairs(tensors: Mapping[str, np.ndarray], where: str
               ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{base name: (A, B)}`` after llama.cpp's name and shape rules (see module docstring)."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, arr in tensors.items():
        if name.endswith(SUFFIX_A):
            base, which = name[: -len(SUFFIX_A)], "a"
        elif name.endswith(SUFFIX_B):
            base, which = name[: -len(SUFFIX_B)], "b"
        else:
            raise AdapterError(f"{where}: tensor {name!r} does not end in {SUFFIX_A!r} or "
                               f"{SUFFIX_B!r} (llama.cpp refuses such adapters)")
        if not base:
            raise AdapterError(f"{where}: tensor {name!r} has no base tensor name")
        halves.setdefault(base, {})[which] = arr
    if not halves:
        raise AdapterError(f"{where}: no LoRA tensors")
    out = {}
    for base, h in halves.items():
        missing = [base + (SUFFIX_A if w == "a" else SUFFIX_B) for w in "ab" if w not in h]
        if missing:
            raise AdapterError(f"{where}: LoRA pair for {base!r} is missing {missing[0]!r}")
        a, b = h["a"], h["b"]
        if a.ndim != 2 or b.ndim != 2:
            raise AdapterError(f"{where}: {base!r}: lora_a and lora_b must be 2-D, got shapes "
                               f"{tuple(a.shape)} and {tuple(b.shape)}")
        if _is_token_embd(base):
            # get_rows(A, tokens) then B·that: A [n_vocab, r], B [n_embd, r] in numpy order
            ok, want = a.shape[1] == b.shape[1], "A [n_vocab, r] and B [n_embd, r]"
        else:
            ok, want = a.shape[0] == b.shape[1], "A [r, n_in] and B [n_out, r]"
        if not ok or min(a.shape + b.shape) < 1:
            raise AdapterError(
                f"{where}: {base!r}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} (numpy "
                f"order) disagree on the rank: need {want}")
        out[base] = (a, b)
    return out


def check_adapter_matches(model_config: Any, tensors: Mapping[str, np.ndarray],
                          source: str = "adapter") -> None:
    """Refuse an adapter made for another base model, as llama.cpp would at load time.

    ``model_config`` is an architecture's config with ``tensor_shapes()`` or a
    mapping ``{tensor name: numpy shape}``.  Every ``<base>`` must be a 2-D tensor of the model
    with ``A`` [r, n_in] and ``B`` [n_out, r] matching its [n_out, n_in]; ``token_embd.weight``
    follows llama.cpp's embedding convention (A [n_vocab, r], B [n_embd, r] in numpy order:
    ``B·get_rows(A, tokens)``).
    Raises :class:`AdapterError` naming the tensor and ``source``.
    """
    shapes = model_config.tensor_shapes() if hasattr(model_config, "tensor_shapes") \
        else dict(model_config)
    for base, (a, b) in lora_pairs(tensors, source).items():
        if base not in shapes:
            raise AdapterError(f"{source}: LoRA tensor {base!r} does not exist in the base model "
                               f"(an adapter for a different model?)")
        shp = tuple(shapes[base])
        if len(shp) != 2:
            raise AdapterError(f"{source}: LoRA on {base!r}, which is not a matrix {shp}")
        n_out, n_in = shp
        if _is_token_embd(base):
            ok = b.shape[0] == n_in and a.shape[0] == n_out   # ne[0]==b.ne[1], ne[1]==a.ne[1]
            want = f"A [{n_out}, r] and B [{n_in}, r]"
        else:
            ok = a.shape[1] == n_in and b.shape[0] == n_out
            want = f"A [r, {n_in}] and B [{n_out}, r]"
        if not ok:
            raise AdapterError(f"{source}: {base!r} is {shp} in the base model but the adapter "
                               f"has A {tuple(a.shape)} and B {tuple(b.shape)}; expected {want} "
                               f"(an adapter for a different model?)")


def check_alpha(alpha, where: str, error: type[Exception] | None = None, name: str = "alpha"
                ) -> float:
    """``alpha`` as a float, or ``error`` (AdapterError by default) saying why it cannot be an
    adapter's alpha: not a number, zero (llama.cpp reads 0 as 'scale 1', not alpha/rank), not
    finite, beyond float32."""
    error = error or AdapterError
    if isinstance(alpha, bool):
        raise error(f"{where}: {name} must be a number, got {alpha!r}")
    try:
        a = float(alpha)
    except (TypeError, ValueError):
        raise error(f"{where}: {name} must be a number, got {alpha!r}") from None
    if not math.isfinite(a) or a == 0.0:
        raise error(f"{where}: {name} must be finite and non-zero, got {alpha!r} "
                    f"(llama.cpp reads alpha 0 as 'scale 1', not alpha/rank)")
    if abs(a) > float(np.finfo(np.float32).max):
        raise error(f"{where}: {name} {alpha!r} does not fit a float32")
    return a


# --------------------------------------------------------------------------- writing

def _add_metadata(w: GGUFWriter, key: str, value: Any, where: str) -> None:
    """Write one caller key with a type inferred from the Python value.

    Integers go out as UINT32 when they fit (llama.cpp's array keys such as
    ``adapter.alora.invocation_tokens`` require it), else INT64; floats as FLOAT32.
    """
    if key in RESERVED_KEYS:
        raise AdapterError(f"{where}: metadata key {key!r} is set by the writer, not the caller")
    if not isinstance(key, str) or not key:
        raise AdapterError(f"{where}: metadata key {key!r} must be a non-empty string")

    def int_type(vals) -> GGUFValueType:
        return (GGUFValueType.UINT32 if all(0 <= v < 2**32 for v in vals)
                else GGUFValueType.INT64)

    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, (int, np.integer)):
        w.add_key_value(key, int(value), int_type([int(value)]))
    elif isinstance(value, (float, np.floating)):
        w.add_float32(key, float(value))
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        vals = list(value)
        if vals and all(isinstance(v, str) for v in vals):
            w.add_array(key, vals)
        elif all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in vals):
            ints = [int(v) for v in vals]
            w.add_key_value(key, ints, GGUFValueType.ARRAY, int_type(ints))
        elif all(isinstance(v, (int, float, np.integer, np.floating))
                 and not isinstance(v, bool) for v in vals):
            w.add_key_value(key, [float(v) for v in vals], GGUFValueType.ARRAY,
                            GGUFValueType.FLOAT32)
        else:
            raise AdapterError(f"{where}: metadata {key!r}: arrays must be all strings or all "
                               f"numbers")
    else:
        raise AdapterError(f"{where}: metadata {key!r} has unsupported type "
                           f"{type(value).__name__}")


def write_lora_gguf(path: str | os.PathLike[str], arch: str, alpha: float,
                    tensors: Mapping[str, np.ndarray],
                    base_metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a LoRA adapter GGUF that llama.cpp loads with ``--lora``; returns the path.

    ``tensors`` maps ``<base>.lora_a`` → A [r, n_in] and ``<base>.lora_b`` → B [n_out, r]
    (numpy order, as :meth:`pytrain.models.lora.LoraAdapter.get` returns them); they are stored as
    F32.  ``base_metadata`` adds key/values (e.g. ``general.name``, provenance keys); the
    adapter contract keys cannot be overridden.  Validation happens before anything touches
    the disk; the file appears under its final name only once complete and fsync'ed.
    """
    p = Path(path)
    if not isinstance(arch, str) or not arch:
        raise AdapterError(f"{p}: arch must be the base model's general.architecture, "
                           f"got {arch!r}")
    alpha = check_alpha(alpha, str(p))
    arrays: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if len(name.encode()) > MAX_NAME_BYTES:
            raise AdapterError(f"{p}: tensor name {name!r} is longer than ggml's "
                               f"{MAX_NAME_BYTES}-byte limit")
        a = np.asarray(arr)
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
            raise AdapterError(f"{p}: tensor {name!r} has dtype {a.dtype}, not a number")
        a = np.ascontiguousarray(a, dtype=np.float32)
        if not np.isfinite(a).all():
            raise AdapterError(f"{p}: tensor {name!r} holds NaN or Inf (a diverged run?); "
                               f"refusing to write it")
        arrays[name] = a
    pairs = lora_pairs(arrays, str(p))

    with replacing(p) as tmp:
        w = GGUFWriter(tmp, arch)          # writes general.architecture
        w.add_type("adapter")
        w.add_string(KEY_ADAPTER_TYPE, "lora")
        w.add_float32(KEY_ALPHA, alpha)
        for key, value in (base_metadata or {}).items():
            _add_metadata(w, key, value, str(p))
        for base in sorted(pairs):        # deterministic order: A then B per base tensor
            a, b = pairs[base]
            w.add_tensor(base + SUFFIX_A, a)
            w.add_tensor(base + SUFFIX_B, b)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return p


# --------------------------------------------------------------------------- reading

def _tensor_f32(t, where: str) -> np.ndarray:
    ttype = GGMLQuantizationType(int(t.tensor_type))
    if ttype == GGMLQuantizationType.F32:
        return np.array(t.data, dtype=np.float32)
    try:
        return np.asarray(dequantize(t.data, ttype), dtype=np.float32)
    except (NotImplementedError, ValueError) as e:
        raise AdapterError(f"{where}: tensor {t.name!r} has type {ttype.name}, which pytrain "
                           f"cannot read: {e}") from e


def read_lora_gguf(path: str | os.PathLike[str], arch: str | None = None
                   ) -> tuple[str, float, dict[str, np.ndarray], dict[str, Any]]:
    """``(arch, alpha, tensors, metadata)`` of a LoRA adapter GGUF, validated.

    ``tensors`` are float32 numpy arrays in numpy order (A [r, n_in], B [n_out, r]);
    ``metadata`` holds every key except the four adapter contract keys and
    ``general.alignment`` (so a write/read round trip returns the caller's metadata).
    ``arch``, if given, must equal the file's architecture.  ``*_norm.weight`` tensors, which
    llama.cpp ignores, are skipped.  Raises :class:`AdapterError` (a ``GGUFError``) naming
    the file for anything llama.cpp would refuse.
    """
    p = Path(path)
    reader: GGUFReader = open_gguf(p)
    meta = metadata_from_reader(reader)
    gtype = meta.get(KEY_TYPE)
    if gtype != "adapter":
        raise AdapterError(f"{p}: not an adapter: general.type is {gtype!r}, expected "
                           f"'adapter'" + (" (a base model?)" if gtype in (None, "model")
                                           else ""))
    atype = meta.get(KEY_ADAPTER_TYPE)
    if atype != "lora":
        raise AdapterError(f"{p}: adapter.type is {atype!r}, expected 'lora'")
    file_arch = meta.get(KEY_ARCH)
    if not isinstance(file_arch, str) or not file_arch:
        raise AdapterError(f"{p}: no general.architecture key")
    if arch is not None and file_arch != arch:
        raise AdapterError(f"{p}: adapter is for architecture {file_arch!r}, but the model is "
                           f"{arch!r}")
    if KEY_ALPHA not in meta:
        raise AdapterError(f"{p}: no {KEY_ALPHA} key (llama.cpp would apply scale 1, not "
                           f"alpha/rank)")
    alpha = check_alpha(meta[KEY_ALPHA], str(p))
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if not (t.name.endswith(SUFFIX_A) or t.name.endswith(SUFFIX_B)) \
                and t.name.endswith("_norm.weight"):
            continue                       # llama.cpp skips these too
        tensors[t.name] = _tensor_f32(t, str(p))
    lora_pairs(tensors, str(p))
    extra = {k: v for k, v in meta.items() if k not in RESERVED_KEYS}
    return file_arch, alpha, tensors, extra
