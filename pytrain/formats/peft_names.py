"""Which Hugging Face module each GGUF tensor of an adapter is, by the base model's
architecture, and how a pair moves between the two orders.

The PEFT writer and reader (``peft_write``, ``peft_read``) name every module through here, so
that one architecture's layout (an ``HFLayout``, see ``hf_layout.py``) decides the names and
the row orders; without a known architecture, the names of every known one are accepted.  The
layouts are those of the model registry's entries (``hf_layout.layouts``): this module keeps
no list of architectures, and finds one by HF class name in the same registry.
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Mapping

import numpy as np

from pytrain.formats.hf_layout import HFLayout, PeftAdapterError, layouts

KEY_PREFIX = "base_model.model."   # PeftModel → LoraModel → the HF model
DEFAULT_LAYERS_PREFIX = "model.layers"             # a ...ForCausalLM
KNOWN_LAYERS_PREFIXES = ("model.layers", "model.language_model.layers")


def _layout(arch: str) -> HFLayout:
    """Architecture ``arch``'s layout, from its registry entry."""
    found = layouts(arch).get(arch)
    if found is None:
        raise PeftAdapterError(f"no PEFT layout for architecture {arch!r}; known: "
                               f"{', '.join(sorted(layouts()))}")
    return found


def hf_tables(arch: str | None = None) -> tuple[dict, dict, dict, dict]:
    """Architecture ``arch``'s GGUF target -> HF module, its inverse, layer kind (recurrent?) ->
    targets only that kind has, and target -> pair conversion; without ``arch``, the union
    over every known architecture (also those registered at run time)."""
    names, kinds, pairs = {}, {False: set(), True: set()}, {}
    for layout in [_layout(arch)] if arch else layouts().values():
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
    known = list(layouts().values())
    return {t for e in known for t in e.pairs
            if any(t in o.modules and t not in o.pairs for o in known)}


def arch_of(arch: str | None, model_config: Any, peft_config: Mapping | None = None
             ) -> str | None:
    """The architecture named, else the one the model's config belongs to (configs carry
    their GGUF ``arch``), else the one of the HF class PEFT recorded in ``auto_mapping``, else
    None (any known architecture's names)."""
    if arch or getattr(model_config, "arch", None):
        return arch or model_config.arch
    auto = (peft_config or {}).get("auto_mapping") or {}
    hf_class = auto.get("base_model_class", "") if isinstance(auto, dict) else ""
    return next((name for name, layout in layouts().items() if hf_class in layout.classes),
                None)


def auto_mapping(arch: str | None) -> dict | None:
    """What PEFT records for a base model class it maps itself (Llama: it did; Qwen3.5: None),
    so that a folder pytrain writes names its layout as PEFT's does."""
    layout = _layout(arch) if arch else None
    if layout is None or not layout.parent_library:
        return None
    return {"base_model_class": layout.classes[0], "parent_library": layout.parent_library}


def warn_ambiguous(bases, arch: str | None, where: str) -> None:
    """Without an architecture, targets that one family re-orders and another does not (Llama
    q/k: the rope permutation) are kept as they are; say so rather than stay silent."""
    if arch is not None:
        return
    ambiguous = _ambiguous_targets()
    hit = sorted(b for b in bases if GGUF_BASE.fullmatch(b).group(2) in ambiguous)
    if hit:
        warnings.warn(f"{where}: the base model's architecture is unknown (pass arch= or "
                      f"model_config=), so {len(hit)} tensors such as {hit[0]!r} keep their "
                      f"row order; for a Llama-family model that is wrong (its q/k rows are "
                      f"permuted for rope)", stacklevel=3)


GGUF_BASE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")
_HF_MODULE = re.compile(r"(?P<prefix>.+)\.(?P<layer>\d+)\.(?P<module>[a-z_]+\.[a-z_]+)")


# --------------------------------------------------------------------------- names

def peft_module_name(gguf_base: str, layers_prefix: str = DEFAULT_LAYERS_PREFIX,
                     arch: str | None = None) -> str:
    """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj`` (the HF module)."""
    m = GGUF_BASE.fullmatch(gguf_base)
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

def convert_pair(base: str, a: np.ndarray, b: np.ndarray, model_config: Any, where: str,
                  to_hf: bool, arch: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of one target from GGUF to HF order (``to_hf``) or back: the architecture that
    has the target says how (most targets are the same in both)."""
    short = GGUF_BASE.fullmatch(base).group(2)
    convert = hf_tables(arch)[3].get(short)
    return (a, b) if convert is None else convert(base, a, b, model_config, where, to_hf)
