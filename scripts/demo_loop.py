"""`make demo-loop`: the training loop's own tools on a real model, on a run made to overfit:
samples while training, the best checkpoint and early stopping.

The model is SmolLM2-135M-Instruct (scripts/fetch_model.py, as `make demo-real`).  The data
are capitals of made-up countries ("What is the capital of Tanmiro?" / "The capital of
Tanmiro is Kalo."), generated here with fixed seeds: the training and validation countries
differ, so what carries over to validation is the answer's form, while the capitals
themselves can only be memorised.  Trained long at a high learning rate, the validation loss
falls while the form is learnt and rises once the training capitals are memorised: the run
must keep the adapter of the lowest validation loss (adapter.best.gguf) and stop by itself
(train.early_stopping_patience), and its samples (train.sample_every, the validation prompts)
must take the answer's form.  Steps:

1. write the data (runs/demo-loop/data/: 32 training and 16 validation questions);
2. `pytrain train config/demo-loop.toml` (samples every 4 steps, validation every 4, early
   stopping after 3 validations without improvement, TensorBoard event files);
3. from the run folder: the validation curve with the best step, the share of samples in the
   answer's form at each sample step, and `pytrain eval` of adapter.best.gguf (its loss must
   be the best validation's);
4. a table written to bench_results/demo_loop.md and .json (with --results) and printed.

Usage:  python -m scripts.demo_loop [--results bench_results] [--out DIR] [--set K=V ...]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from scripts import fetch_model
from scripts.demo_dpo import name

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config" / "demo-loop.toml"
QUESTIONS = ["What is the capital of {c}?", "Which city is the capital of {c}?",
             "Name the capital of {c}."]


def write_data(folder: Path, n_train: int = 32, n_valid: int = 16, seed: int = 0) -> dict:
    """Chat records of made-up capitals; no country in both files (fixed seed)."""
    rng = random.Random(seed)
    countries: dict[str, str] = {}
    while len(countries) < n_train + n_valid:
        countries.setdefault(name(rng, 3), name(rng))
    items = list(countries.items())
    split = {"train": items[:n_train], "valid": items[n_train:]}
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for part, facts in split.items():
        recs = [{"messages": [{"role": "user", "content": rng.choice(QUESTIONS).format(c=c)},
                              {"role": "assistant",
                               "content": f"The capital of {c} is {cap}."}]}
                for c, cap in facts]
        (folder / f"{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        out[part] = recs
    return out


def in_form(completion: str, prompt: str) -> bool:
    """The answer's form: one sentence "The capital of <the country asked> is <Name>."."""
    m = re.search(r"capital of (\w+)", prompt)
    return bool(m) and re.fullmatch(rf"The capital of {m.group(1)} is [A-Z][a-z]+\.",
                                    completion.strip()) is not None


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def summarise(out: Path) -> dict:
    """Validation curve, best step, early stop and the samples' form rate, from the run."""
    recs = read_jsonl(out / "metrics.jsonl")
    valid = [{"step": r["step"], "loss": r["loss"], "accuracy": r["accuracy"],
              "best_step": r["best_step"]} for r in recs if r.get("split") == "valid"]
    stop = next((r["early_stop"] for r in recs if "early_stop" in r), None)
    samples: dict[int, list] = {}
    for s in read_jsonl(out / "samples.jsonl"):
        samples.setdefault(s["step"], []).append(s)
    rates = [{"step": st, "in_form": sum(in_form(s["completion"], s["prompt"]) for s in ss),
              "of": len(ss), "first": ss[0]["completion"]} for st, ss in sorted(samples.items())]
    return {"valid": valid, "early_stop": stop, "samples": rates,
            "steps": max(r["step"] for r in recs if "loss" in r and "split" not in r),
            "best": min(valid, key=lambda v: (v["loss"], v["step"]))}


