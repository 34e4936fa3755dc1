"""An adapter in either format pytrain writes, read for one base model.

Its own module because it is the one place that knows both formats: the PEFT reader builds on
the GGUF one (``adapter_peft`` imports ``adapter_gguf``), so the choice between them sits above
both.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pytrain.formats.adapter_gguf import check_adapter_matches, read_lora_gguf
from pytrain.formats.atomic import restore_folder
from pytrain.formats.adapter_peft import read_peft_adapter


def read_adapter(path: str | os.PathLike[str], arch: str, model_config
                 ) -> tuple[dict[str, np.ndarray], float]:
    """``(tensors, alpha)`` of a LoRA adapter GGUF or a PEFT adapter folder, refused unless it
    fits the base model: its architecture ``arch`` (a GGUF's) and ``model_config`` (names and
    shapes; a PEFT folder's tensors are converted with it)."""
    p = Path(path)
    restore_folder(p)                 # a PEFT folder whose write was killed half way
    if p.is_dir():
        tensors, alpha, _rank, _cfg = read_peft_adapter(p, model_config, arch=arch)
    else:
        _arch, alpha, tensors, _meta = read_lora_gguf(p, arch=arch)
    check_adapter_matches(model_config, tensors, source=str(p))
    return tensors, float(alpha)
