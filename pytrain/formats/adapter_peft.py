"""LoRA adapters in Hugging Face PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``).

pytrain keys its adapters by GGUF tensor name (``blk.N.attn_q.weight.lora_a`` → A [r, n_in],
``.lora_b`` → B [n_out, r], numpy order, see :mod:`pytrain.models.lora`).  PEFT keys them by HF module
(``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` → A [r, n_in],
``....lora_B.weight`` → B [n_out, r]) and applies the same function, ``W·x + (lora_alpha/r)·B·(A·x)``.
Which HF module each GGUF tensor is, and how a pair's rows or columns move between the two
layouts (where the converter re-orders them), is the architecture's (its registry entry's
``HFLayout``, in ``hf_llama.py`` / ``hf_qwen35.py``); this module writes and
reads the format.  Targets that need the model's sizes to convert take ``model_config``.

``adapter_config.json`` is a complete PEFT 0.21 ``LoraConfig`` (every key PEFT 0.21.2's
``save_pretrained`` writes, checked against one by ``scripts/make_peft_logits_golden.py``):
``target_modules`` holds the HF short names (``q_proj``...) with ``layers_to_transform`` when
that set, applied to the model, selects exactly the adapted modules (provable from
``model_config``'s layer kinds, or from the adapted tensors themselves); otherwise it lists the
full module names, so PEFT never adds adapters to layers pytrain did not train.  The module
names are those of a ``...ForCausalLM`` (``model.layers.N``); pass
``layers_prefix="model.language_model.layers"`` for a ``...ForConditionalGeneration`` base.

Writes are atomic per file: each file is written to a temporary file in the folder, fsync'ed,
then renamed over its final name (weights first, then the config), so a failure never leaves a
truncated file under a final name.

Reading (:func:`read_peft_adapter`) accepts what PEFT writes for a plain LoRA on these modules
(float32, float16, bfloat16 or float64 tensors; either module prefix) and refuses, naming the
file, anything pytrain would compute differently: another ``peft_type``, ``fan_in_fan_out``,
a bias, rsLoRA, DoRA and the other LoRA variants, ``rank_pattern`` / ``alpha_pattern``,
``modules_to_save``, unknown modules, and tensors PEFT itself would not load.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from pytrain.formats import hf_llama, hf_qwen35
from pytrain.formats.adapter_gguf import AdapterError, check_alpha, lora_pairs
from pytrain.formats.atomic import replacing_folder, restore_folder
from pytrain.formats.hf_layout import HFLayout, PeftAdapterError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_FORMAT_VERSION = "0.21.2"     # the PEFT release whose saved format this writer reproduces
KEY_PREFIX = "base_model.model."   # PeftModel → LoraModel → the HF model
DEFAULT_LAYERS_PREFIX = "model.layers"             # a ...ForCausalLM
KNOWN_LAYERS_PREFIXES = ("model.layers", "model.language_model.layers")


_LAYOUTS: dict[str, HFLayout] = {"gemma3": hf_llama.GEMMA3, "llama": hf_llama.LLAMA,
                                 "qwen2": hf_llama.QWEN2, "qwen3": hf_llama.QWEN3,
                                 "qwen35": hf_qwen35.QWEN35}


def register_layout(arch: str, layout: HFLayout) -> None:
    """Make architecture ``arch``'s layout known (``pytrain.models.register`` calls this)."""
    _LAYOUTS[arch] = layout


def _layout(arch: str) -> HFLayout:
    if arch not in _LAYOUTS:
        raise PeftAdapterError(f"no PEFT layout for architecture {arch!r}; known: "
                               f"{', '.join(sorted(_LAYOUTS))}")
    return _LAYOUTS[arch]


