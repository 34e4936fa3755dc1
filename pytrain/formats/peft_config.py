"""``adapter_config.json``: the ``LoraConfig`` the writer stores (``peft_config_dict``), with
``target_modules`` / ``layers_to_transform`` chosen to select exactly the adapted modules, and
PEFT's own rule for which modules a config selects (``peft_targets``), by which the reader
refuses tensors PEFT would not load.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

from pytrain.formats.peft_names import (DEFAULT_LAYERS_PREFIX, GGUF_BASE, arch_of, auto_mapping,
                                        hf_tables, peft_module_name)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_FORMAT_VERSION = "0.21.2"     # the PEFT release whose saved format this writer reproduces


def _layer_kind(model_config: Any, layer: int) -> str | None:
    rec = getattr(model_config, "recurrent", None) if model_config is not None else None
    if rec is None or layer >= len(rec):
        return None
    return "linear" if rec[layer] else "attention"


def _targets_for(bases: list[str], model_config: Any, layers_prefix: str,
                 arch: str | None) -> dict[str, Any]:
    """``target_modules`` / ``layers_to_transform`` / ``layers_pattern`` selecting exactly the
    adapted modules: short names × layers when that product (restricted to the modules each
    layer has) is exactly the adapted set, else the full module names."""
    adapted = {(int(m.group(1)), m.group(2)) for m in map(GGUF_BASE.fullmatch, bases)}
    layers = sorted({layer for layer, _ in adapted})
    shorts = sorted({s for _, s in adapted})
    to_hf, _, only, _ = hf_tables(arch)  # only[recurrent]: targets only that layer kind has
    exact = True
    for layer in layers:
        kind = _layer_kind(model_config, layer)
        if kind is None:                                 # infer from what is adapted there
            here = {s for lay, s in adapted if lay == layer}
            if here & only[False]:
                kind = "attention"
            elif here & only[True]:
                kind = "linear"
        for s in shorts:
            if (layer, s) in adapted:
                continue
            absent = ((s in only[False] and kind == "linear")
                      or (s in only[True] and kind == "attention"))
            if not absent:
                exact = False
    pattern = layers_prefix.rsplit(".", 1)[-1]
    if exact:
        return {"target_modules": sorted(to_hf[s].split(".")[1] for s in shorts),
                "layers_to_transform": layers, "layers_pattern": pattern}
    return {"target_modules": sorted(peft_module_name(b, layers_prefix, arch) for b in bases),
            "layers_to_transform": None, "layers_pattern": None}


def peft_config_dict(bases: list[str], alpha: float, rank: int,
                     base_model_name_or_path: str = "", model_config: Any = None,
                     layers_prefix: str = DEFAULT_LAYERS_PREFIX, arch: str | None = None
                     ) -> dict[str, Any]:
    """The ``adapter_config.json`` contents for adapted GGUF tensors ``bases``: every key PEFT
    0.21.2's ``LoraConfig.save_pretrained`` writes, with its default unless set here."""
    arch = arch_of(arch, model_config)
    alpha_json: int | float = int(alpha) if float(alpha).is_integer() else float(alpha)
    cfg: dict[str, Any] = {
        "alora_invocation_tokens": None,
        "alpha_pattern": {},
        "arrow_config": None,
        "auto_mapping": auto_mapping(arch),
        "base_model_name_or_path": base_model_name_or_path or None,
        "bias": "none",
        "corda_config": None,
        "ensure_weight_tying": False,
        "eva_config": None,
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "kasa_config": None,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": alpha_json,
        "lora_bias": False,
        "lora_dropout": 0.0,
        "lora_ga_config": None,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "monteclora_config": None,
        "peft_type": "LORA",
        "peft_version": PEFT_FORMAT_VERSION,
        "qalora_group_size": 16,
        "r": int(rank),
        "rank_pattern": {},
        "revision": None,
        "target_modules": None,
        "target_parameters": None,
        "task_type": "CAUSAL_LM",
        "trainable_token_indices": None,
        "use_bdlora": None,
        "use_dora": False,
        "use_qalora": False,
        "use_rslora": False,
        "velora_config": None,
    }
    cfg.update(_targets_for(list(bases), model_config, layers_prefix, arch))
    return cfg


def peft_targets(config: Mapping[str, Any], module: str) -> bool:
    """PEFT 0.21's ``check_target_module_exists`` for a plain LoRA config (no exclusions)."""
    tm = config.get("target_modules")
    if tm is None:
        return False
    if isinstance(tm, str):
        if tm.lower() == "all-linear":
            return True
        return re.fullmatch(tm, module) is not None
    tm = list(tm)
    if module in tm:
        return True
    if not any(module.endswith("." + t) for t in tm):
        return False
    idx = config.get("layers_to_transform")
    if idx is None or (isinstance(idx, list) and not idx):
        return True
    pats = config.get("layers_pattern")
    match = None
    if not pats:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        for p in [pats] if isinstance(pats, str) else pats:
            match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module)
            if match is not None:
                break
    if match is None:
        return False
    layer = int(match.group("idx"))
    return layer == idx if isinstance(idx, int) else layer in idx


def excluded(config: Mapping[str, Any], module: str) -> bool:
    """PEFT's ``exclude_modules`` rule: the module is left out."""
    ex = config.get("exclude_modules")
    if not ex:
        return False
    if isinstance(ex, str):
        return re.fullmatch(ex, module) is not None
    return module in ex or any(module.endswith("." + e) for e in ex)
