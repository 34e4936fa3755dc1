"""JSONL -> examples -> batches: which tokens are targets, what is skipped, and that the loss's
own target shift sees exactly the targets the data meant.

Chat records go through the real Qwen3.5 template in tests/fixtures/qwen35/gqa-f32.gguf; what is
trained is checked by decoding the masked tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pytrain.config import load_config
from pytrain.data import (DataError, DataStats, Example, load_data, load_examples,
                          make_batches, pad_token_id, split_examples)
from pytrain.data.tokenizer import Tokenizer
from pytrain.formats.gguf_meta import read_metadata

GGUF = Path(__file__).resolve().parent / "fixtures" / "qwen35" / "gqa-f32.gguf"

SYSTEM, USER, ANSWER = "Be brief.", "What does the cow say?", "The cow says moo."
CHAT = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER},
                     {"role": "assistant", "content": ANSWER}]}
MULTI = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_metadata(read_metadata(GGUF))


def jsonl(tmp_path: Path, *records, name: str = "d.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
                 encoding="utf-8")
    return p


def runs(ex: Example) -> list[list[int]]:
    """Maximal runs of masked tokens."""
    out, cur = [], []
    for t, m in zip(ex.tokens.tolist(), ex.train_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


# ------------------------------------------------------------------------------- formats
def test_chat_trains_assistant_turns_only(tmp_path, tok):
    exs, st = load_examples(jsonl(tmp_path, CHAT, MULTI), tok)
    assert (st.format, st.mask, st.examples, st.records) == ("chat", "assistant_only", 2, 2)
    ex = exs[0]
    assert ex.tokens.dtype == np.int32 and ex.train_mask.dtype == bool
    assert ex.tokens.shape == ex.train_mask.shape and ex.source.endswith("d.jsonl:1")
    assert [tok.decode(r) for r in runs(ex)] == [ANSWER + "<|im_end|>"]
    context = tok.decode(ex.tokens[~ex.train_mask])
    assert SYSTEM in context and USER in context and "<|im_start|>assistant\n" in context
    assert [tok.decode(r) for r in runs(exs[1])] == ["4<|im_end|>", "6<|im_end|>"]
    assert st.target_tokens == sum(e.n_targets for e in exs) == sum(e.train_mask.sum() for e in exs)
    assert st.tokens == sum(len(e) for e in exs)


def test_chat_mask_all_trains_every_token(tmp_path, tok):
    (ex,), st = load_examples(jsonl(tmp_path, CHAT), tok, mask="all")
    assert st.mask == "all" and ex.train_mask.all()
    assert tok.decode(ex.tokens).startswith("<|im_start|>system\n" + SYSTEM)


def test_completion_trains_completion_and_eos(tmp_path, tok):
    rec = {"prompt": "Q: cow? A:", "completion": " moo"}
    (ex,), st = load_examples(jsonl(tmp_path, rec), tok)
    assert (st.format, st.mask) == ("completion", "completion_only")
    assert ex.tokens[-1] == tok.eos_id and ex.train_mask[-1]
    n_prompt = len(tok.encode("Q: cow? A:"))
    assert not ex.train_mask[:n_prompt].any() and ex.train_mask[n_prompt:].all()
    assert tok.decode(ex.tokens[ex.train_mask]) == " moo" + tok.id_to_token(tok.eos_id)
    (ex,), st = load_examples(jsonl(tmp_path, rec), tok, mask="all")
    assert ex.train_mask.all() and ex.n_targets == len(ex) - 1


def test_text_trains_everything_plus_eos(tmp_path, tok):
    (ex,), st = load_examples(jsonl(tmp_path, {"text": "the cow says moo"}), tok)
    assert (st.format, st.mask) == ("text", "all")
    assert ex.tokens.tolist() == tok.encode("the cow says moo") + [tok.eos_id]
    assert ex.train_mask.all()


def test_auto_decides_per_file(tmp_path, tok):
    chat = jsonl(tmp_path, CHAT, name="chat.jsonl")
    text = jsonl(tmp_path, {"text": "hello"}, name="text.jsonl")
    assert load_examples(chat, tok)[1].format == "chat"
    assert load_examples(text, tok)[1].format == "text"
    # the first *valid* record decides; a bad first line is skipped, not the decider
    p = jsonl(tmp_path, "{oops", {"text": "hello"}, name="late.jsonl")
    assert load_examples(p, tok, on_error="skip")[1].format == "text"


def test_mixed_formats_are_an_error_naming_file_and_line(tmp_path, tok):
    p = jsonl(tmp_path, CHAT, CHAT, {"text": "hi"})
    with pytest.raises(DataError, match=rf"{p}:3: a text record in a file of chat records "
                                        r"\(decided by line 1\)"):
        load_examples(p, tok)
    with pytest.raises(DataError, match=rf"{p}:1: a chat record in a file of completion records "
                                        r"\(decided by data.format\)"):
        load_examples(p, tok, format="completion")


def test_mask_must_fit_the_format(tmp_path, tok):
    p = jsonl(tmp_path, {"text": "hi there"})
    with pytest.raises(DataError, match=rf"{p}: mask 'assistant_only' does not apply to text"):
        load_examples(p, tok, mask="assistant_only")


# ------------------------------------------------------------------------------- bad records
BAD = [
    ("{not json", "malformed_json", "malformed JSON"),
    ("[1, 2]", "not_an_object", "expected a JSON object, got list"),
    ({"input": "x"}, "unrecognised_record", "record has none \\(or several\\) of the keys"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown_role",
     "messages\\[0\\]: unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": 5}]}, "bad_field",
     "messages\\[0\\]: content must be a string"),
    ({"messages": "hi"}, "bad_field", "\"messages\" must be a non-empty list"),
    ({"messages": [{"content": "x"}]}, "bad_field", "messages\\[0\\] needs a string \"role\""),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "template_error",
     "chat template error: No user query found"),
]


@pytest.mark.parametrize("bad, reason, msg", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_record_stops_with_file_line_or_is_counted(tmp_path, tok, bad, reason, msg):
    p = jsonl(tmp_path, CHAT, bad, CHAT)
    with pytest.raises(DataError, match=rf"{p}:2: {msg}"):
        load_examples(p, tok)
    exs, st = load_examples(p, tok, on_error="skip")
    assert len(exs) == 2 and st.skipped == {reason: 1}
    assert st.skip_messages[reason][0].startswith(f"{p}:2: ")
    assert st.records == st.examples + sum(st.skipped.values())


def test_wrong_types_in_completion_and_text(tmp_path, tok):
    p = jsonl(tmp_path, {"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": 3},
              {"prompt": "a"})
    with pytest.raises(DataError, match=rf"{p}:2: \"completion\" must be a string, got int"):
        load_examples(p, tok)
    exs, st = load_examples(p, tok, on_error="skip")
    assert len(exs) == 1 and st.skipped == {"bad_field": 2}
    p = jsonl(tmp_path, {"text": None})
    with pytest.raises(DataError, match=rf"{p}:1: \"text\" must be a string"):
        load_examples(p, tok)


def test_undecodable_bytes_are_a_record_error(tmp_path, tok):
    p = tmp_path / "b.jsonl"
    p.write_bytes(json.dumps(CHAT).encode() + b"\n" + b'{"text": "\xff"}\n')
    with pytest.raises(DataError, match=rf"{p}:2: not UTF-8"):
        load_examples(p, tok)


def test_conversation_without_assistant_is_skipped_and_counted(tmp_path, tok):
    no_answer = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    p = jsonl(tmp_path, CHAT, no_answer, "", CHAT)   # blank lines are not records
    exs, st = load_examples(p, tok)                    # skipped even with on_error="stop"
    assert len(exs) == 2 and st.records == 3 and st.skipped == {"no_assistant_turn": 1}
    assert st.skip_messages["no_assistant_turn"] == [f"{p}:2: no assistant turn to train"]
    # with mask "all" the same conversation has targets, so it is kept
    assert len(load_examples(p, tok, mask="all")[0]) == 3


def test_empty_dataset_is_an_error_naming_the_file(tmp_path, tok):
    p = jsonl(tmp_path, "{bad", "[]")
    with pytest.raises(DataError, match=rf"{p}: no usable examples \(2 records read; skipped: "
                                        r"malformed_json 1, not_an_object 1\)"):
        load_examples(p, tok, on_error="skip")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=rf"{empty}: no usable examples \(0 records read\)"):
        load_examples(empty, tok)
    with pytest.raises(DataError, match="cannot read dataset"):
        load_examples(tmp_path / "missing.jsonl", tok)


# ------------------------------------------------------------------------------- truncation
def test_truncation_policies(tmp_path, tok):
    long_text = " ".join(["moo"] * 40)
    ids = tok.encode(long_text) + [tok.eos_id]
    assert len(ids) > 16
    p = jsonl(tmp_path, {"text": long_text}, {"text": "moo"})
    short = tok.encode("moo") + [tok.eos_id]
    (a, b), st = load_examples(p, tok, max_seq_len=16, truncation="right")
    assert a.tokens.tolist() == ids[:16] and st.truncated == 1 and b.tokens.tolist() == short
    (a, _), st = load_examples(p, tok, max_seq_len=16, truncation="left")
    assert a.tokens.tolist() == ids[-16:] and a.tokens[-1] == tok.eos_id and st.truncated == 1
    (b,), st = load_examples(p, tok, max_seq_len=16, truncation="drop")
    assert b.tokens.tolist() == short and st.dropped == 1 and st.skipped == {"too_long": 1}
    assert st.truncated == 0 and st.records == 2


def test_no_target_left_after_truncation_is_skipped(tmp_path, tok):
    rec = {"prompt": " ".join(["cow"] * 40), "completion": " moo"}
    p = jsonl(tmp_path, rec, {"prompt": "a", "completion": "b"})
    exs, st = load_examples(p, tok, max_seq_len=16, truncation="right")
    assert len(exs) == 1 and st.skipped == {"no_targets": 1} and st.truncated == 1
    assert "after truncation" in st.skip_messages["no_targets"][0]
    (ex, _), st = load_examples(p, tok, max_seq_len=16, truncation="left")  # keeps the answer
    assert ex.train_mask[-1] and st.skipped == {}


# ------------------------------------------------------------------------------- batching
def synthetic(lengths, prompt=0, eos=None) -> list[Example]:
    """Examples with tokens 1.. and the first ``prompt`` tokens not targets."""
    out = []
    for i, n in enumerate(lengths):
        tokens = np.arange(1, n + 1, dtype=np.int32) + 100 * i
        if eos is not None:
            tokens[-1] = eos
        mask = np.ones(n, bool)
        mask[:prompt] = False
        out.append(Example(tokens, mask, f"s:{i}"))
    return out


def rows_of(batches):
    """Each sample as (tokens, mask) recovered from the batches via seg."""
    got = []
    for b in batches:
        for r in range(b.tokens.shape[0]):
            for s in np.unique(b.seg[r][b.seg[r] >= 0]):
                idx = np.flatnonzero(b.seg[r] == s)
                assert (np.diff(idx) == 1).all()  # contiguous
                got.append((tuple(b.tokens[r, idx]), tuple(b.train_mask[r, idx])))
    return got


def test_bucketing(tmp_path):
    lengths = [5, 17, 3, 9, 12, 4, 8, 30, 2, 11]
    exs = synthetic(lengths)
    batches = make_batches(exs, 3, seed=1, pad_id=0)
    assert [b.tokens.shape[0] for b in batches].count(3) == 3 and len(batches) == 4
    for b in batches:
        assert b.tokens.dtype == np.int32 and b.seg.dtype == np.int64 and b.train_mask.dtype == bool
        real = (b.seg >= 0).sum(1)
        assert b.tokens.shape[1] == real.max()            # T = longest row
        for r, n in enumerate(real):
            assert (b.seg[r, :n] == 0).all() and (b.seg[r, n:] == -1).all()
            assert (b.tokens[r, n:] == 0).all() and not b.train_mask[r, n:].any()
    # buckets are runs of the sorted lengths
    buckets = sorted(sorted((b.seg >= 0).sum(1).tolist()) for b in batches)
    srt = sorted(lengths)
    assert buckets == sorted([srt[0:3], srt[3:6], srt[6:9], srt[9:]])
    # every sample exactly once, intact
    assert sorted(rows_of(batches)) == sorted((tuple(e.tokens), tuple(e.train_mask)) for e in exs)
    # deterministic given the seed; the order depends on it
    again = make_batches(exs, 3, seed=1, pad_id=0)
    assert all((a.tokens == b.tokens).all() for a, b in zip(batches, again))
    orders = {tuple(b.tokens.shape[1] for b in make_batches(exs, 3, seed=s)) for s in range(8)}
    assert len(orders) > 1
    # no shuffle: sorted, in order
    fixed = make_batches(exs, 3, shuffle=False)
    assert [b.tokens.shape[1] for b in fixed] == [4, 9, 17, 30]


def test_pad_id_defaults(tok):
    assert pad_token_id(tok) == tok.pad_id
    exs = synthetic([3, 6])
    b, = make_batches(exs, 2, pad_id=pad_token_id(tok))
    assert (b.tokens[b.seg < 0] == tok.pad_id).all()


def test_packing(tmp_path):
    lengths = [5, 17, 3, 9, 12, 4, 8, 30, 2, 11, 7, 6]
    exs = synthetic(lengths, prompt=1)
    batches = make_batches(exs, 2, packing=True, seed=3, max_seq_len=32, pad_id=0)
    n_rows = sum(b.tokens.shape[0] for b in batches)
    for b in batches:
        assert b.tokens.shape[1] <= 32
        for r in range(b.tokens.shape[0]):
            seg = b.seg[r]
            real = int((seg >= 0).sum())
            assert (seg[real:] == -1).all()                         # padding only at the end
            ids = seg[:real]
            assert ids[0] == 0 and (np.diff(ids) >= 0).all() and (np.diff(ids) <= 1).all()
            assert not b.train_mask[r, real:].any()
    # each sample whole, in one row
    assert sorted(rows_of(batches)) == sorted((tuple(e.tokens), tuple(e.train_mask)) for e in exs)
    # first-fit-decreasing fills these lengths (sum 114) into 4 rows of 32
    assert n_rows == 4
    again = make_batches(exs, 2, packing=True, seed=3, max_seq_len=32, pad_id=0)
    assert all((a.seg == b.seg).all() and (a.tokens == b.tokens).all()
               for a, b in zip(batches, again))
    with pytest.raises(ValueError, match="does not fit a packed row of 16"):
        make_batches(exs, 2, packing=True, max_seq_len=16)


def test_padding_share_and_stats():
    exs = synthetic([2, 4])
    (b,) = make_batches(exs, 2)
    st = DataStats()
    st.record_batches([b])
    assert st.padding_share == pytest.approx(2 / 8)
    assert (b.n_tokens, b.n_samples) == (6, 2)
    padded = b.pad_to(6, 9)
    assert padded.shape == (2, 6) and (padded.tokens[:, 4:] == 9).all()
    assert (padded.seg[:, 4:] == -1).all() and padded.n_targets == b.n_targets


# ------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("packing", [False, True])
def test_shift_targets_sees_exactly_the_expected_targets(packing):
    """Known lengths and prompts -> known target count, through the loss's own shift."""
    from pytrain.step.loss import IGNORE, shift_targets

    eos = 7  # pad id == eos id: real EOS targets must stay targets
    lengths, prompt = [6, 3, 9, 4, 12], 2
    exs = synthetic(lengths, prompt=prompt, eos=eos)
    # per sample: targets are tokens prompt..n-1 (the first token is never a target)
    expected = sum(n - prompt for n in lengths)
    batches = make_batches(exs, 2, packing=packing, seed=0, max_seq_len=16, pad_id=eos)
    total = 0
    n_eos = 0
    for b in batches:
        tgt = shift_targets(b.tokens, b.train_mask, b.seg)
        assert tgt.shape == b.tokens.shape
        n = int((tgt != IGNORE).sum())
        assert n == b.n_targets
        total += n
        n_eos += int((tgt == eos).sum())
        # no target is padding, and none crosses samples
        valid = (tgt != IGNORE)[:, :-1]   # the last column is never a target
        assert not (tgt != IGNORE)[:, -1].any()
        assert (b.seg[:, :-1][valid] >= 0).all()
        assert (b.seg[:, 1:][valid] == b.seg[:, :-1][valid]).all()
    assert total == expected
    assert n_eos == len(lengths)   # every sample's real EOS, no padding position


