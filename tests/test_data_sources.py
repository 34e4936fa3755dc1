"""Training data where it lives: Parquet files and folders (read with pyarrow) and
``datasets.save_to_disk`` folders (read with datasets), in the column layouts people use
(OpenAI messages, ShareGPT, Alpaca, prompt/completion, text), give the same examples as the
JSONL records they stand for; bad rows are named by file and row."""
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import datasets
import pytest

from pytrain.cli import main
from pytrain.data import DataError, load_examples
from pytrain.data import sources
from pytrain.data.preference import load_pairs
from pytrain.data.tokenizer import Tokenizer
from pytrain.formats.gguf_meta import read_metadata
from test_train_run import FIX, records, write_config

ANIMALS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack")]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_metadata(read_metadata(FIX / "gqa-f32.gguf"))


def chats():
    return [{"messages": [{"role": "user", "content": f"What does the {a} say?"},
                          {"role": "assistant", "content": f"The {a} says {s}."}]}
            for a, s in ANIMALS]


def write_jsonl(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def write_parquet(path: Path, recs: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(recs), path)
    return path


def same_examples(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.train_mask, y.train_mask)


def test_parquet_files_folders_and_datasets_folders_give_the_jsonl_examples(tmp_path, tok):
    recs = chats()
    want, _ = load_examples(write_jsonl(tmp_path / "d.jsonl", recs), tok)
    got, stats = load_examples(write_parquet(tmp_path / "d.parquet", recs), tok)
    same_examples(got, want)
    assert [e.source for e in got] == [f"{tmp_path / 'd.parquet'}:row {i}" for i in range(4)]
    assert stats.format == "chat" and stats.records == 4
    # a folder of Parquet shards (the Hub's data/ layout), read in name order
    (tmp_path / "shards" / "data").mkdir(parents=True)
    write_parquet(tmp_path / "shards" / "data" / "train-00000-of-00002.parquet", recs[:3])
    write_parquet(tmp_path / "shards" / "data" / "train-00001-of-00002.parquet", recs[3:])
    same_examples(load_examples(tmp_path / "shards", tok)[0], want)
    # datasets.Dataset.save_to_disk
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "saved"))
    got, _ = load_examples(tmp_path / "saved", tok)
    same_examples(got, want)
    assert got[2].source == f"{tmp_path / 'saved'}:row 2"


def test_rows_are_read_in_batches_in_order(tmp_path, tok, monkeypatch):
    """More rows than a record batch: each comes once, in order (BATCH_ROWS shrunk so the
    file spans several batches)."""
    monkeypatch.setattr(sources, "BATCH_ROWS", 7)
    recs = [{"text": f"line {i}"} for i in range(30)]
    write_parquet(tmp_path / "t.parquet", recs)
    pq_file = pq.ParquetFile(tmp_path / "t.parquet")
    assert pq_file.metadata.num_rows == 30
    rows = list(sources.read_rows(tmp_path / "t.parquet"))
    assert [r.record()["text"] for r in rows] == [r["text"] for r in recs]
    datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / "saved"))
    rows = list(sources.read_rows(tmp_path / "saved"))
    assert [(r.where, r.record()["text"]) for r in rows] == \
        [(f"{tmp_path / 'saved'}:row {i}", f"line {i}") for i in range(30)]


def test_sharegpt_and_alpaca_rows_are_the_chats_they_stand_for(tmp_path, tok):
    share = [{"conversations": [{"from": "system", "value": "Be brief."},
                                {"from": "human", "value": f"What does the {a} say?"},
                                {"from": "gpt", "value": f"The {a} says {s}."}]}
             for a, s in ANIMALS]
    msgs = [{"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": f"What does the {a} say?"},
                          {"role": "assistant", "content": f"The {a} says {s}."}]}
            for a, s in ANIMALS]
    same_examples(load_examples(write_parquet(tmp_path / "s.parquet", share), tok)[0],
                  load_examples(write_jsonl(tmp_path / "m.jsonl", msgs), tok)[0])
    alpaca = [{"instruction": f"Say what the {a} says.", "input": "" if i % 2 else "Be brief.",
               "output": f"The {a} says {s}."} for i, (a, s) in enumerate(ANIMALS)]
    as_chat = [{"messages": [
        {"role": "user", "content": r["instruction"] + (f"\n{r['input']}" if r["input"] else "")},
        {"role": "assistant", "content": r["output"]}]} for r in alpaca]
    same_examples(load_examples(write_jsonl(tmp_path / "a.jsonl", alpaca), tok)[0],
                  load_examples(write_jsonl(tmp_path / "c.jsonl", as_chat), tok)[0])
    # prompt/completion and text rows from Parquet are the JSONL formats' own
    pc = [{"prompt": f"The {a} says", "completion": f" {s}."} for a, s in ANIMALS]
    same_examples(load_examples(write_parquet(tmp_path / "pc.parquet", pc), tok)[0],
                  load_examples(write_jsonl(tmp_path / "pc.jsonl", pc), tok)[0])


