"""Benchmark: forward tokens/s of pytrain (``Model.logits``) against HF transformers on CPU.

Why: pytrain's forward graph should cost no more than HF's eager PyTorch forward of the same
model.  This compares the two on the same weights, the same token batch and the same thread
count, checks that they compute the same thing (log-softmax differences, KL, top-1 agreement), and
writes a markdown table to ``bench_results/forward.md``.  A benchmark, not a test: nothing is asserted
about speed.

Models (``--models``, comma-separated, default ``default,mid,2b``):
    default  the embedded ``pytrain/assets/default-model.gguf`` (skipped with a message when absent);
             HF runs only when its HF checkpoint (``--default-hf``, default
             /tmp/pytrain-default-model/hf, left by scripts/make_default_model.py) exists
    mid      the project's CPU benchmark shape: hidden 512, 8 layers (full attention at 3 and 7),
             8 q / 2 kv heads x 64, FFN 1536, DeltaNet 4 key / 4 value heads x 64, vocab 151936,
             tied; random weights; F32 GGUF; batch 2 x 256, 5 timed runs
    2b       the Qwen3.5-2B shape: hidden 2048, 24 layers (full attention every 4th), 8 q / 2 kv
             heads x 256, FFN 6144, DeltaNet 16/16 heads x 128, vocab 248320, tied; random weights
             rounded to F16 (HF checkpoint stored float16, so the F16 GGUF holds exactly HF's
             weights); F16 GGUF (3.5 GiB) and an HF checkpoint (3.5 GiB); pytrain keeps the F16
             weights (type_policy auto), HF runs in float32 (upcast on load); batch 1 x 128, 3 timed
             runs.  Needs ~8 GB free disk (skipped below 10 GB free) and ~16 GB RAM (both sides
             loaded at once: pytrain ~4.3 GB after a load peak of ~8 GB, HF ~8 GB, peak ~11.7 GB).

Each random model is generated once, deterministically (fixed seeds), by the reference stack
(scripts/qwen35_reference.py: ``qwen35_text_config``, ``randomize_weights``, the pinned llama.cpp
converter with pre forced to qwen35) and cached under ``--cache`` (default
``~/.cache/pytrain/bench/<name>-<hash of the spec>/``, outside git).  The tokenizer is the 512-token
fixture tokenizer (tests/fixtures/qwen35/tokenizer); the converter pads the vocabulary to the
model's size, and the benchmark feeds random token ids over the whole vocabulary.

Timing: each side runs in its own subprocess (so peak RSS figures do not mix); both are loaded,
each does one warm-up forward, then they take turns (alternating which goes first) at timed
forwards of the same [B, T] batch.  The machine may be shared: before each run the script waits
(up to --quiet-wait / 4 s) for other processes to go quiet, and records the cores they kept busy
during the run; runs with >= 0.3 such cores are "contended".  Rounds go on until N rounds have
both runs clean, or 3 N rounds in all.  tokens/s = B*T / median time of the clean runs; the ratio
is the median over clean rounds of HF time / pytrain time (over all rounds when none is clean).
pytrain: ``pytrain.load_model(gguf, device="cpu", threads=T).logits(tokens)`` with the project's
interpreter (the one running this script, or ``--pytrain-python``).  HF:
``Qwen3_5ForCausalLM.from_pretrained(..., dtype=float32, attn_implementation="sdpa")``,
``model(input_ids, use_cache=False)`` under ``torch.no_grad()`` with ``torch.set_num_threads(T)``,
run by ``--ref-python`` (default /opt/refenv/bin/python, which also generates the models).  HF has
no flash-linear-attention / causal-conv1d kernels on CPU: its DeltaNet runs the torch fallback
(``torch_chunk_gated_delta_rule``).  Peak RSS is the process's VmHWM (imports, weights, the
logits, everything; file pages of pytrain's GGUF memory map count while touched).

How (from the repo root, with the project's python, the native library built and the reference
stack of scripts/requirements-reference.txt in /opt/refenv):

    python -m scripts.bench_forward                          # default, mid, 2b -> bench_results/forward.md
    python -m scripts.bench_forward --models mid             # only the mid shape
    python -m scripts.bench_forward --models mid --runs 3 --threads 2 --out /tmp/forward.md

On a machine shared with other jobs (as bench_results/forward.md was made), give the workers the
cores while they run: ``--nice -20`` (root; each worker gets its own session, so its own scheduler
autogroup, whose niceness it sets too: plain niceness does not weigh across autogroups), e.g.

    python -m scripts.bench_forward --nice -20 --quiet-wait 0 --default-hf /tmp/dm3/hf

First run: the mid model takes ~1 minute to make, the 2B one several minutes; the timed part
takes ~1 minute for mid and a few minutes for 2B on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts import bench_common as bc
from scripts.bench_common import CLEAN_OTHERS, DEFAULT_GGUF, REPO, SPECS

# --------------------------------------------------------------------------------------------
# workers (one per side, each in its own process)
# --------------------------------------------------------------------------------------------

def _save_logsoftmax(logits, path: str) -> None:
    import numpy as np
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=logits.shape)
    for b in range(logits.shape[0]):
        x = logits[b].astype(np.float64)
        x -= x.max(-1, keepdims=True)
        x -= np.log(np.exp(x).sum(-1, keepdims=True))
        out[b] = x
    out.flush()


def worker(side: str, a) -> None:
    """Load one side, then serve commands from stdin: ``run`` (one timed forward of the batch;
    answers ``RUN {time, others, own}``) and ``finish`` (saves the last logits' log-softmax to
    ``a.save``; answers ``RESULT {...}`` and exits).  Protocol lines go to the original stdout;
    everything else the libraries print goes to stderr."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    bc.renice(a.nice)
    sys.stdout = sys.stderr

    def say(kind: str, obj: dict) -> None:
        proto.write(f"{kind} {json.dumps(obj)}\n")
        proto.flush()

    import numpy as np
    B, T = a.batch
    t0 = time.perf_counter()
    if side == "pytrain":
        import pytrain
        m = pytrain.load_model(a.gguf, device="cpu", threads=a.threads, type_policy=a.type_policy)
        fwd = m.logits
        info = {"pytrain_file": pytrain.__file__, "type_policy": a.type_policy}
    else:
        import torch
        import transformers
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM
        torch.set_num_threads(a.threads)
        model = Qwen3_5ForCausalLM.from_pretrained(a.hf, dtype=torch.float32,
                                                   attn_implementation=a.hf_attn).eval()

        def fwd(tok):
            with torch.no_grad():
                return model(torch.from_numpy(tok), use_cache=False).logits.numpy()
        info = {"torch": torch.__version__, "transformers": transformers.__version__,
                "attn": model.config._attn_implementation,
                "n_params": sum(p.numel() for p in model.parameters())}
    tok = bc.make_batch(a.vocab, B, T, a.seed)[0]
    say("READY", dict(load_s=time.perf_counter() - t0, rss_after_load=bc.proc_status()["VmRSS"], **info))
    logits = None
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "run":
            logits = None
            logits, dt, others, own = bc.timed(lambda: fwd(tok))
            say("RUN", dict(time=dt, others=others, own=own))
        elif cmd == "finish":
            st = bc.proc_status()
            assert logits is not None and logits.shape == (B, T, a.vocab), getattr(logits, "shape", None)
            _save_logsoftmax(np.asarray(logits), a.save)
            say("RESULT", dict(peak_rss=st["VmHWM"], rss_end_anon=st["RssAnon"], rss_end_file=st["RssFile"]))
            return


