"""pytrain: LoRA fine-tuning of GGUF language models on a pinned ggml, with a loss mask that
is right by construction.

The root package is the public facade, above every layer (see tests/test_layers.py): nothing in
the package imports it, and it imports the model only when ``load_model`` is called, so
``import pytrain.config`` stays cheap.
"""
from pytrain._version import __version__

__all__ = ["__version__", "load_model"]


def load_model(path, device: str = "auto", threads: int | None = None, type_policy: str = "auto",
               compute_type: str = "f32"):
    """Load a GGUF model: see pytrain.models.model.Model (``.logits``, ``.generate``, ``.tokenizer``)."""
    from pytrain.models.model import load_model as _load
    return _load(path, device=device, threads=threads, type_policy=type_policy,
                 compute_type=compute_type)
