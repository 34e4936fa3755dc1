"""`pytrain plan CONFIG`: the memory a run needs on its device, the recompute choice and
whether it fits, from the model file's index and the graphs the trainer builds; checked
against the GGUF's tensor sizes and against what the trainer itself measures and decides."""
import json

import pytest
from gguf import GGUFReader

from pytrain.cli import main
from pytrain.cli.plan import NOT_FIT
from pytrain.step.step_memory import size
from scripts.gguf_models import write_qwen35
from tests.test_train_cli import MODEL, write_config, write_data


def plan(capsys, cfg, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["plan", str(cfg), *args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def plan_json(capsys, cfg, *args) -> dict:
    rc, out = plan(capsys, cfg, "--json", *args)
    d = json.loads(out)
    assert rc == (0 if d["fits"] else NOT_FIT)
    return d


@pytest.fixture
def cfg(tmp_path):
    write_data(tmp_path, copies=1)
    return write_config(tmp_path, batch_size=2, max_steps=1, data={"max_seq_len": 64})


def test_weight_bytes_are_the_gguf_tensor_sizes(capsys, cfg):
    d = plan_json(capsys, cfg)
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(MODEL).tensors}
    assert sum(g["file_bytes"] for g in d["weights"]) + sum(d["not_loaded"].values()) \
        == sum(sizes.values())
    assert set(d["not_loaded"]) < set(sizes)
    assert d["weight_bytes"] == sum(g["loaded_bytes"] for g in d["weights"])
    assert [g["file_type"] for g in d["weights"]] == ["F32"]     # an F32 file loads as F32
    assert d["weight_bytes"] == sum(g["file_bytes"] for g in d["weights"])
    assert d["device"] == "cpu" and d["batch"] == [2, 64]
    assert d["optimizer_bytes"] == 3 * d["adapter_bytes"] > 0
    assert d["lora_params"] * 4 == d["adapter_bytes"]             # F32 A and B
    lw = d["layerwise"]
    assert 0 < lw["largest"] < d["one_graph"]
    assert d["fits"] and d["need_bytes"] <= d["budget_bytes"]


def auto_type(file_type: str, plain: str) -> str:
    """What a training run's ``auto`` loads ``file_type`` matrices as on this CPU with memory
    to spare: F32 where the measured table says a step is FASTER so, else auto's plain rule
    (``plain``) (pytrain/run/type_choice.py; tests/test_type_choice.py checks the rule)."""
    from pytrain import ggml
    from pytrain.run import type_choice as tc
    row = tc.STEP_RATIO.get(tc.device_key("cpu", ggml.blas_enabled()), {})
    return "F32" if (row.get(file_type) or (0,))[0] >= tc.FASTER else plain


def test_a_quantized_llama_keeps_its_type(capsys, cfg):
    """Q8_0 matrices stay Q8_0 on the CPU (their bytes as in the file), norms F32, when the
    memory budget leaves no room for F32 weights or type_policy is "keep"; with room, as the
    measured rule says."""
    path = MODEL.parent.parent / "llama" / "gqa-q8_0.gguf"
    model = f"model.path={path}"
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    kept = plan_json(capsys, cfg, "--set", model)["types"]["kept_bytes"]
    for extra in (["--set", f"train.memory_gib={1.5 * kept / 2**30!r}"],
                  ["--set", 'model.type_policy="keep"']):
        d = plan_json(capsys, cfg, "--set", model, *extra)
        kinds = {(g["file_type"], g["loaded_type"]): g for g in d["weights"]}
        assert set(kinds) == {("Q8_0", "Q8_0"), ("F32", "F32")}, d["types"]["reason"]
        assert d["weight_bytes"] == sum(sizes.values()) - sum(d["not_loaded"].values())
        assert d["arch"] == "llama" and d["lora_tensors"] > 0 and d["layerwise"]
    d = plan_json(capsys, cfg, "--set", model)
    assert {(g["file_type"], g["loaded_type"]) for g in d["weights"]} == \
        {("Q8_0", auto_type("Q8_0", "Q8_0")), ("F32", "F32")}


def test_bf16_weights_load_as_f16_on_the_cpu(capsys, tmp_path, cfg):
    """BF16 becomes F16 (same size) when F32 weights do not fit half the budget; with room,
    F32 where the measured rule says so."""
    write_qwen35(tmp_path / "bf16.gguf", "bf16")
    model = f"model.path={tmp_path / 'bf16.gguf'}"
    kept = plan_json(capsys, cfg, "--set", model)["types"]["kept_bytes"]
    d = plan_json(capsys, cfg, "--set", model, "--set", f"train.memory_gib={kept / 2**30!r}")
    kinds = {(g["file_type"], g["loaded_type"]): g for g in d["weights"]}
    g = kinds[("BF16", "F16")]
    assert g["loaded_bytes"] == g["file_bytes"] > 0
    assert ("F32", "F32") in kinds       # norms and other element-wise tensors
    d = plan_json(capsys, cfg, "--set", model)
    assert ("BF16", auto_type("BF16", "F16")) in {(g["file_type"], g["loaded_type"])
                                                  for g in d["weights"]}


def test_a_gpu_this_machine_lacks_is_planned_for_a_given_memory(capsys, tmp_path, cfg):
    """--device cuda without a GPU: refused unless train.memory_gib gives its memory; then the
    weights take the types a CUDA run keeps (BF16 stays BF16, where the CPU makes it F16)."""
    from pytrain import ggml
    if any(d.name.startswith("CUDA") for d in ggml.devices()):    # not Vulkan's lavapipe
        pytest.skip("this machine has a CUDA GPU")
    write_qwen35(tmp_path / "bf16.gguf", "bf16")
    model = f"model.path={tmp_path / 'bf16.gguf'}"
    rc, out = plan(capsys, cfg, "--device", "cuda", "--set", model)
    assert rc == 1 and "train.memory_gib" in out
    d = plan_json(capsys, cfg, "--device", "cuda", "--set", model, "--set", "train.memory_gib=1")
    assert d["device"] == "cuda" and d["free_bytes"] is None and d["budget_bytes"] == 2**30
    assert ("BF16", "BF16") in {(g["file_type"], g["loaded_type"]) for g in d["weights"]}


def test_vulkan_plans_with_the_vulkan_devices_memory(capsys, cfg, monkeypatch):
    """--device vulkan: the plan names the Vulkan device (a GPU, or Mesa's lavapipe in CI)
    and plans with the free and total memory ggml reports for it; its budget is the free
    memory, as on any GPU (lavapipe's is the system's: ggml-vulkan reads the driver's heap
    budget).  The free memory moves with other processes, so each read is recorded."""
    from pytrain import ggml
    from vulkan_support import vulkan_device
    desc = vulkan_device()
    reads = []
    real = ggml.Runtime.device_memory_info

    def record(self):
        reads.append((self.device_label(), real(self)))
        return reads[-1][1]
    monkeypatch.setattr(ggml.Runtime, "device_memory_info", record)
    d = plan_json(capsys, cfg, "--device", "vulkan")
    vk = next(x for x in ggml.devices() if x.name.startswith("Vulkan"))
    label = f"{vk.name}: {desc}"
    assert d["device"] == "vulkan" and d["device_label"] == label
    assert [lb for lb, _ in reads] == [label, label]      # the plan's read, then the budget's
    assert (d["free_bytes"], d["total_bytes"]) == reads[0][1]
    assert d["total_bytes"] == vk.memory_total > 0
    assert d["budget_bytes"] == d["available_bytes"] == reads[1][1][0]
    assert d["budget_source"] == "the device's free memory"
    assert any("lavapipe" in n for n in d["notes"]) is ggml.is_lavapipe(desc)
    reads.clear()
    rc, out = plan(capsys, cfg, "--device", "vulkan")
    free, total = reads[0][1]
    assert rc == 0 and f"device:  vulkan ({label})" in out.splitlines()
    assert f"device memory: {size(free)} free of {size(total)}; " in out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "vulkan" in capsys.readouterr().out


def test_a_tiny_memory_limit_does_not_fit(capsys, cfg):
    rc, out = plan(capsys, cfg, "--set", "train.memory_gib=0.0001")
    assert rc == NOT_FIT
    assert "DOES NOT FIT" in out and "train.memory_gib" in out
    assert "recompute: layers" in out        # auto: nothing is left for one graph
    rc, out = plan(capsys, cfg)
    assert rc == 0 and out.rstrip().endswith("FITS")


def test_recompute_setting_is_reported_as_set(capsys, cfg):
    d = plan_json(capsys, cfg, "--set", 'train.recompute="layers"')
    assert d["layers"] and 'train.recompute = "layers"' in d["reason"]
    assert d["need_bytes"] == (d["weight_bytes"] + d["adapter_bytes"] + d["optimizer_bytes"]
                               + d["layerwise"]["largest"] + d["layerwise"]["persistent"])
    d = plan_json(capsys, cfg, "--set", 'train.recompute="off"')
    assert not d["layers"]
    assert d["need_bytes"] == (d["weight_bytes"] + d["adapter_bytes"] + d["optimizer_bytes"]
                               + d["one_graph"])


def test_plan_agrees_with_the_trainer(capsys, cfg):
    """The compute buffer the plan reports is the one the trainer measures on the loaded
    model, and recompute = auto decides the same at memory limits on both sides of it."""
    from pytrain.config import load_config
    from pytrain.step import loss as loss_mod
    from pytrain.step.graphs import GradGraph
    from pytrain.step.graph_memory import compute_bytes
    from pytrain.run.loop import open_session
    d = plan_json(capsys, cfg)
    B, T = d["batch"]
    s = open_session(load_config(cfg), cfg.parent / "out", lambda _: None)
    try:
        tr = s.trainer
        g = GradGraph(s.model, s.adapter, B, T, opt_state=tr.opt_state,
                      rows=loss_mod.rows_bucket(B * T, B * T))
        assert compute_bytes(s.model.runtime, g.graph) == d["one_graph"]
        g.close()
        for times, layers in ((4, False), (1.5, True)):
            gib = (d["weight_bytes"] + times * d["one_graph"]) / 2**30
            tr.memory_bytes, tr._auto = int(gib * 2**30), {}
            assert tr._recompute(B, T) is layers
            p = plan_json(capsys, cfg, "--set", f"train.memory_gib={gib!r}")
            assert p["layers"] is layers, p["reason"]
    finally:
        s.close()


def test_errors_name_the_file_or_the_key(capsys, cfg, tmp_path):
    rc, out = plan(capsys, cfg, "--set", f"model.path={tmp_path / 'absent.gguf'}")
    assert rc == 1 and "absent.gguf" in out
    rc, out = plan(capsys, cfg, "--set", "train.no_such_key=1")
    assert rc == 1 and "no_such_key" in out
    rc, out = plan(capsys, tmp_path / "nope.toml")
    assert rc == 1 and "nope.toml" in out


DEMO = MODEL.parent.parent.parent.parent / "config" / "demo.toml"


@pytest.mark.parametrize("max_seq_len", [32768, 100000])
def test_a_sequence_too_long_for_memory_does_not_fit_without_allocating(capsys, monkeypatch,
                                                                        max_seq_len):
    """The demo config at 32768 and 100000 tokens: DOES NOT FIT (exit 3), not a failed
    allocation of the layer inputs the plan only measures; nothing the plan allocates grows
    with the sequence (the LoRA tensors, their optimizer state and a few small inputs), and
    a length past the model's context is named."""
    from pytrain import ggml
    allocated = []
    real_alloc = ggml.Runtime.alloc

    def alloc(self, ctx, on_cpu=False, **kw):
        if not kw.get("measure_only"):
            allocated.append(sum(int(ggml.lib.ggml_nbytes(t)) for t in ctx.tensors()))
        return real_alloc(self, ctx, on_cpu, **kw)
    monkeypatch.setattr(ggml.Runtime, "alloc", alloc)
    args = ("--set", f"data.max_seq_len={max_seq_len}", "--set", "train.memory_gib=16",
            "--set", "model.device=cpu")
    warning = (f"warning: data.max_seq_len = {max_seq_len} is longer than the model's context "
               f"length (4096)")
    if max_seq_len == 32768:
        rc, out = plan(capsys, DEMO, *args)
        assert rc == NOT_FIT, out
        assert "DOES NOT FIT" in out and "Traceback" not in out and warning in out
    else:
        d = plan_json(capsys, DEMO, *args)
        assert not d["fits"] and any(w.startswith(warning) for w in d["warnings"])
        # the kept layer inputs (3 GiB per layer here) are measured, not allocated
        assert d["layerwise"]["persistent"] > 6 * 8 * max_seq_len * 128 * 4
    assert max(allocated) < 2**20


def test_a_sequence_within_the_context_gets_no_warning(capsys):
    rc, out = plan(capsys, DEMO, "--set", "model.device=cpu", "--set", "data.max_seq_len=4096")
    assert rc in (0, NOT_FIT) and "batch:   8 x 4096" in out
    assert "context length" not in out


LLAMA = MODEL.parent.parent / "llama" / "gqa-f32.gguf"


def train(capsys, cfg, *args) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["train", str(cfg), "--no-progress", *args])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("model, max_seq_len", [(LLAMA, 1000000), (MODEL, 10**8)],
                         ids=["llama", "qwen35"])