# --------------------------------------------------------------------------------------------
# orchestration
# --------------------------------------------------------------------------------------------

class Side:
    """A worker process for one side (pytrain or hf) of one model."""

    def __init__(self, python: str, side: str, model: dict, a, save: str):
        self.side, self.name = side, model["name"]
        cmd = [python, "-m", "scripts.bench_forward", "--worker", side, "--threads", str(a.threads),
               "--batch", str(model["batch"][0]), str(model["batch"][1]),
               "--vocab", str(model["vocab"]), "--save", save, "--hf-attn", a.hf_attn, "--nice", str(a.nice),
               "--type-policy", a.type_policy]
        cmd += ["--gguf", str(model["gguf"])] if side == "pytrain" else ["--hf", str(model["hf"])]
        env = bc.worker_env(a.threads)
        if a.pytrain_path:    # another pytrain tree than this checkout's
            env["PYTHONPATH"] = os.pathsep.join([a.pytrain_path, str(REPO)])
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                  text=True, env=env, cwd=str(REPO), start_new_session=bool(a.nice))
        self.res = dict(side=side, times=[], others=[], own=[], **self._read("READY"))

    def _read(self, kind: str) -> dict:
        line = self.p.stdout.readline()
        if not line.startswith(kind + " "):
            self.p.kill()
            self.err.seek(0)
            sys.stderr.write(self.err.read()[-6000:])
            raise RuntimeError(f"[{self.name}] {self.side} worker failed (wanted {kind}, got {line[:200]!r})")
        return json.loads(line[len(kind) + 1:])

    def run(self) -> dict:
        self.p.stdin.write("run\n")
        self.p.stdin.flush()
        return self._read("RUN")

    def finish(self) -> dict:
        self.p.stdin.write("finish\n")
        self.p.stdin.flush()
        self.res.update(self._read("RESULT"))
        self.p.wait()
        return self.res

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def bench_model(model: dict, a, tmp: str) -> dict:
    """Both sides loaded side by side, then alternating timed runs (see the module docstring)."""
    row = dict(model)
    paths = {s: str(Path(tmp) / f"{model['name']}-{s}.npy") for s in ("pytrain", "hf")}
    sides: dict[str, Side] = {}
    try:
        sides["pytrain"] = Side(a.pytrain_python, "pytrain", model, a, paths["pytrain"])
        if model["hf"]:
            sides["hf"] = Side(a.ref_python, "hf", model, a, paths["hf"])
        for s in sides.values():
            print(f"  [{model['name']}] {s.side}: loaded in {s.res['load_s']:.1f} s", flush=True)
            s.res["warmup_s"] = s.run()["time"]
        rounds = []
        while len(rounds) < 3 * model["runs"]:
            order = list(sides.values()) if len(rounds) % 2 == 0 else list(sides.values())[::-1]
            rnd = {}
            for s in order:
                if a.quiet_wait:
                    bc.wait_quiet(a.quiet_wait / 4, CLEAN_OTHERS, 1.0)
                r = s.run()
                rnd[s.side] = r
                for k in ("time", "others", "own"):
                    s.res[k + ("s" if k == "time" else "")].append(r[k])
            rounds.append(rnd)
            print(f"  [{model['name']}] round {len(rounds)}: " + ", ".join(
                f"{k} {v['time']:.3f} s (others {v['others']:.2f})" for k, v in rnd.items()), flush=True)
            if sum(all(v["others"] < CLEAN_OTHERS for v in r.values()) for r in rounds) >= model["runs"]:
                break
        for s in sides.values():
            res = s.finish()
            clean = [t for t, o in zip(res["times"], res["others"]) if o < CLEAN_OTHERS]
            B, T = model["batch"]
            res.update(n_clean=len(clean), median_s=statistics.median(clean or res["times"]),
                       others_cores=statistics.mean(res["others"]), own_cores=statistics.mean(res["own"]),
                       best_tokens_per_s=B * T / min(res["times"]))
            res["tokens_per_s"] = B * T / res["median_s"]
            row[s.side] = res
            print(f"  [{model['name']}] {s.side}: {res['tokens_per_s']:.1f} tokens/s (median of "
                  f"{res['n_clean']} clean of {len(res['times'])} runs), peak RSS "
                  f"{res['peak_rss'] / 2**30:.2f} GiB", flush=True)
        if "hf" not in sides:
            row["hf"] = None
        else:
            both = [r for r in rounds if all(v["others"] < CLEAN_OTHERS for v in r.values())]
            row["pair_ratio"] = statistics.median(r["hf"]["time"] / r["pytrain"]["time"]
                                                  for r in (both or rounds))
            row["n_clean_pairs"], row["n_rounds"] = len(both), len(rounds)
            row["cmp"] = compare(paths["pytrain"], paths["hf"])
            print(f"  [{model['name']}] pytrain/HF = {row['pair_ratio']:.2f} (median over "
                  f"{len(both) or len(rounds)} rounds); max |d log-softmax| "
                  f"{row['cmp']['max_dlogsoftmax']:.2e} (p >= 1e-4: {row['cmp']['max_dlogsoftmax_plausible']:.2e}), "
                  f"mean KL {row['cmp']['mean_kl']:.2e}, argmax agree "
                  f"{100 * row['cmp']['argmax_agree']:.1f}%", flush=True)
    finally:
        for s in sides.values():
            s.close()
        for f in paths.values():
            if os.path.exists(f):
                os.remove(f)
    return row


