"""PEFT adapter export/import (pytrain.formats.adapter_peft) against HF transformers + PEFT.

The reference is tests/fixtures/qwen35/peft_logits.npz (scripts/make_peft_logits_golden.py):
PEFT 0.21.2 loaded folders written by ``write_peft_adapter`` into the HF model behind
``gqa-f32.gguf`` and computed float32 logits; the script also checked that PEFT wrapped exactly
the adapted modules, that its own ``adapter_config.json`` for the same targets is identical, and
that llama.cpp's ``convert_lora_to_gguf.py`` turns the folders back into pytrain's tensors bit
for bit.  Two tensor sets: "all" (every supported target on every layer: attention q/k/v/o,
FFN gate/up/down and DeltaNet attn_qkv/attn_gate/ssm_beta/ssm_alpha/ssm_out, whose value heads
the converter re-orders; r=4, alpha=8) and "sparse" (six irregular modules, full module names
in target_modules; r=2, alpha=3.5).

Tolerance: pytrain (ggml, chunked DeltaNet) and HF (torch eager) are both float32 but round
differently, and the tiny random model amplifies rounding.  Measured on this machine (2 CPU
threads), logits of magnitude ~14, adapters moving them by up to 13.4 ("all") / 9.4 ("sparse"):

    set      T    max|Δ logits|   mean|Δ|
    all      33   2.0e-4          5.3e-6
    all      100  1.1e-4          4.2e-6
    sparse   33   9.7e-5          2.9e-6
    sparse   100  7.3e-5          3.0e-6

Bounds (tests/bounds.py, ``reference_bounds``), derived on the same input: the golden also
holds HF + PEFT in true float64 on the GGUF's exact weights (``S/logits64``), the exact answer.
HF float32's distance from it (up to 2.0e-4 on these, the largest over both sets and every
sequence) is this network's float32 rounding on the machine that made the golden; pytrain's
own is measured now, by perturbation (model and adapter one float32 step off,
tests/perturbation.py).  pytrain is allowed ``f32_bound`` of the larger (4x, at least 8 ulps)
from the exact answer, and that plus HF's distance from HF float32: two float32 evaluations
made on different machines differ by up to both of their errors.  That is four orders of magnitude below the adapter's effect;
the same tensors applied without the converter's value-head re-ordering miss by > 100 x the
bound (checked below), as would a wrong scale, orientation or module.
No torch at test time: only numpy, safetensors and pytrain.
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import pytrain
from pytrain.models import lora
from pytrain.formats.adapter_gguf import read_lora_gguf, write_lora_gguf
from pytrain.formats.adapter_peft import (CONFIG_NAME, WEIGHTS_NAME, PeftAdapterError, gguf_base_name,
                                  peft_config_dict, peft_module_name, read_peft_adapter,
                                  write_peft_adapter)

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "qwen35"


def bounds_of(gold, s: str, j: int, n: int) -> tuple[float, float]:
    """(bound against the float64 logits, HF float32's distance from them) of sequence j.

    The bound is calibrated on HF float32's error over the whole golden (both adapter sets,
    every sequence), not on sequence j alone: one implementation's rounding error at one
    sequence is a single sample, which varied 10x between the two sets on the same tokens,
    and ggml's haswell kernels (no BLAS) rounded sparse T=33 5x worse than HF did there
    while HF rounded "all" T=33 2x worse than ggml.  The network's float32 rounding scale
    is the largest such sample."""
    from bounds import reference_bounds
    exact = gold[f"{s}/logits64"][j, :n]
    hf = float(np.abs(gold[f"{s}/logits"][j, :n] - exact).max())
    return reference_bounds(own_rounding(), hf_rounding(gold), exact)[0], hf


@functools.cache
def own_rounding() -> float:
    """pytrain's own float32 rounding of the golden's logits, measured now: its largest change
    over both sets and every sequence when the model and the adapter are each one float32
    step off (tests/perturbation.py), as ``hf_rounding`` is HF's over the same."""
    from perturbation import logprob_rounding, nudged
    gold = dict(np.load(FIX / "peft_logits.npz"))

    def logits(m, bent):
        out = []
        for s in SETS:
            t = tensor_set(gold, s)
            out += [pytrain_logits(m, nudged(t) if bent else t, float(gold[f"{s}/alpha"]),
                                   int(gold[f"{s}/rank"]), gold["tokens"][j, :n]).ravel()
                    for j, n in enumerate(gold["lengths"])]
        return np.concatenate(out)
    return logprob_rounding(FIX / "gqa-f32.gguf", logits)