def test_from_files_through_config(tmp_path, tok):
    from pytrain.step.loss import IGNORE, shift_targets

    jsonl(tmp_path, *([CHAT, MULTI] * 5), name="train.jsonl")
    valid = jsonl(tmp_path, MULTI, name="valid.jsonl")
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(f'[model]\npath = "{GGUF}"\n[data]\ntrain = "train.jsonl"\n'
                        'split = 0.2\nmax_seq_len = 128\n')
    cfg = load_config(cfg_path)
    sp = load_data(cfg.data, tok)
    assert (len(sp.train), len(sp.valid), sp.valid_stats.examples) == (8, 2, 2)
    assert sp.train_stats.examples == 10
    cfg = load_config(cfg_path, ["data.split=0", "data.validation=" + str(valid)])
    sp = load_data(cfg.data, tok)
    assert (len(sp.train), len(sp.valid), sp.valid_stats.examples) == (10, 1, 1)
    batches = make_batches(sp.train, 4, seed=cfg.data.shuffle_seed, pad_id=pad_token_id(tok))
    n = sum(int((shift_targets(b.tokens, b.train_mask, b.seg) != IGNORE).sum()) for b in batches)
    assert n == sp.train_stats.target_tokens
    sp.train_stats.record_batches(batches)
    assert 0 < sp.train_stats.padding_share < 1 and "train.jsonl" in sp.train_stats.summary()


