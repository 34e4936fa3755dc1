#!/usr/bin/env python3
"""Masking experiments: the seeds' loss-masking findings reproduced with pytrain, and three more.

    python -m scripts.masking_experiments                     # all five, into experiments/
    python -m scripts.masking_experiments --only seed003,accum --out /tmp/exp
    python -m scripts.masking_experiments --results experiments_results   # + copy the tables
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

The experiments live in scripts/masking_seed003.py, scripts/masking_seed000.py and
scripts/masking_widths.py (their shared helpers in scripts/masking_common.py).  Every one returns
its results as a dict, so ``tests/test_masking_experiments.py`` runs tiny versions of the same
code.  CPU, one thread (see the configs); minutes on the embedded model.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from scripts.masking_common import EXPERIMENTS, ROOT
from scripts.masking_seed000 import run_real, run_seed000
from scripts.masking_seed003 import run_seed003
from scripts.masking_widths import run_accum, run_packing, run_padwidth


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