def hf_rounding(gold) -> float:
    """HF float32's largest distance from the float64 logits over every set and sequence."""
    return max(float(np.abs(gold[f"{s}/logits"][j, :n] - gold[f"{s}/logits64"][j, :n]).max())
               for s in SETS for j, n in enumerate(gold["lengths"]))


SETS = ("all", "sparse")


@pytest.fixture(scope="module")
def gold():
    return dict(np.load(FIX / "peft_logits.npz"))


@pytest.fixture(scope="module")
def model():
    m = pytrain.load_model(FIX / "gqa-f32.gguf", device="cpu", threads=2)
    yield m
    m.close()


def tensor_set(gold, s):
    p = f"{s}/t/"
    return {k[len(p):]: gold[k] for k in gold if k.startswith(p)}


def bases_of(tensors):
    return sorted(k[:-len(".lora_a")] for k in tensors if k.endswith(".lora_a"))


def pytrain_logits(model, tensors, alpha, rank, tokens):
    ad = lora.create(model.runtime, model.config, bases_of(tensors), rank, alpha)
    ad.set(tensors)
    return model.logits(tokens, lora=ad.hook)


def small_tensors(rng, r=2, names=("blk.1.attn_q.weight", "blk.3.attn_v.weight")):
    shapes = {"blk.1.attn_q.weight": (128, 64), "blk.3.attn_v.weight": (32, 64),
              "blk.1.ffn_down.weight": (64, 128)}
    out = {}
    for n in names:
        n_out, n_in = shapes[n]
        out[n + ".lora_a"] = rng.normal(size=(r, n_in)).astype(np.float32)
        out[n + ".lora_b"] = rng.normal(size=(n_out, r)).astype(np.float32)
    return out


