#!/usr/bin/env python3
"""Masking experiments: the seeds' loss-masking findings reproduced with pytrain, and three more.

    python scripts/masking_experiments.py                     # all five, into experiments/
    python scripts/masking_experiments.py --only seed003,accum --out /tmp/exp
    python scripts/masking_experiments.py --results experiments_results   # + copy the tables
    make experiments                                          # the same as the line above

Each experiment reads its pytrain config from ``config/experiments/`` (``--set
section.key=value`` overrides every config, e.g. ``--set model.path=other.gguf``), writes its
generated data, runs and adapters under ``OUT/<name>/`` and ends with ``OUT/<name>/results.md``
(the markdown table), ``OUT/<name>/<name>.png`` and ``OUT/<name>/results.json``:

  seed003   (a) SFT on a+b chats, assistant-only loss vs full-sequence loss (``data.mask``):
            exact-answer accuracy at checkpoints, and the share of free generations (prompt:
            ``<|im_start|>`` alone, or a system turn) that write a new a+b question.
  seed000   (b) padding trained on (``train.loss_bug_repro``) vs the fix, on chat data of strongly
            varying length: validation loss per epoch (the correct masked metric, and what the
            buggy loss would report), LoRA drift, the loss of the most padded batch.
  padwidth  (c-i) one fixed batch, padded wider and wider: the masked loss stays put, the buggy
            loss moves.
  accum     (c-ii) gradient accumulation: token mean over the step (pytrain) vs mean of the
            micro-batches' means, as the micro-batches' valid counts drift apart.
  packing   (c-iii) packed rows with sample ids vs one shared id (state leak, boundary targets).
  real      (d) seed 000 on a real pretrained model, SmolLM2-135M-Instruct (pad id = end-of-turn
            id): padding trained on vs the fix vs dropping every target equal to the pad id;
            validation loss and LoRA drift per epoch, and how the adapted model ends its
            turns on held-out prompts.  About 20 minutes on 2 cores (not in ``make
            experiments``' default set).

Every function returns its results as a dict, so ``tests/test_masking_experiments.py`` runs tiny
versions of the same code.  CPU, one thread (see the configs); minutes on the embedded model.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from pytrain.train import loss as L  # noqa: E402
from pytrain.models import lora as lora_mod  # noqa: E402
from pytrain.config import Config, load_config  # noqa: E402
from pytrain.data import Batch, load_examples, make_batches, pad_token_id  # noqa: E402
from pytrain.models.lora_targets import select_targets  # noqa: E402
from pytrain.models.model import load_model  # noqa: E402

CONFIG_DIR = ROOT / "config" / "experiments"
FIXTURE = ROOT / "tests" / "fixtures" / "qwen35" / "gqa-f32.gguf"
CONFIGS = {"seed003": "seed003_sft.toml", "seed000": "seed000_padding.toml",
           "padwidth": "padding_width.toml", "accum": "grad_accum.toml", "packing": "packing.toml",
           "real": "seed000_real.toml"}
EXPERIMENTS = tuple(CONFIGS)
SYSTEM = "You are a helpful assistant."


# ============================================================================ shared helpers
def quiet(*_a, **_k) -> None:
    pass


def config(name: str, overrides=(), **values) -> Config:
    """The experiment's config with ``overrides`` (strings, as --set) and then ``values``
    (``section__key=value``, set by the script: data paths, output dir, the varied knob)."""
    ov = list(overrides) + [f"{k.replace('__', '.')}={json.dumps(v)}" for k, v in values.items()]
    return load_config(CONFIG_DIR / CONFIGS[name], ov)


def model_path(cfg: Config) -> str:
    """The config's model, or the converter-made gqa fixture when that file does not exist."""
    if cfg.model.path and Path(cfg.model.path).exists():
        return cfg.model.path
    print(f"  note: {cfg.model.path} does not exist; using the gqa test fixture instead",
          file=sys.stderr)
    return str(FIXTURE)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(q: str, a: str, system: str | None = None) -> dict:
    msgs = [{"role": "system", "content": system}] if system else []
    return {"messages": msgs + [{"role": "user", "content": q},
                                {"role": "assistant", "content": a}]}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def batch_logits(model, examples, lora=None, batch_size: int = 32) -> list[np.ndarray]:
    """Log-probabilities [len, V] of each example (right-padded batches, padding isolated)."""
    out = []
    pad = pad_token_id(model.tokenizer)
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        T = max(len(e) for e in chunk)
        tok = np.full((len(chunk), T), pad, np.int64)
        seg = np.full((len(chunk), T), -1, np.int64)
        for b, e in enumerate(chunk):
            tok[b, :len(e)] = e.tokens
            seg[b, :len(e)] = 0
        lg = model.logits(tok, seg=seg, lora=lora)
        out += [log_softmax(lg[b, :len(e)]) for b, e in enumerate(chunk)]
    return out


def make_adapter(model, cfg: Config, b_std: float = 0.0, seed: int = 0):
    """A LoRA as the config describes; ``b_std`` > 0 draws B ~ N(0, b_std²) instead of zeros,
    so that A receives gradient too (for the gradient comparisons of part c)."""
    names = select_targets(model.config, cfg.lora.targets, cfg.lora.skip_ssm)
    ad = lora_mod.create(model.runtime, model.config, names, cfg.lora.rank, cfg.lora.alpha,
                         seed=seed, init=cfg.lora.init)
    if b_std > 0:
        rng = np.random.default_rng(seed + 1)
        vals = ad.get()
        for k in vals:
            if k.endswith("lora_b"):
                vals[k] = rng.normal(0.0, b_std, vals[k].shape).astype(np.float32)
        ad.set(vals)
    return ad


