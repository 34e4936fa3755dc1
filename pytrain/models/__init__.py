"""Model architectures, one module each (like llama.cpp's src/models/), and their registry.

An architecture is one ``Architecture`` entry: how to read its config from the GGUF keys, how
to build its graph, which host inputs that graph takes, how sequences are padded for it and
how many graph nodes it needs.  Everything else in pytrain (the trainer, the step graphs,
checkpoints, adapter writers, merge, the CLI) asks the model's entry and names no
architecture.  ``general.architecture`` of a GGUF selects the entry; an unknown one is refused
with the list of known ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any, Callable, Protocol

import numpy as np

from pytrain.errors import PytrainError
from pytrain.formats.hf_layout import HFLayout


# LoRA target vocabularies (short GGUF tensor names): what every decoder layer has
ATTENTION_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN_TARGETS = ("ffn_gate", "ffn_up", "ffn_down")


class ModelConfig(Protocol):
    """What generic code reads of an architecture's config."""
    arch: str                        # the GGUF general.architecture (the registry key)
    n_layer: int
    n_embd: int
    n_vocab: int
    recurrent: tuple[bool, ...]      # per layer: True = a recurrent (state-space) layer

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]: ...


@dataclass(frozen=True)
class Architecture:
    name: str                                            # the GGUF general.architecture
    config_from_metadata: Callable[..., ModelConfig]     # (meta, tensor_names, n_vocab=, source=)
    graph: Callable[[ModelConfig, dict], Any]            # (config, weights) -> graph builder:
    #   new_inputs(ctx, B, T), embed(ctx, inp), layer(ctx, il, x, inp, B, T, lora),
    #   head(ctx, x, inp, B, T, rows), build(ctx, B, T, lora, rows) -> .logits, .inputs
    input_values: Callable[[ModelConfig, np.ndarray, np.ndarray], dict]   # tokens, seg [B, T]
    set_inputs: Callable[[Any, dict], None]              # (graph inputs, input_values(...))
    padded_length: Callable[[int], int]                  # the T a graph runs for T tokens
    layer_budget: Callable[[ModelConfig, int], int]      # graph nodes of one layer at T
    # the LoRA targets (short tensor names) its layers have, and those adapted by default
    targets: tuple[str, ...] = ATTENTION_TARGETS + FFN_TARGETS
    default_targets: tuple[str, ...] = ATTENTION_TARGETS
    # Hugging Face's layout, for PEFT adapters (None: no PEFT format for it); the PEFT code
    # keeps no list of its own and looks it up here (``hf_layouts``)
    hf_layout: HFLayout | None = None
    # generation with a KV cache (attention-only models): (config, n_past, new tokens) -> the
    # host values of ``graph.decode(ctx, cache, n_past, n, lora)``; None: generation
    # recomputes the prefix (recurrent layers would need their state cached too)
    decode_values: Callable[[ModelConfig, int, np.ndarray], dict] | None = None


class ArchitectureError(PytrainError, ValueError):
    """A model of an architecture pytrain does not know."""


_MODULES = {"gemma3": "pytrain.models.gemma3", "llama": "pytrain.models.llama",
            "qwen2": "pytrain.models.qwen2",
            "qwen3": "pytrain.models.qwen3", "qwen35": "pytrain.models.qwen35"}
_REGISTERED: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    """Make ``arch`` loadable by its name (the modules above register on first use); its
    ``hf_layout`` is then what PEFT folders of it are written and read with (``hf_layouts``)."""
    _REGISTERED[arch.name] = arch
    return arch


def names() -> list[str]:
    return sorted(set(_MODULES) | set(_REGISTERED))


def get(name: str, path: str = "") -> Architecture:
    if name not in _REGISTERED and name in _MODULES:
        register(import_module(_MODULES[name]).ARCHITECTURE)
    if name not in _REGISTERED:
        where = f"{path}: " if path else ""
        raise ArchitectureError(f"{where}unsupported architecture {name!r}; supported: "
                         f"{', '.join(names())}")
    return _REGISTERED[name]


def hf_layouts(name: str | None = None) -> dict[str, HFLayout]:
    """``{name: hf_layout}`` of architecture ``name`` (empty when unknown or without one), or of
    every known architecture: where the PEFT reader and writer, below this layer, take layouts
    from (``pytrain/__init__.py`` hands this function to ``formats.hf_layout.use_registry``),
    so that the registry stays the one list of architectures, HF class names included."""
    chosen = names() if name is None else [name] if name in names() else []
    return {n: get(n).hf_layout for n in chosen if get(n).hf_layout is not None}
