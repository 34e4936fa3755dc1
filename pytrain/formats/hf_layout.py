"""What a PEFT adapter needs to know of an architecture: Hugging Face's module for each GGUF
tensor, and how a LoRA pair's rows or columns move where llama.cpp's converter re-orders them.

A file-format fact, like gguf-py's tensor-name tables, so it lives with the formats: the
architectures in ``pytrain/models/`` point their registry entry at their layout, and an
architecture registered at run time brings its own (``adapter_peft.register_layout``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from pytrain.errors import PytrainError


class PeftAdapterError(PytrainError, ValueError):
    """A PEFT adapter folder or tensor set pytrain cannot write or read exactly; names the file
    or tensor."""


@dataclass(frozen=True)
class HFLayout:
    # the HF module (within ``model.layers.N``) of each adaptable GGUF target
    modules: Mapping[str, str]
    # the targets only one kind of layer has, by the config's ``recurrent`` flag
    layer_kind_modules: Mapping[bool, frozenset] = field(default_factory=dict)
    # targets whose rows or columns HF orders differently:
    # (base, A, B, model_config, where, to_hf) -> (A, B)
    pairs: Mapping[str, Callable[..., tuple]] = field(default_factory=dict)
    # the HF model classes, as PEFT records them in adapter_config.json's auto_mapping
    # ("base_model_class"): lets a PEFT folder say which layout it is in
    classes: tuple[str, ...] = ()
    parent_library: str = ""