def test_split_examples():
    exs = synthetic(range(2, 22))
    tr, va = split_examples(exs, 0.25, seed=5)
    assert (len(tr), len(va)) == (15, 5)
    assert {e.source for e in tr}.isdisjoint({e.source for e in va})
    assert [e.source for e in split_examples(exs, 0.25, seed=5)[1]] == [e.source for e in va]
    assert split_examples(exs, 0.0, 1) == (exs, [])
    assert len(split_examples(exs[:2], 0.01, 0)[1]) == 1   # at least one each side
    with pytest.raises(DataError):
        split_examples(exs[:1], 0.5, 0)


def test_content_parts_and_tools_reach_the_template(tmp_path, tok):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": USER}]},
                          {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}]}
    plain = {"messages": [{"role": "user", "content": USER},
                          {"role": "assistant", "content": ANSWER}]}
    (a, b), _ = load_examples(jsonl(tmp_path, parts, plain), tok)
    assert a.tokens.tolist() == b.tokens.tolist() and a.train_mask.tolist() == b.train_mask.tolist()
    tool = {"type": "function", "function": {"name": "moo", "parameters": {}}}
    (c,), _ = load_examples(jsonl(tmp_path, {**plain, "tools": [tool]}), tok)
    assert "# Tools" in tok.decode(c.tokens[~c.train_mask])
    assert tok.decode(c.tokens[c.train_mask]) == ANSWER + "<|im_end|>"