def restore(gold, s, tag, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in (CONFIG_NAME, WEIGHTS_NAME):
        (folder / f).write_bytes(gold[f"{s}/{tag}/{f}"].tobytes())
    return folder


def peft_saved(gold, s):
    """What PEFT's own ``save_pretrained`` wrote after loading set ``s`` (the golden's
    S/peft_saved): the parsed adapter_config.json and the safetensors bytes."""
    cfg = json.loads(gold[f"{s}/peft_saved/{CONFIG_NAME}"].tobytes())
    return cfg, gold[f"{s}/peft_saved/{WEIGHTS_NAME}"].tobytes()


def peft_wrapped(gold, s):
    """The modules PEFT wrapped when it loaded set ``s``: those its save holds lora_A/B for."""
    from safetensors.numpy import load
    return {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
            for k in load(peft_saved(gold, s)[1])}


def peft_selects(cfg, key):
    """PEFT's rule for whether adapter config ``cfg`` targets module ``key`` (peft
    tuners_utils.check_target_module_exists, list target_modules, no exclude_modules):
    the full name or a ".name" suffix, and with layers_to_transform, the number after
    ".<layers_pattern>." must be one of them."""
    targets = cfg["target_modules"]
    if key in targets:
        return True
    if not any(key.endswith("." + t) for t in targets):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    patterns = cfg.get("layers_pattern")
    if not patterns:
        m = re.match(r".*\.[^.]*\.(\d+)\.", key)
    else:
        m = None
        for pat in [patterns] if isinstance(patterns, str) else patterns:
            m = re.match(rf".*\.{pat}\.(\d+)\.", key)
            if m is not None:
                break
    if m is None:
        return False
    return int(m.group(1)) == layers if isinstance(layers, int) else int(m.group(1)) in layers


# --------------------------------------------------------------------------- logits vs HF + PEFT

@pytest.mark.parametrize("s", SETS)
def test_logits_match_hf_peft(gold, model, s):
    tensors = tensor_set(gold, s)
    alpha, rank = float(gold[f"{s}/alpha"]), int(gold[f"{s}/rank"])
    assert float(gold[f"{s}/effect"]) > 5.0           # the adapter matters on the HF side
    for j, n in enumerate(gold["lengths"]):
        toks = gold["tokens"][j, :n]
        ours = pytrain_logits(model, tensors, alpha, rank, toks)
        ref = gold[f"{s}/logits"][j, :n]
        d = float(np.abs(ours - ref).max())
        d64 = float(np.abs(ours - gold[f"{s}/logits64"][j, :n]).max())
        bound, hf = bounds_of(gold, s, j, n)
        print(f"\n{s} T={n}: max|Δ logits| pytrain vs float64 {d64:.3g} (bound {bound:.3g}), "
              f"vs HF+PEFT float32 {d:.3g} (bound {bound + hf:.3g})")
        assert d64 <= bound and d <= bound + hf, (d64, d, bound, hf)


def test_value_head_reorder_is_needed(gold, model, tmp_path):
    """The HF-order tensors (what the safetensors file holds) applied to the GGUF model as if
    no re-ordering were needed give clearly wrong logits: the permutation is tested."""
    from safetensors.numpy import load_file
    path = restore(gold, "all", "peft_saved", tmp_path / "peft") / WEIGHTS_NAME
    st = load_file(str(path))
    naive = {}
    for k, v in st.items():
        mod = k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        naive[gguf_base_name(mod) + (".lora_a" if ".lora_A." in k else ".lora_b")] = v
    tensors = tensor_set(gold, "all")
    moved = [k for k in tensors if not np.array_equal(naive[k], tensors[k])]
    assert sorted({k.split(".")[2] for k in moved}) == \
        ["attn_gate", "attn_qkv", "ssm_alpha", "ssm_beta", "ssm_out"]
    n = int(gold["lengths"][0])
    toks = gold["tokens"][0, :n]
    d = float(np.abs(pytrain_logits(model, naive, 8.0, 4, toks)
                     - gold["all/logits"][0, :n]).max())
    assert d > 100 * sum(bounds_of(gold, "all", 0, n)), d


# --------------------------------------------------------------------------- config

@pytest.mark.parametrize("s", SETS)
def test_config_is_what_peft_writes(gold, model, s):
    """adapter_config.json against PEFT itself: the file PEFT writes for the same targets
    (get_peft_model + save_pretrained), the one it re-saved after loading pytrain's folder, and
    PEFT's target-matching rule applied to the config written now selects exactly the modules
    PEFT wrapped (the modules its save holds weights for)."""
    tensors = tensor_set(gold, s)
    alpha, rank = float(gold[f"{s}/alpha"]), int(gold[f"{s}/rank"])
    ours = peft_config_dict(bases_of(tensors), alpha, rank, model_config=model.config)
    for theirs in (json.loads(str(gold[f"{s}/peft_config_json"])), peft_saved(gold, s)[0]):
        theirs["target_modules"] = sorted(theirs["target_modules"])    # PEFT saves a set
        assert ours == theirs
    universe = peft_wrapped(gold, "all")              # every module pytrain adapts, all layers
    assert len(universe) == 30
    assert {k for k in universe if peft_selects(ours, k)} == peft_wrapped(gold, s)
    if s == "all":
        assert ours["layers_to_transform"] == [0, 1, 2, 3] and ours["layers_pattern"] == "layers"
        assert "q_proj" in ours["target_modules"] and "in_proj_qkv" in ours["target_modules"]
    else:
        assert ours["layers_to_transform"] is None
        assert ours["target_modules"] == sorted(peft_module_name(b) for b in bases_of(tensors))


def test_target_modules_only_adapted_layers(model, rng):
    cfg = model.config                                # layers: linear, full, linear, full
    def cfg_for(names, mc=cfg):
        t = {}
        for n in names:
            n_out, n_in = cfg.tensor_shapes()[n]
            t[n + ".lora_a"] = np.zeros((2, n_in), np.float32)
            t[n + ".lora_b"] = np.zeros((n_out, 2), np.float32)
        return peft_config_dict(bases_of(t), 4, 2, model_config=mc)
    # q/k/v/o of the attention layers: short names, layers 1 and 3
    c = cfg_for([f"blk.{i}.attn_{x}.weight" for i in (1, 3) for x in ("q", "k", "v", "output")])
    assert c["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert c["layers_to_transform"] == [1, 3]
    # ffn_up on layers 1 and 3 only, with q on both: still a product
    c = cfg_for(["blk.1.attn_q.weight", "blk.3.attn_q.weight", "blk.1.ffn_up.weight",
                 "blk.3.ffn_up.weight"])
    assert c["target_modules"] == ["q_proj", "up_proj"] and c["layers_to_transform"] == [1, 3]
    # q on layer 1 but not 3: full names
    c = cfg_for(["blk.1.attn_q.weight", "blk.3.attn_k.weight"])
    assert c["target_modules"] == ["model.layers.1.self_attn.q_proj",
                                   "model.layers.3.self_attn.k_proj"]
    assert c["layers_to_transform"] is None and c["layers_pattern"] is None
    # without a model config, kinds come from the adapted tensors; an FFN-only layer with an
    # attention name in the set cannot be proven, so full names
    c = cfg_for(["blk.1.attn_q.weight", "blk.0.ffn_up.weight", "blk.1.ffn_up.weight"], None)
    assert c["layers_to_transform"] is None
    c = cfg_for(["blk.1.attn_q.weight", "blk.0.ssm_out.weight"], None)
    assert c["target_modules"] == ["out_proj", "q_proj"] and c["layers_to_transform"] == [0, 1]


# --------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("s", SETS)
def test_write_read_round_trip_exact(gold, model, tmp_path, s):
    tensors = tensor_set(gold, s)
    alpha, rank = float(gold[f"{s}/alpha"]), int(gold[f"{s}/rank"])
    folder = write_peft_adapter(tmp_path / "ad", tensors, alpha, rank, "some/base-model",
                                {"pytrain.step": 12, "note": "x"}, model_config=model.config)
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    back, a2, r2, cfg = read_peft_adapter(folder, model.config)
    assert (a2, r2) == (alpha, rank) and cfg["base_model_name_or_path"] == "some/base-model"
    assert set(back) == set(tensors)
    for k in tensors:
        assert back[k].dtype == np.float32 and np.array_equal(back[k], tensors[k]), k
    with safe_open(folder / WEIGHTS_NAME, "np") as f:
        assert f.metadata() == {"format": "pt", "pytrain.step": "12", "note": "x"}
    # without extra metadata, the folder is what PEFT's own save_pretrained wrote after loading
    # it: the same safetensors bytes (names, order, dtypes, shapes, values, header), the same
    # config but for the order of target_modules (PEFT saves a set)
    again = write_peft_adapter(tmp_path / "ad2", tensors, alpha, rank, model_config=model.config)
    peft_cfg, peft_weights = peft_saved(gold, s)
    assert (again / WEIGHTS_NAME).read_bytes() == peft_weights
    cfg = json.loads((again / CONFIG_NAME).read_text())
    assert cfg.pop("target_modules") == sorted(peft_cfg.pop("target_modules"))
    assert cfg == peft_cfg


def test_round_trip_conditional_generation_prefix(model, tmp_path, rng):
    t = small_tensors(rng)
    folder = write_peft_adapter(tmp_path / "vl", t, 16, 2,
                                layers_prefix="model.language_model.layers")
    from safetensors.numpy import load_file
    keys = sorted(load_file(str(folder / WEIGHTS_NAME)))
    assert keys[0] == "base_model.model.model.language_model.layers.1.self_attn.q_proj.lora_A.weight"
    back, alpha, rank, _ = read_peft_adapter(folder)
    assert alpha == 16 and rank == 2
    assert all(np.array_equal(back[k], t[k]) for k in t)


@pytest.mark.parametrize("s", SETS)
def test_import_peft_written_folder_same_logits_as_gguf(gold, model, tmp_path, s):
    """A folder PEFT itself saved imports to exactly pytrain's tensors, and gives the same
    logits as the same adapter through the GGUF path (write_lora_gguf / read_lora_gguf)."""
    tensors = tensor_set(gold, s)
    alpha, rank = float(gold[f"{s}/alpha"]), int(gold[f"{s}/rank"])
    folder = restore(gold, s, "peft_saved", tmp_path / "peft")
    imported, a2, r2, cfg = read_peft_adapter(folder, model.config)
    assert (a2, r2) == (alpha, rank) and cfg["peft_type"] == "LORA"
    assert set(imported) == set(tensors)
    assert all(np.array_equal(imported[k], tensors[k]) for k in tensors)

    gguf = write_lora_gguf(tmp_path / "ad.gguf", "qwen35", alpha, tensors)
    _, g_alpha, via_gguf, _ = read_lora_gguf(gguf, arch="qwen35")
    n = int(gold["lengths"][0])
    toks = gold["tokens"][0, :n]
    l_peft = pytrain_logits(model, imported, a2, r2, toks)
    l_gguf = pytrain_logits(model, via_gguf, g_alpha, rank, toks)
    assert np.array_equal(l_peft, l_gguf)
    assert float(np.abs(l_peft - gold[f"{s}/logits"][0, :n]).max()) <= sum(bounds_of(gold, s, 0, n))


def test_import_peft_bf16_folder(gold, model, tmp_path):
    """PEFT's bfloat16 save (its usual output for bf16 training) reads without torch: each
    value is the float32 tensor rounded to bfloat16 (nearest, ties to even)."""
    tensors = tensor_set(gold, "sparse")
    folder = restore(gold, "sparse", "peft_saved_bf16", tmp_path / "bf16")
    imported, alpha, rank, _ = read_peft_adapter(folder, model.config)
    assert (alpha, rank) == (3.5, 2)

    def bf16(x):
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
        return u.astype(np.uint32).view(np.float32)
    for k, v in tensors.items():
        assert np.array_equal(imported[k], bf16(v)), k
    n = int(gold["lengths"][1])
    toks = gold["tokens"][1, :n]
    want = gold["sparse/logits"][1, :n]
    d = float(np.abs(pytrain_logits(model, imported, alpha, rank, toks) - want).max())
    # bf16 keeps 8 significant bits: A and B each move by at most 2^-8 of themselves, so the
    # adapter's effect on the logits (|with - without|) moves by about 2 x 2^-8 of itself to
    # first order; 4 x 2^-8 of the effect allows for the second order.  A wrong scale or a
    # missing pair would move the logits by a large part of the effect itself.
    effect = float(np.abs(want - model.logits(toks)).max())
    assert 0 < d <= 4 * 2.0 ** -8 * effect, (d, effect)


def test_read_float16_and_layer_prefixless_keys(tmp_path, rng):
    """Hand-made safetensors: F16 tensors; keys without the base_model.model. prefix."""
    a = rng.normal(size=(2, 64)).astype(np.float16)
    b = rng.normal(size=(32, 2)).astype(np.float16)
    names = {"model.layers.3.self_attn.k_proj.lora_A.weight": a,
             "model.layers.3.self_attn.k_proj.lora_B.weight": b}
    from safetensors.numpy import save_file
    tmp_path.mkdir(exist_ok=True)
    save_file(names, str(tmp_path / WEIGHTS_NAME))
    (tmp_path / CONFIG_NAME).write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["k_proj"]}))
    t, alpha, rank, _ = read_peft_adapter(tmp_path)
    assert np.array_equal(t["blk.3.attn_k.weight.lora_a"], a.astype(np.float32))
    assert np.array_equal(t["blk.3.attn_k.weight.lora_b"], b.astype(np.float32))


