"""`make demo`: fine-tune the embedded default model on the embedded chat data, end to end,
and show what changed: greedy answers to held-out questions before and after, where the
adapter, metrics and loss plot are."""
import json
import sys
from pathlib import Path

from pytrain.config import load_config
from pytrain.data.chat_template import render
from pytrain.models.model import load_model
from pytrain.run import loop as run

ROOT = Path(__file__).resolve().parent.parent


def questions(path: Path, n: int = 4) -> list[list[dict]]:
    out = []
    for line in path.read_text().splitlines()[:n]:
        msgs = json.loads(line)["messages"]
        cut = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        out.append(msgs[:cut])
    return out


def answers(model, convs, lora=None) -> list[str]:
    tok = model.tokenizer
    res = []
    for msgs in convs:
        text = render(tok.chat_template, msgs, add_generation_prompt=True,
                      enable_thinking=False, **tok.special_tokens_map())
        ids = model.generate(tok.encode(text), 32, lora=lora)
        res.append(tok.decode(ids, skip_special=True).strip())
    return res


def main() -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a key of config/demo.toml (repeatable)")
    cfg = load_config(ROOT / "config" / "demo.toml", ap.parse_args().set)
    convs = questions(Path(cfg.data.validation))
    base = load_model(cfg.model.path, "cpu", cfg.model.threads)
    before = answers(base, convs)
    res = run.train(cfg)
    from pytrain.cli import _load_adapter
    after = answers(base, convs, lora=_load_adapter(base, res.adapter).hook)
    print("\nbefore → after (greedy, held-out questions):")
    for msgs, b, a in zip(convs, before, after):
        print(f"  user: {msgs[-1]['content']}\n    base:    {b!r}\n    adapted: {a!r}")
    e = res.final_eval or {}
    print(f"\nvalidation loss {e.get('loss', float('nan')):.4f}, accuracy "
          f"{e.get('accuracy', float('nan')):.3f} over {e.get('n_valid', 0)} target tokens")
    print(f"adapter:  {res.adapter}  (llama.cpp: --lora)")
    print(f"metrics:  {res.out_dir / 'metrics.jsonl'}")
    print(f"plot:     {res.out_dir / 'loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
