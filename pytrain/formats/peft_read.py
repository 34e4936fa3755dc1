"""Reading a PEFT LoRA adapter folder into pytrain's GGUF-keyed pairs: what PEFT writes for a
plain LoRA is accepted, and anything pytrain would compute differently (another PEFT type, a
LoRA variant, tensors the config does not select) is refused naming the file.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from pytrain.formats.atomic import restore_folder
from pytrain.formats.hf_layout import PeftAdapterError
from pytrain.formats.peft_checks import check_lora_alpha, check_rank, check_shapes
from pytrain.formats.peft_config import CONFIG_NAME, WEIGHTS_NAME, excluded, peft_targets
from pytrain.formats.peft_names import arch_of, convert_pair, gguf_base_name, warn_ambiguous
from pytrain.formats.safetensors_file import read_safetensors


# config keys that change what a LoRA computes (value: what a plain LoRA has)
_MUST_BE = {"fan_in_fan_out": False, "use_dora": False, "lora_bias": False, "use_qalora": False}
_MUST_BE_EMPTY = ("rank_pattern", "alpha_pattern", "modules_to_save", "layer_replication",
                  "trainable_token_indices", "target_parameters", "alora_invocation_tokens",
                  "use_bdlora", "arrow_config", "kasa_config", "monteclora_config",
                  "velora_config")


def _check_config(cfg: Any, p: Path) -> tuple[float, int]:
    if not isinstance(cfg, dict):
        raise PeftAdapterError(f"{p}: not a PEFT adapter config (a JSON object is expected)")
    pt = cfg.get("peft_type")
    if pt != "LORA":
        raise PeftAdapterError(f"{p}: peft_type is {pt!r}; pytrain reads only 'LORA' adapters")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise PeftAdapterError(f"{p}: bias is {bias!r}; pytrain's LoRA has no bias terms "
                               f"(only 'none' is supported)")
    for k, plain in _MUST_BE.items():
        if bool(cfg.get(k, plain)) != plain:
            what = {"fan_in_fan_out": "fan_in_fan_out (transposed, Conv1D-style weights)",
                    "use_dora": "use_dora (DoRA magnitude vectors)",
                    "lora_bias": "lora_bias (a bias on lora_B)",
                    "use_qalora": "use_qalora"}[k]
            raise PeftAdapterError(f"{p}: {what} is not supported by pytrain")
    for k in _MUST_BE_EMPTY:
        if cfg.get(k):
            raise PeftAdapterError(f"{p}: {k} = {cfg[k]!r} is not supported by pytrain (only a "
                                   f"plain LoRA with one rank and one alpha)")
    if "r" not in cfg or "lora_alpha" not in cfg:
        raise PeftAdapterError(f"{p}: 'r' and 'lora_alpha' are required")
    alpha, rank = check_lora_alpha(cfg["lora_alpha"], str(p)), check_rank(cfg["r"], str(p))
    if cfg.get("use_rslora"):          # scale alpha/sqrt(r): a plain LoRA's alpha for it
        alpha = plain_alpha(alpha, rank, True)
    return alpha, rank


def plain_alpha(alpha: float, rank: int, rslora: bool) -> float:
    """The alpha that gives a plain LoRA (scale alpha/r, llama.cpp's) the scale of this one:
    rsLoRA scales by alpha/sqrt(r), so alpha·sqrt(r)."""
    return float(alpha) * math.sqrt(rank) if rslora else float(alpha)


def read_peft_adapter(folder: str | os.PathLike[str], model_config: Any = None,
                      arch: str | None = None) -> tuple[dict[str, np.ndarray], float, int, dict[str, Any]]:
    """``(tensors, alpha, rank, config)`` of a PEFT LoRA adapter folder; ``alpha`` is a plain
    LoRA's (scale alpha/r): an rsLoRA adapter's (``use_rslora``) is converted (``plain_alpha``).

    ``tensors`` are pytrain's GGUF-keyed float32 pairs (``blk.N.<t>.weight.lora_a`` A [r, n_in],
    ``.lora_b`` B [n_out, r]), ready for :meth:`pytrain.models.lora.LoraAdapter.set` or
    :func:`pytrain.formats.adapter_gguf.write_lora_gguf`; ``config`` is ``adapter_config.json`` as a
    dict.  ``model_config`` is needed for modules whose layout needs the model's sizes and, when
    given, checks every shape; ``arch`` (the base model's architecture) maps the modules with
    that architecture's names (default: any known architecture's).  Raises :class:`PeftAdapterError` naming the file.
    """
    folder = Path(folder)
    cpath, wpath = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    restore_folder(folder)            # a write killed half way leaves the old folder aside
    if not folder.is_dir():
        raise PeftAdapterError(f"{folder}: no such adapter folder")
    if not cpath.is_file():
        raise PeftAdapterError(f"{cpath}: missing (not a PEFT adapter folder?)")
    if not wpath.is_file():
        alt = folder / "adapter_model.bin"
        hint = (f" ({alt.name} is present: pytrain reads only safetensors; re-save with "
                f"safe_serialization=True)" if alt.exists() else "")
        raise PeftAdapterError(f"{wpath}: missing{hint}")
    try:
        cfg = json.loads(cpath.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PeftAdapterError(f"{cpath}: cannot read the adapter config: {e}") from None
    alpha, rank = _check_config(cfg, cpath)
    arch = arch_of(arch, model_config, cfg)

    raw, _ = read_safetensors(wpath)
    halves: dict[str, dict[str, np.ndarray]] = {}
    modules: dict[str, str] = {}
    for key, arr in raw.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<w>[AB])\.weight", key)
        if not m:
            raise PeftAdapterError(f"{wpath}: tensor {key!r} is not a lora_A/lora_B weight "
                                   f"(DoRA, embeddings, modules_to_save or biases are not "
                                   f"supported)")
        module = m.group("module")
        try:
            base = gguf_base_name(module, arch)
        except PeftAdapterError as e:
            raise PeftAdapterError(f"{wpath}: tensor {key!r}: {e}") from None
        if modules.setdefault(base, module) != module:
            raise PeftAdapterError(f"{wpath}: {modules[base]!r} and {module!r} are the same "
                                   f"layer module under two prefixes")
        if not peft_targets(cfg, module) or excluded(cfg, module):
            raise PeftAdapterError(
                f"{wpath}: tensor {key!r} is for module {module!r}, which {CONFIG_NAME}'s "
                f"target_modules/layers_to_transform do not select (PEFT would not load it)")
        halves.setdefault(base, {})[m.group("w").lower()] = arr
    if not halves:
        raise PeftAdapterError(f"{wpath}: no LoRA tensors")
    warn_ambiguous(halves, arch, str(wpath))
    tensors: dict[str, np.ndarray] = {}
    for base, h in sorted(halves.items()):
        for w in "ab":
            if w not in h:
                raise PeftAdapterError(f"{wpath}: {modules[base]!r} has no "
                                       f"lora_{w.upper()}.weight")
        a, b = h["a"], h["b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise PeftAdapterError(
                f"{wpath}: {modules[base]!r}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} must be [r, n_in] and [n_out, r] with r = {rank} "
                f"({CONFIG_NAME})")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise PeftAdapterError(f"{wpath}: {modules[base]!r} holds NaN or Inf")
        a, b = convert_pair(base, a, b, model_config, str(wpath), to_hf=False, arch=arch)
        tensors[base + ".lora_a"], tensors[base + ".lora_b"] = a, b
    check_shapes({k[:-7]: (tensors[k], tensors[k[:-7] + ".lora_b"])
                   for k in tensors if k.endswith(".lora_a")}, model_config, str(wpath))
    return tensors, alpha, rank, cfg
