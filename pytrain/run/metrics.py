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
    """The loss curve; a preference run (records with rewards) also gets its reward margin
    and preference accuracy, each in a panel of its own under the loss."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    pref = any("rewards/margins" in r for r in recs)
    panels = [("loss", "preference loss" if pref else "cross-entropy per target token")]
    if pref:
        panels += [("rewards/margins", "reward margin"), ("rewards/accuracies",
                                                          "preference accuracy")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 4 + 2.5 * (len(panels) - 1)),
                             sharex=True, squeeze=False)
    for ax, (key, label) in zip(axes[:, 0], panels):
        train, valid = [], []
        for r in recs:
            v = r.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                (valid if r.get("split") == "valid" else train).append((r["step"], v))
        if train:
            ax.plot(*zip(*train), label="train" if pref else "train (valid tokens)", lw=1)
        if valid:
            ax.plot(*zip(*valid), "o-", label="validation", lw=2)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if train or valid:
            ax.legend()
    axes[-1, 0].set_xlabel("optimizer step")
    fig.tight_layout()
    with atomic.replacing(png) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
