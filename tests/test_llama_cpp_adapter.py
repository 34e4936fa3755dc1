"""llama.cpp loads pytrain's adapter GGUF and computes the same logits as pytrain with it.

The authority for "loads in llama.cpp with --lora" is llama.cpp: ``scripts/llama_logits``
(built by ``python -m scripts.build_llama_cpp`` from the pinned source) runs llama.cpp's model
loader, ``llama_adapter_lora_init`` and its qwen35 graph on our file.  For each real
converter-made model: a rank-4, alpha-8 adapter on q/k/v/o of the attention layers with
non-zero random A and B must (1) change llama.cpp's logits, by far more than the tolerance,
and (2) give llama.cpp logits equal to ``model.logits(tokens, lora=adapter.hook)``.

Tolerance: both sides are float32 but use different graphs (llama.cpp: fused Gated DeltaNet
and conv ops, F32 KV cache; pytrain: chunked delta rule from differentiable ops, sequence
padded to its chunk length), so they agree to rounding, not bit for bit, and the tiny random
models amplify rounding with depth in the sequence.  Measured on this machine (2 CPU threads),
logits of magnitude ~10, adapter A and B ~ N(0, 0.3):

    model    T    max|Δ| base   max|Δ| with adapter   adapter effect
    gqa      40   1.2e-5        1.6e-5                16
    gqa      100  2.4e-5        2.5e-5                16
    untied   40   2.3e-5        3.6e-5                13
    untied   100  4.9e-5        1.7e-4                13

(Other token draws and T = 160: at most 1.9e-4.)  The bound is derived on the same input
(tests/bounds.py, tests/perturbation.py): the same model and adapter with every float32 weight
moved one float32 step moves pytrain's logits by e (this network's amplification of float32
rounding on these tokens: 1.9e-5 - 2.2e-4 on these); llama.cpp, another float32 computation
of the same function, is allowed ``f32_bound(e)`` = 4 e (at least 8 ulps).  That is still
four orders of magnitude below the change the adapter makes; an adapter llama.cpp applied
with a different scale, orientation or target would miss it by far.
"""
import subprocess
from pathlib import Path

import numpy as np
import pytest
from llama_cpp_check import deltas_with_adapter, llama_cpp_compatible

import pytrain
from pytrain.models import lora
from pytrain.formats.adapter_gguf import check_adapter_matches, read_lora_gguf, write_lora_gguf
from pytrain.models.lora_targets import select_targets

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "qwen35"
MIN_EFFECT = 0.05    # the adapter must move llama.cpp's logits at least this much

pytestmark = pytest.mark.slow   # llama.cpp runs on every fixture: tens of seconds


def tokens_for(n_vocab: int, T: int = 40, seed: int = 7) -> np.ndarray:
    """Random ids over the normal vocabulary (no special tokens, so both sides see the same
    ids without any tokenizer involvement)."""
    return np.random.default_rng(seed).integers(0, min(n_vocab, 480), T)