def test_a_bad_row_is_named_by_file_and_row(tmp_path, tok):
    share = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
             for _ in range(3)]
    share[2]["conversations"][1]["from"] = "robot"
    path = write_parquet(tmp_path / "bad.parquet", share)
    with pytest.raises(DataError, match=r"bad\.parquet:row 2: conversations\[1\]: unknown "
                                        r"speaker 'robot'"):
        load_examples(path, tok)
    examples, stats = load_examples(path, tok, on_error="skip")
    assert len(examples) == 2 and stats.skipped == {"unknown_role": 1}
    # columns: each row has all three, null where the record has none
    datasets.Dataset.from_dict({"text": ["a", None], "prompt": [None, "p"],
                                "completion": [None, "c"]}).save_to_disk(str(tmp_path / "mixed"))
    with pytest.raises(DataError, match=r"mixed:row 1: a completion record in a file of text "
                                        r"records \(decided by row 0\)"):
        load_examples(tmp_path / "mixed", tok)


def test_folders_that_are_not_data_say_so(tmp_path, tok):
    d = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}]),
                              "test": datasets.Dataset.from_list([{"text": "b"}])})
    d.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict folder \(splits: train, test\): name one "
                                        r"split's folder, e\.g\. .*dd/train"):
        load_examples(tmp_path / "dd", tok)
    assert len(load_examples(tmp_path / "dd" / "train", tok)[0]) == 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .parquet file"):
        load_examples(tmp_path / "empty", tok)


def test_without_the_extra_the_error_says_what_to_install(tmp_path, tok, monkeypatch):
    path = write_parquet(tmp_path / "d.parquet", chats())
    datasets.Dataset.from_list(chats()).save_to_disk(str(tmp_path / "saved"))
    for mod in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, mod, None)      # as if not installed
    with pytest.raises(DataError, match=r"d\.parquet: reading Parquet needs pyarrow: pip install "
                                        r"'pytrain\[datasets\]'"):
        load_examples(path, tok)
    with pytest.raises(DataError, match=r"saved: reading a datasets.save_to_disk folder needs "
                                        r"the datasets library: pip install 'pytrain\[datasets\]'"):
        load_examples(tmp_path / "saved", tok)


def test_preference_pairs_from_parquet(tmp_path, tok):
    pairs = [{"prompt": f"What does the {a} say?", "chosen": f" The {a} says {s}.",
              "rejected": " I do not know."} for a, s in ANIMALS]
    want, _ = load_pairs(write_jsonl(tmp_path / "p.jsonl", pairs), tok)
    got, _ = load_pairs(write_parquet(tmp_path / "p.parquet", pairs), tok)
    assert len(got) == len(want)
    for x, y in zip(got, want):
        for k in ("prompt", "chosen", "rejected"):
            np.testing.assert_array_equal(getattr(x, k), getattr(y, k))


def test_a_run_trains_from_a_datasets_folder_as_from_jsonl(tmp_path):
    from test_train_run import write_data
    write_data(tmp_path)
    for split in ("train", "valid"):
        recs = [json.loads(x) for x in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        datasets.Dataset.from_list(recs).save_to_disk(str(tmp_path / split))
    cfg = write_config(tmp_path, max_steps=2, eval_every=0, formats=["gguf"])
    assert main(["train", str(cfg), "--no-progress"]) == 0
    assert main(["train", str(cfg), "--no-progress", "--set", f"output.dir={tmp_path / 'b'}",
                 "--set", f"data.train={tmp_path / 'train'}",
                 "--set", f"data.validation={tmp_path / 'valid'}"]) == 0
    strip = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "seconds")}
             for r in records(tmp_path / "out")]
    assert strip == [{k: v for k, v in r.items() if k not in ("tokens_per_s", "seconds")}
                     for r in records(tmp_path / "b")]
    stats = json.loads((tmp_path / "b" / "data_stats.json").read_text())
    assert stats["train"]["path"] == str(tmp_path / "train")