def test_names():
    assert peft_module_name("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj"
    assert peft_module_name("blk.2.ssm_alpha.weight") == "model.layers.2.linear_attn.in_proj_a"
    assert gguf_base_name("model.layers.2.linear_attn.in_proj_b") == "blk.2.ssm_beta.weight"
    assert gguf_base_name("model.language_model.layers.0.mlp.gate_proj") == \
        "blk.0.ffn_gate.weight"


# --------------------------------------------------------------------------- atomic writes

def test_failed_write_leaves_previous_adapter(tmp_path, rng, monkeypatch):
    t = small_tensors(rng)
    folder = write_peft_adapter(tmp_path / "ad", t, 8, 2)
    before = {f: (folder / f).read_bytes() for f in (CONFIG_NAME, WEIGHTS_NAME)}
    # a validation failure touches nothing
    bad = dict(t)
    bad["blk.1.attn_q.weight.lora_a"] = np.full((2, 64), np.nan, np.float32)
    with pytest.raises(PeftAdapterError, match="NaN"):
        write_peft_adapter(folder, bad, 8, 2)
    # a crash while writing the second file (its fsync fails: a full disk): the folder is
    # replaced as a unit, so both files are still the previous adapter's, and no temporary
    # folder is left behind.  (It replaced the weights alone and kept the old config.)
    import pytrain.formats.atomic as at
    real = os.fsync
    calls = []

    def flaky(fd):   # fsyncs: the weights file, then the config file (fails)
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(fd)
    monkeypatch.setattr(at.os, "fsync", flaky)
    t2 = small_tensors(np.random.default_rng(99))
    with pytest.raises(OSError):
        write_peft_adapter(folder, t2, 8, 2, metadata={"run": "2"})
    monkeypatch.setattr(at.os, "fsync", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad"]
    assert sorted(p.name for p in folder.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    assert {f: (folder / f).read_bytes() for f in before} == before
    # and a write that succeeds replaces both
    write_peft_adapter(folder, t2, 8, 2, metadata={"run": "2"})
    back, _, _, _ = read_peft_adapter(folder)
    assert all(np.array_equal(back[k], t2[k]) for k in t2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ad"]


def test_write_keeps_umask_permissions(tmp_path, rng):
    old = os.umask(0o022)
    try:
        folder = write_peft_adapter(tmp_path / "ad", small_tensors(rng), 8, 2)
    finally:
        os.umask(old)
    for f in (CONFIG_NAME, WEIGHTS_NAME):
        assert (folder / f).stat().st_mode & 0o777 == 0o644


# --------------------------------------------------------------------------- write errors

@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.update({"token_embd.weight.lora_a": t.pop("blk.1.attn_q.weight.lora_a"),
                         "token_embd.weight.lora_b": t.pop("blk.1.attn_q.weight.lora_b")}),
     "'token_embd.weight' has no PEFT module"),
    (lambda t: t.update({"blk.1.attn_q_norm.weight.lora_a": np.zeros((2, 16), np.float32)}),
     "'blk.1.attn_q_norm.weight' has no PEFT module"),
    (lambda t: t.update({"blk.1.attn_q.weight.lora_c": np.zeros((2, 16), np.float32)}),
     "does not end in"),
    (lambda t: t.pop("blk.3.attn_v.weight.lora_b"), "missing 'blk.3.attn_v.weight.lora_b'"),
    (lambda t: t.update({"blk.3.attn_v.weight.lora_a": np.zeros((3, 64), np.float32)}),
     "with r = 2"),
    (lambda t: t.update({"blk.3.attn_v.weight.lora_b": np.zeros((32, 2), object)}),
     "not a number"),
])
def test_write_errors(tmp_path, rng, mutate, message):
    t = small_tensors(rng)
    mutate(t)
    with pytest.raises(PeftAdapterError, match=message):
        write_peft_adapter(tmp_path / "ad", t, 8, 2)
    assert not (tmp_path / "ad").exists()


@pytest.mark.parametrize("kw, message", [
    (dict(alpha=0), "lora_alpha must be finite and non-zero"),
    (dict(alpha=float("inf")), "lora_alpha must be finite"),
    (dict(rank=0), "rank"),
    (dict(rank=2.0), "rank"),
    (dict(metadata={"format": "np"}), "reserved"),
    (dict(layers_prefix="transformer.h"), "layers_prefix"),
])
def test_write_argument_errors(tmp_path, rng, kw, message):
    args = dict(alpha=8, rank=2)
    args.update(kw)
    with pytest.raises(PeftAdapterError, match=message):
        write_peft_adapter(tmp_path / "ad", small_tensors(rng), args.pop("alpha"),
                           args.pop("rank"), **args)


def test_write_deltanet_needs_model_config(gold, tmp_path):
    t = {k: v for k, v in tensor_set(gold, "sparse").items() if ".attn_qkv." in k}
    with pytest.raises(PeftAdapterError, match=r"'blk\.2\.attn_qkv\.weight' is a DeltaNet tensor"
                                               r".*pass model_config"):
        write_peft_adapter(tmp_path / "ad", t, 3.5, 2)
    assert not (tmp_path / "ad").exists()


def test_write_checks_shapes_against_model(model, tmp_path, rng):
    t = small_tensors(rng)
    t["blk.1.attn_q.weight.lora_b"] = np.zeros((96, 2), np.float32)
    with pytest.raises(PeftAdapterError, match=r"'blk\.1\.attn_q\.weight' is \(128, 64\)"):
        write_peft_adapter(tmp_path / "ad", t, 8, 2, model_config=model.config)
    t = small_tensors(rng)
    t["blk.0.attn_q.weight.lora_a"] = t.pop("blk.1.attn_q.weight.lora_a")   # layer 0 is DeltaNet
    t["blk.0.attn_q.weight.lora_b"] = t.pop("blk.1.attn_q.weight.lora_b")
    with pytest.raises(PeftAdapterError, match="'blk.0.attn_q.weight' does not exist"):
        write_peft_adapter(tmp_path / "ad", t, 8, 2, model_config=model.config)


# --------------------------------------------------------------------------- read errors

@pytest.fixture
def good_folder(tmp_path, rng):
    return write_peft_adapter(tmp_path / "good", small_tensors(rng), 8, 2)


def edit_config(folder, **changes):
    p = folder / CONFIG_NAME
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, message", [
    (dict(peft_type="IA3"), "peft_type is 'IA3'"),
    (dict(fan_in_fan_out=True), "fan_in_fan_out"),
    (dict(bias="lora_only"), "bias is 'lora_only'"),
    (dict(use_dora=True), "use_dora"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(alpha_pattern={"q_proj": 8}), "alpha_pattern"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(lora_bias=True), "lora_bias"),
    (dict(r=4), r"with r = 4"),
    (dict(lora_alpha="eight"), "lora_alpha must be a number"),
    (dict(target_modules=["q_proj"], layers_to_transform=[1], layers_pattern="layers"),
     "'model.layers.3.self_attn.v_proj', which adapter_config.json's target_modules"),
])
def test_read_config_errors(good_folder, changes, message):
    edit_config(good_folder, **changes)
    with pytest.raises(PeftAdapterError, match=message) as e:
        read_peft_adapter(good_folder)
    assert str(good_folder) in str(e.value)


