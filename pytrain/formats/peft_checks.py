"""What the PEFT writer checks before it touches the disk: alpha, rank, and each LoRA pair's
names, number types, shapes and values (also against the base model's shapes, which the
reader checks too), so that a refused adapter names the tensor at fault.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from pytrain.formats.adapter_gguf import AdapterError, check_alpha, lora_pairs
from pytrain.formats.hf_layout import PeftAdapterError
from pytrain.formats.peft_names import peft_module_name


def check_lora_alpha(alpha: Any, where: str) -> float:
    """``lora_alpha`` as a float, refused as ``adapter_gguf.check_alpha`` refuses an alpha."""
    return check_alpha(alpha, where, PeftAdapterError, "lora_alpha")


def check_rank(rank: Any, where: str) -> int:
    """``r`` as an int, refused unless a positive integer."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or int(rank) < 1:
        raise PeftAdapterError(f"{where}: rank (r) must be a positive integer, got {rank!r}")
    return int(rank)


def gguf_pairs(tensors: Mapping[str, Any], rank: int, where: str, arch: str | None
               ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{gguf base: (A, B)}`` as float32.  First what PEFT needs of each tensor (a module for
    its base, a number type, the adapter's rank), then llama.cpp's pairing and shape rules
    (``adapter_gguf.lora_pairs``), then finite values."""
    for name, arr in tensors.items():
        base, half = name.rpartition(".")[0], name.rpartition(".")[2]
        if half not in ("lora_a", "lora_b"):
            continue                                     # lora_pairs names the bad suffix
        try:
            peft_module_name(base, arch=arch)            # refuses unmapped targets by name
        except PeftAdapterError as e:
            raise PeftAdapterError(f"{where}: {e}") from None
        x = np.asarray(arr)
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise PeftAdapterError(f"{where}: tensor {name!r} has dtype {x.dtype}, not a number")
        if x.ndim == 2 and x.shape[0 if half == "lora_a" else 1] != rank:
            raise PeftAdapterError(
                f"{where}: {name!r} has shape {tuple(x.shape)}: A must be [r, n_in] and B "
                f"[n_out, r] with r = {rank}")
    try:
        pairs = lora_pairs({k: np.asarray(v) for k, v in tensors.items()}, where)
    except AdapterError as e:
        raise PeftAdapterError(str(e)) from None
    out = {}
    for base, (a, b) in sorted(pairs.items()):
        a, b = (np.ascontiguousarray(x, dtype=np.float32) for x in (a, b))
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise PeftAdapterError(f"{where}: {base!r} holds NaN or Inf (a diverged run?); "
                                   f"refusing to write it")
        out[base] = (a, b)
    return out


def check_shapes(pairs: Mapping[str, tuple[np.ndarray, np.ndarray]], model_config: Any,
                 where: str) -> None:
    """Each pair fits the base model's tensor (when ``model_config`` gives the shapes)."""
    if model_config is None or not hasattr(model_config, "tensor_shapes"):
        return
    shapes = model_config.tensor_shapes()
    for base, (a, b) in pairs.items():
        if base not in shapes:
            raise PeftAdapterError(f"{where}: LoRA tensor {base!r} does not exist in the base "
                                   f"model (an adapter for a different model?)")
        n_out, n_in = shapes[base]
        if a.shape[1] != n_in or b.shape[0] != n_out:
            raise PeftAdapterError(
                f"{where}: {base!r} is ({n_out}, {n_in}) in the base model but the adapter has "
                f"A {tuple(a.shape)} and B {tuple(b.shape)} (an adapter for a different model?)")
