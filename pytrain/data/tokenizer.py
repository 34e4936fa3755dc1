"""The GGUF's tokenizer rebuilt from its metadata, matching llama.cpp token for token: byte-level
BPE (``tokenizer.ggml.model = gpt2``: Qwen, Llama 3, SmolLM2) and SentencePiece-style BPE
(``llama``: Gemma 3, Llama 2).

The GGUF (and llama.cpp reading it) is the authority, not the model's HF ``tokenizer.json``:
training must see exactly the ids llama.cpp will feed the adapted model.  So there is no
normalizer (transformers' Qwen3.5 tokenizer applies NFC, llama.cpp does not), the split regex
is llama.cpp's own spelling for the GGUF's ``tokenizer.ggml.pre``, and special-token handling
follows ``llama_vocab::tokenizer_st_partition``:

* CONTROL (and UNKNOWN) tokens are matched in text only when ``parse_special`` is true;
* USER_DEFINED tokens (e.g. ``<think>`` in Qwen3.5) are always matched, whatever the flag.

The ``tokenizers`` library does the work (Rust BPE, offsets for loss masks): CONTROL tokens are
its "special" added tokens and USER_DEFINED its non-special ones, and its
``encode_special_tokens`` switch gives exactly the ``parse_special=False`` behaviour.

SentencePiece-style vocabularies (``llm_tokenizer_spm`` in llama.cpp) have scores instead of
merges: spaces become ``▁``, each character is a symbol, and the adjacent pair whose
concatenation is the vocabulary's highest-scoring token is merged first, until no pair is a
token; a character that is no token becomes its UTF-8 bytes' ``<0xXX>`` tokens.  That is BPE
with the merges (a, b) of every token a+b, ranked by the score of a+b, and byte fallback:
``spm_merges`` lists them.  A leading-space prefix (``add_space_prefix``, Llama 2) is refused:
llama.cpp adds it per text fragment, which is not reproduced here.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from pytrain.errors import PytrainError

# llama_token_type values written by the converters (gguf.TokenType).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"


@dataclass(frozen=True)
class _PreTokenizer:
    """One of llama.cpp's pre-tokenizer types (``src/llama-vocab.cpp``), copied verbatim.
    With several regexes, each splits the pieces the one before it left (llama.cpp's
    ``unicode_regex_split``), matched and unmatched stretches alike."""

    regex: str
    first: tuple[str, ...] = ()   # regexes applied before ``regex``
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_QWEN2 = _PreTokenizer(
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = _PreTokenizer(
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = _PreTokenizer(
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+", ignore_merges=True, add_bos=True)
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_GPT2 = _PreTokenizer(_GPT2_REGEX)
# STARCODER / REFACT / SMOLLM (and COMMAND_R, ...): every digit alone, then GPT-2's split
_DIGITS_THEN_GPT2 = _PreTokenizer(_GPT2_REGEX, first=(r"\p{N}",))

# Only pre-tokenizers whose llama.cpp test vectors pass are listed (tests/test_tokenizer.py).
PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "qwen35": _QWEN35,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "gpt-2": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
}

# Texts llama.cpp treats as end-of-generation whatever the GGUF says (llama-vocab.cpp's
# "auto-detect special tokens by text" list); used to find where an assistant turn ends.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>", "<|eom_id|>",
    "<|return|>", "<|call|>", "<|calls|>", "<|flush|>",
})


class TokenizerError(PytrainError, ValueError):
    """GGUF tokenizer metadata that pytrain cannot reproduce exactly."""


SPM_SPACE = "\u2581"                     # ▁, SentencePiece's space


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every (a, b) whose concatenation is a token, a and b tokens too, best score first (the
    order llama.cpp's SPM session merges them in; ties by token id)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                found.append((-float(scores[i]), i, k))
    found.sort()
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in found]


def _opt_int(meta: dict[str, Any], key: str) -> int | None:
    v = meta.get(key)
    return None if v is None else int(v)


class Tokenizer:
    """A GGUF vocabulary as an encoder/decoder; see the module docstring for the rules."""

    def __init__(self, tokens: Sequence[str], token_types: Sequence[int], merges: Sequence[str],
                 pre: str, *, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None, eot_id: int | None = None, add_bos: bool | None = None,
                 add_eos: bool = False, chat_template: str | None = None, model: str = "gpt2",
                 scores: Sequence[float] | None = None) -> None:
        if model == "llama":                      # SentencePiece-style: no pre-tokenizer
            pre = "default"
        elif pre not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"unsupported tokenizer.ggml.pre {pre!r}: pytrain supports "
                f"{', '.join(sorted(PRE_TOKENIZERS))}")
        if len(token_types) != len(tokens):
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(token_types)} entries but "
                                 f"tokenizer.ggml.tokens has {len(tokens)}")
        spec = PRE_TOKENIZERS.get(pre, _PreTokenizer("", add_bos=True))
        self.pre, self.model = pre, model
        self._tokens = list(tokens)
        self._types = [int(t) for t in token_types]
        self.bos_id, self.eos_id, self.pad_id, self.eot_id = bos_id, eos_id, pad_id, eot_id
        for name in ("bos_id", "eos_id", "pad_id", "eot_id"):
            tid = getattr(self, name)
            if tid is not None and not 0 <= tid < len(self._tokens):
                raise TokenizerError(f"{name} {tid} is outside the vocabulary of {len(self._tokens)}")
        self.add_bos = spec.add_bos if add_bos is None else bool(add_bos)
        self.add_eos = bool(add_eos)
        if self.add_bos and bos_id is None:
            raise TokenizerError("add_bos_token is set but the GGUF has no bos_token_id")
        if self.add_eos and eos_id is None:
            raise TokenizerError("add_eos_token is set but the GGUF has no eos_token_id")
        self.chat_template = chat_template
        self.source: str | None = None   # the model file it came from (load_model sets it)

        # llama.cpp's token_to_id map: a later duplicate wins.
        vocab = {tok: i for i, tok in enumerate(self._tokens)}
        if model == "llama":
            tk = self._spm_backend(vocab, scores)
        else:
            tk = self._byte_level_backend(vocab, merges, spec)
        added = []
        for i, (tok, ty) in enumerate(zip(self._tokens, self._types)):
            if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED) and tok and vocab[tok] == i:
                added.append(AddedToken(tok, special=ty != TOKEN_USER_DEFINED, normalized=False,
                                        single_word=False, lstrip=False, rstrip=False))
        tk.add_tokens(added)
        self._hf = tk
        self._hf_raw_text: _HFTokenizer | None = None  # built on first parse_special=False call
        self._lock = threading.Lock()
        self._control = frozenset(i for i, t in enumerate(self._types)
                                  if t in (TOKEN_CONTROL, TOKEN_UNKNOWN))

    @staticmethod
    def _byte_level_backend(vocab: dict[str, int], merges: Sequence[str],
                            spec: _PreTokenizer) -> _HFTokenizer:
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise TokenizerError(f"malformed merge {m!r} in tokenizer.ggml.merges")
            pairs.append((a, b))
        tk = _HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges,
                                     byte_fallback=False, fuse_unk=False))
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
              for r in (*spec.first, spec.regex)),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        tk.decoder = decoders.ByteLevel()
        return tk

    def _spm_backend(self, vocab: dict[str, int], scores: Sequence[float] | None) -> _HFTokenizer:
        if scores is None or len(scores) != len(self._tokens):
            raise TokenizerError("a SentencePiece-style vocabulary needs tokenizer.ggml.scores, "
                                 "one per token")
        missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
        if missing:
            raise TokenizerError(f"the vocabulary lacks byte tokens such as {missing[0]} "
                                 f"(llama.cpp's byte fallback needs all 256)")
        tk = _HFTokenizer(models.BPE(vocab=vocab, merges=spm_merges(self._tokens, scores),
                                     byte_fallback=True, fuse_unk=False))
        tk.normalizer = normalizers.Replace(" ", SPM_SPACE)
        tk.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(),
                                        decoders.Fuse()])
        return tk

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        """Build from :func:`pytrain.formats.gguf_meta.read_metadata` output."""
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise TokenizerError(f"unsupported tokenizer.ggml.model {model!r}: pytrain supports "
                                 "byte-level BPE ('gpt2') and SentencePiece-style BPE ('llama')")
        if model == "llama" and meta.get("tokenizer.ggml.add_space_prefix", True):
            raise TokenizerError("tokenizer.ggml.add_space_prefix is true (or absent, which "
                                 "llama.cpp reads as true): pytrain does not reproduce llama.cpp's "
                                 "per-fragment space prefix")
        needed = ("tokenizer.ggml.tokens",
                  "tokenizer.ggml.merges" if model == "gpt2" else "tokenizer.ggml.scores")
        for key in needed:
            if key not in meta:
                raise TokenizerError(f"GGUF metadata lacks {key}")
        tokens = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        pre = meta.get("tokenizer.ggml.pre", "default")
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        return cls(tokens, types, meta.get("tokenizer.ggml.merges", ()), pre,
                   model=model, scores=meta.get("tokenizer.ggml.scores"),
                   bos_id=_opt_int(meta, "tokenizer.ggml.bos_token_id"),
                   eos_id=_opt_int(meta, "tokenizer.ggml.eos_token_id"),
                   pad_id=_opt_int(meta, "tokenizer.ggml.padding_token_id"),
                   eot_id=_opt_int(meta, "tokenizer.ggml.eot_token_id"),
                   add_bos=None if add_bos is None else bool(add_bos),
                   add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                   chat_template=meta.get("tokenizer.chat_template"))

    # -- encoding -------------------------------------------------------------------------
    def _backend(self, parse_special: bool) -> _HFTokenizer:
        if parse_special:
            return self._hf
        # A second instance rather than toggling the flag on the shared one, so concurrent
        # callers (data-loader threads) never see each other's setting.
        with self._lock:
            if self._hf_raw_text is None:
                raw = _HFTokenizer.from_str(self._hf.to_str())
                raw.encode_special_tokens = True
                self._hf_raw_text = raw
        return self._hf_raw_text

    def encode_with_offsets(self, text: str, add_special: bool = False, parse_special: bool = True
                            ) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and, per id, the ``(start, end)`` character range of ``text`` it came from.

        BOS/EOS added by ``add_special`` get empty ranges at the start/end.  A character that
        byte-level BPE splits over several tokens is reported by each of them.
        """
        enc = self._backend(parse_special).encode(text, add_special_tokens=False)
        ids, offsets = list(enc.ids), [tuple(o) for o in enc.offsets]
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
            offsets.insert(0, (0, 0))
        if add_special and self.add_eos:
            ids.append(self.eos_id)
            offsets.append((len(text), len(text)))
        return ids, offsets

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Like llama.cpp's ``llama_tokenize(text, add_special, parse_special)``."""
        return self.encode_with_offsets(text, add_special, parse_special)[0]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; ``skip_special`` drops CONTROL tokens (USER_DEFINED ones stay, as in
        llama.cpp's detokenizer)."""
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    # -- vocabulary -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    @property
    def eog_ids(self) -> list[int]:
        """Tokens that end a turn or generation: eot, eos, and the control tokens llama.cpp
        recognises as end-of-generation by their text (e.g. ``<|im_end|>``)."""
        ids = {i for i in (self.eot_id, self.eos_id) if i is not None}
        ids |= {i for i in self._control if self._tokens[i] in _EOG_TEXTS}
        return sorted(ids)

    def special_tokens_map(self) -> dict[str, str]:
        """``bos_token``/``eos_token``/... strings, as transformers passes them to templates."""
        out = {}
        for name, tid in (("bos_token", self.bos_id), ("eos_token", self.eos_id),
                          ("pad_token", self.pad_id)):
            if tid is not None:
                out[name] = self._tokens[tid]
        return out

    def __repr__(self) -> str:
        return (f"Tokenizer(pre={self.pre!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, pad={self.pad_id}, eot={self.eot_id}, add_bos={self.add_bos})")