@pytest.mark.parametrize("T", [40, 100])
@pytest.mark.parametrize("fixture", ["gqa-f32.gguf", "untied-f32.gguf"])
def test_llama_cpp_loads_adapter_and_matches_pytrain(llama_logits_exe, tmp_path, fixture, T,
                                                     measured):
    path = llama_cpp_compatible(FIX / fixture, tmp_path)
    m = pytrain.load_model(path, device="cpu", threads=2)
    try:
        names = select_targets(m.config)                 # q/k/v/o of the attention layers
        assert names and all(".attn_" in n for n in names)
        ad = lora.create(m.runtime, m.config, names, rank=4, alpha=8, seed=0)
        rng = np.random.default_rng(1)
        vals = ad.get()
        for k in vals:                                   # non-zero A and B
            vals[k] = rng.normal(0, 0.3, vals[k].shape).astype(np.float32)
        ad.set(vals)
        tensors = ad.get()
        check_adapter_matches(m.config, tensors)
        arch = m.metadata["general.architecture"]
        adapter_file = write_lora_gguf(tmp_path / "adapter.gguf", arch, ad.alpha, tensors,
                                       {"general.name": f"test {fixture}"})
        arch, alpha, back, _ = read_lora_gguf(adapter_file, arch="qwen35")
        assert arch == "qwen35" and alpha == 8.0
        assert all(np.array_equal(back[k], tensors[k]) for k in tensors)

        toks = tokens_for(m.config.n_vocab, T)
        ours_base = m.logits(toks)
        ours_lora = m.logits(toks, lora=ad.hook)
    finally:
        m.close()
    from perturbation import adapter_bounds

    def same_adapter(mp):
        adp = lora.create(mp.runtime, mp.config, names, rank=4, alpha=8, seed=0)
        adp.set(tensors)
        return adp
    atol_base, atol_lora = adapter_bounds(path, tmp_path, toks, ours_base, ours_lora, same_adapter)

    d_base, d_lora, effect = deltas_with_adapter(llama_logits_exe, path, adapter_file, toks,
                                                 ours_base, ours_lora, tmp_path)
    print(f"\n{fixture} T={T}: max|Δ| base {d_base:.3g}, with adapter {d_lora:.3g}; "
          f"adapter effect {effect:.3g}; logit scale {float(np.abs(ours_lora).max()):.3g}")
    measured(f"{fixture} T={T}: llama.cpp vs pytrain, max |Δ logit|", d_base, atol_base)
    measured(f"{fixture} T={T}: with the adapter (llama.cpp --lora), max |Δ logit|", d_lora,
             atol_lora)
    measured(f"{fixture} T={T}: the adapter's effect (must exceed)", effect, MIN_EFFECT)
    assert effect > MIN_EFFECT, "llama.cpp ignored the adapter (logits did not change)"
    assert d_base <= atol_base, f"base logits differ by {d_base} (bound {atol_base})"
    assert d_lora <= atol_lora, f"logits with the adapter differ by {d_lora} (bound {atol_lora})"