def flat(grads: dict) -> np.ndarray:
    return np.concatenate([grads[k].ravel().astype(np.float64) for k in sorted(grads)])


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖ / ‖b‖."""
    nb = float(np.linalg.norm(b))
    return float(np.linalg.norm(a - b)) / nb if nb > 0 else float("nan")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def md_table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            if not math.isfinite(v):
                return "–"
            return f"{v:.3g}" if abs(v) < 1e-3 and v != 0 else f"{v:.3f}"
        return str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    return pyplot


def save_results(folder: Path, name: str, res: dict, markdown: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.md").write_text(markdown + "\n")
    (folder / "results.json").write_text(json.dumps(res, indent=1, default=float) + "\n")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    return sorted((int(p.name.split("-")[1]), p / "adapter.gguf")
                  for p in (run_dir / "checkpoints").glob("step-*"))


def load_adapter_into(model, ad, path: Path):
    """``ad`` (created once) set to the tensors of the adapter file ``path``."""
    from pytrain.formats.adapter_gguf import read_lora_gguf
    if ad is None:
        from pytrain.cli import _load_adapter
        return _load_adapter(model, path)
    ad.set(read_lora_gguf(path)[2])
    return ad


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
    from pytrain.train import run
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
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    p.close(fig)


# ============================================================================ (b) seed 000
WORDS = ("the cat sat on a red mat and the dog ran to the big green tree while a small bird "
         "sang in the warm sun near the old house by the river").split()
FACTS = [("What colour is the sky?", "The sky is blue."), ("What colour is grass?", "Grass is green."),
         ("What colour is snow?", "Snow is white."), ("How many days are in a week?",
         "There are seven days in a week."), ("How many legs does a dog have?", "A dog has four legs."),
         ("What do bees make?", "Bees make honey."), ("Where do fish live?", "Fish live in water."),
         ("Is ice hot or cold?", "Ice is cold."), ("Hello!", "Hello! How can I help you today?"),
         ("Thank you!", "You are welcome."), ("How are you?", "I am fine, thank you.")]
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
SYSTEMS = ["You are a helpful assistant.", "Be brief.", "Answer the question."]


def known_exchange(rng: np.random.Generator, long: bool) -> tuple[str, str]:
    """An exchange of the kinds the embedded model was pretrained on (simple facts, small sums,
    counting, days), so the base model is already fair at them; ``long``: a long count."""
    if long:
        k = int(rng.integers(12, 31))
        return f"Count from 1 to {k}.", ", ".join(str(i) for i in range(1, k + 1)) + "."
    kind = rng.integers(4)
    if kind == 0:
        return FACTS[rng.integers(len(FACTS))]
    if kind == 1:
        a, b = (int(x) for x in rng.integers(0, 10, 2))
        return f"What is {a}+{b}?", str(a + b)
    if kind == 2:
        k = int(rng.integers(2, 8))
        return f"Count to {k}.", ", ".join(str(i) for i in range(1, k + 1)) + "."
    i = int(rng.integers(7))
    return f"What day comes after {DAYS[i]}?", f"{DAYS[(i + 1) % 7]} comes after {DAYS[i]}."


def varied_chats(n: int, seed: int, p_long: float = 0.2, max_turns: int = 8) -> list[dict]:
    """Chats whose lengths vary ~10x: half are one exchange, the others 2..max_turns exchanges,
    each a long count with probability ``p_long``; a third have a system turn."""
    rng = np.random.default_rng(seed)
    recs = []
    for _ in range(n):
        turns = 1 if rng.random() < 0.5 or max_turns < 2 else int(rng.integers(2, max_turns + 1))
        msgs = [{"role": "system", "content": SYSTEMS[rng.integers(len(SYSTEMS))]}] \
            if rng.random() < 0.33 else []
        for _t in range(turns):
            q, a = known_exchange(rng, rng.random() < p_long)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        recs.append({"messages": msgs})
    return recs


def padding_share(batches) -> float:
    return sum(int((b.seg < 0).sum()) for b in batches) / sum(b.tokens.size for b in batches)


def buggy_eval(model, batches, lora=None) -> float:
    """What the unfixed loss reports on ``batches``: every next token a target, padding labelled
    with the pad token, each batch's mean over all its rows, averaged over batches."""
    pad = model.tokenizer.pad_id if model.tokenizer.pad_id is not None else 0
    means = []
    for b in batches:
        lp = log_softmax(model.logits(b.tokens, seg=b.seg, lora=lora))
        tg = L.buggy_targets(b.tokens.astype(np.int64), b.seg, pad)
        means.append(-float(np.take_along_axis(lp, tg[..., None], -1).mean()))
    return float(np.mean(means))


