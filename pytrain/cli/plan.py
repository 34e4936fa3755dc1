"""``pytrain plan CONFIG``: the memory a training run will need on its device, whether it fits,
and whether the trainer will recompute layers; nothing is loaded and no step is run."""
from __future__ import annotations

import argparse
import json

NOT_FIT = 3     # exit status of a run that does not fit (1 is an error)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="plan for this device instead of model.device (cpu, cuda, "
                   "vulkan, auto, rpc:HOST:PORT)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def render(plan) -> list[str]:
    """The plan as the command prints it."""
    from pytrain.step.step_memory import size      # loaded when the command runs
    B, T = plan.batch
    lines = [f"model:   {plan.model} ({plan.arch})",
             f"device:  {plan.device}" + (f" ({plan.device_label})" if plan.device_label
                                          and plan.device != "cpu" else ""),
             f"batch:   {B} x {T} tokens (train.batch_size x data.max_seq_len, every token a "
             f"target: the largest micro-batch)",
             f"compute: {plan.compute.removeprefix('compute ')}", *plan.warnings, "",
             f"weights as loaded on {plan.device}:",
             f"  {'file type -> loaded':<22} {'tensors':>8} {'in file':>12} {'loaded':>12}"]
    for g in plan.weights:
        kind = g["file_type"] + ("" if g["file_type"] == g["loaded_type"]
                                 else f" -> {g['loaded_type']}")
        lines.append(f"  {kind:<22} {g['tensors']:>8} {size(g['file_bytes']):>12} "
                     f"{size(g['loaded_bytes']):>12}")
    lines.append(f"  {'total':<22} {sum(g['tensors'] for g in plan.weights):>8} "
                 f"{size(sum(g['file_bytes'] for g in plan.weights)):>12} "
                 f"{size(plan.weight_bytes):>12}")
    if plan.not_loaded:
        lines.append(f"  not loaded: {len(plan.not_loaded)} tensors of the file (MTP, extras), "
                     f"{size(sum(plan.not_loaded.values()))}")
    if plan.types:
        lines.append(f"  types: {plan.types['reason']}")
    lines.append(f"LoRA:    {plan.lora_tensors} tensors, {plan.lora_params:,} parameters: "
                 f"{size(plan.adapter_bytes)}; gradients + AdamW moments: "
                 f"{size(plan.optimizer_bytes)}")
    lines += _step_lines(plan, size)
    lines += ["", "recompute: not decided (no graph was built)" if plan.unbuilt else
              f"recompute: {'layers' if plan.layers else 'off'} ({plan.reason})",
              f"device memory: {size(plan.free_bytes)} free of {size(plan.total_bytes)}; "
              f"available to the run: {size(plan.available_bytes)}" if plan.free_bytes is not None
              else f"device memory: no {plan.device} device on this machine (planned for "
                   f"train.memory_gib)",
              f"needed:  {size(plan.need_bytes)} = weights + LoRA + optimizer state + "
              + ("the step graph's metadata" if plan.unbuilt else
                 f"step ({'layer-wise' if plan.layers else 'one graph'})")
              + f"; budget {size(plan.budget_bytes)} ({plan.budget_source})"]
    lines += [f"         {n}" for n in plan.notes]
    short = plan.need_bytes - plan.budget_bytes
    lines.append("FITS" if plan.fits else
                 f"DOES NOT FIT: {plan.unbuilt}" if plan.unbuilt else
                 f"DOES NOT FIT: {size(short)} over the budget")
    return lines


def _step_lines(plan, size) -> list[str]:
    """The compute buffers of the step: one graph and layer-wise, or why none was built."""
    if plan.unbuilt:
        return [f"compute buffer: not measured: {plan.unbuilt}"]
    lines = [f"compute buffer, one graph (recompute off):   {size(plan.one_graph)}"]
    lw = plan.layerwise
    if lw:
        lines.append(f"compute buffer, layer-wise (recompute layers): {size(lw['largest'])} "
                     f"largest graph + {size(lw['persistent'])} kept layer inputs (head and "
                     f"loss on chunks of {lw['head_chunk_rows']} rows)")
    else:
        lines.append("compute buffer, layer-wise: not possible (adapted tensors outside the "
                     "blocks, or a preference objective)")
    return lines


def main(cfg, args: argparse.Namespace) -> int:
    from pytrain.plan.run_memory import plan_run
    plan = plan_run(cfg)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print("\n".join(render(plan)))
    return 0 if plan.fits else NOT_FIT
