"""The run's metrics.jsonl read back (a line torn by a crash left out), and its loss plot."""
from __future__ import annotations

import json
import math
from pathlib import Path

from pytrain.formats import atomic


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a crash mid-append) is left out."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def plot_losses(metrics_path: Path, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, valid = [], []
    for r in read_metrics(metrics_path):
        if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]):
            (valid if r.get("split") == "valid" else train).append((r["step"], r["loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train (valid tokens)", lw=1)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation", lw=2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy per target token")
    ax.grid(alpha=0.3)
    if train or valid:
        ax.legend()
    fig.tight_layout()
    with atomic.replacing(png) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