def eval_best(py: str, cfg: Path, out: Path, sets: list[str]) -> float:
    r = subprocess.run([py, "-m", "pytrain", "eval", str(cfg), "--adapter",
                        str(out / "adapter.best.gguf"), *sets], capture_output=True, text=True,
                       cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"pytrain eval failed:\n{r.stderr[-2000:]}")
    return float(re.search(r"loss ([\d.]+)", r.stdout.strip().splitlines()[-1]).group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=None, help="write demo_loop.md/.json here")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "demo-loop")
    ap.add_argument("--train", type=int, default=32)
    ap.add_argument("--valid", type=int, default=16)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config overrides (e.g. train.max_steps=8 for a quick run)")
    a = ap.parse_args()
    gguf = fetch_model.fetch("smollm2")
    write_data(a.out / "data", a.train, a.valid)
    sets = [f"model.path={gguf}", f"output.dir={a.out}", f"data.train={a.out / 'data' / 'train.jsonl'}",
            f"data.validation={a.out / 'data' / 'valid.jsonl'}", *a.set]
    args = [x for s in sets for x in ("--set", s)]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytrain", "train", str(CONFIG), "--no-progress",
                        "--overwrite", *args], cwd=ROOT, capture_output=True, text=True)
    took = time.perf_counter() - t0
    print(r.stdout[-4000:])
    if r.returncode != 0:
        raise SystemExit(f"pytrain train failed ({r.returncode}):\n{r.stderr[-3000:]}")
    res = summarise(a.out)
    res["best_adapter_eval_loss"] = eval_best(sys.executable, CONFIG, a.out, args)
    res.update(seconds=round(took), date=dt.date.today().isoformat(),
               command="python -m scripts.demo_loop" + "".join(
                   f" --set {shlex.quote(s)}" for s in a.set),
               commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                     capture_output=True, text=True).stdout.strip(),
               tensorboard=sorted(p.name for p in a.out.glob("events.out.tfevents.*")) != [])
    text = markdown(res)
    print(text)
    if a.results is not None:
        a.results.mkdir(parents=True, exist_ok=True)
        (a.results / "demo_loop.json").write_text(json.dumps(res, indent=2) + "\n")
        (a.results / "demo_loop.md").write_text(text)
    return 0


def markdown(r: dict) -> str:
    b = r["best"]
    lines = ["# The training loop on a run that overfits: samples, best checkpoint, early "
             "stopping", "",
             f"Made by `{r['command']}` (config/demo-loop.toml) at commit {r['commit']} on "
             f"{r['date']}, {r['seconds']} s.  SmolLM2-135M-Instruct learns capitals of made-up "
             f"countries; the validation countries are not in the training data, so only the "
             f"answer's form carries over and memorising the training capitals overfits.", "",
             f"- **Best validation loss {b['loss']:.4f} at step {b['step']}**: "
             f"adapter.best.gguf; `pytrain eval --adapter adapter.best.gguf` gives "
             f"{r['best_adapter_eval_loss']:.4f}.",
             f"- **{'Stopped early' if r['early_stop'] else 'Not stopped early'}** after step "
             f"{r['steps']}" + (f": {r['early_stop']}" if r['early_stop'] else "") + ".",
             f"- **Samples in the answer's form** (\"The capital of X is Y.\", greedy, the "
             f"validation prompts): {r['samples'][0]['in_form']}/{r['samples'][0]['of']} at "
             f"step {r['samples'][0]['step']} -> {r['samples'][-1]['in_form']}/"
             f"{r['samples'][-1]['of']} at step {r['samples'][-1]['step']}.",
             f"- TensorBoard event files written: {'yes' if r['tensorboard'] else 'no'}.", "",
             "| step | validation loss | token accuracy | best so far | samples in form | "
             "first sample |", "|---|---|---|---|---|---|"]
    rates = {s["step"]: s for s in r["samples"]}
    for v in r["valid"]:
        s = rates.get(v["step"])
        first = (s["first"].replace("|", "\\|").replace("\n", " ")[:60] if s else "")
        lines.append(f"| {v['step']} | {v['loss']:.4f} | {v['accuracy']:.3f} | "
                     f"{v['best_step']}{' (this)' if v['best_step'] == v['step'] else ''} | "
                     + (f"{s['in_form']}/{s['of']}" if s else "") + f" | {first} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
