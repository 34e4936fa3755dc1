"""Writing a PEFT LoRA adapter folder: every check first (``peft_checks``), each pair in HF's
order under its HF module name (``peft_names``), the config (``peft_config``), then both files
replaced as one unit (``atomic.replacing_folder``), so a failure leaves the old folder whole.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from pytrain.formats.atomic import replacing_folder
from pytrain.formats.hf_layout import PeftAdapterError
from pytrain.formats.peft_checks import check_lora_alpha, check_rank, check_shapes, gguf_pairs
from pytrain.formats.peft_config import CONFIG_NAME, WEIGHTS_NAME, peft_config_dict
from pytrain.formats.peft_names import (DEFAULT_LAYERS_PREFIX, KEY_PREFIX, KNOWN_LAYERS_PREFIXES,
                                        arch_of, convert_pair, peft_module_name, warn_ambiguous)
from pytrain.formats.safetensors_file import safetensors_bytes


def write_peft_adapter(folder: str | os.PathLike[str], tensors: Mapping[str, Any], alpha: float,
                       rank: int, base_model_name_or_path: str = "",
                       metadata: Mapping[str, Any] | None = None, *, model_config: Any = None,
                       layers_prefix: str = DEFAULT_LAYERS_PREFIX, arch: str | None = None,
                       use_rslora: bool = False) -> Path:
    """Write a PEFT LoRA adapter folder that ``PeftModel.from_pretrained(hf_model, folder)``
    loads; returns the folder.

    ``tensors``: pytrain's GGUF-keyed pairs (:meth:`pytrain.models.lora.LoraAdapter.get`), every A of
    rank ``rank``.  ``metadata``: extra ``__metadata__`` strings of the safetensors file
    (non-strings are stored as JSON; ``format`` is the writer's).  ``model_config`` (the
    model's config) is required for targets whose layout needs the model's sizes, and when
    given also checks every shape and decides ``target_modules`` from the model's layer kinds.
    ``arch`` (the base model's architecture) names the modules with that architecture's HF
    layout (default: any known architecture's).  Everything is validated before the disk is
    touched.
    """
    folder = Path(folder)
    where = str(folder)
    arch = arch_of(arch, model_config)
    alpha = check_lora_alpha(alpha, where)
    rank = check_rank(rank, where)
    if layers_prefix not in KNOWN_LAYERS_PREFIXES:
        raise PeftAdapterError(f"{where}: layers_prefix must be one of "
                               f"{', '.join(KNOWN_LAYERS_PREFIXES)}, got {layers_prefix!r}")
    if not isinstance(base_model_name_or_path, str):
        raise PeftAdapterError(f"{where}: base_model_name_or_path must be a string")
    pairs = gguf_pairs(tensors, rank, where, arch)
    check_shapes(pairs, model_config, where)
    warn_ambiguous(pairs, arch, where)
    st_meta = {"format": "pt"}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not k or k == "format":
            raise PeftAdapterError(f"{where}: metadata key {k!r} is reserved or not a string")
        st_meta[k] = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    arrays: dict[str, np.ndarray] = {}
    for base, (a, b) in pairs.items():
        a, b = convert_pair(base, a, b, model_config, where, to_hf=True, arch=arch)
        key = KEY_PREFIX + peft_module_name(base, layers_prefix, arch)
        arrays[key + ".lora_A.weight"] = a
        arrays[key + ".lora_B.weight"] = b
    config = peft_config_dict(sorted(pairs), alpha, rank, base_model_name_or_path, model_config,
                              layers_prefix, arch)
    config["use_rslora"] = bool(use_rslora)
    blob = safetensors_bytes(arrays, st_meta)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"

    if folder.exists() and not folder.is_dir():
        raise PeftAdapterError(f"{where}: exists and is not a folder")
    with replacing_folder(folder) as tmp:       # weights and config replaced as one unit
        (tmp / WEIGHTS_NAME).write_bytes(blob)
        (tmp / CONFIG_NAME).write_bytes(text.encode())
    return folder
