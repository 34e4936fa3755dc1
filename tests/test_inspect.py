"""`pytrain inspect`: the text a user reads before training on a file."""

from scripts.gguf_models import write_qwen35
from pytrain.cli import main


def run(capsys, *argv):
    rc = main(["inspect", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_inspect_reports_layers_types_mtp_and_targets(tmp_path, capsys):
    m = write_qwen35(tmp_path / "tiny.gguf", "q8_0", n_nextn=1)
    rc, out, err = run(capsys, m.path)
    assert rc == 0 and err == ""
    assert "architecture: qwen35" in out
    assert "0 linear, 1 linear, 2 linear, 3 attention" in out
    assert "n_embd = 256" in out and "n_nextn = 1" in out
    trunk = [n for n in m.types if not n.startswith("blk.4.")]
    n_q8 = sum(m.types[n] == "q8_0" for n in trunk)
    q8_bytes = sum(m.raw[n].nbytes for n in trunk if m.types[n] == "q8_0")
    assert f"Q8_0        {n_q8} tensors  {q8_bytes / 2**20:.2f} MiB" in out
    assert "F32 " in out
    n_mtp = sum(n.startswith("blk.4.") for n in m.types)
    assert f"ignored (MTP/nextn and extras, not loaded): {n_mtp} tensors, blocks 4" in out
    # default targets: q/k/v/o of layer 3; rank 16 x (in + out)
    lora = 16 * ((256 + 512) + (256 + 128) + (256 + 128) + (256 + 256))
    assert (f"default attn_q,attn_k,attn_v,attn_output, skip_ssm=True: 4 tensors in layers 3; "
            f"{lora:,} LoRA parameters") in out
    assert "skip_ssm=False: 4 tensors in layers 3" in out and "(same tensors)" in out
    assert "blk.3.attn_q.weight  [512, 256] Q8_0" in out
    assert "all, skip_ssm=True: 7 tensors in layers 3;" in out
    assert "all, skip_ssm=False: 31 tensors in layers 0, 1, 2, 3;" in out
    # memory: Q8_0 matrices as F32 on CUDA
    assert "cuda auto" in out and "cpu  auto" in out


def test_inspect_without_mtp(tmp_path, capsys):
    m = write_qwen35(tmp_path / "tiny.gguf", "bf16", recurrent=[True, False, True, False])
    rc, out, _ = run(capsys, m.path)
    assert rc == 0
    assert "0 linear, 1 attention, 2 linear, 3 attention" in out
    assert "ignored (MTP/nextn and extras): none" in out
    assert "BF16 " in out
    assert "in layers 1, 3;" in out


def test_inspect_refuses_other_architectures(tmp_path, capsys):
    m = write_qwen35(tmp_path / "mamba.gguf", "f32", arch="mamba")
    rc, out, err = run(capsys, m.path)
    assert rc == 2 and out == ""
    from pytrain import models
    assert str(m.path) in err and ("unsupported architecture 'mamba'; supported: "
                                   + ", ".join(models.names())) in err
    assert "gemma3, llama, qwen2, qwen3, qwen35" in err


def test_inspect_not_a_gguf(tmp_path, capsys):
    p = tmp_path / "notes.txt"
    p.write_text("hello")
    rc, _out, err = run(capsys, p)
    assert rc == 2 and f"{p}: not a GGUF file" in err


def test_a_model_without_ssm_layers_lists_no_skip_ssm_variants(capsys):
    """skip_ssm only matters where some layers are recurrent: a Llama lists each target set
    once, without skip_ssm (it listed both variants, "(same tensors)")."""
    from pathlib import Path
    llama = Path(__file__).resolve().parent / "fixtures" / "llama" / "gqa-f32.gguf"
    rc, out, _ = run(capsys, llama)
    assert rc == 0 and "skip_ssm" not in out and "(same tensors)" not in out
    assert "  default attn_q,attn_k,attn_v,attn_output: 12 tensors in layers 0, 1, 2;" in out
    assert "  all: 21 tensors in layers 0, 1, 2;" in out