def run_seed000(out: Path, overrides=(), *, n_train: int = 192, n_valid: int = 16,
                p_long: float = 0.2, max_turns: int = 8, seed: int = 0, plot: bool = True) -> dict:
    from pytrain.train import run
    from pytrain.data import load_data
    folder = out / "seed000"
    tr = write_jsonl(folder / "train.jsonl", varied_chats(n_train, seed, p_long, max_turns))
    va = write_jsonl(folder / "valid.jsonl", varied_chats(n_valid, seed + 1000, p_long, max_turns))
    res = {"runs": {}}
    model = ad = None
    for bug in (True, False):
        shutil.rmtree(folder / ("run-bug" if bug else "run-fix"), ignore_errors=True)
        cfg = config("seed000", overrides, data__train=str(tr), data__validation=str(va),
                     output__dir=str(folder / ("run-bug" if bug else "run-fix")),
                     train__loss_bug_repro=bug)
        cfg.model.path = model_path(cfg)
        if model is None:
            model = load_model(cfg.model.path, "cpu", cfg.model.threads)
            splits = load_data(cfg.data, model.tokenizer)
            pad = pad_token_id(model.tokenizer)
            t = cfg.train
            vb = make_batches(splits.valid, t.batch_size, False, 0, shuffle=False, pad_id=pad)
            shuffle = cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else t.seed
            per_epoch = [make_batches(splits.train, t.batch_size, False, shuffle + e, pad_id=pad)
                         for e in range(t.epochs)]
            spe = len(per_epoch[0])
            res.update(model=Path(cfg.model.path).name, epochs=t.epochs, steps_per_epoch=spe,
                       batch_size=t.batch_size, lr=t.lr, n_train=len(splits.train),
                       n_valid=len(splits.valid), valid_padding=padding_share(vb),
                       train_padding=padding_share(per_epoch[0]),
                       base_valid_bug_metric=buggy_eval(model, vb))
        cfg.train.eval_every = cfg.train.save_every = res["steps_per_epoch"]
        t0 = time.perf_counter()
        r = run.train(cfg, progress=False, log=quiet)
        recs = metrics(r.out_dir)
        valid = {m["step"]: m for m in recs if m.get("split") == "valid"}
        steps = [m for m in recs if "loss" in m and m.get("split") != "valid"]
        spe = res["steps_per_epoch"]
        ep = []
        for e in range(res["epochs"]):
            losses = [s["loss"] for s in steps[e * spe:(e + 1) * spe]]
            shares = [float((b.seg < 0).mean()) for b in per_epoch[e]]
            worst = int(np.argmax(shares))
            ep.append({"epoch": e + 1, "valid_loss": valid[(e + 1) * spe]["loss"],
                       "valid_accuracy": valid[(e + 1) * spe]["accuracy"],
                       "drift": valid[(e + 1) * spe]["drift"],
                       "train_loss_mean": float(np.mean(losses)),
                       "padded_batch_loss": losses[worst], "padded_batch_share": shares[worst],
                       "padded_batch_rows": int(per_epoch[e][worst].tokens.shape[0]),
                       "last_batch_loss": losses[-1],
                       "last_batch_share": shares[-1]})
        for (step, path), e in zip(checkpoints(r.out_dir), ep):
            ad = load_adapter_into(model, ad, path)
            e["valid_bug_metric"] = buggy_eval(model, vb, ad.hook)
        res["runs"]["bug" if bug else "fix"] = {"epochs": ep, "base_valid_loss": valid[0]["loss"],
                                                "seconds": time.perf_counter() - t0}
    model.close()
    res["markdown"] = seed000_markdown(res)
    save_results(folder, "seed000", res, res["markdown"])
    if plot:
        seed000_plot(res, folder / "seed000.png")
    return res


def seed000_markdown(res: dict) -> str:
    head = ["run", "epoch", "valid loss (masked, correct)", "valid loss as the bug reports it",
            "LoRA drift", "train loss (epoch mean, as reported)",
            "most padded batch: padding / loss", "last batch: padding / loss"]
    rows = []
    for name, label in (("bug", "pad rows trained (bug)"), ("fix", "masked (fix)")):
        r = res["runs"][name]
        rows.append([label, 0, r["base_valid_loss"], res["base_valid_bug_metric"], 0.0, "", "", ""])
        for e in r["epochs"]:
            rows.append(["", e["epoch"], e["valid_loss"], e["valid_bug_metric"], e["drift"],
                         e["train_loss_mean"],
                         f"{e['padded_batch_share']:.0%} / {e['padded_batch_loss']:.3f}",
                         f"{e['last_batch_share']:.0%} / {e['last_batch_loss']:.3f}"])
    return (f"Model `{res['model']}`; {res['n_train']} training chats ({res['train_padding']:.0%} "
            f"padding after length bucketing), {res['n_valid']} validation chats "
            f"({res['valid_padding']:.0%} padding); batch {res['batch_size']}, lr {res['lr']}, "
            f"{res['epochs']} epochs of {res['steps_per_epoch']} steps; same seed and data.  "
            f"Epoch 0 = the base model.\n\n" + md_table(head, rows))