def hf_tables(arch: str | None = None) -> tuple[dict, dict, dict, dict]:
    """Architecture ``arch``'s GGUF target -> HF module, its inverse, layer kind (recurrent?) ->
    targets only that kind has, and target -> pair conversion; without ``arch``, the union
    over every known architecture (also those registered at run time)."""
    names, kinds, pairs = {}, {False: set(), True: set()}, {}
    for layout in [_layout(arch)] if arch else _LAYOUTS.values():
        names.update(layout.modules)
        for k, v in layout.layer_kind_modules.items():
            kinds[k] |= set(v)
        pairs.update(layout.pairs)
    if not arch:      # no layout both share: kept as it is (Llama q/k need arch or a config)
        ambiguous = _ambiguous_targets()
        pairs = {t: f for t, f in pairs.items() if t not in ambiguous}
    return names, {v: k for k, v in names.items()}, kinds, pairs


def _ambiguous_targets() -> set[str]:
    """Targets that one architecture re-orders and another keeps as they are (attn_q: Llama's
    rope permutation, Qwen3.5's none)."""
    layouts = list(_LAYOUTS.values())
    return {t for e in layouts for t in e.pairs
            if any(t in o.modules and t not in o.pairs for o in layouts)}


def _arch_of(arch: str | None, model_config: Any, peft_config: Mapping | None = None
             ) -> str | None:
    """The architecture named, else the one the model's config belongs to (configs carry
    their GGUF ``arch``), else the one of the HF class PEFT recorded in ``auto_mapping``, else
    None (any known architecture's names)."""
    if arch or getattr(model_config, "arch", None):
        return arch or model_config.arch
    auto = (peft_config or {}).get("auto_mapping") or {}
    hf_class = auto.get("base_model_class", "") if isinstance(auto, dict) else ""
    return next((name for name, layout in _LAYOUTS.items() if hf_class in layout.classes), None)


def _auto_mapping(arch: str | None) -> dict | None:
    """What PEFT records for a base model class it maps itself (Llama: it did; Qwen3.5: None),
    so that a folder pytrain writes names its layout as PEFT's does."""
    layout = _layout(arch) if arch else None
    if layout is None or not layout.parent_library:
        return None
    return {"base_model_class": layout.classes[0], "parent_library": layout.parent_library}


def _warn_ambiguous(bases, arch: str | None, where: str) -> None:
    """Without an architecture, targets that one family re-orders and another does not (Llama
    q/k: the rope permutation) are kept as they are; say so rather than stay silent."""
    if arch is not None:
        return
    ambiguous = _ambiguous_targets()
    hit = sorted(b for b in bases if _GGUF_BASE.fullmatch(b).group(2) in ambiguous)
    if hit:
        warnings.warn(f"{where}: the base model's architecture is unknown (pass arch= or "
                      f"model_config=), so {len(hit)} tensors such as {hit[0]!r} keep their "
                      f"row order; for a Llama-family model that is wrong (its q/k rows are "
                      f"permuted for rope)", stacklevel=3)


_GGUF_BASE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")
_HF_MODULE = re.compile(r"(?P<prefix>.+)\.(?P<layer>\d+)\.(?P<module>[a-z_]+\.[a-z_]+)")

# safetensors dtype → (numpy dtype of the stored bytes, bytes per element)
_ST_DTYPES = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2), "F64": ("<f8", 8)}


# --------------------------------------------------------------------------- names

