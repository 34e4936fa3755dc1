"""Qwen3.5 hyperparameters as llama.cpp's converter writes them (``qwen35.*`` GGUF keys)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

ARCH = "qwen35"


@dataclass(frozen=True)
class Qwen35Config:
    arch: ClassVar[str] = ARCH
    n_layer: int                 # trunk layers (MTP/nextn blocks excluded)
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    rms_eps: float
    rope_base: float
    n_rot: int                   # rotated dims per head (partial rotary)
    rope_sections: tuple[int, ...]
    conv_kernel: int
    ssm_inner: int               # value heads × value head dim
    ssm_state: int               # key/value head dim of the DeltaNet layers
    ssm_v_heads: int             # "time_step_rank": value heads
    ssm_k_heads: int             # "group_count": key heads
    recurrent: tuple[bool, ...] = field(default=())   # per trunk layer: True = DeltaNet
    n_nextn: int = 0
    tied_embeddings: bool = True
    context_length: int = 0

    @property
    def layer_kinds(self) -> list[str]:
        return ["linear" if r else "attention" for r in self.recurrent]

    @property
    def ssm_head_v_dim(self) -> int:
        return self.ssm_inner // self.ssm_v_heads

    @property
    def conv_channels(self) -> int:
        return 2 * self.ssm_k_heads * self.ssm_state + self.ssm_inner

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], tensor_names: set[str] | None = None,
                      n_vocab: int | None = None, source: str = "") -> "Qwen35Config":
        where = f"{source}: " if source else ""

        def get(key: str, default: Any = None, required: bool = True) -> Any:
            full = f"{ARCH}.{key}"
            if full in meta:
                return meta[full]
            if required and default is None:
                raise KeyError(f"{where}missing GGUF key {full!r}")
            return default

        block_count = int(get("block_count"))
        n_nextn = int(get("nextn_predict_layers", 0, required=False))
        n_layer = block_count - n_nextn
        recurrent_all = get("attention.recurrent_layers", None, required=False)
        if recurrent_all is not None:
            recurrent = tuple(bool(x) for x in list(recurrent_all)[:n_layer])
        else:
            interval = int(get("full_attention_interval", 4, required=False))
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
        head_dim = int(get("attention.key_length", 0, required=False)) or \
            int(get("embedding_length")) // int(get("attention.head_count"))
        if n_vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise KeyError(f"{where}cannot tell the vocabulary size (no tokenizer.ggml.tokens)")
            n_vocab = len(tokens)
        tied = tensor_names is None or "output.weight" not in tensor_names
        sections = get("rope.dimension_sections", [0, 0, 0, 0], required=False)
        return cls(
            n_layer=n_layer,
            n_embd=int(get("embedding_length")),
            n_ff=int(get("feed_forward_length")),
            n_head=int(get("attention.head_count")),
            n_head_kv=int(get("attention.head_count_kv")),
            head_dim=head_dim,
            n_vocab=int(n_vocab),
            rms_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_base=float(get("rope.freq_base", 10000000.0, required=False)),
            n_rot=int(get("rope.dimension_count", head_dim // 4, required=False)),
            rope_sections=tuple(int(x) for x in sections),
            conv_kernel=int(get("ssm.conv_kernel")),
            ssm_inner=int(get("ssm.inner_size")),
            ssm_state=int(get("ssm.state_size")),
            ssm_v_heads=int(get("ssm.time_step_rank")),
            ssm_k_heads=int(get("ssm.group_count")),
            recurrent=recurrent,
            n_nextn=n_nextn,
            tied_embeddings=tied,
            context_length=int(get("context_length", 0, required=False)),
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every trunk tensor's expected shape in numpy order ([out, in] for matrices)."""
        e, hd = self.n_embd, self.head_dim
        s: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (self.n_vocab, e),
            "output_norm.weight": (e,),
        }
        if not self.tied_embeddings:
            s["output.weight"] = (self.n_vocab, e)
        key_dim = self.ssm_k_heads * self.ssm_state
        for i, rec in enumerate(self.recurrent):
            p = f"blk.{i}."
            s[p + "attn_norm.weight"] = (e,)
            s[p + "post_attention_norm.weight"] = (e,)
            s[p + "ffn_gate.weight"] = (self.n_ff, e)
            s[p + "ffn_up.weight"] = (self.n_ff, e)
            s[p + "ffn_down.weight"] = (e, self.n_ff)
            if rec:
                s[p + "attn_qkv.weight"] = (2 * key_dim + self.ssm_inner, e)
                s[p + "attn_gate.weight"] = (self.ssm_inner, e)
                s[p + "ssm_conv1d.weight"] = (self.conv_channels, self.conv_kernel)
                s[p + "ssm_dt.bias"] = (self.ssm_v_heads,)
                s[p + "ssm_a"] = (self.ssm_v_heads,)
                s[p + "ssm_beta.weight"] = (self.ssm_v_heads, e)
                s[p + "ssm_alpha.weight"] = (self.ssm_v_heads, e)
                s[p + "ssm_norm.weight"] = (self.ssm_head_v_dim,)
                s[p + "ssm_out.weight"] = (e, self.ssm_inner)
            else:
                s[p + "attn_q.weight"] = (2 * self.n_head * hd, e)
                s[p + "attn_k.weight"] = (self.n_head_kv * hd, e)
                s[p + "attn_v.weight"] = (self.n_head_kv * hd, e)
                s[p + "attn_output.weight"] = (e, self.n_head * hd)
                s[p + "attn_q_norm.weight"] = (hd,)
                s[p + "attn_k_norm.weight"] = (hd,)
        return s


# The Qwen3.5-2B shape (hidden 2048, 24 layers with attention every 4th, 8/2 heads x 256,
# FFN 6144, DeltaNet 16/16 heads x 128, vocabulary 248320, tied embeddings)
QWEN35_2B = Qwen35Config(n_layer=24, n_embd=2048, n_ff=6144, n_head=8, n_head_kv=2,
                         head_dim=256, n_vocab=248320, rms_eps=1e-6, rope_base=1e7, n_rot=64,
                         rope_sections=(11, 11, 10, 0), conv_kernel=4, ssm_inner=2048,
                         ssm_state=128, ssm_v_heads=16, ssm_k_heads=16,
                         recurrent=tuple(i % 4 != 3 for i in range(24)))
