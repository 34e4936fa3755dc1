"""Experiment (a), seed 003 reproduced: SFT on a+b chats with the loss on the assistant's
tokens only vs on the whole sequence, measured as exact-answer accuracy at checkpoints and as
the share of free generations that write a new question (scripts/masking_experiments.py runs
it)."""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import numpy as np

from pytrain.data import load_examples
from pytrain.models.model import load_model
from pytrain.step import loss as L
from scripts.masking_common import (SYSTEM, WORDS, batch_logits, chat, checkpoints, config,
                                    load_adapter_into, log_softmax, md_table, metrics, model_path,
                                    plt, quiet, save_plot, save_results, write_jsonl)


# ============================================================================ (a) seed 003
OPS = {"+": (lambda a, b: str(a + b), "a + b"),
       "-": (lambda a, b: str(a - b), "a - b"),
       "*": (lambda a, b: str(a * b), "a × b"),
       "#": (lambda a, b: str(a + b + 1), "a + b + 1"),
       "&": (lambda a, b: f"{a}{b}", "the digits of a then b"),
       "@": (lambda a, b: f"{b}{a}", "the digits of b then a")}


def arithmetic_task(op: str = "+", lo: int = 0, hi: int = 99):
    """(question, answer) functions for ``What is <a><op><b>?`` with operands in [lo, hi];
    ``op`` is a key of OPS (``+ - *``, or a novel operator the base model never saw)."""
    fn = OPS[op][0]
    return (lambda a, b: f"What is {a}{op}{b}?"), fn, lo, hi


