"""pytrain: LoRA fine-tuning of GGUF language models on a pinned ggml, with a loss mask that
is right by construction.

The Python API (docs/python.md) does what the command does, and the command calls it:

    result = pytrain.train("config/demo.toml", overrides={"train.max_steps": 50})
    with pytrain.load(result.config.model.path, adapter=result.adapter) as model:
        model.generate([{"role": "user", "content": "What does the cow say?"}])
    pytrain.export(result.config.model.path, result.adapter, format="peft", out="peft")

The root package is the public facade, above every layer (see tests/test_layers.py): nothing in
the package imports it.  ``import pytrain`` loads no native code: ggml loads on the first call
that needs it, so ``import pytrain.config`` stays cheap.
"""
from pytrain.formats import hf_layout as _hf_layout
from pytrain._version import __version__
from pytrain.api import (EvalResult, ExportOutputError, ExportResult, LoadedModel,
                         PreferenceEvalResult, RunResult, export, load, resolve_config, train)

__all__ = ["EvalResult", "ExportOutputError", "ExportResult", "LoadedModel",
           "PreferenceEvalResult", "RunResult", "__version__", "export", "load", "load_model",
           "resolve_config", "train"]


def _registry_layouts(name=None):
    """The model registry's HF layouts (``pytrain.models.hf_layouts``), imported on first use."""
    from pytrain import models
    return models.hf_layouts(name)


# The PEFT code (formats) sits below the models and cannot import their registry; the root,
# above every layer, hands it down, so every importer of the formats sees every architecture.
_hf_layout.use_registry(_registry_layouts)


def load_model(path, device: str = "auto", threads: int | None = None, type_policy: str = "auto",
               compute_type: str = "f32"):
    """Load a GGUF model: see pytrain.models.model.Model (``.logits``, ``.generate``, ``.tokenizer``)."""
    from pytrain.models.model import load_model as _load
    return _load(path, device=device, threads=threads, type_policy=type_policy,
                 compute_type=compute_type)
