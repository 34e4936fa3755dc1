"""What a PEFT adapter needs to know of an architecture: Hugging Face's module for each GGUF
tensor, and how a LoRA pair's rows or columns move where llama.cpp's converter re-orders them.

A file-format fact, like gguf-py's tensor-name tables, so it lives with the formats: the
architectures in ``pytrain/models/`` point their registry entry at their layout
(``Architecture.hf_layout``), and that registry is the one list of architectures.  The formats
sit below the models and cannot ask it themselves, so the PEFT code looks layouts up through
``layouts``, whose source the package root hands down once (``use_registry``): a new family,
built in or registered at run time, is added in one place and PEFT folders name it.
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


# ``(arch) -> {arch: its layout}`` (empty when unknown or without one); ``(None) -> every
# architecture's``: the model registry's lookup, handed down by the package root
LayoutSource = Callable[[str | None], Mapping[str, HFLayout]]
_source: LayoutSource | None = None


def use_registry(source: LayoutSource) -> None:
    """Take architectures' layouts from ``source`` (``pytrain/__init__.py`` passes the model
    registry's ``pytrain.models.hf_layouts``)."""
    global _source
    _source = source


def layouts(arch: str | None = None) -> Mapping[str, HFLayout]:
    """``{arch: layout}`` for the architecture named (empty if it has none), or for every known
    one; from the model registry."""
    if _source is None:
        raise PeftAdapterError("no architecture registry to take Hugging Face layouts from "
                               "(importing pytrain hands down pytrain.models.hf_layouts)")
    return _source(arch)
