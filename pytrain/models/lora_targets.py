"""Which base tensors get a LoRA adapter.

Targets are short tensor names (``attn_q``) matched against ``blk.N.<name>.weight``; the
result is full GGUF tensor names, the names llama.cpp's adapter loader pairs with
``.lora_a``/``.lora_b``.  Which names exist, and which are adapted when none are given, is the
architecture's (``Architecture.targets`` / ``default_targets``): q/k/v/o of the
softmax-attention layers by default, like the seed runs and PEFT's usual setting.
``skip_ssm`` keeps every tensor of the recurrent (DeltaNet) layers frozen even when a pattern
such as ``ffn_up`` would match there: adapters inside the recurrence are a separate, opt-in
experiment.
"""
from __future__ import annotations

from typing import Iterable

from pytrain import models
from pytrain.errors import PytrainError
from pytrain.models import ModelConfig


class LoraTargetError(PytrainError, ValueError):
    """Target names that are unknown or select nothing."""


def _normalise(targets: Iterable[str] | str, arch: models.Architecture) -> list[str]:
    if isinstance(targets, str):
        targets = [t for t in targets.replace(",", " ").split()]
    out: list[str] = []
    for t in targets:
        short = t.strip().removesuffix(".weight")
        if short not in out:
            out.append(short)
    valid = ", ".join(arch.targets)
    unknown = [t for t in out if t not in arch.targets]
    if unknown:
        raise LoraTargetError(f"unknown LoRA target{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(map(repr, unknown))} for {arch.name}; valid: {valid}")
    if not out:
        raise LoraTargetError(f"no LoRA targets given; valid for {arch.name}: {valid}")
    return out


def select_targets(config: ModelConfig, targets: Iterable[str] | str | None = None,
                   skip_ssm: bool = True) -> list[str]:
    """Full names of the adapted tensors, by layer then in target order.

    ``targets`` None: the architecture's default; or names, also as one comma/space separated
    string (as in a TOML or CLI value).  Raises :class:`LoraTargetError` for names the
    architecture does not have or when nothing matches (for example ``attn_qkv`` with
    ``skip_ssm=True``), since a run that trains nothing is a mistake.
    """
    arch = models.get(config.arch)
    wanted = _normalise(arch.default_targets if targets is None else targets, arch)
    shapes = config.tensor_shapes()
    names = []
    for i, recurrent in enumerate(config.recurrent):
        if recurrent and skip_ssm:
            continue
        for t in wanted:
            name = f"blk.{i}.{t}.weight"
            if name in shapes:
                names.append(name)
    if not names:
        hint = " (the recurrent layers are skipped: skip_ssm=True)" if skip_ssm else ""
        raise LoraTargetError(f"LoRA targets {', '.join(wanted)} match no tensor of this "
                              f"model{hint}")
    return names


def lora_shapes(config: ModelConfig, names: Iterable[str], rank: int | dict[str, int]
                ) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """Per target: numpy shapes of (A, B) with A = [rank, n_in], B = [n_out, rank]
    (GGUF ``lora_a`` ne = [n_in, r], ``lora_b`` ne = [r, n_out]); ``rank`` one for all, or
    per target (an adapter file may hold pairs of different ranks)."""
    shapes = config.tensor_shapes()
    out = {}
    for n in names:
        n_out, n_in = shapes[n]
        r = rank[n] if isinstance(rank, dict) else rank
        out[n] = ((r, n_in), (n_out, r))
    return out


def lora_param_count(config: ModelConfig, names: Iterable[str], rank: int) -> int:
    """Trainable parameters: rank × (n_in + n_out) per adapted matrix."""
    return sum(a[0] * a[1] + b[0] * b[1] for a, b in lora_shapes(config, names, rank).values())