def test_read_missing_files(tmp_path, good_folder):
    with pytest.raises(PeftAdapterError, match="no such adapter folder"):
        read_peft_adapter(tmp_path / "nope")
    (good_folder / WEIGHTS_NAME).rename(good_folder / "adapter_model.bin")
    with pytest.raises(PeftAdapterError, match=r"adapter_model\.safetensors: missing "
                                               r"\(adapter_model\.bin is present"):
        read_peft_adapter(good_folder)
    (good_folder / CONFIG_NAME).unlink()
    with pytest.raises(PeftAdapterError, match=r"adapter_config\.json: missing"):
        read_peft_adapter(good_folder)


def test_read_bad_json_and_truncated_weights(good_folder):
    w = good_folder / WEIGHTS_NAME
    data = w.read_bytes()
    w.write_bytes(data[:-100])
    with pytest.raises(PeftAdapterError, match=r"adapter_model\.safetensors: tensor .* "
                                               r"\(truncated\?\)"):
        read_peft_adapter(good_folder)
    w.write_bytes(b"\x01\x02")
    with pytest.raises(PeftAdapterError, match="not a safetensors file"):
        read_peft_adapter(good_folder)
    (good_folder / CONFIG_NAME).write_text("{not json")
    with pytest.raises(PeftAdapterError, match=r"adapter_config\.json: cannot read"):
        read_peft_adapter(good_folder)


