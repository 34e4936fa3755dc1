"""Experiments (c-i) to (c-iii): one gradient at a time rather than training runs, on fixed
batches: loss vs padding width, gradient accumulation's token mean vs mean of means, and
packed rows with sample ids vs one shared id (scripts/masking_experiments.py runs them)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pytrain.config import mask_for
from pytrain.data import Batch, load_examples, make_batches, pad_token_id
from pytrain.models.model import load_model
from pytrain.step import loss as L
from scripts.masking_common import (config, cosine, flat, make_adapter, md_table, model_path, plt,
                                    rel, save_plot, save_results, write_jsonl, xy_plot)
from scripts.masking_seed000 import varied_chats


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
    ex, _ = load_examples(data, model.tokenizer, format=cfg.data.format, mask=mask_for("chat", cfg.data.mask),
                          max_seq_len=cfg.data.max_seq_len)
    return folder, cfg, model, ex


def grad_run(model, ad, tokens, seg, targets, n_valid_step=None, buggy=False, T=None) -> dict:
    from pytrain.step.graphs import GradGraph
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
        w = [r["width"] for r in rows]
        xy_plot(folder / "padwidth.png", "padded width (tokens), same content", "loss",
                [(w, [r["fix_loss"] for r in rows], "go-", "masked (pytrain)"),
                 (w, [r["bug_loss"] for r in rows], "rs-", "pad rows trained, ÷ all rows (bug)")])
    return res


# ============================================================================ (c-ii) accumulation
def run_accum(out: Path, overrides=(), *, n_pairs: int = 6, b_std: float = 0.02, n_data: int = 256,
              max_turns: int = 8, seed: int = 0, plot: bool = True) -> dict:
    """Two micro-batches per step (config: train.grad_accum = 2 of train.batch_size examples):
    the first holds long chats (many targets), the second chats with fewer and fewer targets."""
    from pytrain.step.graphs import GradGraph
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
        ratio = [r["ratio"] for r in rows]
        xy_plot(folder / "accum.png", "valid targets: micro-batch 1 / micro-batch 2",
                "‖Δ gradient‖ / ‖gradient‖",
                [(ratio, [r["mom_vs_token_mean"] for r in rows], "o-",
                  "mean of means vs token mean"),
                 (ratio, [max(r["accum_vs_one_batch"], 1e-9) for r in rows], "s-",
                  "pytrain accumulation vs one batch")], logx=True)
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
        save_plot(p, fig, folder / "packing.png")
    return res