def compare(p_path: str, h_path: str) -> dict:
    """Max |log-softmax difference| over all entries and over the entries HF gives >= 1e-4
    probability, mean KL(HF || pytrain) per position, top-1 agreement."""
    import numpy as np
    p = np.load(p_path, mmap_mode="r")
    h = np.load(h_path, mmap_mode="r")
    mx, mx_plaus, kl, agree, n = 0.0, 0.0, 0.0, 0, 0
    for b in range(p.shape[0]):
        for s in range(0, p.shape[1], 32):
            x, y = np.asarray(p[b, s:s + 32], np.float64), np.asarray(h[b, s:s + 32], np.float64)
            d = np.abs(x - y)
            mx = max(mx, float(d.max()))
            mx_plaus = max(mx_plaus, float(d[y >= np.log(1e-4)].max()))
            kl += float((np.exp(y) * (y - x)).sum())
            agree += int((x.argmax(-1) == y.argmax(-1)).sum())
            n += x.shape[0]
    return {"max_dlogsoftmax": mx, "max_dlogsoftmax_plausible": mx_plaus, "mean_kl": kl / n,
            "argmax_agree": agree / n}


def prepare(name: str, a) -> dict | None:
    """Model record {name, gguf, hf, vocab, batch, runs, desc, weights} or None (skipped)."""
    if name == "default":
        if not DEFAULT_GGUF.exists():
            print(f"[default] skipped: {DEFAULT_GGUF.relative_to(REPO)} is absent", flush=True)
            return None
        try:
            from pytrain.models.model_file import open_model
            _arch, _meta, _infos, cfg = open_model(DEFAULT_GGUF)
            vocab = int(cfg.n_vocab)
            desc = (f"embedded default model: hidden {cfg.n_embd}, {cfg.n_layer} layers, "
                    f"vocab {vocab}")
        except Exception as e:  # pragma: no cover - depends on the config object's fields
            print(f"[default] skipped: cannot read its config ({e})", flush=True)
            return None
        hf = a.default_hf if (a.default_hf / "model.safetensors").exists() else None
        if hf is None:
            print(f"[default] HF side skipped: no HF checkpoint at {a.default_hf}", flush=True)
        return dict(name="default", gguf=DEFAULT_GGUF, hf=hf, vocab=vocab, batch=a.tokens.get("default", (2, 256)), runs=a.runs or 5,
                    desc=desc, weights="F32 / f32")
    spec = SPECS[name]
    d = bc.ensure_model(name, a.cache, a.ref_python, "bench_forward")
    if d is None:
        return None
    done = json.loads((d / "done.json").read_text())
    B, T = spec["batch"]
    if a.tokens and name in a.tokens:
        B, T = a.tokens[name]
    gguf_type = spec["outtype"].upper()
    return dict(name=name, gguf=d / done["gguf"], hf=d / "hf", vocab=spec["config"]["vocab_size"],
                batch=(B, T), runs=a.runs or spec["runs"], desc=spec["desc"],
                n_params=done["n_params"],
                weights=f"{gguf_type}{' (loaded as F32)' if a.type_policy == 'f32' else ''} / f32")