def rewrite_weights(folder, fn):
    from safetensors.numpy import load_file, save_file
    t = load_file(str(folder / WEIGHTS_NAME))
    fn(t)
    save_file(t, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})


Q = "base_model.model.model.layers.1.self_attn.q_proj"


@pytest.mark.parametrize("fn, message", [
    (lambda t: t.update({"base_model.model.model.layers.1.self_attn.qq_proj.lora_A.weight":
                         t.pop(Q + ".lora_A.weight")}),
     "module 'model.layers.1.self_attn.qq_proj' is not one pytrain can map"),
    (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": t.pop(Q + ".lora_A.weight")}),
     "'base_model.model.lm_head.lora_A.weight'"),
    (lambda t: t.update({Q + ".lora_magnitude_vector": np.ones(128, np.float32)}),
     "not a lora_A/lora_B weight"),
    (lambda t: t.pop(Q + ".lora_B.weight"), "has no lora_B.weight"),
    (lambda t: t.update({Q + ".lora_B.weight": np.zeros((128, 3), np.float32)}), "with r = 2"),
    (lambda t: t.update({Q + ".lora_B.weight": np.full((128, 2), np.inf, np.float32)}),
     "NaN or Inf"),
])
def test_read_tensor_errors(good_folder, fn, message):
    rewrite_weights(good_folder, fn)
    with pytest.raises(PeftAdapterError, match=message) as e:
        read_peft_adapter(good_folder)
    assert WEIGHTS_NAME in str(e.value)


def test_read_checks_model(gold, model, tmp_path):
    folder = restore(gold, "all", "peft_saved", tmp_path / "all")
    with pytest.raises(PeftAdapterError, match=r"'blk\.0\.attn_gate\.weight' is a DeltaNet tensor"):
        read_peft_adapter(folder)                     # value heads need the model's sizes
    t = small_tensors(np.random.default_rng(0))
    t["blk.1.attn_q.weight.lora_a"] = np.zeros((2, 96), np.float32)
    f2 = write_peft_adapter(tmp_path / "wide", t, 8, 2)
    with pytest.raises(PeftAdapterError, match="different model"):
        read_peft_adapter(f2, model.config)
