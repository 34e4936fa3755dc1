"""LoRA target selection on a Qwen3.5 layout (DeltaNet layers 0-2, 4-6; attention 3, 7)."""
import pytest

from pytrain.models import qwen35
from pytrain.models.lora_targets import (LoraTargetError, lora_param_count, lora_shapes,
                                         select_targets)
from pytrain.models.qwen35_config import Qwen35Config

DEFAULT_TARGETS = qwen35.ARCHITECTURE.default_targets
VALID_TARGETS = qwen35.ARCHITECTURE.targets


@pytest.fixture
def cfg():
    # the "mid" CPU benchmark shape (scripts/bench_common.py), built directly (no file needed)
    return Qwen35Config(n_layer=8, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, head_dim=64,
                        n_vocab=151936, rms_eps=1e-6, rope_base=1e7, n_rot=16,
                        rope_sections=(11, 11, 10, 0), conv_kernel=4, ssm_inner=256,
                        ssm_state=64, ssm_v_heads=4, ssm_k_heads=4,
                        recurrent=tuple((i + 1) % 4 != 0 for i in range(8)))


def test_default_targets_attention_qkvo(cfg):
    names = select_targets(cfg)
    assert names == [f"blk.{i}.{t}.weight" for i in (3, 7) for t in DEFAULT_TARGETS]
    assert select_targets(cfg, skip_ssm=False) == names   # q/k/v/o exist in attention only


def test_ffn_targets_follow_skip_ssm(cfg):
    on = select_targets(cfg, ("ffn_up", "attn_q"), skip_ssm=True)
    assert on == ["blk.3.ffn_up.weight", "blk.3.attn_q.weight",
                  "blk.7.ffn_up.weight", "blk.7.attn_q.weight"]
    off = select_targets(cfg, ("ffn_up", "attn_q"), skip_ssm=False)
    assert [n for n in off if "ffn_up" in n] == [f"blk.{i}.ffn_up.weight" for i in range(8)]
    assert [n for n in off if "attn_q" in n] == ["blk.3.attn_q.weight", "blk.7.attn_q.weight"]


def test_linear_layer_targets_need_skip_ssm_off(cfg):
    with pytest.raises(LoraTargetError, match="match no tensor.*skip_ssm=True"):
        select_targets(cfg, ("attn_qkv", "ssm_out"), skip_ssm=True)
    names = select_targets(cfg, ("attn_qkv", "attn_gate", "ssm_out", "ssm_beta", "ssm_alpha"),
                           skip_ssm=False)
    assert len(names) == 6 * 5
    assert not any(n.startswith(("blk.3.", "blk.7.")) for n in names)


def test_every_valid_target_exists_somewhere(cfg):
    names = select_targets(cfg, VALID_TARGETS, skip_ssm=False)
    shapes = cfg.tensor_shapes()
    assert all(n in shapes and len(shapes[n]) == 2 for n in names)
    assert {n.split(".")[2] for n in names} == set(VALID_TARGETS)


def test_unknown_target_lists_valid_ones(cfg):
    with pytest.raises(LoraTargetError, match=r"unknown LoRA target 'q_proj' for qwen35; "
                                              r"valid: attn_q, attn_k, .*ssm_out"):
        select_targets(cfg, ("attn_q", "q_proj"))
    with pytest.raises(LoraTargetError, match="no LoRA targets"):
        select_targets(cfg, ())
    assert issubclass(LoraTargetError, ValueError)


def test_string_and_suffix_forms(cfg):
    assert select_targets(cfg, "attn_q, attn_v.weight attn_q") == [
        "blk.3.attn_q.weight", "blk.3.attn_v.weight", "blk.7.attn_q.weight",
        "blk.7.attn_v.weight"]


def test_param_count_rank_times_in_plus_out(cfg):
    names = select_targets(cfg)
    # attention layer: q 1024x512, k 128x512, v 128x512, o 512x512
    per_layer = 16 * ((512 + 1024) + (512 + 128) + (512 + 128) + (512 + 512))
    assert lora_param_count(cfg, names, 16) == 2 * per_layer
    a, b = lora_shapes(cfg, ["blk.3.attn_q.weight"], 8)["blk.3.attn_q.weight"]
    assert a == (8, 512) and b == (1024, 8)


def test_each_architecture_has_its_own_target_names():
    """A Llama has no DeltaNet tensors: their names are refused for it, not silently matched
    against nothing, and its default is attention q/k/v/o."""
    from pathlib import Path

    from pytrain.models.model_file import open_model
    llama = open_model(Path(__file__).parent / "fixtures" / "llama" / "gqa-f32.gguf")[3]
    with pytest.raises(LoraTargetError, match=r"unknown LoRA target 'attn_qkv' for llama; "
                                              r"valid: attn_q, .*ffn_down$"):
        select_targets(llama, "attn_qkv")
    assert {n.split(".")[2] for n in select_targets(llama)} == set(DEFAULT_TARGETS)
    assert {n.split(".")[2] for n in select_targets(llama, "ffn_up")} == {"ffn_up"}
