"""`pytrain profile CONFIG`: the config's first training step computed node by node, its time
by part of the model and by op (the values are timings: only their structure is asserted)."""
import json
from pathlib import Path

import pytest

from pytrain.cli import main
from tests.test_train_cli import write_config, write_data


@pytest.fixture
def cfg(tmp_path):
    write_data(tmp_path, copies=1)
    return write_config(tmp_path, batch_size=2, max_steps=1, data={"max_seq_len": 64})


def profile(capsys, cfg, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["profile", str(cfg), *args])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("recompute", ["off", "layers"])
def test_parts_and_ops_sum_to_the_total(capsys, cfg, recompute):
    rc, out = profile(capsys, cfg, "--json", "--steps", "2", "--set",
                      f'train.recompute="{recompute}"')
    assert rc == 0
    d = json.loads(out)
    assert d["steps"] == 2 and d["n_nodes"] > 0 and d["total"] > 0
    for k in ("by_op", "by_part", "by_backend", "by_part_op", "by_op_backend"):
        assert sum(d[k].values()) == pytest.approx(d["total"], rel=1e-9), k
    ops, parts = set(d["by_op"]), set(d["by_part"])
    assert {"MUL_MAT", "OUT_PROD", "CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK"} <= ops
    assert {"LM head + CE", "LM head + CE (bwd)", "LoRA", "LoRA (bwd)", "attention"} <= parts
    assert any(p.endswith("(recompute)") for p in parts) is (recompute == "layers")
    assert ("layer-wise recompute" in d["step_graph"]) is (recompute == "layers")
    assert d["micro_batches"] and d["targets"] > 0
    # the matrix products' FLOPs, counted from the nodes the profiled steps computed
    pr = d["products"]
    assert d["product_flops"] == pr["flops"] > 0 and set(pr["by_op"]) == {"MUL_MAT", "OUT_PROD"}
    assert sum(pr["by_op"].values()) == pr["flops"]


def test_products_count_the_second_forward_of_a_recompute(capsys, cfg):
    """Layer-wise recompute runs the adapted layers forward twice: more product FLOPs than
    one graph, the LM head's the same; the text output names the count and the time outside
    the products."""
    flops = {}
    for recompute in ("off", "layers"):
        rc, out = profile(capsys, cfg, "--json", "--set", f'train.recompute="{recompute}"')
        assert rc == 0
        flops[recompute] = json.loads(out)["product_flops"]
    assert flops["layers"] > flops["off"] > 0
    rc, out = profile(capsys, cfg)
    line = next(ln for ln in out.splitlines() if ln.startswith("matrix products: "))
    assert f"{flops['off'] / 1e9:.3f} GFLOP per step" in line and "in every other node" in line


def test_a_llama_model_has_no_deltanet_part(capsys, cfg):
    model = Path(__file__).parent / "fixtures" / "llama" / "gqa-f32.gguf"
    rc, out = profile(capsys, cfg, "--json", "--set", f"model.path={model}")
    assert rc == 0
    d = json.loads(out)
    parts = set(d["by_part"])
    assert {"attention", "attention (bwd)", "FFN", "FFN (bwd)", "LoRA (bwd)"} <= parts
    assert not any("DeltaNet" in p for p in parts)
    assert sum(d["by_part"].values()) == pytest.approx(d["total"], rel=1e-9)


def test_text_output(capsys, cfg):
    rc, out = profile(capsys, cfg, "--top", "3")
    assert rc == 0
    lines = out.splitlines()
    for title in ("part", "op", "part: op"):
        assert any(ln.split() and ln.split()[0] == title.split()[0] for ln in lines), title
    # the op table: --top 3 rows of ggml op names (which three depends on timings), then the
    # rest summed in one "(N more)" row
    at = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["op", "nodes"])
    rows = lines[at + 1:at + 5]
    assert all(r.split()[0].replace("_", "").isupper() for r in rows[:3]), rows
    assert rows[3].startswith("(") and "more)" in rows[3], rows


def test_bad_steps(capsys, cfg):
    rc, out = profile(capsys, cfg, "--steps", "0")
    assert rc == 1 and "--steps" in out


def test_a_vulkan_step_runs_on_the_vulkan_device(capsys, cfg):
    """model.device = "vulkan" (Mesa's lavapipe in CI): the profiled step's nodes ran on the
    Vulkan backend, none on the CPU, and the text output's backend tables say so (with one
    backend in use they were left out, which hid where a GPU step ran)."""
    from dataclasses import fields

    from vulkan_support import vulkan_device

    from pytrain.cli.profile import render
    from pytrain.plan.profile import StepProfile
    desc = vulkan_device()
    rc, out = profile(capsys, cfg, "--json", "--set", 'model.device="vulkan"')
    assert rc == 0
    d = json.loads(out)
    assert d["device"] == "vulkan" and f": {desc})" in d["runtime"], d["runtime"]
    vk = d["backends"][0]
    assert vk.startswith("Vulkan") and d["backends"][1:] == ["CPU"], d["backends"]
    assert set(d["by_backend"]) == {vk}, d["by_backend"]
    assert all(k.endswith(f" [{vk}]") for k in d["count_op_backend"]), d["count_op_backend"]
    assert {"MUL_MAT", "OUT_PROD", "CROSS_ENTROPY_LOSS", "CROSS_ENTROPY_LOSS_BACK"} <= set(
        d["by_op"])
    assert d["by_backend"][vk] == pytest.approx(d["total"], rel=1e-9) and d["total"] > 0
    lines = render(StepProfile(**{f.name: d[f.name] for f in fields(StepProfile)}), d)
    at = next((i for i, ln in enumerate(lines) if ln.split()[:1] == ["backend"]), None)
    assert at is not None, "no backend table in the text output"
    assert lines[at + 1].split()[0] == vk and lines[at + 1].endswith("100.0%"), lines[at:at + 3]
    assert any(ln.startswith("op [backend]") for ln in lines)