def peft_module_name(gguf_base: str, layers_prefix: str = DEFAULT_LAYERS_PREFIX,
                     arch: str | None = None) -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj`` (the HF module)."""
    m = _GGUF_BASE.fullmatch(gguf_base)
    to_hf = hf_tables(arch)[0]
    if not m or m.group(2) not in to_hf:
        raise PeftAdapterError(
            f"tensor {gguf_base!r} has no PEFT module: supported are blk.N.<t>.weight with t in "
            f"{', '.join(to_hf)}")
    return f"{layers_prefix}.{int(m.group(1))}.{to_hf[m.group(2)]}"


def gguf_base_name(module: str, arch: str | None = None) -> str:
    """``model.layers.3.self_attn.q_proj`` (or ``model.language_model.layers.3...``) →
    ``blk.3.attn_q.weight``."""
    m = _HF_MODULE.fullmatch(module)
    to_gguf = hf_tables(arch)[1]
    if not m or m.group("prefix") not in KNOWN_LAYERS_PREFIXES \
            or m.group("module") not in to_gguf:
        raise PeftAdapterError(
            f"module {module!r} is not one pytrain can map to a GGUF tensor: expected "
            f"{' or '.join(p + '.N' for p in KNOWN_LAYERS_PREFIXES)}.<module> with module in "
            f"{', '.join(to_gguf)}")
    return f"blk.{int(m.group('layer'))}.{to_gguf[m.group('module')]}.weight"


# --------------------------------------------------------------------------- the architecture's layout

def _convert_pair(base: str, a: np.ndarray, b: np.ndarray, model_config: Any, where: str,
                  to_hf: bool, arch: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of one target from GGUF to HF order (``to_hf``) or back: the architecture that
    has the target says how (most targets are the same in both)."""
    short = _GGUF_BASE.fullmatch(base).group(2)
    convert = hf_tables(arch)[3].get(short)
    return (a, b) if convert is None else convert(base, a, b, model_config, where, to_hf)


# --------------------------------------------------------------------------- validation

def _check_alpha(alpha: Any, where: str) -> float:
    return check_alpha(alpha, where, PeftAdapterError, "lora_alpha")