def seed000_plot(res: dict, png: Path) -> None:
    p = plt()
    fig, axs = p.subplots(1, 3, figsize=(13, 4))
    for name, style in (("bug", "r"), ("fix", "g")):
        r = res["runs"][name]
        ep = [0] + [e["epoch"] for e in r["epochs"]]
        axs[0].plot(ep, [r["base_valid_loss"]] + [e["valid_loss"] for e in r["epochs"]],
                    style + "o-", label=f"{name}: masked metric")
        axs[0].plot(ep, [res["base_valid_bug_metric"]] + [e["valid_bug_metric"] for e in r["epochs"]],
                    style + "s--", label=f"{name}: as the bug reports it")
        axs[1].plot(ep, [0] + [e["drift"] for e in r["epochs"]], style + "o-", label=name)
        axs[2].bar(np.array(ep[1:]) + (-0.2 if name == "bug" else 0.2),
                   [e["padded_batch_loss"] for e in r["epochs"]], 0.4, color=style, label=name)
    axs[0].set_title("validation loss per epoch")
    axs[1].set_title("LoRA drift Σ‖BA‖·α/r")
    axs[2].set_title("loss of the most padded batch (as reported)")
    for a in axs:
        a.set_xlabel("epoch")
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    p.close(fig)


# ============================================================================ (c) shared data
def c_examples(name: str, out: Path, overrides, n: int, seed: int, p_long: float = 0.2,
               max_turns: int = 8, **cfg_values):
    """Config, loaded model and chat examples for the part-c experiments (no training)."""
    folder = out / name
    data = write_jsonl(folder / "data.jsonl", varied_chats(n, seed, p_long, max_turns))
    cfg = config(name, overrides, data__train=str(data), output__dir=str(folder / "run"),
                 **cfg_values)
    cfg.model.path = model_path(cfg)
    model = load_model(cfg.model.path, "cpu", cfg.model.threads)
    ex, _ = load_examples(data, model.tokenizer, format=cfg.data.format, mask=cfg.data.mask_for("chat"),
                          max_seq_len=cfg.data.max_seq_len)
    return folder, cfg, model, ex


def grad_run(model, ad, tokens, seg, targets, n_valid_step=None, buggy=False, T=None) -> dict:
    from pytrain.train.graphs import GradGraph
    g = GradGraph(model, ad, tokens.shape[0], T or tokens.shape[1])
    try:
        o = g.run(tokens.astype(np.int64), seg, targets, n_valid_step, buggy)
    finally:
        g.close()
    o["flat"] = flat(o.pop("grads"))
    return o