DEMO = Path(__file__).resolve().parent.parent / "config" / "demo.toml"


def test_demo_config_data_loads():
    cfg = load_config(DEMO)
    if not (Path(cfg.data.train).exists() and Path(cfg.model.path).exists()):
        pytest.skip("the embedded demo model/data are not built")
    t = Tokenizer.from_metadata(read_metadata(cfg.model.path))
    sp = load_data(cfg.data, t)
    assert sp.train and sp.valid and sp.train_stats.format == "chat"
    assert sp.train_stats.records == sp.train_stats.examples  # the demo data is clean
    (b, *_) = make_batches(sp.train, cfg.train.batch_size, seed=cfg.data.shuffle_seed,
                           pad_id=pad_token_id(t))
    assert b.n_targets > 0


def test_chat_template_from_the_config(tmp_path, tok):
    """data.chat_template (a path relative to the config) replaces the model's template for
    chat records, its assistant turns still the only targets; a file that is not there is
    named with its key."""
    jsonl(tmp_path, CHAT, name="train.jsonl")
    (tmp_path / "turns.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>\n{% endfor %}")
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(f'[model]\npath = "{GGUF}"\n[data]\ntrain = "train.jsonl"\n'
                        'chat_template = "turns.jinja"\n')
    cfg = load_config(cfg_path)
    assert cfg.data.chat_template == str(tmp_path / "turns.jinja")
    (ex,) = load_data(cfg.data, tok).train
    text = tok.decode(ex.tokens)
    assert text.startswith("[system] Be brief.<|im_end|>\n[user] ") and "<|im_start|>" not in text
    # the first target token is " The": BPE joins the template's space to the reply
    assert tok.decode(ex.tokens[np.asarray(ex.train_mask, bool)]) == \
        " " + CHAT["messages"][-1]["content"] + "<|im_end|>"
    cfg = load_config(cfg_path, ["data.chat_template=missing.jinja"])
    with pytest.raises(DataError, match="data.chat_template: cannot read .*missing.jinja"):
        load_data(cfg.data, tok)