def test_train_refuses_what_plan_says_does_not_fit(capsys, cfg, model, max_seq_len):
    """One rule for both commands: the largest micro-batch the config allows
    (train.batch_size rows of data.max_seq_len tokens) must fit the memory budget.  Where
    plan says DOES NOT FIT, train stops before its first step with an error naming the key
    and the ways out, although this data's examples are short.  The Qwen3.5 graph grows with
    the length (its DeltaNet chunks): at 10^8 tokens its tensors' metadata alone is over any
    host's memory, which both commands say instead of aborting in ggml_init."""
    args = ("--set", f"model.path={model}", "--set", f"data.max_seq_len={max_seq_len}")
    rc, out = plan(capsys, cfg, *args)
    assert rc == NOT_FIT and "DOES NOT FIT" in out, out
    rc, out = train(capsys, cfg, *args)
    assert rc == 1, out
    error = next(line for line in out.splitlines() if line.startswith("error: "))
    assert error.startswith(f"error: --set data.max_seq_len={max_seq_len}: data.max_seq_len: "
                            f"a micro-batch of 2 x "), error
    assert "does not fit" in error, error
    # the device's budget can be given; the host's memory for the graph is the machine's
    assert ("train.memory_gib" in error) is (model == LLAMA), error
    assert ("host memory for its tensors' metadata alone" in error) is (model == MODEL), error
    assert "the longest example here has " in error, error
    assert not (cfg.parent / "out" / "adapter.gguf").exists()
    assert not (cfg.parent / "out" / "metrics.jsonl").exists()


def test_plan_and_train_agree_at_the_budget(capsys, cfg):
    """At the budget the plan needs, and one byte under it (recompute off: the step's memory
    does not move with the budget), both commands decide alike on the same config."""
    off = ("--set", 'train.recompute="off"')
    need = plan_json(capsys, cfg, *off, "--set", "train.memory_gib=1")["need_bytes"]
    for budget, fits in ((need - 1, False), (need, True)):
        gib = ("--set", f"train.memory_gib={budget / 2**30!r}")
        d = plan_json(capsys, cfg, *off, *gib)
        assert (d["need_bytes"], d["budget_bytes"], d["fits"]) == (need, budget, fits)
        rc, out = train(capsys, cfg, *off, *gib, "--overwrite")
        assert rc == (0 if fits else 1), out
        assert ("does not fit" in out) is not fits, out
