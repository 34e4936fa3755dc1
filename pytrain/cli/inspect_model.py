"""`pytrain inspect MODEL.gguf`: what pytrain sees in a model file, before training on it.

Reads only the header and tensor index (no weights are loaded), so it is instant on a large
model and works on a machine that could not hold it.  It answers the questions a run would
otherwise answer late: is the architecture supported, which layers are DeltaNet, what types
the weights are in and what they will cost in memory under the type policy, which tensors are
MTP extras, and which tensors a LoRA adapter would touch.
"""
from __future__ import annotations

import os
import sys
from collections import Counter

from pytrain.formats.gguf_meta import GGUFError
from pytrain import models
from pytrain.ggml import lib
from pytrain.models.lora_targets import LoraTargetError, lora_param_count, select_targets
from pytrain.models.model_file import open_model
from pytrain.models.weights import load_type

LORA_RANK = 16


def _size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _params(n: int) -> str:
    return f"{n:,}"


def report(path: str | os.PathLike[str]) -> str:
    arch, meta, infos, cfg = open_model(path)
    shapes = cfg.tensor_shapes()
    lines = [f"file: {path}", f"architecture: {arch}"]
    if meta.get("general.name"):
        lines.append(f"name: {meta['general.name']}")

    lines.append("config:")
    for k, v in vars(cfg).items():
        if k != "recurrent":
            lines.append(f"  {k} = {v:.6g}" if isinstance(v, float) else f"  {k} = {v}")
    kinds = cfg.layer_kinds
    counts = (f"{kinds.count('linear')} linear / DeltaNet, {kinds.count('attention')} attention"
              if "linear" in kinds else "all attention")
    lines.append(f"layers: {len(kinds)} ({counts})")
    lines.append("  " + ", ".join(f"{i} {k}" for i, k in enumerate(kinds)))

    trunk = [infos[n] for n in shapes if n in infos]
    missing = [n for n in shapes if n not in infos]
    extra = [i for n, i in infos.items() if n not in shapes]
    n_params = sum(i.n_elements for i in trunk)
    lines.append(f"tensors: {len(infos)} in the file, {len(trunk)} trunk "
                 f"({_params(n_params)} parameters)")
    by_type: Counter = Counter()
    bytes_by_type: Counter = Counter()
    for i in trunk:
        by_type[i.type_name] += 1
        bytes_by_type[i.type_name] += i.n_bytes
    for t in sorted(by_type):
        lines.append(f"  {t:<8} {by_type[t]:5d} tensors  {_size(bytes_by_type[t])}")
    if missing:
        lines.append(f"  MISSING {len(missing)} tensors: {', '.join(missing[:8])}"
                     + (" ..." if len(missing) > 8 else ""))

    lines.append("memory of the trunk weights by type policy (as stored -> loaded):")
    stored = sum(i.n_bytes for i in trunk)
    for device in ("cpu", "cuda"):
        for policy in ("auto", "f32"):
            loaded = sum(_loaded_bytes(i, load_type(i.name, i.shape, i.type, device, policy))
                         for i in trunk)
            lines.append(f"  {device:<4} {policy:<4}  {_size(stored)} -> {_size(loaded)}")

    if extra:
        mtp_blocks = sorted({int(i.name.split(".")[1]) for i in extra
                             if i.name.startswith("blk.") and i.name.split(".")[1].isdigit()})
        desc = f"blocks {', '.join(map(str, mtp_blocks))}" if mtp_blocks else "no blocks"
        lines.append(f"ignored (MTP/nextn and extras, not loaded): {len(extra)} tensors, {desc}, "
                     f"{_size(sum(i.n_bytes for i in extra))}")
        others = [i.name for i in extra if not i.name.startswith("blk.")]
        if others:
            lines.append(f"  non-block: {', '.join(others[:8])}")
    else:
        lines.append("ignored (MTP/nextn and extras): none")

    return "\n".join(lines + _target_lines(cfg, shapes, infos))


def _target_lines(cfg, shapes: dict, infos: dict) -> list[str]:
    """The LoRA targets section: the default set (its tensors listed) and all targets, with
    and without skip_ssm where the model has recurrent layers (without them it changes
    nothing, so each set is one line)."""
    lines = [f"LoRA targets (rank {LORA_RANK}):"]
    present = {n.split(".")[2] for n in shapes if n.startswith("blk.") and n.endswith(".weight")}
    default = models.get(cfg.arch).default_targets
    here = tuple(t for t in models.get(cfg.arch).targets if t in present)   # this model's
    lines.append(f"  all = {','.join(here)}")
    skips = (True, False) if any(getattr(cfg, "recurrent", ())) else (False,)
    for label, targets in (("default " + ",".join(default), default), ("all", here)):
        previous: list[str] | None = None
        for skip in skips:
            variant = f"{label}, skip_ssm={skip}" if len(skips) > 1 else label
            try:
                names = select_targets(cfg, targets, skip_ssm=skip)
            except LoraTargetError as e:
                lines.append(f"  {variant}: {e}")
                continue
            layers = sorted({int(n.split(".")[1]) for n in names})
            lines.append(f"  {variant}: {len(names)} tensors in layers "
                         f"{', '.join(map(str, layers))}; "
                         f"{_params(lora_param_count(cfg, names, LORA_RANK))} LoRA parameters"
                         + (" (same tensors)" if names == previous else ""))
            if targets is default and names != previous:
                for n in names:
                    out_, in_ = shapes[n]
                    lines.append(f"    {n}  [{out_}, {in_}] {infos[n].type_name}")
            previous = names
    return lines


def _loaded_bytes(info, t: int) -> int:
    return int(lib.ggml_row_size(t, info.ne[0])) * (info.n_elements // info.ne[0])


def main(path: str) -> int:
    """Print the report; a file pytrain cannot use is a one-line error and exit status 2."""
    try:
        text = report(path)
    except GGUFError as e:
        print(f"pytrain inspect: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0
