"""Experiments (b) and (d), seed 000 reproduced: padding trained on vs masked, on chat data of
strongly varying length, first on the embedded model, then on a real pretrained model whose
pad id is its end-of-turn id (scripts/masking_experiments.py runs them)."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from pytrain.data import make_batches, pad_token_id
from pytrain.models.model import load_model
from pytrain.step import loss as L
from scripts.masking_common import (checkpoints, config, load_adapter_into, log_softmax, md_table,
                                    metrics, model_path, plt, quiet, save_plot, save_results,
                                    write_jsonl)


# ============================================================================ (b) seed 000
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
    from pytrain.run import loop as run
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
    return finish(res, folder, "seed000", seed000_markdown, seed000_plot if plot else None)


def finish(res: dict, folder: Path, name: str, markdown, plotter) -> dict:
    """The experiment's table, JSON and (``plotter`` given) plot written under ``name``."""
    res["markdown"] = markdown(res)
    save_results(folder, name, res, res["markdown"])
    if plotter is not None:
        plotter(res, folder / f"{name}.png")
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
    return run_setup(res) + "Epoch 0 = the base model.\n\n" + md_table(head, rows)


def run_setup(res: dict, model_note: str = "", chats_note: str = "") -> str:
    """The sentence saying what both runs of an experiment trained on."""
    return (f"Model `{res['model']}`{model_note}; {res['n_train']} training chats{chats_note} "
            f"({res['train_padding']:.0%} padding after length bucketing), {res['n_valid']} "
            f"validation chats ({res['valid_padding']:.0%} padding); batch {res['batch_size']}, "
            f"lr {res['lr']}, {res['epochs']} epochs of {res['steps_per_epoch']} steps; same "
            f"seed and data.  ")


def finish_panels(p, fig, axs, titles: list[str], png: Path, legend_size: int,
                  epoch_axes: int) -> None:
    for a, title in zip(axs, titles):
        a.set_title(title)
    for a in axs[:epoch_axes]:
        a.set_xlabel("epoch")
    for a in axs:
        a.legend(fontsize=legend_size)
        a.grid(alpha=0.3)
    save_plot(p, fig, png)


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
    finish_panels(p, fig, axs, ["validation loss per epoch", "LoRA drift Σ‖BA‖·α/r",
                                "loss of the most padded batch (as reported)"], png, 8, 3)


# ============================================================================ (d) a real model
def date_chats(n: int, seed: int, taken: set, max_exchanges: int = 4) -> list[dict]:
    """Chats of 1 to ``max_exchanges`` date conversions (scripts/demo_real.py's task), some with
    a system turn, so lengths vary and batches pad; no date of ``taken`` (which grows)."""
    import random
    from scripts import demo_real
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
    from scripts import demo_real
    eot = model.tokenizer.token_to_id("<|im_end|>")
    ends = right = empty = 0
    for c in convs:
        prompt = demo_real.prompt_ids(model, c, model.tokenizer.chat_template)
        out = model.generate(prompt, max_new, stop_ids=[], lora=lora)
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
    from scripts import fetch_model
    from scripts import demo_real
    from pytrain.run import loop as run
    from pytrain.step.trainer import Trainer
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
    return finish(res, folder, "real", real_markdown, real_plot if plot else None)


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
    return (run_setup(res, f" (pad id {res['pad_id']} = `<|im_end|>`)", " of 1-4 date conversions")
            + f"Turn endings: greedy answers to {res['n_held']} held-out single-question "
            f"prompts, 32 tokens, never stopped early, after the last epoch.\n\n"
            + md_table(head, rows))


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
    finish_panels(p, fig, axs, ["validation loss (masked) per epoch", "LoRA drift Σ‖BA‖·α/r",
                                "held-out answers that end the turn"], png, 7, 2)