def seed003_data(folder: Path, n_train: int, n_test: int, op: str, lo: int, hi: int, seed: int,
                 context: tuple[int, int] = (0, 0)):
    """train.jsonl / test.jsonl: held-out operand pairs for the test set.  ``context`` (min, max)
    > 0 puts that many random words before each question ("<words>. What is 3+4?"): an
    unpredictable prompt, as real user turns are, that the answer does not depend on."""
    question, answer, lo, hi = arithmetic_task(op, lo, hi)
    n_test = min(n_test, (hi - lo + 1) ** 2 // 3)
    rng = np.random.default_rng(seed)
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    order = rng.permutation(len(pairs))
    test = [pairs[i] for i in order[:n_test]]
    rest = [pairs[i] for i in order[n_test:]]
    train = [rest[i] for i in rng.choice(len(rest), n_train, replace=n_train > len(rest))]

    def q(a, b):
        k = int(rng.integers(context[0], context[1] + 1)) if context[1] > 0 else 0
        words = " ".join(rng.choice(WORDS, k)) if k else ""
        return (f"{words[0].upper()}{words[1:]}. " if words else "") + question(a, b)
    tr = write_jsonl(folder / "train.jsonl", [chat(q(a, b), answer(a, b)) for a, b in train])
    te = write_jsonl(folder / "test.jsonl", [chat(q(a, b), answer(a, b)) for a, b in test])
    return tr, te


def exact_accuracy(model, examples, lora=None) -> tuple[float, float]:
    """(exact-answer accuracy, answer-token loss) on assistant-only examples.  Exact = every
    answer token is the argmax given the right prefix and the argmax after the answer is an
    end-of-generation token, i.e. greedy decoding writes exactly the answer and stops."""
    eog = set(model.tokenizer.eog_ids)
    ok, nll, n = 0, 0.0, 0
    for e, lp in zip(examples, batch_logits(model, examples, lora)):
        seg = np.zeros((1, len(e)), np.int64)
        tgt = L.shift_targets(e.tokens[None].astype(np.int64), e.train_mask[None], seg)[0]
        pos = np.nonzero(tgt >= 0)[0]
        pred = lp[pos].argmax(-1)
        good = bool(np.all(pred[:-1] == tgt[pos[:-1]])) and int(pred[-1]) in eog
        ok += good
        nll -= float(lp[pos, tgt[pos]].sum())
        n += len(pos)
    return ok / len(examples), nll / max(n, 1)


def free_prompts(tok) -> dict[str, list[int]]:
    """Prompts with no question in them.  Qwen3.5's template refuses a conversation without a
    user turn, so the system-only prompt is written the way the template writes a system turn."""
    return {"empty": tok.encode("<|im_start|>"),
            "system": tok.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>")}


def sample(model, prompt: list[int], n: int, max_new: int, temperature: float, seed: int,
           lora=None) -> list[list[int]]:
    """``n`` samples of ``max_new`` tokens after ``prompt``, batched (all rows share one length)."""
    rng = np.random.default_rng(seed)
    toks = np.tile(np.asarray(prompt, np.int64), (n, 1))
    for _ in range(max_new):
        lp = log_softmax(model.logits(toks, lora=lora)[:, -1] / temperature)
        p = np.exp(lp)
        c = p.cumsum(-1)
        nxt = (c < rng.random((n, 1)) * c[:, -1:]).sum(-1)
        toks = np.concatenate([toks, np.minimum(nxt, p.shape[-1] - 1)[:, None]], 1)
    return [list(r[len(prompt):]) for r in toks]


def question_share(model, op: str, n: int, max_new: int, seed: int, lora=None) -> dict:
    """Share of free generations that write a new task question (``What is <a><op><b>?``) in the
    turn they open, per free prompt; plus a few decoded examples."""
    tok = model.tokenizer
    pat = re.compile(rf"What is \d+\s*{re.escape(op)}\s*\d+\s*\?")
    res = {}
    for i, (name, prompt) in enumerate(free_prompts(tok).items()):
        outs = sample(model, prompt, n, max_new, 1.0, seed + i, lora)
        texts = [tok.decode(o).split("<|im_end|>")[0] for o in outs]
        hits = [bool(pat.search(t)) for t in texts]
        res[name] = {"share": sum(hits) / n, "user_turn": sum(t.startswith("user\n") for t in texts) / n,
                     "examples": texts[:4]}
    res["all"] = float(np.mean([res[k]["share"] for k in free_prompts(tok)]))
    return res


def run_seed003(out: Path, overrides=(), *, n_train: int = 4000, n_test: int = 200,
                op: str = "+", lo: int = 0, hi: int = 20, context: tuple[int, int] = (0, 0),
                n_free: int = 32, max_new: int = 16, seed: int = 0, plot: bool = True) -> dict:
    """Two SFT runs of config seed003_sft.toml, data.mask assistant_only vs all; exact accuracy on
    held-out pairs at every checkpoint; free-generation question share at the end."""
    from pytrain.run import loop as run
    name = "seed003_context" if context[1] else "seed003"
    max_new += 2 * context[1]          # room to write the random words before the question
    folder = out / name
    tr, te = seed003_data(folder, n_train, n_test, op, lo, hi, seed, context)
    res = {"task": f"What is a{op}b? ({OPS[op][1]}) for a, b in [{lo}, {hi}]"
                   + (f", after {context[0]}-{context[1]} random words" if context[1] else ""),
           "n_train": n_train,
           "n_test": n_test, "runs": {}}
    model = ad = None
    for mask in ("assistant_only", "all"):
        shutil.rmtree(folder / f"run-{mask}", ignore_errors=True)   # no stale checkpoints
        cfg = config("seed003", overrides, data__train=str(tr), data__validation=str(te),
                     data__mask=mask, output__dir=str(folder / f"run-{mask}"))
        cfg.model.path = model_path(cfg)
        t0 = time.perf_counter()
        r = run.train(cfg, progress=False, log=quiet)
        secs = time.perf_counter() - t0
        if model is None:
            model = load_model(cfg.model.path, "cpu", cfg.model.threads)
            test, _ = load_examples(te, model.tokenizer, format="chat", mask="assistant_only",
                                    max_seq_len=cfg.data.max_seq_len)
            res["n_test"] = len(test)
            base_acc, base_loss = exact_accuracy(model, test)
            res["base"] = {"accuracy": base_acc, "answer_loss": base_loss,
                           "questions": question_share(model, op, n_free, max_new, seed)}
            res["model"] = Path(cfg.model.path).name
            res["steps"] = cfg.train.max_steps
        curve = [(0, base_acc, base_loss)]
        for step, path in checkpoints(r.out_dir):
            ad = load_adapter_into(model, ad, path)
            curve.append((step, *exact_accuracy(model, test, ad.hook)))
        q = question_share(model, op, n_free, max_new, seed, ad.hook)
        res["runs"][mask] = {"curve": curve, "questions": q, "seconds": secs,
                             "train_loss": [m["loss"] for m in metrics(r.out_dir)
                                            if "loss" in m and m.get("split") != "valid"]}
    model.close()
    res["name"] = name
    res["markdown"] = seed003_markdown(res)
    save_results(folder, name, res, res["markdown"])
    if plot:
        seed003_plot(res, folder / f"{name}.png")
    return res


def seed003_markdown(res: dict) -> str:
    runs = res["runs"]
    steps = [c[0] for c in runs["assistant_only"]["curve"]]
    head = ["loss over", *[f"acc@{s}" for s in steps], "answer loss (end)",
            "question share: `<|im_start|>`", "question share: system turn",
            "opens a user turn (both prompts)"]

    def q(r):
        return [r["empty"]["share"], r["system"]["share"],
                (r["empty"]["user_turn"] + r["system"]["user_turn"]) / 2]
    rows = [["— (base model)", *[res["base"]["accuracy"]] + [""] * (len(steps) - 1),
             res["base"]["answer_loss"], *q(res["base"]["questions"])]]
    names = {"assistant_only": "assistant only (masked)", "all": "the full sequence"}
    for k, r in runs.items():
        rows.append([names[k], *[c[1] for c in r["curve"]], r["curve"][-1][2], *q(r["questions"])])
    ex = runs["all"]["questions"]["empty"]["examples"][:2]
    return (f"Task: {res['task']}; {res['n_train']} training chats, {res['n_test']} held-out "
            f"pairs; model `{res['model']}`, {res['steps']} steps per run, same seed.  "
            f"acc@N: exact-answer accuracy (greedy) after N steps.\n\n" + md_table(head, rows)
            + "\n\nFull-sequence model, free generations after `<|im_start|>`: "
            + "; ".join(f"`{t!r}`" for t in ex))


def seed003_plot(res: dict, png: Path) -> None:
    p = plt()
    fig, (ax, bx) = p.subplots(1, 2, figsize=(10, 4))
    names = {"assistant_only": "assistant only (masked)", "all": "full sequence"}
    for k, r in res["runs"].items():
        s, a, _ = zip(*r["curve"])
        ax.plot(s, a, "o-", label=names[k])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("exact-answer accuracy (held-out)")
    ax.set_title(res["task"])
    ax.legend()
    ax.grid(alpha=0.3)
    labels = ["base", *[names[k] for k in res["runs"]]]
    qs = [res["base"]["questions"], *[r["questions"] for r in res["runs"].values()]]
    x = np.arange(len(labels))
    bx.bar(x - 0.2, [q["empty"]["share"] for q in qs], 0.4, label="prompt <|im_start|>")
    bx.bar(x + 0.2, [q["system"]["share"] for q in qs], 0.4, label="prompt: system turn")
    bx.set_xticks(x, labels, fontsize=8)
    bx.set_ylim(0, 1)
    bx.set_ylabel("free generations writing a new question")
    bx.legend(fontsize=8)
    save_plot(p, fig, png)