# ------------------------------------------------------------------------------- issue 37
def test_malformed_json_names_the_column_python_names(tmp_path, tok):
    """A line cut short (its closing brace lost): the column is where the line ends, as
    Python's own error on the line says, not column 1 of the line after its newline."""
    line = json.dumps(CHAT)[:-1]
    with pytest.raises(json.JSONDecodeError) as py:
        json.loads(line)
    assert py.value.colno == len(line) + 1
    p = jsonl(tmp_path, CHAT, line)
    with pytest.raises(DataError, match=rf"{p}:2: malformed JSON: Expecting ',' delimiter "
                                        rf"\(column {len(line) + 1}\)"):
        load_examples(p, tok)


def test_skip_counts_a_record_of_another_format(tmp_path, tok):
    """on_error = "skip": a record of another format than the file's is one bad record,
    skipped and counted with its line; "stop" still stops on it."""
    p = jsonl(tmp_path, CHAT, {"text": "hi"}, CHAT)
    exs, st = load_examples(p, tok, on_error="skip")
    assert len(exs) == 2 and st.skipped == {"other_format": 1}
    assert st.skip_messages["other_format"][0].startswith(f"{p}:2: a text record")
    assert st.records == st.examples + sum(st.skipped.values())
    with pytest.raises(DataError, match=rf"{p}:2: a text record in a file of chat records"):
        load_examples(p, tok)


