"""pytrain: LoRA fine-tuning of GGUF language models on a pinned ggml, with a loss mask that
is right by construction."""
__version__ = "0.1.0"