def machine_info(a) -> list[str]:
    m = bc.machine_facts()
    cpu, mem, commit, ggml_v = m["cpu"], m["mem"], m["commit"], m["ggml"]
    return [f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; pytrain commit {commit}",
            f"- CPU: {cpu}, {os.cpu_count()} cores visible, {mem} RAM; both sides use "
            f"**{a.threads} threads** (pytrain `threads={a.threads}`, torch `set_num_threads({a.threads})`)",
            f"- ggml {ggml_v}",
            f"- python {platform.python_version()} (pytrain side); worker processes at niceness "
            f"{a.nice:+d}" + (" (so that other jobs on this shared machine yield the cores while "
                              "they run)" if a.nice < 0 else "")]


def report(rows: list[dict], a) -> str:
    hf_ver = next((r["hf"] for r in rows if r.get("hf")), None)
    lines = ["# Forward throughput: pytrain vs HF transformers (CPU)", "",
             f"Made by `{bc.command_line('bench_forward')}` (see the script's docstring). Both sides are loaded in "
             "their own processes, then timed in alternating rounds (one full forward of the batch "
             "returning all logits per side per round, after one warm-up each). Tokens/s = batch "
             "tokens / median wall time over the *clean* runs, those during which other processes "
             "kept < 0.3 cores busy (this machine is shared, and with 2 threads on 2 cores a stolen "
             "core slows either side several times); ratio = median over clean rounds (both runs "
             "clean) of HF time / pytrain time; clean rounds = clean / all rounds (when none is "
             "clean, all runs count and the figures are contended). Peak RSS = VmHWM of that side's "
             "process. Other load = mean cores kept busy by other processes during that side's runs.",
             ""]
    lines += machine_info(a)
    if a.pytrain_path:
        lines.append(f"- pytrain package timed from {a.pytrain_path}")
    if hf_ver:
        lines.append(f"- HF: torch {hf_ver['torch']}, transformers {hf_ver['transformers']}, "
                     f"attn_implementation={hf_ver['attn']}, float32, `model(input_ids, use_cache=False)` "
                     f"under `torch.no_grad()`; no flash-linear-attention (torch DeltaNet fallback)")
    lines += ["", "| model | weights (pytrain / HF) | batch B x T | clean rounds | pytrain tokens/s | HF tokens/s | "
              "ratio pytrain/HF | pytrain peak RSS | HF peak RSS | max abs diff log-softmax (all / p>=1e-4) | "
              "mean KL | argmax agree | "
              "other load (cores) pytrain / HF |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, h, c = r.get("pytrain"), r.get("hf"), r.get("cmp")
        ratio = f"**{r['pair_ratio']:.2f}**" if p and h else "-"
        nruns = (f"{r['n_clean_pairs']}/{r['n_rounds']}" if p and h else
                 f"{p['n_clean']}/{len(p['times'])}" if p else "-")
        cells = [r["name"], r["weights"], f"{r['batch'][0]} x {r['batch'][1]}", nruns,
                 f"{p['tokens_per_s']:.1f}" if p else "-", f"{h['tokens_per_s']:.1f}" if h else "-", ratio,
                 bc.fmt_gib(p["peak_rss"]) if p else "-", bc.fmt_gib(h["peak_rss"]) if h else "-",
                 f"{c['max_dlogsoftmax']:.1e} / {c['max_dlogsoftmax_plausible']:.1e}" if c else "-",
                 (f"{c['mean_kl']:.1e}" if c["mean_kl"] >= 1e-8 else "< 1e-8") if c else "-",
                 f"{100 * c['argmax_agree']:.1f}%" if c else "-",
                 " / ".join(f"{x['others_cores']:.2f}" if x else "-" for x in (p, h))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Shapes:", ""]
    for r in rows:
        n = f"; {r['n_params'] / 1e6:.1f} M parameters" if r.get("n_params") else ""
        lines.append(f"- **{r['name']}**: {r['desc']}{n}")
    lines += ["", "Details (seconds):", ""]
    for r in rows:
        for side in ("pytrain", "hf"):
            x = r.get(side)
            if x:
                lines.append(f"- {r['name']} {side}: load {x['load_s']:.2f}, warm-up {x['warmup_s']:.3f}, "
                             f"runs {', '.join(f'{t:.3f} ({o:.2f})' for t, o in zip(x['times'], x['others']))} "
                             f"(other cores in brackets); best {x['best_tokens_per_s']:.1f} tokens/s; RSS after load "
                             f"{bc.fmt_gib(x['rss_after_load'])}, at end anon {bc.fmt_gib(x['rss_end_anon'])} + "
                             f"file {bc.fmt_gib(x['rss_end_file'])}; cores used {x['own_cores']:.2f}, by others "
                             f"{x['others_cores']:.2f}")
    if a.notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in a.notes]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,mid,2b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=None, help="clean timed runs wanted (default per model: 5, 2b: 3)")
    ap.add_argument("--tokens", default="", help="override batches, e.g. 'mid=2x256,2b=1x64'")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pytrain" / "bench")
    ap.add_argument("--ref-python", default="/opt/refenv/bin/python")
    ap.add_argument("--pytrain-python", default=sys.executable)
    ap.add_argument("--pytrain-path", default=None,
                    help="directory holding the pytrain package to time (default: this repo), e.g. a "
                         "copy whose pytrain/_native/lib has a differently built libggml-cpu")
    ap.add_argument("--default-hf", type=Path, default=Path("/tmp/pytrain-default-model/hf"))
    ap.add_argument("--hf-attn", default="sdpa")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each side, wait up to this many seconds (before each timed run, a "
                         "quarter of it) for other processes to use < 0.3 cores (0: do not wait)")
    ap.add_argument("--type-policy", default="auto", choices=["auto", "f32", "keep"],
                    help="pytrain.load_model's type_policy (auto: F16 GGUF weights stay F16 on CPU)")
    ap.add_argument("--nice", type=int, default=0,
                    help="niceness increment of the worker processes; on a shared machine, -20 (needs "
                         "root) lets them take the cores from other jobs while they run, for clean figures")
    ap.add_argument("--out", type=Path, default=REPO / "bench_results" / "forward.md")
    ap.add_argument("--note", dest="notes", action="append", default=[], help="a line for the Notes section")
    # internal
    ap.add_argument("--make", choices=sorted(SPECS), help=argparse.SUPPRESS)
    ap.add_argument("--into", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=["pytrain", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1234, help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.make:
        bc.make_model(a.make, a.into)
        return 0
    if a.worker:
        worker(a.worker, a)
        return 0

    a.tokens = {k: tuple(int(x) for x in v.split("x")) for k, v in
                (kv.split("=") for kv in a.tokens.split(",") if kv)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="pytrain-bench-") as tmp:
        for name in [m.strip() for m in a.models.split(",") if m.strip()]:
            model = prepare(name, a)
            if model is None:
                continue
            print(f"[{name}] batch {model['batch'][0]} x {model['batch'][1]}, {model['runs']} runs, "
                  f"{a.threads} threads", flush=True)
            row = bench_model(model, a, tmp)
            rows.append(row)
    if not rows:
        print("nothing was benchmarked")
        return 1
    md = report(rows, a)
    print()
    print(md)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(md)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