def test_a_split_reports_the_held_out_examples(tmp_path, tok):
    jsonl(tmp_path, *([CHAT, MULTI] * 5), name="train.jsonl")
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(f'[model]\npath = "{GGUF}"\n[data]\ntrain = "train.jsonl"\n'
                        'split = 0.2\nmax_seq_len = 128\n')
    sp = load_data(load_config(cfg_path).data, tok)
    v = sp.valid_stats.to_dict()
    assert v["examples"] == len(sp.valid) == 2 and v["split_of"] == str(tmp_path / "train.jsonl")
    assert v["tokens"] == sum(len(e) for e in sp.valid)
    assert v["target_tokens"] == sum(e.n_targets for e in sp.valid)
    assert sp.train_stats.to_dict()["held_out"] == 2


SMOL_STYLE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
              "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}")


def test_content_parts_are_joined_for_a_template_that_wants_strings(tmp_path, tok):
    """A template that concatenates content as a string (SmolLM2's) gets the text parts
    joined with a newline, as llama.cpp does for such templates; the same conversation with
    string content gives the same tokens and targets."""
    tpl = tmp_path / "smol.jinja"
    tpl.write_text(SMOL_STYLE)
    two = [{"type": "text", "text": "What does the"}, {"type": "text", "text": "cow say?"}]
    parts = {"messages": [{"role": "user", "content": two},
                          {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}]}
    plain = {"messages": [{"role": "user", "content": "What does the\ncow say?"},
                          {"role": "assistant", "content": ANSWER}]}
    (a, b), st = load_examples(jsonl(tmp_path, parts, plain), tok, template=SMOL_STYLE)
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.train_mask.tolist() == b.train_mask.tolist() and st.skipped == {}


