"""How much memory a training step may plan for: what the device has free now, and on the CPU
also what this process's cgroup (a container's limit) still allows.

Why: ``recompute = "auto"`` keeps one graph per step when its compute buffer fits, and splits
the step layer by layer otherwise.  Sizing that against the machine's total memory picks one
graph on a 128 GiB host for a container limited to 16 GiB, which the kernel then OOM-kills;
on a GPU the total ignores the weights already loaded and the CUDA context.
"""
from __future__ import annotations

import re
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None      # "max" (cgroup v2: unlimited) -> None


def _cgroup_dirs() -> list[Path]:
    """The memory cgroup folders that may hold this process's limit: cgroup v2's unified
    path, cgroup v1's memory controller path, and the mount roots themselves (inside a
    container's cgroup namespace the process's own group is mounted at the root)."""
    out = []
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":
            out += [CGROUP_ROOT / rel, CGROUP_ROOT / "unified" / rel]
        elif "memory" in controllers.split(","):
            out.append(CGROUP_ROOT / "memory" / rel)
    return out + [CGROUP_ROOT, CGROUP_ROOT / "memory"]


def cgroup_available() -> int | None:
    """Bytes this process's memory cgroup still allows (its limit minus its usage), or None
    when it sets no limit or none can be read."""
    best = None
    for d in _cgroup_dirs():
        for limit_file, usage_file in (("memory.max", "memory.current"),
                                       ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            limit = _read_int(d / limit_file)
            if limit is None or limit >= 1 << 60:        # v1 writes ~2^63 for "no limit"
                continue
            left = max(0, limit - (_read_int(d / usage_file) or 0))
            best = left if best is None else min(best, left)
    return best


def system_available() -> int | None:
    """MemAvailable of /proc/meminfo: what the kernel can give without swapping."""
    try:
        m = re.search(r"^MemAvailable:\s+(\d+) kB", MEMINFO.read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def available_bytes(runtime) -> int:
    """Memory a step may plan for now, on the runtime's compute device: a GPU's free memory
    (as its driver reports it, after the weights and context), else the least of the
    system's available memory and the cgroup's."""
    free, total = runtime.device_memory_info()
    if runtime.gpu is not None:
        return free
    known = [x for x in (system_available(), cgroup_available()) if x is not None]
    return min(known) if known else total
