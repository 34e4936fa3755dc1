"""pytrain: LoRA fine-tuning of GGUF language models on a pinned ggml, with a loss mask that
is right by construction."""
__version__ = "0.1.0"


def load_model(path, device: str = "auto", threads: int | None = None, type_policy: str = "auto"):
    """Load a GGUF model: see pytrain.models.model.Model (``.logits``, ``.generate``, ``.tokenizer``)."""
    from pytrain.models.model import load_model as _load
    return _load(path, device=device, threads=threads, type_policy=type_policy)
