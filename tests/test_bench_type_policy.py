"""scripts/bench_type_policy.py at its smallest size, so that the script the type table is
measured with keeps running: both sides of each type stepped in turn, the results written
with the machine named; and the real-model part's data and ``auto`` answer on SmolLM2."""
import json

from llama_cpp_check import fetched_model
from scripts import bench_type_policy as bench


def test_smoke_run_writes_both_sides_per_type(tmp_path, capsys):
    rc = bench.main(["--size", "smoke", "--models", "", "--types", "Q8_0,Q4_1", "--rounds", "2",
                     "--blas", "on", "--threads", "1", "--results", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "type_policy.json").read_text())
    assert r["machine"]["cpu"] and r["size"] == "smoke" and "other work on the machine" in r["shared_note"]
    assert [x["type"] for x in r["synthetic"]] == ["Q8_0", "Q4_1"] and r["real"] == []
    for x in r["synthetic"]:
        s = x["sides"]
        assert list(s) == ["keep", "f32", "f16"]
        assert all(len(v["steps_s"]) == 2 and v["tokens_per_s"] > 0 for v in s.values())
        n = s["keep"]["loaded"][x["type"]]              # the matrices: kept, or F32
        assert n > 0 and s["keep"]["loaded"] == {x["type"]: n}
        assert s["f32"]["loaded"] == {f"{x['type']}->F32": n}
        assert s["f32"]["keep_over_this"] > 0 and s["f16"]["keep_over_this_cpu"] > 0
        assert s["f32"]["weight_bytes"] > s["keep"]["weight_bytes"]
    md = (tmp_path / "type_policy.md").read_text()
    assert r["machine"]["cpu"] in md and "| Q4_1 | cpu+blas |" in md
    assert set(r["table"]["cpu+blas"]) >= {"Q8_0", "Q4_1"}     # what type_choice.py would hold


def test_real_part_uses_the_demo_batches_and_says_what_auto_takes(tmp_path):
    """SmolLM2's demo batches are the demo config's (batch 8, rows up to 128) and ``auto``
    dequantizes its Q4_1 on this CPU (the table's measurement)."""
    from pytrain.models.model import load_model
    path = fetched_model("smollm2", "93 MB")
    m = load_model(path, "cpu", 1)
    try:
        batches, cfg = bench.demo_batches("smollm2", path, tmp_path, m)
    finally:
        m.close()
    assert (cfg.train.batch_size, cfg.data.max_seq_len, cfg.model.threads) == (8, 128, 2)
    assert len(batches) == 600 // 8 and all(b.tokens.shape[1] <= 128 for b in batches)
    c = bench.auto_choice(path, 1)
    assert bench.auto_side(c, {"Q4_1", "Q8_0"}) in ("f32", "auto") and "Q4_1" in c.reason, c
    assert "Q4_1" in {bench.ggml_name(t) for t in c.dequantize}


def test_smoke_run_of_the_bf16_sides_writes_their_ratio_under_its_name(tmp_path):
    """The bf16 sides (``train.compute_type = "bf16"``, quantized matrices kept or as BF16
    copies) beside f32: each loaded as named, the ratio BF16_STEP_RATIO is copied from (bf16-
    keep's step time over bf16's) recorded, and the files written under ``--name``."""
    import pytest

    from pytrain import ggml
    if not ggml.bf16_kernel():
        pytest.skip("no oneDNN bf16 matmul on this CPU")
    rc = bench.main(["--size", "smoke", "--models", "", "--types", "Q4_1", "--rounds", "2",
                     "--blas", "on", "--threads", "1", "--sides", "f32,bf16-keep,bf16",
                     "--results", str(tmp_path), "--name", "bf16_smoke"])
    assert rc == 0 and not (tmp_path / "type_policy.json").exists()
    r = json.loads((tmp_path / "bf16_smoke.json").read_text())
    s = r["synthetic"][0]["sides"]
    assert list(s) == ["f32", "bf16-keep", "bf16"]
    n = s["bf16-keep"]["loaded"]["Q4_1"]
    assert n > 0 and s["bf16"]["loaded"] == {"Q4_1->BF16": n}
    assert s["f32"]["loaded"] == {"Q4_1->F32": n}
    assert round(s["bf16"]["keep_over_this"], 4) == s["bf16"]["over"]["bf16-keep"] > 0
    assert s["bf16"]["weight_bytes"] < s["f32"]["weight_bytes"]
    assert r["bf16_table"]["cpu+blas"]["Q4_1"] == round(s["bf16"]["keep_over_this"], 2)
    md = (tmp_path / "bf16_smoke.md").read_text()
    assert "under compute bf16" in md and "| Q4_1 |" in md
