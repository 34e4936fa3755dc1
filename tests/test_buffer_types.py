"""pytrain's own ggml never computes through ggml-cpu's extra buffer types.

Those types (CPU_REPACK: Q4_0/Q4_K/IQ4_NL re-laid for AVX2; AMX on Intel CPUs with AMX) hold
weights in other layouts and run other kernels; ggml-cpu's AMX Q8_0 kernel dies with SIGILL
on this project's Intel machines when llama.cpp uses it.  pytrain allocates weights, adapters
and optimizer state with ``ggml_backend_alloc_ctx_tensors`` (the backend's default buffer
type) and creates its scheduler without buffer types (defaults again), so nothing it owns can
land there.  This checks it on the types those paths take (Q4_0, Q8_0) through a real
training step, and that the extra types it avoids do exist on AVX2/AMX CPUs (so on such a
machine the check compares against a non-empty list).
"""
from pathlib import Path

import numpy as np
import pytest
from scripts.gguf_models import quantized_copy

import pytrain
from pytrain import ggml
from pytrain.ggml import lib
from pytrain.models import lora
from pytrain.data import Example, make_batches
from pytrain.models.lora_targets import select_targets
from pytrain.step.optimizer import AdamWSettings
from pytrain.step.trainer import Trainer

FIX = Path(__file__).resolve().parent / "fixtures" / "qwen35"


def tensor_buffer_type(t) -> str:
    """The name of the buffer type ``t``'s data lives in ("CPU", "CUDA0", "CPU_REPACK", ...)."""
    assert t.buffer != ggml.ffi.NULL, ggml.name(t)
    return ggml.buffer_type_name(lib.ggml_backend_buffer_get_type(t.buffer))


def test_extra_buffer_types_exist_where_the_cpu_has_them():
    feats = ggml.cpu_features()
    extra = ggml.extra_buffer_types()
    if "avx2" in feats:
        assert "CPU_REPACK" in extra, extra
    if "amx_int8" in feats:
        assert "AMX" in extra, extra
    assert "CPU" not in extra


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_weights_adapter_optimizer_and_compute_stay_in_default_buffers(tmp_path, qtype):
    path = quantized_copy(FIX / "gqa-f32.gguf", FIX / "gqa-q8_0.gguf", tmp_path / "m.gguf", qtype)
    m = pytrain.load_model(path, device="cpu", threads=2)
    try:
        assert m.weights.tensors["blk.3.attn_q.weight"].type == ggml.TYPES[qtype]
        ad = lora.create(m.runtime, m.config, select_targets(m.config), rank=4, alpha=8, seed=0)
        tr = Trainer(m, ad, AdamWSettings(lr=1e-3))
        rng = np.random.default_rng(0)
        ex = [Example(rng.integers(0, 400, n).astype(np.int32), np.ones(n, bool))
              for n in (24, 17)]
        r = tr.step(make_batches(ex, 2, seed=0), lr=1e-3)
        assert r is not None and np.isfinite(r.loss)
        used = {tensor_buffer_type(t) for t in m.weights.tensors.values()}
        used |= {tensor_buffer_type(t) for t in ad.params()}
        used |= {ggml.buffer_type_name(lib.ggml_backend_sched_get_buffer_type(m.runtime.sched, b))
                 for b in m.runtime.backends}     # where the scheduler puts compute buffers
        tr.close()
    finally:
        m.close()
    assert used == {"CPU"}, used
    assert not used & set(ggml.extra_buffer_types())
