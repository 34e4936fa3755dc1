"""`make demo-dpo`: preference training (DPO) of a real pretrained model end to end, checked in
llama.cpp itself.

The model is SmolLM2-135M-Instruct (scripts/fetch_model.py, as `make demo-real`).  The
behaviour taught is following an answer format the base model ignores: a short question
(arithmetic, a unit conversion, or a look-up in a small table given in the question) that asks
to be answered as ``ANSWER: <answer>``, answered with exactly that one line.  The base model
answers in a sentence (0 of the 40 held-out prompts in the format).  Each preference pair has
the same correct content twice: chosen ``ANSWER: 42``, rejected a sentence ("The sum of 17 and
25 is 42."), so what the pairs prefer is the format alone, and a regex on greedy generations
measures it.  (Without the request in the prompt the base model finds the chosen answer
17.9 nats less likely than the rejected one, mean over the validation pairs, instead of 6.1,
and DPO alone, with no SFT first, only taught it to avoid the rejected answers: empty answers,
"ANSWER" then <|im_end|>.)  The content is no part of the preference, and DPO does not keep
it: the base model is right in 4 of the 40 answers (in a sentence), the adapted one in 2.
Steps:

1. generate the pairs (fixed seeds, nothing written per record; runs/demo-dpo/data/): 256
   training pairs, 48 held-out validation pairs and 40 held-out generation prompts, whose facts
   (numbers, tables) and so prompts are in no training pair nor in each other;
2. greedy answers of the base model (pytrain, the GGUF's Q4_1 weights) on the held-out prompts;
3. `pytrain train config/demo-dpo.toml` (train.objective = "dpo"; LoRA r 8 on q/k/v/o): the
   held-out reward accuracy and margin of the validation pairs before (step 0) and after;
4. greedy answers with the adapter (pytrain's Model.generate, as `pytrain generate --adapter`);
5. llama.cpp on the same prompt tokens (scripts/llama_generate, greedy), without and with
   ``--lora adapter.gguf``, and how many of its answers are pytrain's token for token;
6. a table written to bench_results/demo_dpo.md and .json (with --results) and printed.

The pieces are scripts/demo_real.py's: the model, the prompt tokens, both generators.

Usage:  python -m scripts.demo_dpo [--results bench_results] [--pairs N] [--valid N]
                                   [--prompts N] [--steps N] [--out DIR]
                                   [--set SECTION.KEY=VALUE ...]
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

import numpy as np

from pytrain.config import load_config
from pytrain.data.template_files import read_template
from pytrain.models.model import load_model
from scripts import fetch_model
from scripts.demo_real import (examples_table, llama_answers, llama_generate, prompt_ids,
                               pytrain_answers, timed)

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "config" / "demo-dpo.toml"
# the behaviour: the whole answer is one line "ANSWER: <x>", x one word or number (no space:
# the shape of every chosen answer; "ANSWER: ANSWER: ANSWER: ..." is not it)
BEHAVIOUR = re.compile(r"ANSWER: (\S+)")
# what run.train says once it has computed the reference log-probabilities
REFERENCE_SECONDS = re.compile(r"reference log-probabilities of \d+ pairs .*: ([\d.]+) s")

# ------------------------------------------------------------------------------------ the data
SYLLABLES = ["ka", "lo", "mi", "ra", "ven", "to", "su", "nel", "bri", "da", "zor", "fi", "mo",
             "tal", "ge", "ri", "pan", "os", "ul", "chi", "ber", "na", "qui", "es"]
UNITS = [("kilometers", "meters", 1000), ("kilograms", "grams", 1000), ("hours", "minutes", 60),
         ("minutes", "seconds", 60), ("feet", "inches", 12), ("days", "hours", 24),
         ("weeks", "days", 7), ("liters", "milliliters", 1000)]


def name(rng: random.Random, parts: int = 2) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def arithmetic(rng: random.Random) -> tuple[tuple, str, str, list[str]]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 19), rng.randint(2, 12)
        x = a * b
        asks = ["What is {a} times {b}?", "What is {a} * {b}?", "Multiply {a} by {b}."]
        says = ["{a} times {b} is {x}.", "The product of {a} and {b} is {x}.", "{a} * {b} = {x}."]
    elif op == "+":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        x = a + b
        asks = ["What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}."]
        says = ["{a} plus {b} is {x}.", "The sum of {a} and {b} is {x}.", "{a} + {b} = {x}."]
    else:
        a, b = rng.randint(20, 99), rng.randint(1, 19)
        x = a - b
        asks = ["What is {a} - {b}?", "What is {a} minus {b}?", "Subtract {b} from {a}."]
        says = ["{a} minus {b} is {x}.", "The difference of {a} and {b} is {x}.",
                "{a} - {b} = {x}."]
    f = dict(a=a, b=b, x=x)
    return ("arith", op, a, b), rng.choice(asks).format(**f), str(x), [s.format(**f) for s in says]


def conversion(rng: random.Random) -> tuple[tuple, str, str, list[str]]:
    big, small, k = rng.choice(UNITS)
    q = rng.randint(2, 60)
    f = dict(q=q, big=big, small=small, x=q * k)
    asks = ["How many {small} are in {q} {big}?", "Convert {q} {big} to {small}.",
            "{q} {big} is how many {small}?"]
    says = ["There are {x} {small} in {q} {big}.", "{q} {big} is {x} {small}.",
            "{q} {big} equals {x} {small}."]
    return (("unit", big, q), rng.choice(asks).format(**f), str(q * k),
            [s.format(**f) for s in says])


def lookup(rng: random.Random) -> tuple[tuple, str, str, list[str]]:
    if rng.random() < 0.5:
        people = {}
        while len(people) < 3:
            people[name(rng)] = rng.randint(18, 80)
        who = rng.choice(list(people))
        table = ", ".join(f"{n} {age}" for n, age in people.items())
        q = rng.choice(["Ages: {t}. How old is {w}?", "{t} (name and age). What is {w}'s age?"])
        x = str(people[who])
        says = [f"{who} is {x} years old.", f"{who}'s age is {x}."]
        return ("age", table, who), q.format(t=table, w=who), x, says
    lands = {}
    while len(lands) < 3:
        lands[name(rng, 3)] = name(rng)
    land = rng.choice(list(lands))
    table = "; ".join(f"{c}: {cap}" for c, cap in lands.items())
    q = rng.choice(["Capitals: {t}. What is the capital of {c}?",
                    "Country and capital: {t}. Which city is the capital of {c}?"])
    x = lands[land]
    says = [f"The capital of {land} is {x}.", f"{x} is the capital of {land}."]
    return ("capital", table, land), q.format(t=table, c=land), x, says


FAMILIES = [arithmetic, conversion, lookup]
# the format asked for after each question: the base model reads it and answers in a sentence
# anyway (0 of the 40 held-out prompts at baseline)
INSTRUCTIONS = ["Reply with one line: ANSWER: <answer>.", "Answer in the format ANSWER: <answer>.",
                "Give only ANSWER: <answer>."]


def pairs(rng: random.Random, n: int, taken: set) -> list[dict]:
    """``n`` preference pairs whose facts are not in ``taken`` (then added to it): the
    conversational records of TRL's DPOTrainer, plus the expected answer (``answer``, kept
    out of the training files)."""
    out = []
    while len(out) < n:
        key, q, x, says = rng.choice(FAMILIES)(rng)
        if key in taken or q in taken:
            continue
        taken.update((key, q))
        q += " " + rng.choice(INSTRUCTIONS)
        out.append({"prompt": [{"role": "user", "content": q}],
                    "chosen": [{"role": "assistant", "content": f"ANSWER: {x}"}],
                    "rejected": [{"role": "assistant", "content": rng.choice(says)}],
                    "answer": x, "family": key[0]})
    return out


def write_data(folder: Path, n_train: int, n_valid: int, n_prompts: int) -> dict:
    """The training pairs, the held-out validation pairs and the held-out generation prompts:
    no fact (and so no prompt) of the held-out two in training, nor in each other."""
    rng, taken = random.Random(2027), set()
    held_out = pairs(rng, n_prompts, taken)
    valid = pairs(rng, n_valid, taken)
    train = pairs(rng, n_train, taken)
    folder.mkdir(parents=True, exist_ok=True)
    strip = lambda r: {k: r[k] for k in ("prompt", "chosen", "rejected")}
    for fname, rows in (("train", train), ("valid", valid)):
        (folder / f"{fname}.jsonl").write_text("".join(json.dumps(strip(r)) + "\n" for r in rows))
    (folder / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
    return {"train": train, "valid": valid, "held_out": held_out}


# ------------------------------------------------------------------------------- the measures
def behaviour(text: str) -> bool:
    """The whole answer is one line ``ANSWER: <x>``, ``x`` without a space."""
    return BEHAVIOUR.fullmatch(text.strip()) is not None


def correct(text: str, want: str) -> bool:
    return text.strip() == f"ANSWER: {want}"


def mentions(text: str, want: str) -> bool:
    """The right answer is somewhere in ``text`` (whatever the format)."""
    return re.search(rf"(?<![\w-]){re.escape(want)}(?!\w)", text) is not None


def valid_records(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines())
            if r.get("split") == "valid"]


def base_preference(out: Path) -> dict:
    """The base model's own preference on the validation pairs, from the run's cached
    reference log-probabilities (summed over each completion's tokens): how often it already
    gives the chosen answer the higher probability, and the mean log-probability gap."""
    with np.load(out / "reference_logps.npz") as z:
        c, r = z["valid_chosen"], z["valid_rejected"]
    return {"base_prefers_chosen": float((c > r).mean()),
            "base_logp_gap": float((c - r).mean())}


def main() -> int:
    from pytrain.cli import _load_adapter
    from pytrain.run import loop as run
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=256, help="training pairs (256)")
    ap.add_argument("--valid", type=int, default=48, help="held-out validation pairs (48)")
    ap.add_argument("--prompts", type=int, default=40, help="held-out generation prompts (40)")
    ap.add_argument("--steps", type=int, help="train.max_steps (default: the config's)")
    ap.add_argument("--out", type=Path, help="run folder, data in DIR/data (default: the "
                    "config's, runs/demo-dpo)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a key of config/demo-dpo.toml (repeatable)")
    ap.add_argument("--results", type=Path, help="write demo_dpo.md/.json into this folder")
    a = ap.parse_args()
    t_start = time.perf_counter()
    gguf = fetch_model.fetch("smollm2")
    exe = llama_generate()
    sets = [f"model.path={json.dumps(str(gguf))}"]
    if a.out is not None:
        out = a.out.resolve()
        sets += [f"output.dir={json.dumps(str(out))}",
                 f"data.train={json.dumps(str(out / 'data' / 'train.jsonl'))}",
                 f"data.validation={json.dumps(str(out / 'data' / 'valid.jsonl'))}"]
    if a.steps is not None:
        sets.append(f"train.max_steps={a.steps}")
    cfg = load_config(CONFIG, sets + a.set)
    out = Path(cfg.output.dir)
    data = write_data(Path(cfg.data.train).parent, a.pairs, a.valid, a.prompts)
    held_out = data["held_out"]
    model = load_model(gguf, "cpu", cfg.model.threads)
    eog = set(model.tokenizer.eog_ids)
    template = (read_template(cfg.data.chat_template, "data.chat_template")[0]
                if cfg.data.chat_template else model.tokenizer.chat_template)
    convs = [{"messages": r["prompt"] + r["chosen"]} for r in held_out]
    prompts = [prompt_ids(model, c, template) for c in convs]
    answers, seconds = {}, {}
    answers["base"], seconds["base_answers"] = timed(pytrain_answers, model, prompts)
    # the demo's own folder: an earlier demo run there is replaced (the cached reference
    # log-probabilities are kept and reused when the pairs are the same)
    said: list[str] = []

    def log(*args, **kw):
        print(*args, **kw, flush=True)
        said.append(" ".join(map(str, args)))
    res, seconds["train"] = timed(lambda: run.train(cfg, progress=False, log=log,
                                                    overwrite=True))
    ref = next((m for m in map(REFERENCE_SECONDS.search, said) if m), None)
    seconds["reference"] = float(ref.group(1)) if ref else 0.0     # 0: read from the cache
    ad = _load_adapter(model, res.adapter)
    answers["adapted"], seconds["adapted_answers"] = timed(pytrain_answers, model, prompts, ad.hook)
    answers["llama_base"], seconds["llama_base_answers"] = timed(
        llama_answers, exe, gguf, None, prompts, out, eog)
    answers["llama_lora"], seconds["llama_answers"] = timed(
        llama_answers, exe, gguf, res.adapter, prompts, out, eog)
    n_layer = model.config.n_layer
    tok = model.tokenizer
    model.close()
    seconds["total"] = time.perf_counter() - t_start
    result = record(a, cfg, gguf, n_layer, tok, data, answers, res, seconds)
    md = markdown(result)
    print("\n" + md)
    if a.results:
        a.results.mkdir(parents=True, exist_ok=True)
        (a.results / "demo_dpo.json").write_text(json.dumps(result, indent=2) + "\n")
        (a.results / "demo_dpo.md").write_text(md)
    print(f"adapter:  {res.adapter}  (llama.cpp: --lora)\n"
          f"metrics:  {res.out_dir / 'metrics.jsonl'}\nplot:     {res.out_dir / 'loss.png'}")
    return 0


def record(a, cfg, gguf: Path, n_layer: int, tok, data: dict, answers: dict, res,
           seconds: dict) -> dict:
    """The demo's results: what bench_results/demo_dpo.json holds and the table is made of."""
    held_out = data["held_out"]
    want = [r["answer"] for r in held_out]
    text = lambda ids: tok.decode(ids, skip_special=True).strip()
    texts = {k: [text(x) for x in v] for k, v in answers.items()}
    valid = valid_records(res.out_dir / "metrics.jsonl")
    before, after = valid[0], valid[-1]
    pick = lambda r: {"step": r["step"], "accuracy": r["rewards/accuracies"],
                      "margin": r["rewards/margins"], "chosen": r["rewards/chosen"],
                      "rejected": r["rewards/rejected"], "loss": r["loss"]}
    t = cfg.train
    return {
        "date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "command": " ".join(["python -m scripts.demo_dpo"]
                            + [shlex.quote(x) for x in sys.argv[1:]]),
        "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                     if ln.startswith("model name")), ""),
        "model": gguf.name, "n_layer": n_layer,
        "train_pairs": len(data["train"]), "valid_pairs": len(data["valid"]),
        "n_held_out": len(held_out),
        "objective": t.objective, "beta": t.beta, "loss_type": t.loss_type,
        "steps": res.steps, "batch_size": t.batch_size, "lr": t.lr, "schedule": t.schedule,
        "threads": cfg.model.threads,
        "targets": "/".join(x.removeprefix("attn_").replace("output", "o")
                            for x in cfg.lora.targets),
        "rank": cfg.lora.rank, "alpha": cfg.lora.alpha,
        "valid_before": pick(before), "valid_after": pick(after),
        **(pref := base_preference(res.out_dir)),
        # the mean over the validation pairs of log p(chosen) - log p(rejected) under the
        # trained policy: the reward margin is beta times its change from the reference's
        "policy_logp_gap": pref["base_logp_gap"] + after["rewards/margins"] / t.beta,
        **{f"behaviour_{k}": sum(map(behaviour, v)) for k, v in texts.items()},
        **{f"correct_{k}": sum(correct(x, w) for x, w in zip(v, want)) for k, v in texts.items()},
        **{f"mentions_{k}": sum(mentions(x, w) for x, w in zip(v, want))
           for k, v in texts.items()},
        "same_tokens_llama_lora": sum(x == y for x, y in zip(answers["adapted"],
                                                                answers["llama_lora"])),
        "same_tokens_llama_base": sum(x == y for x, y in zip(answers["base"],
                                                                answers["llama_base"])),
        "seconds": seconds,
        "examples": [{"prompt": r["prompt"][0]["content"], "want": f"ANSWER: {r['answer']}",
                      "base": b, "adapted": x, "llama_lora": y}
                     for r, b, x, y in list(zip(held_out, texts["base"], texts["adapted"],
                                                texts["llama_lora"]))[:8]],
    }


