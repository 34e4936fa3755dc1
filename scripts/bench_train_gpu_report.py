"""The markdown report of scripts/bench_train_gpu.py (bench_results/train-cuda.md,
train-vulkan*.md) from its results: the header (which device, and whether its speed means
anything), the throughput and memory table, the profiles."""
from __future__ import annotations

from scripts import bench_common as bc

LAVAPIPE = ("**Lavapipe (Mesa's Vulkan driver) runs on the CPU: these times say nothing about "
            "any GPU.** The run shows that the Vulkan path trains end to end (weights, LoRA, "
            "optimizer state and every node of the step on the Vulkan device); only a real GPU "
            "gives a speed.")


def summary(r: dict) -> str:
    """One line of a worker's result, for the log."""
    if "error" in r:
        return "FAILED " + r["error"].splitlines()[-1][:300] if r["error"].strip() else "FAILED"
    peak, src = peak_memory(r)
    return (f"{r['tokens_per_s']:.0f} tokens/s (median step {r['median_s']:.3f} s), first loss "
            f"{r['first_loss']:.4f}, peak device memory {gib(peak)} ({src or '-'})")


def gib(b) -> str:
    if b is None or b == 0:
        return "-"
    return f"{b / 2**30:.1f} GiB" if abs(b) >= 2**30 else f"{b / 2**20:.0f} MiB"


def peak_memory(r: dict | None) -> tuple[float | None, str | None]:
    """(bytes, source) of a worker's device memory: nvidia-smi's peak above idle where the
    machine has nvidia-smi, else ggml's own reading (pytrain: the device's free memory before
    the model loaded minus after the steps)."""
    mem = (r or {}).get("gpu_memory") or {}
    if mem:
        return mem["peak_above_idle_mib"] * 2**20, "nvidia-smi"
    used = (r or {}).get("device_used_ggml")
    return (used, "ggml") if used is not None else (None, None)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _header(j: dict, hf: dict) -> list[str]:
    B, T = j["batch"]
    label = j.get("device_label")
    lines = [f"# LoRA training on {j['device'].upper()}"
             + (f" ({label.partition(': ')[2] or label})" if label else "")
             + f": pytrain vs HF transformers + PEFT ({j['shape']} shape)", ""]
    if j.get("lavapipe"):
        lines += [LAVAPIPE, ""]
    lines += [f"Made by `{j['command']}` ({j['date']}); scripts/bench_train_gpu.py says what "
              "is measured and how.", "",
              f"- model: {j['desc']}; {_count(j['n_params'])} parameters, random weights",
              f"- batch {B} x {T}, the first half of each row a masked prompt; LoRA r {bc.RANK}, "
              f"alpha {bc.ALPHA:g} on q/k/v/o of the attention layers; AdamW lr {bc.LR:g}, clip "
              f"{bc.MAX_NORM:g}; {j['warmup']} warm-up and {j['steps']} timed steps per side",
              f"- machine: {j['machine'].get('gpu') or label or 'no GPU'}; "
              f"{j['machine'].get('cpu', '')}; pytrain {j['machine'].get('commit', '?')}"]
    if "tokens_per_s" in hf:
        lines.append(f"- HF side: torch {hf['torch']}, transformers {hf['transformers']}, PEFT "
                     f"{hf['peft']}, attention {hf['attn']}, base bf16, LoRA "
                     f"{'/'.join(hf['lora_dtypes'])}")
    elif hf.get("not_run"):
        lines.append(f"- HF side: not run: {hf['not_run']}")
    return lines


def _row(side: str, t: str, r: dict, hf: dict, anchor: dict, lavapipe: bool) -> str:
    if "error" in r:
        err = r["error"].strip()
        return f"| {side} | {t} | failed: {err.splitlines()[-1][:160] if err else '?'} " \
               "| | | | | | |"
    tps = r["tokens_per_s"]
    x_hf = f"{tps / hf['tokens_per_s']:.2f}" if "tokens_per_s" in hf else "-"
    x_an = "-" if lavapipe else f"{tps / anchor['tokens_per_s']:.2f}"
    if side == "HF + PEFT":
        own, what, step = r.get("max_reserved"), "bf16 (torch)", "one graph (autograd)"
    else:
        own = r.get("device_used_end")
        what = ", ".join(f"{k}: {v}" for k, v in sorted(r["weight_types"].items()))
        step = f"recompute={r.get('policy', '?')}: {r['step_graph']}"
    peak, src = peak_memory(r)
    return (f"| {side} | {what} | {tps:,.{0 if tps >= 100 else 1}f} | {x_hf} | {x_an} | "
            f"{gib(peak)}{f' ({src})' if src else ''} | {gib(own)} | {r['first_loss']:.4f} | "
            f"{step} |")


def _profiles(j: dict) -> list[str]:
    lines = []
    for t, p in j.get("profile", {}).items():
        if "error" in p or "profile" not in p:
            lines += ["", f"Profile of {t}: failed: {p.get('error', '?').strip()[-300:]}"]
            continue
        p = p["profile"]
        if t == "hf":
            lines += ["", f"## Profile: HF + PEFT, one step under torch.profiler (wall "
                      f"{p['wall']:.3f} s; {p['key']} summed {p['total_s']:.3f} s)", "",
                      "| op | self time (s) | share | calls |", "|---|---:|---:|---:|"]
            lines += [f"| `{k[:70]}` | {s:.4f} | {s / p['total_s']:.1%} | {n} |"
                      for k, s, n in p["top"]]
            continue
        lines += bc.profile_lines(f"pytrain {t}", p)
    return lines


def report(j: dict) -> str:
    hf = j.get("hf") or {}
    an = j["anchor"]
    lavapipe = bool(j.get("lavapipe"))
    lines = _header(j, hf)
    lines += ["", f"Anchor (measured earlier on one H200, {an['stack']}): {an['tokens_per_s']:,} "
              f"tokens/s, {an['peak_gib']} GiB peak" + ("; not compared with lavapipe." if
                                                         lavapipe else "."), "",
              "| side | frozen weights (as loaded) | tokens/s | x HF here | x anchor | peak device "
              "memory (source) | own allocator figure | first loss | step |",
              "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    rows = ([("HF + PEFT", "bf16", hf)] if hf and not hf.get("not_run") else []) + \
        [("pytrain", k.split()[0], r) for k, r in j["pytrain"].items()]
    lines += [_row(side, t, r, hf, an, lavapipe) for side, t, r in rows]
    lines += ["", "Peak device memory: nvidia-smi's peak above what was in use before the worker "
              "started (everything: context, weights, activations, pools), where the machine has "
              "nvidia-smi; else (ggml) the device's free memory as ggml reports it before pytrain "
              "loaded the model minus after the timed steps"
              + (" (lavapipe's memory is the system's, so other processes move it too)" if
                 lavapipe else "") + ". Own allocator figure: HF = "
              "`torch.cuda.max_memory_reserved`; pytrain = device memory in use after the timed "
              "steps (ggml_backend_dev_memory: total - free; ggml's buffers and pools only grow)."]
    return "\n".join(lines + _profiles(j)) + "\n"
