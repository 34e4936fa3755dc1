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
        f"{' + blas (' + info['blas'] + ')' if info.get('blas') else ''}",
        f"  patches: {', '.join(info.get('patches', [])) or 'none'}",
        f"  cmake: {' '.join(o for o in info.get('options', []) if o.startswith('-DGGML_'))}",
        "devices:",
    ]
    for d in ggml.devices():
        mem = (f"{d.memory_free / 2**30:.1f} GiB free of {d.memory_total / 2**30:.1f} GiB"
               if d.memory_total else "memory unknown")
        lines.append(f"  {d.name:<8} {d.kind:<5} {d.description}  ({mem})")
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
    lines.append(f"threads (default): {ggml.default_threads()}")
    return "\n".join(lines)


def main() -> int:
    try:
        print(report())
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
