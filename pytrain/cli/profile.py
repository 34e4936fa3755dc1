"""``pytrain profile CONFIG``: the first training step of a config computed node by node, time
by part of the model (forward, backward, recompute, optimizer) and by op."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=1, help="profiled steps, averaged (default 1; "
                   "after one warm-up step and one unprofiled step)")
    p.add_argument("--top", type=int, default=15, help="rows of the op and part x op tables "
                   "(default 15; the rest summed in one row)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")


def _table(title: str, d: dict[str, float], total: float, counts: dict | None = None,
           top: int | None = None) -> list[str]:
    rows = sorted(d.items(), key=lambda kv: -kv[1])
    shown = rows[:top] if top else rows
    # the width of every row, shown or not: the layout is the graph's, not the timing's
    w = max([len(k) for k, _ in rows] + [len(title)])
    lines = [f"{title:<{w}}  {'nodes' if counts else '':>6} {'ms':>10} {'share':>7}"]
    for k, v in shown:
        n = str(counts.get(k, "")) if counts else ""
        lines.append(f"{k:<{w}}  {n:>6} {v * 1e3:>10.3f} {100 * v / total if total else 0:>6.1f}%")
    if len(shown) < len(rows):
        rest = sum(v for _, v in rows[len(shown):])
        lines.append(f"{f'({len(rows) - len(shown)} more)':<{w}}  {'':>6} {rest * 1e3:>10.3f} "
                     f"{100 * rest / total if total else 0:>6.1f}%")
    return lines


def render(prof, facts: dict, top: int = 15) -> list[str]:
    mb = ", ".join(f"{b} x {t}" for b, t in facts["micro_batches"])
    unprof = facts.get("unprofiled_step")
    lines = [f"model:   {facts['model']}",
             f"runtime: {facts['runtime']}",
             f"step:    micro-batches {mb}; {facts['tokens']} tokens, {facts['targets']} targets; "
             f"{prof.step_graph}",
             f"time:    {prof.wall:.4f} s per profiled step ({prof.steps} averaged"
             + (f"; {unprof:.4f} s unprofiled" if unprof else "") + f"), {prof.n_nodes} nodes; "
             f"node times sum {prof.total:.4f} s (dispatch overhead {prof.overhead * 1e6:.1f} us "
             f"per node subtracted)"]
    if prof.product_flops:
        prod, other = prof.split()
        lines.append(f"matrix products: {prof.product_flops / 1e9:.3f} GFLOP per step "
                     f"(MUL_MAT / OUT_PROD nodes, as computed), {prod:.4f} s in their nodes"
                     + (f" = {prof.product_flops / prod / 1e9:.1f} GFLOP/s" if prod > 0 else "")
                     + f"; {other:.4f} s in every other node "
                     f"({100 * other / prof.total if prof.total else 0:.1f}% of node time)")
    lines += [""] + _table("part", prof.by_part, prof.total) + [""]
    counts = {k.rsplit(" [", 1)[0]: 0 for k in prof.count_op_backend}
    for k, v in prof.count_op_backend.items():
        counts[k.rsplit(" [", 1)[0]] += v
    lines += _table("op", prof.by_op, prof.total, counts, top) + [""]
    if len(prof.by_backend) > 1 or len(prof.backends) > 1:    # (a GPU run: which ran where)
        lines += _table("backend", prof.by_backend, prof.total) + [""]
        lines += _table("op [backend]", prof.by_op_backend, prof.total,
                        prof.count_op_backend, top) + [""]
    lines += _table("part: op", prof.by_part_op, prof.total, top=top)
    return lines


def main(cfg, args: argparse.Namespace) -> int:
    from pytrain.errors import PytrainError       # the command's modules load when it runs,
    from pytrain.plan.profile import profile_run  # not for every `pytrain --help`
    if args.steps < 1:
        raise PytrainError(f"--steps must be at least 1, got {args.steps}")
    prof, facts = profile_run(cfg, args.steps)
    if args.json:
        print(json.dumps(dict(facts, **prof.to_dict()), indent=1))
    else:
        print("\n".join(render(prof, facts, args.top)))
    return 0