def test_a_parquet_folder_is_read_without_hidden_folders_or_virtualenvs(tmp_path, tok):
    """A Parquet folder is read recursively, as pyarrow's dataset discovery reads it: names
    starting with "." or "_" are skipped (caches, Spark's _temporary, __pycache__), and no
    virtualenv (a folder with pyvenv.cfg) or site-packages is ever walked: pyarrow's own test
    data there is Parquet too."""
    recs = chats()
    want, _ = load_examples(write_jsonl(tmp_path / "d.jsonl", recs), tok)
    top = tmp_path / "project"
    foreign = [{"a": 1, "b": "not a record"}]
    for sub in (".cache/hub", "_temporary/0", "data/.ipynb_checkpoints", "data/__pycache__",
                ".venv/lib/python3.11/site-packages/pyarrow/tests/data/parquet",
                "env/lib/python3.11/site-packages/pyarrow/tests/data/parquet",
                "lib/python3/dist-packages/x", "data/site-packages"):
        (top / sub).mkdir(parents=True)
        write_parquet(top / sub / "v0.7.1.all-named-index.parquet", foreign)
    (top / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (top / "env" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (top / "env" / "train.parquet").parent.mkdir(exist_ok=True)
    write_parquet(top / "env" / "train.parquet", foreign)          # in the venv's root too
    write_parquet(top / "data" / "_SUCCESS.parquet", foreign)
    write_parquet(top / "data" / ".part-0.parquet", foreign)
    (top / "data" / "train" / "lang=en").mkdir(parents=True)        # Hive partitions: kept
    write_parquet(top / "data" / "train" / "lang=en" / "part-0.parquet", recs[:2])
    write_parquet(top / "data" / "train-1.parquet", recs[2:])
    got, stats = load_examples(top, tok)
    same_examples(got, want)
    assert {e.source.rpartition(":row")[0] for e in got} == \
        {str(top / "data" / "train" / "lang=en" / "part-0.parquet"),
         str(top / "data" / "train-1.parquet")}
    # the folder named is read even when its own name starts with "." (it was asked for)
    assert [r.record() for r in sources.read_rows(top / ".cache" / "hub")] == foreign


def test_an_empty_data_path_is_refused(tmp_path, tok, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_parquet(tmp_path / "stray.parquet", [{"a": 1}])
    with pytest.raises(DataError, match="an empty path"):
        load_examples("", tok)


@pytest.mark.parametrize("fmt", ["numpy", "pandas", "arrow", "torch"])
def test_a_datasets_folder_saved_with_a_format_is_read_as_its_records(tmp_path, tok, fmt):
    """``save_to_disk`` keeps the dataset's output format (state.json's ``_format_type``) and
    ``load_from_disk`` applies it: numpy arrays for lists, an Arrow table, torch tensors
    (which need torch where the folder is read).  The rows are read unformatted, as the
    records they hold."""
    recs = chats()
    want, _ = load_examples(write_jsonl(tmp_path / "d.jsonl", recs), tok)
    folder = tmp_path / fmt
    ds = datasets.Dataset.from_list(recs)
    ds.with_format(fmt if fmt != "torch" else "numpy").save_to_disk(str(folder), num_shards=2)
    if fmt == "torch":      # what a machine with torch writes; this venv has no torch
        state = json.loads((folder / "state.json").read_text())
        state["_format_type"] = "torch"
        (folder / "state.json").write_text(json.dumps(state))
    state = json.loads((folder / "state.json").read_text())
    assert state["_format_type"] == fmt and len(state["_data_files"]) == 2
    got, stats = load_examples(folder, tok)
    same_examples(got, want)
    assert stats.format == "chat" and got[1].source == f"{folder}:row 1"