def markdown(r: dict) -> str:
    n, s, b, e = r["n_held_out"], r["seconds"], r["valid_before"], r["valid_after"]
    rate = lambda k: f"{r[k]}/{n} ({r[k] / n:.0%})"
    lines = [
        "# demo-dpo: SmolLM2-135M-Instruct learns an answer format from preference pairs (DPO)",
        "",
        f"Made by `{r['command']}` at commit {r['commit']}, {r['date']}, on "
        f"{r['threads']} threads of an {r['cpu']}.  Task: short questions (arithmetic, unit "
        f"conversions, a look-up in a small table in the question) that ask for the answer as "
        f"`ANSWER: <answer>`, generated from fixed seeds; each pair has the same correct "
        f"content twice, chosen exactly `ANSWER: <x>`, rejected a sentence, so the preference "
        f"is the format.  {r['train_pairs']} training "
        f"pairs; {r['valid_pairs']} held-out validation pairs and {n} held-out generation "
        f"prompts, none of their facts in training.  DPO ({r['loss_type']}, beta "
        f"{r['beta']:g}), LoRA r {r['rank']} alpha {r['alpha']:g} on {r['targets']} of the "
        f"{r['n_layer']} layers, {r['steps']} steps of {r['batch_size']} pairs, lr "
        f"{r['lr']:g} {r['schedule']}.  Behaviour: the whole greedy answer (at most 24 tokens) "
        f"is one line `ANSWER: <x>`, x one word or number (as every chosen answer).",
        "",
        "| | before (base model) | after (DPO adapter) |",
        "|---|---|---|",
        f"| held-out reward accuracy ({r['valid_pairs']} pairs) | {b['accuracy']:.3f} | "
        f"{e['accuracy']:.3f} |",
        f"| held-out reward margin | {b['margin']:.3f} | {e['margin']:.3f} |",
        f"| held-out DPO loss | {b['loss']:.4f} | {e['loss']:.4f} |",
        f"| behaviour rate, pytrain greedy | {rate('behaviour_base')} | "
        f"{rate('behaviour_adapted')} |",
        f"| behaviour rate, llama.cpp greedy (after: `--lora adapter.gguf`) | "
        f"{rate('behaviour_llama_base')} | {rate('behaviour_llama_lora')} |",
        f"| `ANSWER: <the right x>`, pytrain | {rate('correct_base')} | "
        f"{rate('correct_adapted')} |",
        f"| `ANSWER: <the right x>`, llama.cpp | {rate('correct_llama_base')} | "
        f"{rate('correct_llama_lora')} |",
        f"| the right x anywhere in the answer, pytrain | {rate('mentions_base')} | "
        f"{rate('mentions_adapted')} |",
        f"| the right x anywhere in the answer, llama.cpp | {rate('mentions_llama_base')} | "
        f"{rate('mentions_llama_lora')} |",
        "",
        f"llama.cpp's greedy answers are pytrain's token for token on "
        f"{r['same_tokens_llama_base']}/{n} prompts with the base model and "
        f"{r['same_tokens_llama_lora']}/{n} with the adapter (Q4_1 weights: the two "
        f"round some activations differently, and greedy decoding amplifies a near tie).  "
        f"The step-0 rewards are 0 by definition "
        f"(the policy is the reference), so the accuracy before is 0; the base model itself "
        f"gives the chosen answer the higher log-probability on "
        f"{r['base_prefers_chosen']:.0%} of the validation pairs, and the mean log-probability "
        f"gap log p(chosen) - log p(rejected) goes from {r['base_logp_gap']:.2f} nats (base) "
        f"to {r['policy_logp_gap']:.2f} (adapted: the base's plus the margin / beta).  "
        f"The pairs prefer a format, not content (both answers of a pair hold the same "
        f"content): the base model has the right answer somewhere in "
        f"{r['mentions_base']}/{n} answers, the adapted one in {r['mentions_adapted']}/{n}.  "
        f"Wall time: base answers "
        f"{s['base_answers']:.0f} s, training {s['train']:.0f} s (of which the reference "
        f"log-probabilities of the training and validation pairs {s['reference']:.0f} s), "
        f"adapted answers {s['adapted_answers']:.0f} s, llama.cpp "
        f"{s['llama_base_answers'] + s['llama_answers']:.0f} s, whole demo "
        f"{s['total']:.0f} s.",
        "", *examples_table(r["examples"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
