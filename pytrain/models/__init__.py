"""Model architectures, one module each (like llama.cpp's src/models/), and their registry.

An architecture is one ``Architecture`` entry: how to read its config from the GGUF keys, how
to build its graph, which host inputs that graph takes, how sequences are padded for it and
how many graph nodes it needs.  Everything else in pytrain (the trainer, the step graphs,
checkpoints, adapter writers, merge, the CLI) asks the model's entry and names no
architecture.  ``general.architecture`` of a GGUF selects the entry; an unknown one is refused
with the list of known ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from pytrain.errors import PytrainError


class ModelConfig(Protocol):
    """What generic code reads of an architecture's config."""
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
    default_targets: tuple[str, ...] = ("attn_q", "attn_k", "attn_v", "attn_output")
    # Hugging Face's layout, for PEFT adapters: the HF module (within model.layers.N) of each
    # adaptable GGUF tensor, the targets only one kind of layer has (by the config's
    # ``recurrent`` flag), and, for targets whose rows or columns HF orders differently,
    # (base, A, B, config, where, to_hf) -> (A, B)
    hf_modules: Mapping[str, str] = field(default_factory=dict)
    hf_layer_kind_modules: Mapping[bool, frozenset] = field(default_factory=dict)
    hf_pairs: Mapping[str, Callable[..., tuple]] = field(default_factory=dict)
    # the HF model classes of this family, as PEFT records them in adapter_config.json's
    # auto_mapping ("base_model_class"): lets a PEFT folder say which layout it is in
    hf_classes: tuple[str, ...] = ()
    hf_parent_library: str = ""
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
    """Make ``arch`` loadable by its name (the modules above register on first use)."""
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


def by_hf_class(hf_class: str) -> Architecture | None:
    """The architecture whose HF model class is ``hf_class`` (e.g. ``LlamaForCausalLM``)."""
    return next((a for a in all_registered() if hf_class in a.hf_classes), None)


def all_registered() -> list[Architecture]:
    """Every architecture pytrain knows (their modules imported)."""
    return [get(n) for n in names()]
