"""Llama-family hyperparameters as llama.cpp's converter writes them (``llama.*`` GGUF keys).

One GGUF architecture covers Llama 2/3, SmolLM2, Mistral, TinyLlama and their fine-tunes:
``LlamaForCausalLM`` and ``MistralForCausalLM`` both convert to ``general.architecture =
llama``.  What differs between them is all in keys and optional tensors:

* grouped-query attention: ``attention.head_count_kv`` (default: as many as query heads);
* the head size: ``attention.key_length`` (Mistral-Nemo style heads wider than n_embd / n_head),
  else n_embd / n_head; llama.cpp rotates the whole head (``rope.dimension_count`` = head size);
* rope: ``rope.freq_base`` and the scaling keys ``rope.scaling.type`` (none | linear | yarn),
  ``rope.scaling.factor`` (or the old ``rope.scale_linear``), ``rope.scaling.attn_factor``,
  ``rope.scaling.original_context_length``; Llama 3's frequency ramp is the tensor
  ``rope_freqs.weight`` (one factor per rotated pair), not a key;
* tied embeddings: no ``output.weight``, the LM head is ``token_embd.weight``;
* optional biases on q/k/v/o and the FFN (``attention_bias`` / ``mlp_bias`` models).

The rope parameters are what llama.cpp passes to ``ggml_rope_ext`` for this architecture
(``src/llama-model.cpp`` load_hparams, ``src/llama-context.cpp``): freq_scale = 1/factor for
linear and YaRN; for YaRN ext_factor 1, beta_fast 32, beta_slow 1 (the llama architecture reads
no YaRN keys beyond these) and attn_factor = ``rope.scaling.attn_factor`` (llama.cpp cancels
ggml's own YaRN magnitude correction for this architecture).  Mixture-of-experts models
(Mixtral: ``expert_count`` > 0) and LongRoPE are refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

ARCH = "llama"
# projections that may carry a bias (``blk.N.<name>.bias``), in llama.cpp's tensor names
BIASED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
ROPE_SCALING = ("none", "linear", "yarn")


@dataclass(frozen=True)
class RopeParams:
    """The arguments of ``ggml_rope_ext`` after the position tensor and head size."""
    base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    scaling: str = "none"


@dataclass(frozen=True)
class LlamaConfig:
    arch: ClassVar[str] = ARCH
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    rms_eps: float
    rope: RopeParams = RopeParams()
    rope_freqs: bool = False            # the model has rope_freqs.weight (Llama 3 scaling)
    tied_embeddings: bool = True
    biases: frozenset = frozenset()     # projections with a bias tensor (see BIASED)
    context_length: int = 0
    qk_norm: bool = False               # per-head RMS norms of q and k before rope (Qwen3)

    @property
    def recurrent(self) -> tuple[bool, ...]:
        return (False,) * self.n_layer

    @property
    def layer_kinds(self) -> list[str]:
        return ["attention"] * self.n_layer

    @property
    def n_rot(self) -> int:
        return self.head_dim

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], tensor_names: set[str] | None = None,
                      n_vocab: int | None = None, source: str = "") -> "LlamaConfig":
        where = f"{source}: " if source else ""
        names = tensor_names or set()
        arch = cls.arch

        def get(key: str, default: Any = None) -> Any:
            full = f"{arch}.{key}"
            if full in meta:
                return meta[full]
            if default is None:
                raise KeyError(f"{where}missing GGUF key {full!r}")
            return default

        if int(get("expert_count", 0)) > 0:
            raise ValueError(f"{arch}.expert_count is {get('expert_count')}: mixture-of-experts "
                             f"(Mixtral-style) models are not supported")
        n_embd, n_head = int(get("embedding_length")), int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", 0)) or n_embd // n_head
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise ValueError(f"{arch}.attention.value_length differs from key_length")
        n_rot = int(get("rope.dimension_count", head_dim))
        if n_rot != head_dim:
            raise ValueError(f"{arch}.rope.dimension_count is {n_rot} but the heads have "
                             f"{head_dim} dimensions; llama.cpp rotates whole heads")
        if n_vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise KeyError(f"{where}cannot tell the vocabulary size (no tokenizer.ggml.tokens)")
            n_vocab = len(tokens)
        n_layer = int(get("block_count"))
        context = int(get("context_length", 0) or 0)
        return cls(
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=int(get("feed_forward_length")),
            n_head=n_head,
            n_head_kv=int(get("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_vocab=int(n_vocab),
            rms_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope=rope_params(meta, context, arch),
            rope_freqs="rope_freqs.weight" in names,
            tied_embeddings="output.weight" not in names,
            biases=frozenset(b for b in BIASED if f"blk.0.{b}.bias" in names),
            context_length=context,
            qk_norm="blk.0.attn_q_norm.weight" in names,
        )

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's expected shape in numpy order ([out, in] for matrices)."""
        e, hd = self.n_embd, self.head_dim
        q, kv = self.n_head * hd, self.n_head_kv * hd
        s: dict[str, tuple[int, ...]] = {
            "token_embd.weight": (self.n_vocab, e),
            "output_norm.weight": (e,),
        }
        if not self.tied_embeddings:
            s["output.weight"] = (self.n_vocab, e)
        if self.rope_freqs:
            s["rope_freqs.weight"] = (hd // 2,)
        outs = {"attn_q": (q, e), "attn_k": (kv, e), "attn_v": (kv, e), "attn_output": (e, q),
                "ffn_gate": (self.n_ff, e), "ffn_up": (self.n_ff, e), "ffn_down": (e, self.n_ff)}
        for i in range(self.n_layer):
            p = f"blk.{i}."
            s[p + "attn_norm.weight"] = (e,)
            s[p + "ffn_norm.weight"] = (e,)
            for name, shape in outs.items():
                s[p + name + ".weight"] = shape
                if name in self.biases:
                    s[p + name + ".bias"] = (shape[0],)
            if self.qk_norm:
                s[p + "attn_q_norm.weight"] = (hd,)
                s[p + "attn_k_norm.weight"] = (hd,)
        return s


def rope_params(meta: dict[str, Any], context_length: int, arch: str = ARCH) -> RopeParams:
    """llama.cpp's rope arguments for a GGUF of ``arch`` (see the module docstring)."""
    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    scaling = str(key("rope.scaling.type", "linear"))
    if scaling == "longrope":
        raise ValueError(f"{arch}.rope.scaling.type is 'longrope', which pytrain does not support")
    if scaling not in ROPE_SCALING:
        raise ValueError(f"{arch}.rope.scaling.type is {scaling!r}; supported: "
                         f"{', '.join(ROPE_SCALING)}")
    # llama.cpp reads the old rope.scale_linear only when rope.scaling.factor is absent
    factor = float(key("rope.scaling.factor") if f"{arch}.rope.scaling.factor" in meta
                   else key("rope.scale_linear", 0.0) or 0.0)
    freq_scale = 1.0 if factor == 0.0 or scaling == "none" else 1.0 / factor
    yarn = scaling == "yarn"
    return RopeParams(
        base=float(key("rope.freq_base", 10000.0)),
        freq_scale=freq_scale,
        ext_factor=1.0 if yarn else 0.0,
        attn_factor=float(key("rope.scaling.attn_factor", 1.0)),
        n_ctx_orig=int(key("rope.scaling.original_context_length", context_length) or 0),
        scaling="none" if scaling == "linear" and not factor else scaling,
    )
