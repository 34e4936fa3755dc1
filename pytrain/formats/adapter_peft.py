"""LoRA adapters in Hugging Face PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``).

pytrain keys its adapters by GGUF tensor name (``blk.N.attn_q.weight.lora_a`` → A [r, n_in],
``.lora_b`` → B [n_out, r], numpy order, see :mod:`pytrain.models.lora`).  PEFT keys them by HF module
(``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` → A [r, n_in],
``....lora_B.weight`` → B [n_out, r]) and applies the same function, ``W·x + (lora_alpha/r)·B·(A·x)``.
Which HF module each GGUF tensor is, and how a pair's rows or columns move between the two
layouts (where the converter re-orders them), is the architecture's (its registry entry's
``HFLayout``, in ``hf_llama.py`` / ``hf_qwen35.py``); the modules below write and
read the format.  Targets that need the model's sizes to convert take ``model_config``.

``adapter_config.json`` is a complete PEFT 0.21 ``LoraConfig`` (every key PEFT 0.21.2's
``save_pretrained`` writes, checked against one by ``scripts/make_peft_logits_golden.py``):
``target_modules`` holds the HF short names (``q_proj``...) with ``layers_to_transform`` when
that set, applied to the model, selects exactly the adapted modules (provable from
``model_config``'s layer kinds, or from the adapted tensors themselves); otherwise it lists the
full module names, so PEFT never adds adapters to layers pytrain did not train.  The module
names are those of a ``...ForCausalLM`` (``model.layers.N``); pass
``layers_prefix="model.language_model.layers"`` for a ``...ForConditionalGeneration`` base.

Writes are atomic per file: each file is written to a temporary file in the folder, fsync'ed,
then renamed over its final name (weights first, then the config), so a failure never leaves a
truncated file under a final name.

Reading (:func:`read_peft_adapter`) accepts what PEFT writes for a plain LoRA on these modules
(float32, float16, bfloat16 or float64 tensors; either module prefix) and refuses, naming the
file, anything pytrain would compute differently: another ``peft_type``, ``fan_in_fan_out``,
a bias, rsLoRA, DoRA and the other LoRA variants, ``rank_pattern`` / ``alpha_pattern``,
``modules_to_save``, unknown modules, and tensors PEFT itself would not load.

This module is the format's public face; the work is split by what each part holds:
``peft_names`` (GGUF tensor ↔ HF module, by the architecture's layout), ``peft_checks``
(what is refused before writing), ``peft_config`` (``adapter_config.json``),
``safetensors_file`` (the weights file's bytes), ``peft_write`` and ``peft_read``.
"""
from __future__ import annotations

from pytrain.formats.hf_layout import HFLayout, PeftAdapterError
from pytrain.formats.peft_config import (CONFIG_NAME, PEFT_FORMAT_VERSION, WEIGHTS_NAME,
                                         peft_config_dict)
from pytrain.formats.peft_names import (DEFAULT_LAYERS_PREFIX, KEY_PREFIX, KNOWN_LAYERS_PREFIXES,
                                        gguf_base_name, hf_tables, peft_module_name)
from pytrain.formats.peft_read import plain_alpha, read_peft_adapter
from pytrain.formats.peft_write import write_peft_adapter

__all__ = ["CONFIG_NAME", "DEFAULT_LAYERS_PREFIX", "HFLayout", "KEY_PREFIX",
           "KNOWN_LAYERS_PREFIXES", "PEFT_FORMAT_VERSION", "PeftAdapterError", "WEIGHTS_NAME",
           "gguf_base_name", "hf_tables", "peft_config_dict", "peft_module_name", "plain_alpha",
           "read_peft_adapter", "write_peft_adapter"]