def _check_rank(rank: Any, where: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or int(rank) < 1:
        raise PeftAdapterError(f"{where}: rank (r) must be a positive integer, got {rank!r}")
    return int(rank)


def _gguf_pairs(tensors: Mapping[str, Any], rank: int, where: str, arch: str | None
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


def _check_shapes(pairs: Mapping[str, tuple[np.ndarray, np.ndarray]], model_config: Any,
                  where: str) -> None:
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


# --------------------------------------------------------------------------- target_modules

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
    adapted = {(int(m.group(1)), m.group(2)) for m in map(_GGUF_BASE.fullmatch, bases)}
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
    arch = _arch_of(arch, model_config)
    alpha_json: int | float = int(alpha) if float(alpha).is_integer() else float(alpha)
    cfg: dict[str, Any] = {
        "alora_invocation_tokens": None,
        "alpha_pattern": {},
        "arrow_config": None,
        "auto_mapping": _auto_mapping(arch),
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


def _peft_targets(config: Mapping[str, Any], module: str) -> bool:
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


def _excluded(config: Mapping[str, Any], module: str) -> bool:
    ex = config.get("exclude_modules")
    if not ex:
        return False
    if isinstance(ex, str):
        return re.fullmatch(ex, module) is not None
    return module in ex or any(module.endswith("." + e) for e in ex)


# --------------------------------------------------------------------------- file I/O

def _safetensors_bytes(arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    from safetensors.numpy import save
    return save(dict(arrays), metadata=dict(metadata))


def _read_safetensors(p: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors (as float32) and ``__metadata__`` of a safetensors file.  Parsed here so that
    bfloat16 files (PEFT's usual output for bf16 training) load without torch."""
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise PeftAdapterError(f"{p}: cannot read: {e.strerror or e}") from None
    if len(raw) < 8:
        raise PeftAdapterError(f"{p}: not a safetensors file ({len(raw)} bytes)")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8 or n > 100_000_000:
        raise PeftAdapterError(f"{p}: not a safetensors file (header length {n} for a "
                               f"{len(raw)}-byte file)")
    try:
        header = json.loads(raw[8:8 + n])
        assert isinstance(header, dict)
    except (ValueError, AssertionError):
        raise PeftAdapterError(f"{p}: not a safetensors file (unreadable JSON header)") from None
    meta = header.pop("__metadata__", None) or {}
    data = memoryview(raw)[8 + n:]
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise PeftAdapterError(f"{p}: tensor {name!r}: malformed header entry") from None
        if dtype not in _ST_DTYPES:
            raise PeftAdapterError(f"{p}: tensor {name!r} has dtype {dtype}; pytrain reads "
                                   f"{', '.join(_ST_DTYPES)}")
        np_dtype, size = _ST_DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        if not (0 <= start <= end <= len(data)) or end - start != count * size:
            raise PeftAdapterError(f"{p}: tensor {name!r}: data offsets [{start}, {end}) do not "
                                   f"fit shape {shape} {dtype} in the file (truncated?)")
        x = np.frombuffer(data[start:end], dtype=np_dtype).reshape(shape)
        if dtype == "BF16":
            x = (x.astype(np.uint32) << 16).view(np.float32)
        out[name] = np.array(x, dtype=np.float32)
    return out, {str(k): str(v) for k, v in meta.items()}


# --------------------------------------------------------------------------- writing

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
    arch = _arch_of(arch, model_config)
    alpha = _check_alpha(alpha, where)
    rank = _check_rank(rank, where)
    if layers_prefix not in KNOWN_LAYERS_PREFIXES:
        raise PeftAdapterError(f"{where}: layers_prefix must be one of "
                               f"{', '.join(KNOWN_LAYERS_PREFIXES)}, got {layers_prefix!r}")
    if not isinstance(base_model_name_or_path, str):
        raise PeftAdapterError(f"{where}: base_model_name_or_path must be a string")
    pairs = _gguf_pairs(tensors, rank, where, arch)
    _check_shapes(pairs, model_config, where)
    _warn_ambiguous(pairs, arch, where)
    st_meta = {"format": "pt"}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not k or k == "format":
            raise PeftAdapterError(f"{where}: metadata key {k!r} is reserved or not a string")
        st_meta[k] = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    arrays: dict[str, np.ndarray] = {}
    for base, (a, b) in pairs.items():
        a, b = _convert_pair(base, a, b, model_config, where, to_hf=True, arch=arch)
        key = KEY_PREFIX + peft_module_name(base, layers_prefix, arch)
        arrays[key + ".lora_A.weight"] = a
        arrays[key + ".lora_B.weight"] = b
    config = peft_config_dict(sorted(pairs), alpha, rank, base_model_name_or_path, model_config,
                              layers_prefix, arch)
    config["use_rslora"] = bool(use_rslora)
    blob = _safetensors_bytes(arrays, st_meta)
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"

    if folder.exists() and not folder.is_dir():
        raise PeftAdapterError(f"{where}: exists and is not a folder")
    with replacing_folder(folder) as tmp:       # weights and config replaced as one unit
        (tmp / WEIGHTS_NAME).write_bytes(blob)
        (tmp / CONFIG_NAME).write_bytes(text.encode())
    return folder


# --------------------------------------------------------------------------- reading

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
    alpha, rank = _check_alpha(cfg["lora_alpha"], str(p)), _check_rank(cfg["r"], str(p))
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
    arch = _arch_of(arch, model_config, cfg)

    raw, _ = _read_safetensors(wpath)
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
        if not _peft_targets(cfg, module) or _excluded(cfg, module):
            raise PeftAdapterError(
                f"{wpath}: tensor {key!r} is for module {module!r}, which {CONFIG_NAME}'s "
                f"target_modules/layers_to_transform do not select (PEFT would not load it)")
        halves.setdefault(base, {})[m.group("w").lower()] = arr
    if not halves:
        raise PeftAdapterError(f"{wpath}: no LoRA tensors")
    _warn_ambiguous(halves, arch, str(wpath))
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
        a, b = _convert_pair(base, a, b, model_config, str(wpath), to_hf=False, arch=arch)
        tensors[base + ".lora_a"], tensors[base + ".lora_b"] = a, b
    _check_shapes({k[:-7]: (tensors[k], tensors[k[:-7] + ".lora_b"])
                   for k in tensors if k.endswith(".lora_a")}, model_config, str(wpath))
    return tensors, alpha, rank, cfg
