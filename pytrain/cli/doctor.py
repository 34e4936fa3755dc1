"""`pytrain doctor`: what this install runs on, for bug reports and for checking a GPU build."""
from __future__ import annotations

import platform
import sys

import numpy as np


def report() -> str:
    from pytrain import ggml
    from pytrain._version import __version__

    info = ggml.build_info()
    lines = [
        f"pytrain {__version__}  (Python {platform.python_version()}, numpy {np.__version__}, "
        f"{platform.machine()})",
        f"ggml {info['ggml_version']} from {info['archive_project']} ({info['archive']})",
        f"  sha256 {info['archive_sha256']}",
        f"  source {info['source']}",
        f"  backends built: cpu{' + cuda' if info['cuda'] else ''}"
        f"{' + vulkan' if info.get('vulkan') else ''}"
        f"{' + blas (' + info['blas'] + ')' if info.get('blas') else ''}",
        f"  patches: {', '.join(info.get('patches', [])) or 'none'}",
        f"  cmake: {' '.join(o for o in info.get('options', []) if o.startswith('-DGGML_'))}",
        "devices:",
    ]
    ggml.load_vulkan()            # a Vulkan build's devices are listed only once it is loaded
    for d in ggml.devices():
        mem = (f"{d.memory_free / 2**30:.1f} GiB free of {d.memory_total / 2**30:.1f} GiB"
               if d.memory_total else "memory unknown")
        lines.append(f"  {d.name:<8} {d.kind:<5} {d.description}  ({mem})")
    lines.append(vulkan_line(info))
    v = ggml.CPU_VARIANT
    runnable = [n for n, (_, score) in sorted(ggml.cpu_variant_scores().items()) if score > 0]
    lines.append(f"cpu variant: {v.name} ({v.chosen_by}; {v.path.name}); this CPU runs "
                 f"{len(runnable)} of the build's {len(info.get('cpu_variants', []))}: "
                 f"{' '.join(runnable)}")
    lines.append(f"cpu features: {' '.join(ggml.cpu_features()) or 'none detected'} "
                 f"(those the variant was compiled for)")
    extra = ggml.extra_buffer_types()
    lines.append(f"cpu extra buffer types: {' '.join(extra) or 'none'} (never used by pytrain: "
                 f"weights and compute stay in the default buffer types)")
    lines.append(bf16_line(info))
    lines.append(f"threads (default): {ggml.default_threads()}")
    return "\n".join(lines)


def bf16_line(info: dict) -> str:
    """What ``train.compute_type = "bf16"`` would run on: oneDNN's kernel and the CPU's bf16
    units (a CPU without them gets an emulation, slower than f32)."""
    from pytrain import ggml
    from pytrain.models.precision import cpu_bf16_units
    kernel = ggml.bf16_kernel()
    if not info.get("onednn"):
        return "bf16 compute: unavailable (no oneDNN in the BLAS backend of this build)"
    if not kernel:
        return (f"bf16 compute: unavailable on this CPU ({info['onednn']} has no bf16 matmul "
                f"without AVX-512 or AMX)")
    units = cpu_bf16_units()
    return (f"bf16 compute: {info['onednn']}, kernel {kernel}; this CPU's bf16 units: "
            f"{' '.join(units) if units else 'none (bf16 would be slower than f32 here)'}")


def vulkan_line(info: dict) -> str:
    """Which Vulkan device ``device = "vulkan"`` gets, and whether it is Mesa's lavapipe (a
    CPU driver: right results, no GPU speed) or a GPU."""
    import os

    from pytrain import ggml
    if not info.get("vulkan"):
        return "vulkan: not built (make build VULKAN=1, or PYTRAIN_VULKAN=1 pip install .)"
    vk = [d for d in ggml.devices() if d.name.startswith("Vulkan")]
    if not vk:
        hint = (" (lavapipe, Mesa's CPU driver, is installed: GGML_VK_VISIBLE_DEVICES=0 uses it)"
                if ggml.lavapipe_installed() and "GGML_VK_VISIBLE_DEVICES" not in os.environ
                else "")
        return f"vulkan: built; no device listed{hint}"
    d = vk[0]
    kind = ("lavapipe (Mesa's CPU driver: correct results, not GPU speed)"
            if ggml.is_lavapipe(d.description) else "a GPU")
    return f"vulkan: device = \"vulkan\" uses {d.name}, {d.description}: {kind}"


def main() -> int:
    try:
        print(report())
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