@pytest.mark.parametrize("arch, n_in, message", [
    ("qwen35", 96, "incorrect shape"),                      # made for a wider model
    ("llama", 64, "model arch and LoRA arch mismatch"),     # made for another architecture
])
def test_llama_cpp_refuses_adapter_for_other_base(llama_logits_exe, tmp_path, arch, n_in,
                                                  message):
    """llama.cpp's loader refuses mismatched adapters (check_adapter_matches and
    read_lora_gguf(arch=...) report the same earlier, with clearer messages)."""
    rng = np.random.default_rng(0)
    t = {"blk.3.attn_q.weight.lora_a": rng.normal(size=(4, n_in)).astype(np.float32),
         "blk.3.attn_q.weight.lora_b": rng.normal(size=(128, 4)).astype(np.float32)}
    p = write_lora_gguf(tmp_path / "other.gguf", arch, 8, t)
    model = llama_cpp_compatible(FIX / "gqa-f32.gguf", tmp_path)
    cmd = [str(llama_logits_exe), str(model), str(p), "1,2,3", str(tmp_path / "o.f32"), "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert message in r.stderr


def test_llama_cpp_keeps_weights_out_of_extra_buffer_types(llama_logits_exe, tmp_path):
    """Regression: on Intel CPUs with AMX, llama.cpp (built native) put Q8_0 weights in
    ggml-cpu's AMX buffer type and died with SIGILL in its AMX kernel, so the cross-checks
    failed there and nowhere else.  ``llama_logits`` now loads with ``use_extra_bufts =
    false`` (llama.cpp's ``--no-repack``) and every cross-check asserts that the weights
    stayed in a plain CPU buffer (``run_llama``).

    A Q4_0 model makes this fail on every x86 machine, not only on AMX ones: ggml-cpu
    repacks Q4_0 for AVX2 (CPU_REPACK) and tiles it for AMX.  The first half shows that
    the check would fire here (extra buffer types allowed -> weights leave the plain
    buffer, into a type pytrain's own ggml lists for this CPU); the second that with the
    fix llama.cpp and pytrain compute the same Q4_0 logits, with and without an adapter, to
    within Q4_0's own rounding noise (``bounds.assert_same_rounding``)."""
    from scripts.gguf_models import quantized_copy
    from llama_cpp_check import PLAIN_CPU_BUFFERS, weight_buffers
    from pytrain import ggml

    compat = llama_cpp_compatible(FIX / "gqa-f32.gguf", tmp_path)
    path = quantized_copy(compat, FIX / "gqa-q8_0.gguf", tmp_path / "gqa-q4_0.gguf", "q4_0")
    extra = ggml.extra_buffer_types()
    if "avx2" in ggml.cpu_features() or "amx_int8" in ggml.cpu_features():
        assert extra, "ggml-cpu offers no extra buffer type on an AVX2/AMX CPU"
    if extra:
        r = subprocess.run([str(llama_logits_exe), "--extra-bufts", "--load-only", str(path),
                            "-", "1", str(tmp_path / "unused.f32")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        moved = set(weight_buffers(r.stderr)) - PLAIN_CPU_BUFFERS
        assert moved and moved <= set(extra), (weight_buffers(r.stderr), extra)

    from bounds import assert_same_rounding, log_softmax
    from llama_cpp_check import run_llama
    toks = tokens_for(480, 40)
    logs = {}
    for policy in ("auto", "f32"):     # Q4_0 kept, and the same values as float32
        m = pytrain.load_model(path, device="cpu", threads=2, type_policy=policy)
        try:
            want = "q4_0" if policy == "auto" else "f32"
            assert m.weights.tensors["blk.3.attn_q.weight"].type == ggml.TYPES[want]
            ad = lora.create(m.runtime, m.config, select_targets(m.config), rank=4, alpha=8,
                             seed=0)
            rng = np.random.default_rng(1)
            ad.set({k: rng.normal(0, 0.3, v.shape).astype(np.float32)
                    for k, v in ad.get().items()})
            logs[policy] = (m.logits(toks), m.logits(toks, lora=ad.hook))
            adapter_file = write_lora_gguf(tmp_path / "adapter.gguf", "qwen35", ad.alpha,
                                           ad.get())
        finally:
            m.close()
    # the same Q4_0 kernels, but llama.cpp's fused DeltaNet ops group float32 sums otherwise
    # upstream of each 8-bit activation rounding: within Q4_0's own noise on these tokens
    V = logs["auto"][0].shape[-1]
    theirs = [run_llama(llama_logits_exe, path, adapter, toks, tmp_path / f"q{i}.f32", V)
              for i, adapter in enumerate((None, adapter_file))]
    effect = float(np.abs(theirs[1] - theirs[0]).max())
    print(f"\nQ4_0: max|Δ| base {np.abs(theirs[0] - logs['auto'][0]).max():.3g}, with adapter "
          f"{np.abs(theirs[1] - logs['auto'][1]).max():.3g}; effect {effect:.3g}")
    assert effect > MIN_EFFECT
    for i in (0, 1):
        assert_same_rounding(log_softmax(logs["auto"][i]), log_softmax(theirs[i]),
                             log_softmax(logs["f32"][i]))


@pytest.mark.parametrize("fixture", ["gqa-q8_0.gguf", "gqa-bf16.gguf"])
def test_kept_weight_types_match_llama_cpp(llama_logits_exe, tmp_path, fixture, measured):
    """pytrain with the file's weights kept (Q8_0; BF16 as F16) computes what llama.cpp
    computes with the same weights and the same activation rounding: llama.cpp runs the Q8_0
    file itself, and for BF16 an F16 copy of it (pytrain's CPU type for BF16; the values are
    exactly representable), within the kept type's own noise on the same tokens
    (``bounds.assert_same_rounding``: pytrain kept against pytrain with the weights as F32)."""
    from bounds import assert_same_rounding, log_softmax
    from scripts.gguf_models import retyped_copy
    from llama_cpp_check import run_llama
    path = llama_cpp_compatible(FIX / fixture, tmp_path)
    theirs_path = (retyped_copy(path, tmp_path / "as-f16.gguf", "bf16", "f16")
                   if "bf16" in fixture else path)
    toks = tokens_for(480, 60)
    got = {}
    for policy in ("auto", "f32"):
        m = pytrain.load_model(path, device="cpu", threads=2, type_policy=policy)
        try:
            got[policy] = log_softmax(m.logits(toks))
        finally:
            m.close()
    theirs = log_softmax(run_llama(llama_logits_exe, theirs_path, None, toks, tmp_path / "l.f32",
                                   got["auto"].shape[-1]))
    print(f"\n{fixture}: pytrain kept vs llama.cpp {np.abs(got['auto'] - theirs).max():.3g}, "
          f"kept vs F32 {np.abs(got['auto'] - got['f32']).max():.3g}")
    measured(f"{fixture} kept vs llama.cpp, max |Δ log-softmax|",
             np.abs(got["auto"] - theirs).max(), "the type's own noise")
    measured(f"{fixture} kept vs pytrain F32 (the type's own noise), max |Δ log-softmax|",
             np.abs(got["auto"] - got["f32"]).max(), "-")
    assert_same_rounding(got["auto"], theirs, got["f32"])