def test_a_template_that_fails_on_a_record_is_a_record_error(tmp_path, tok):
    """A Python error inside a template (here adding a number to a string) is that record's
    template error: skipped and counted with on_error = "skip", file:line with "stop"."""
    tpl = ("{% for m in messages %}{{ m['content'] + (1 if m['content'] == 'boom' else '') }}"
           "<|im_end|>{% endfor %}")
    bad = {"messages": [{"role": "user", "content": "boom"},
                        {"role": "assistant", "content": "x"}]}
    p = jsonl(tmp_path, CHAT, bad, CHAT)
    with pytest.raises(DataError, match=rf"{p}:2: chat template error: TypeError"):
        load_examples(p, tok, template=tpl)
    exs, st = load_examples(p, tok, template=tpl, on_error="skip")
    assert len(exs) == 2 and st.skipped == {"template_error": 1}


def test_a_builtin_chat_template_by_name(tmp_path, tok):
    """data.chat_template = "gemma" names the template shipped with pytrain, from any folder
    (a pip install has no pytrain/assets path to give); a file of that name beside the config
    would win; an unknown name lists the built-in ones."""
    from pytrain.data.template_files import TEMPLATE_DIR, builtin_names
    assert "gemma" in builtin_names()
    jsonl(tmp_path, CHAT, name="train.jsonl")
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(f'[model]\npath = "{GGUF}"\n[data]\ntrain = "train.jsonl"\n'
                        'chat_template = "gemma"\n')
    assert load_config(cfg_path).data.chat_template == "gemma"
    cfg = load_config(cfg_path, ["data.chat_template=gemmma"])
    with pytest.raises(DataError, match=r"data.chat_template: cannot read gemmma: .*built-in "
                                        r"templates: gemma"):
        load_data(cfg.data, tok)
    (tmp_path / "gemma").write_text("{{ messages[0]['content'] }}")
    assert load_config(cfg_path).data.chat_template == str(tmp_path / "gemma")
    from pytrain.data.template_files import read_template
    text, source = read_template("gemma", "data.chat_template")
    assert source == str(TEMPLATE_DIR / "gemma.jinja") and "<start_of_turn>" in text
    assert text == (TEMPLATE_DIR / "gemma.jinja").read_text(encoding="utf-8")
    # (rendered through `pytrain generate --chat-template gemma`: tests/test_cli_messages.py)


def test_a_model_without_a_template_names_the_builtin_ones(tmp_path):
    bare = Tokenizer.from_metadata({**read_metadata(GGUF), "tokenizer.chat_template": None})
    with pytest.raises(DataError, match=r"chat records need a chat template and the model has "
                                        r"none: set data.chat_template to a built-in template "
                                        r"\(gemma\) or a Jinja file"):
        load_examples(jsonl(tmp_path, CHAT), bare)