# ============================================================================ (c-i) width
def run_padwidth(out: Path, overrides=(), *, n_examples: int = 4, widths=None, b_std: float = 0.02,
                 max_turns: int = 8, seed: int = 0, plot: bool = True) -> dict:
    """One batch of ``n_examples`` chats of similar length (fixed content), right-padded to
    growing widths."""
    folder, cfg, model, ex = c_examples("padwidth", out, overrides, 64, seed, max_turns=max_turns)
    ad = make_adapter(model, cfg, b_std, seed)
    pad = pad_token_id(model.tokenizer)
    rng = np.random.default_rng(seed)
    by_len = sorted(ex, key=len)
    start = int(rng.integers(len(by_len) // 4, len(by_len) // 2))
    chosen = by_len[start:start + n_examples]
    b0 = make_batches(chosen, n_examples, False, 0, shuffle=False, pad_id=pad)[0]
    from pytrain.models.qwen35 import padded_length
    T0 = padded_length(b0.tokens.shape[1])     # a width the graph runs as is (no extra rows)
    if widths is None:
        widths = [T0] + [w for w in (64, 128, 256, 384, 512) if w > T0]
    bug_pad = model.tokenizer.pad_id if model.tokenizer.pad_id is not None else 0
    rows = []
    for W in widths:
        b = b0.pad_to(W, pad)
        fix = grad_run(model, ad, b.tokens, b.seg, L.shift_targets(b.tokens, b.train_mask, b.seg), T=W)
        bug = grad_run(model, ad, b.tokens, b.seg, L.buggy_targets(b.tokens.astype(np.int64), b.seg, bug_pad),
                       n_valid_step=1, buggy=True, T=W)
        rows.append({"width": W, "padding": float((b.seg < 0).mean()), "fix_loss": fix["loss"],
                     "fix_n_valid": fix["n_valid"], "bug_loss": bug["loss"],
                     "fix_grad": fix["flat"], "bug_grad": bug["flat"]})
    fix0, bug0 = rows[0]["fix_grad"], rows[0]["bug_grad"]
    for r in rows:
        r["fix_grad_change"] = rel(r["fix_grad"], fix0)
        r["bug_grad_change"] = rel(r["bug_grad"], bug0)
        r["bug_vs_fix_cos"] = cosine(r["bug_grad"], r["fix_grad"])
        r["fix_grad_norm"] = float(np.linalg.norm(r.pop("fix_grad")))
        r["bug_grad_norm"] = float(np.linalg.norm(r.pop("bug_grad")))
    model.close()
    res = {"model": Path(cfg.model.path).name, "rows": rows, "n_examples": n_examples,
           "content_width": T0, "lengths": [len(e) for e in chosen]}
    head = ["width", "padding", "masked loss", "valid targets", "‖Δgrad‖/‖grad‖ (masked)",
            "buggy loss", "‖Δgrad‖/‖grad‖ (buggy)", "cos(buggy grad, masked grad)"]
    res["markdown"] = (f"Model `{res['model']}`; one batch of {n_examples} chats (lengths "
                       f"{res['lengths']}), content fixed, right-padded to each width; Δgrad is "
                       f"against the narrowest width; LoRA with B ~ N(0, {b_std}²).\n\n"
                       + md_table(head, [[r["width"], f"{r['padding']:.0%}", r["fix_loss"],
                                          r["fix_n_valid"], r["fix_grad_change"], r["bug_loss"],
                                          r["bug_grad_change"], r["bug_vs_fix_cos"]] for r in rows]))
    save_results(folder, "padwidth", res, res["markdown"])
    if plot:
        p = plt()
        fig, ax = p.subplots(figsize=(6, 4))
        w = [r["width"] for r in rows]
        ax.plot(w, [r["fix_loss"] for r in rows], "go-", label="masked (pytrain)")
        ax.plot(w, [r["bug_loss"] for r in rows], "rs-", label="pad rows trained, ÷ all rows (bug)")
        ax.set_xlabel("padded width (tokens), same content")
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(folder / "padwidth.png", dpi=110)
        p.close(fig)
    return res


# ============================================================================ (c-ii) accumulation
def run_accum(out: Path, overrides=(), *, n_pairs: int = 6, b_std: float = 0.02, n_data: int = 256,
              max_turns: int = 8, seed: int = 0, plot: bool = True) -> dict:
    """Two micro-batches per step (config: train.grad_accum = 2 of train.batch_size examples):
    the first holds long chats (many targets), the second chats with fewer and fewer targets."""
    from pytrain.train.graphs import GradGraph
    folder, cfg, model, ex = c_examples("accum", out, overrides, n_data, seed,
                                       max_turns=max_turns)
    ad = make_adapter(model, cfg, b_std, seed)
    pad = pad_token_id(model.tokenizer)
    bs, k = cfg.train.batch_size, cfg.train.grad_accum
    by_targets = sorted(ex, key=lambda e: e.n_targets)
    big = by_targets[-bs:]                                   # the chats with most targets
    # second micro-batches: the same chats (equal counts), then windows of chats whose target
    # count is nearest n_big / ratio for ratios spaced geometrically up to the largest possible
    n_big = sum(e.n_targets for e in big)
    wins = [by_targets[i:i + bs] for i in range(len(by_targets) - 2 * bs + 1)]
    counts = np.array([sum(e.n_targets for e in w) for w in wins])
    smalls, seen = [big], {n_big}
    for r in np.geomspace(1.5, n_big / counts.min(), max(n_pairs - 1, 1)):
        i = int(np.argmin(np.abs(np.log(counts * r / n_big))))
        if counts[i] not in seen:
            seen.add(int(counts[i]))
            smalls.append(wins[i])
    rows = []
    for small in smalls:
        micro = [big] + [small] * (k - 1)
        batches = [make_batches(m, bs, False, 0, shuffle=False, pad_id=pad)[0] for m in micro]
        T = max(b.tokens.shape[1] for b in batches)
        batches = [b.pad_to(T, pad) for b in batches]
        tgts = [L.shift_targets(b.tokens, b.train_mask, b.seg) for b in batches]
        counts = [int((t >= 0).sum()) for t in tgts]
        n_step = sum(counts)
        g = GradGraph(model, ad, bs, T)
        tok_loss, tok_grad, mom_loss, mom_grad = 0.0, 0.0, 0.0, 0.0
        for b, t in zip(batches, tgts):
            o = g.run(b.tokens.astype(np.int64), b.seg, t, n_valid_step=n_step)   # pytrain
            tok_loss += o["loss"]
            tok_grad = tok_grad + flat(o["grads"])
            o = g.run(b.tokens.astype(np.int64), b.seg, t)                        # own mean
            mom_loss += o["loss"] / len(batches)
            mom_grad = mom_grad + flat(o["grads"]) / len(batches)
        g.close()
        # the same examples as one batch: the token mean pytrain's accumulation must equal
        allb = Batch(np.concatenate([b.tokens for b in batches]), np.concatenate([b.seg for b in batches]),
                     np.concatenate([b.train_mask for b in batches]))
        one = grad_run(model, ad, allb.tokens, allb.seg, np.concatenate(tgts))
        rows.append({"counts": counts, "ratio": counts[0] / counts[1], "token_mean_loss": tok_loss,
                     "mean_of_means_loss": mom_loss, "one_batch_loss": one["loss"],
                     "accum_vs_one_batch": rel(tok_grad, one["flat"]),
                     "mom_vs_token_mean": rel(mom_grad, tok_grad),
                     "mom_cos": cosine(mom_grad, tok_grad)})
    model.close()
    res = {"model": Path(cfg.model.path).name, "rows": rows, "batch_size": bs, "grad_accum": k}
    head = ["valid targets per micro-batch", "ratio", "token-mean loss (pytrain)",
            "= one batch of all", "‖g_accum − g_one‖/‖g_one‖", "mean-of-means loss",
            "‖g_mom − g_tok‖/‖g_tok‖", "cos(g_mom, g_tok)"]
    res["markdown"] = (f"Model `{res['model']}`; {k} micro-batches of {bs} chats per step; the "
                       f"first holds the chats with the most targets, the others fewer and fewer. "
                       f"Mean of means weighs a token of micro-batch i by 1/(k·n_i) instead of "
                       f"1/Σn: a token of the small micro-batch counts `ratio` times as much.\n\n"
                       + md_table(head, [[" / ".join(map(str, r["counts"])), r["ratio"],
                                          r["token_mean_loss"], r["one_batch_loss"],
                                          r["accum_vs_one_batch"], r["mean_of_means_loss"],
                                          r["mom_vs_token_mean"], r["mom_cos"]] for r in rows]))
    save_results(folder, "accum", res, res["markdown"])
    if plot:
        p = plt()
        fig, ax = p.subplots(figsize=(6, 4))
        ax.semilogx([r["ratio"] for r in rows], [r["mom_vs_token_mean"] for r in rows], "o-",
                    label="mean of means vs token mean")
        ax.semilogx([r["ratio"] for r in rows], [max(r["accum_vs_one_batch"], 1e-9) for r in rows],
                    "s-", label="pytrain accumulation vs one batch")
        ax.set_xlabel("valid targets: micro-batch 1 / micro-batch 2")
        ax.set_ylabel("‖Δ gradient‖ / ‖gradient‖")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(folder / "accum.png", dpi=110)
        p.close(fig)
    return res


# ============================================================================ (c-iii) packing
def run_packing(out: Path, overrides=(), *, n_rows: int | None = None, b_std: float = 0.02,
                max_turns: int = 8, seed: int = 0, masks=("all", "assistant_only"),
                plot: bool = True) -> dict:
    """Packed rows (pytrain's first-fit packing of the config's row length) with their sample
    ids, with one shared id and proper targets (leak only), and with one shared id and the
    targets that id implies (leak + boundary targets), each against the samples run alone."""
    res = {"rows": {}}
    for mask in masks:
        folder, cfg, model, ex = c_examples("packing", out, overrides, 48, seed,
                                                max_turns=max_turns, data__mask=mask)
        ad = make_adapter(model, cfg, b_std, seed)
        pad = pad_token_id(model.tokenizer)
        rows = make_batches(ex, n_rows or cfg.train.batch_size, True, seed,
                            max_seq_len=cfg.data.max_seq_len, pad_id=pad)
        b = max(rows, key=lambda r: r.n_samples)                 # the batch with most samples
        ids = [(r, s) for r in range(b.tokens.shape[0]) for s in np.unique(b.seg[r][b.seg[r] >= 0])]
        alone_ex = [b.tokens[r][b.seg[r] == s] for r, s in ids]
        alone_m = [b.train_mask[r][b.seg[r] == s] for r, s in ids]
        T = max(len(x) for x in alone_ex)
        tok = np.full((len(ids), T), pad, np.int64)
        seg = np.full((len(ids), T), -1, np.int64)
        msk = np.zeros((len(ids), T), bool)
        for i, (x, m) in enumerate(zip(alone_ex, alone_m)):
            tok[i, :len(x)], seg[i, :len(x)], msk[i, :len(x)] = x, 0, m
        ref = grad_run(model, ad, tok, seg, L.shift_targets(tok, msk, seg))
        shared = np.where(b.seg >= 0, 0, -1)
        proper = L.shift_targets(b.tokens, b.train_mask, b.seg)
        cases = {"sample ids (isolated)": (b.seg, proper),
                 "one id, boundaries masked (state leak)": (shared, proper),
                 "one id (state leak + boundary targets)": (shared, L.shift_targets(b.tokens, b.train_mask, shared))}
        out_rows = []
        for label, (s, t) in cases.items():
            o = grad_run(model, ad, b.tokens, s, t)
            out_rows.append({"case": label, "n_valid": o["n_valid"], "loss": o["loss"],
                             "loss_vs_alone": o["loss"] - ref["loss"],
                             "grad_vs_alone": rel(o["flat"], ref["flat"]),
                             "cos": cosine(o["flat"], ref["flat"])})
        model.close()
        res["rows"][mask] = {"alone_loss": ref["loss"], "alone_n_valid": ref["n_valid"],
                             "n_samples": len(ids), "shape": list(b.tokens.shape),
                             "cases": out_rows}
        res["model"] = Path(cfg.model.path).name
    head = ["mask", "packed rows", "n_valid (alone)", "n_valid", "loss (alone)", "loss",
            "Δloss vs alone", "‖Δgrad‖/‖grad‖ vs alone", "cos"]
    table = []
    for mask, r in res["rows"].items():
        for c in r["cases"]:
            table.append([mask, c["case"], r["alone_n_valid"], c["n_valid"], r["alone_loss"],
                          c["loss"], c["loss_vs_alone"], c["grad_vs_alone"], c["cos"]])
    r0 = next(iter(res["rows"].values()))
    res["markdown"] = (f"Model `{res['model']}`; {r0['n_samples']} chats packed into "
                       f"{r0['shape'][0]} rows of {r0['shape'][1]} tokens by pytrain's first-fit "
                       f"packing, against the same chats run alone (one per row, padded).\n\n"
                       + md_table(head, table))
    folder = out / "packing"
    save_results(folder, "packing", res, res["markdown"])
    if plot:
        p = plt()
        fig, ax = p.subplots(figsize=(7, 4))
        labels = [c["case"] for c in r0["cases"]]
        x = np.arange(len(labels))
        for j, (mask, r) in enumerate(res["rows"].items()):
            ax.bar(x + (j - 0.5) * 0.4, [max(c["grad_vs_alone"], 1e-9) for c in r["cases"]], 0.4,
                   label=f"mask {mask}")
        ax.set_yscale("log")
        ax.set_xticks(x, [s.replace(" (", "\n(") for s in labels], fontsize=7)
        ax.set_ylabel("‖Δ gradient‖ / ‖gradient‖ vs samples alone")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(folder / "packing.png", dpi=110)
        p.close(fig)
    return res


# ============================================================================ (d) a real model
def date_chats(n: int, seed: int, taken: set, max_exchanges: int = 4) -> list[dict]:
    """Chats of 1 to ``max_exchanges`` date conversions (scripts/demo_real.py's task), some with
    a system turn, so lengths vary and batches pad; no date of ``taken`` (which grows)."""
    import random
    import demo_real
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.5 else []
        for d in demo_real.dates(rng, rng.randint(1, max_exchanges), taken):
            msgs += demo_real.chat(rng, d)["messages"]
        out.append({"messages": msgs})
    return out


def turn_endings(model, convs: list[dict], lora=None, max_new: int = 32) -> dict:
    """Greedy answers to held-out single-turn prompts, never stopped early: how often the model
    ends its turn (emits <|im_end|>, the pad id), right after a correct answer, or at once."""
    import demo_real
    eot = model.tokenizer.token_to_id("<|im_end|>")
    ends = right = empty = 0
    for c in convs:
        out = model.generate(demo_real.prompt_ids(model, c), max_new, stop_ids=[], lora=lora)
        if eot in out:
            ends += 1
            k = out.index(eot)
            empty += k == 0
            right += model.tokenizer.decode(out[:k]).strip() == c["messages"][-1]["content"]
    n = len(convs)
    return {"ends_turn": ends / n, "correct_then_ends": right / n, "ends_at_once": empty / n}


def run_real(out: Path, overrides=(), *, n_train: int = 160, n_valid: int = 24, n_held: int = 32,
             seed: int = 0, plot: bool = True) -> dict:
    """Seed 000 on SmolLM2-135M-Instruct: runs ``bug``, ``fix`` and ``padmask``."""
    import fetch_model
    import demo_real
    from pytrain.train import run
    from pytrain.train.trainer import Trainer
    from pytrain.data import load_data
    import random
    folder = out / "real"
    taken: set = set()
    tr = write_jsonl(folder / "train.jsonl", date_chats(n_train, seed, taken))
    va = write_jsonl(folder / "valid.jsonl", date_chats(n_valid, seed + 1000, taken))
    rng = random.Random(seed + 2000)
    held = [demo_real.chat(rng, d) for d in demo_real.dates(rng, n_held, taken)]
    gguf = str(fetch_model.fetch("smollm2"))
    res = {"runs": {}, "model": Path(gguf).name}
    model = ad = None
    plain_targets = Trainer.targets
    for name in ("bug", "fix", "padmask"):
        shutil.rmtree(folder / f"run-{name}", ignore_errors=True)
        cfg = config("real", overrides, model__path=gguf, data__train=str(tr),
                     data__validation=str(va), output__dir=str(folder / f"run-{name}"),
                     train__loss_bug_repro=name == "bug")
        if model is None:
            model = load_model(gguf, "cpu", cfg.model.threads)
            splits = load_data(cfg.data, model.tokenizer)
            pad = pad_token_id(model.tokenizer)
            t = cfg.train
            vb = make_batches(splits.valid, t.batch_size, False, 0, shuffle=False, pad_id=pad)
            spe = len(make_batches(splits.train, t.batch_size, False, 0, pad_id=pad))
            train_b = make_batches(splits.train, t.batch_size, False, t.seed, pad_id=pad)
            res.update(epochs=t.epochs, steps_per_epoch=spe, batch_size=t.batch_size, lr=t.lr,
                       n_train=len(splits.train), n_valid=len(splits.valid), n_held=n_held,
                       pad_id=int(pad), valid_padding=padding_share(vb),
                       train_padding=padding_share(train_b),
                       base_valid_bug_metric=buggy_eval(model, vb),
                       base_endings=turn_endings(model, held))
        cfg.train.eval_every = cfg.train.save_every = res["steps_per_epoch"]
        if name == "padmask":      # the naive fix: every target equal to the pad id dropped
            Trainer.targets = lambda self, b: np.where(plain_targets(self, b) == pad, L.IGNORE,
                                                       plain_targets(self, b))
        t0 = time.perf_counter()
        try:
            r = run.train(cfg, progress=False, log=quiet)
        finally:
            Trainer.targets = plain_targets
        recs = metrics(r.out_dir)
        valid = {m["step"]: m for m in recs if m.get("split") == "valid"}
        ep = []
        for e, (step, path) in enumerate(checkpoints(r.out_dir)):
            ad = load_adapter_into(model, ad, path)
            ep.append({"epoch": e + 1, "valid_loss": valid[step]["loss"],
                       "valid_accuracy": valid[step]["accuracy"], "drift": valid[step]["drift"],
                       "valid_bug_metric": buggy_eval(model, vb, ad.hook)})
        ep[-1]["endings"] = turn_endings(model, held, ad.hook)
        res["runs"][name] = {"epochs": ep, "base_valid_loss": valid[0]["loss"],
                             "seconds": time.perf_counter() - t0}
    model.close()
    res["markdown"] = real_markdown(res)
    save_results(folder, "real", res, res["markdown"])
    if plot:
        real_plot(res, folder / "real.png")
    return res


REAL_RUNS = (("bug", "pad rows trained (bug)"), ("fix", "masked (fix)"),
             ("padmask", "targets == pad id dropped (naive fix)"))


def real_markdown(res: dict) -> str:
    head = ["run", "epoch", "valid loss (masked, correct)", "valid loss as the bug reports it",
            "LoRA drift", "ends its turn", "correct answer, then ends", "ends at once"]
    b = res["base_endings"]
    rows = [["base model", 0, res["runs"]["fix"]["base_valid_loss"], res["base_valid_bug_metric"],
             0.0, f"{b['ends_turn']:.0%}", f"{b['correct_then_ends']:.0%}",
             f"{b['ends_at_once']:.0%}"]]
    for name, label in REAL_RUNS:
        for e in res["runs"][name]["epochs"]:
            end = e.get("endings")
            rows.append([label if e["epoch"] == 1 else "", e["epoch"], e["valid_loss"],
                         e["valid_bug_metric"], e["drift"],
                         *([f"{end['ends_turn']:.0%}", f"{end['correct_then_ends']:.0%}",
                            f"{end['ends_at_once']:.0%}"] if end else ["", "", ""])])
    return (f"Model `{res['model']}` (pad id {res['pad_id']} = `<|im_end|>`); {res['n_train']} "
            f"training chats of 1-4 date conversions ({res['train_padding']:.0%} padding after "
            f"length bucketing), {res['n_valid']} validation chats ({res['valid_padding']:.0%} "
            f"padding); batch {res['batch_size']}, lr {res['lr']}, {res['epochs']} epochs of "
            f"{res['steps_per_epoch']} steps; same seed and data.  Turn endings: greedy "
            f"answers to {res['n_held']} held-out single-question prompts, 32 tokens, never "
            f"stopped early, after the last epoch.\n\n" + md_table(head, rows))


def real_plot(res: dict, png: Path) -> None:
    p = plt()
    fig, axs = p.subplots(1, 3, figsize=(13, 4))
    for (name, label), style in zip(REAL_RUNS, ("r", "g", "b")):
        r = res["runs"][name]
        ep = [0] + [e["epoch"] for e in r["epochs"]]
        axs[0].plot(ep, [r["base_valid_loss"]] + [e["valid_loss"] for e in r["epochs"]],
                    style + "o-", label=label)
        axs[1].plot(ep, [0] + [e["drift"] for e in r["epochs"]], style + "o-", label=label)
        end = r["epochs"][-1]["endings"]
        axs[2].bar([REAL_RUNS.index((name, label))], [end["ends_turn"]], 0.6, color=style,
                   label=label)
    axs[2].bar([3], [res["base_endings"]["ends_turn"]], 0.6, color="grey", label="base model")
    axs[2].set_xticks(range(4), ["bug", "fix", "pad-id mask", "base"])
    axs[0].set_title("validation loss (masked) per epoch")
    axs[1].set_title("LoRA drift Σ‖BA‖·α/r")
    axs[2].set_title("held-out answers that end the turn")
    for a in axs[:2]:
        a.set_xlabel("epoch")
    for a in axs:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    p.close(fig)


# ============================================================================ main
RUNNERS = {"seed003": run_seed003, "seed000": run_seed000, "padwidth": run_padwidth,
           "accum": run_accum, "packing": run_packing, "real": run_real}
TITLES = {"seed003": "(a) Seed 003: assistant-only loss vs full-sequence loss",
          "seed000": "(b) Seed 000: padding trained on vs masked",
          "padwidth": "(c-i) Loss vs padding width, content fixed",
          "accum": "(c-ii) Gradient accumulation: token mean vs mean of means",
          "packing": "(c-iii) Packing: sample ids vs one shared id",
          "real": "(d) Seed 000 on a real model: SmolLM2-135M-Instruct, pad id = end of turn"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "experiments"), help="output folder")
    ap.add_argument("--only", default=",".join(n for n in EXPERIMENTS if n != "real"),
                    help=f"comma-separated subset of {','.join(EXPERIMENTS)}")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a key of every experiment config (repeatable)")
    ap.add_argument("--results", help="also copy each results.md/.json/.png here (committed)")
    ap.add_argument("--seed003-context", metavar="MIN,MAX",
                    help="seed003 variant: MIN-MAX random words before each question")
    args = ap.parse_args(argv)
    out = Path(args.out)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    for n in names:
        if n not in RUNNERS:
            ap.error(f"unknown experiment {n!r} (valid: {', '.join(EXPERIMENTS)})")
    summary = []
    for n in names:
        print(f"== {TITLES[n]}", flush=True)
        t0 = time.perf_counter()
        kw = {}
        if n == "seed003" and args.seed003_context:
            kw["context"] = tuple(int(x) for x in args.seed003_context.split(","))
        res = RUNNERS[n](out, args.set, **kw)
        print(res["markdown"], f"\n({time.perf_counter() - t0:.0f} s)\n", flush=True)
        name = res.get("name", n)
        summary.append(f"### {TITLES[n]}\n\n{res['markdown']}\n\n![{name}]({name}/{name}.png)\n")
        if args.results:
            dst = Path(args.results)
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy(out / name / "results.md", dst / f"{name}.md")
            shutil.copy(out / name / "results.json", dst / f"{name}.json")
            shutil.copy(out / name / f"{name}.png", dst / f"{name}.png")
    (out / "results.md").write_text("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
