"""Shared pieces for the Qwen3.5 reference-fixture scripts (not part of the pytrain package).

Why: pytrain's Qwen3.5 graph must match HF transformers and llama.cpp's GGUF format.  The fixture
scripts (`scripts/make_qwen35_fixtures.py`, `scripts/make_default_model.py`) build small random or
briefly trained HF `Qwen3_5ForCausalLM` models, convert them with the pinned llama.cpp converter and
record golden outputs.  This module holds what they share: a trained byte-level BPE tokenizer in
Qwen's format, a deterministic synthetic English corpus, the chat template, model construction and
weight randomisation, and the converter call (with `tokenizer.ggml.pre` forced to `qwen35`);
`scripts/qwen35_gguf.py` reads the converted files.

How: it needs the reference stack of `scripts/requirements-reference.txt`, kept outside the repo:

    python3 -m venv /opt/refenv
    /opt/refenv/bin/pip install -r scripts/requirements-reference.txt

and is imported by the scripts above, run from the repo root with that interpreter, e.g.
`/opt/refenv/bin/python -m scripts.make_qwen35_fixtures`.  The pinned llama.cpp source is found
(and fetched once, verified by sha256) through `native/build.py`; the converter runs in a child
process with the archive's own `gguf-py` on its PYTHONPATH, so it uses the pinned gguf package.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

from scripts import native_build  # native/build.py as a module

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# pinned llama.cpp source
# --------------------------------------------------------------------------------------------


def llama_cpp_dir() -> Path:
    """vendor/llama.cpp of the pinned llama-cpp-python archive (fetched and verified once)."""
    nb = native_build.load()
    nb.extract_source()
    return nb.llama_cpp_dir()


def fix_hash_seed(module: str) -> None:
    """Re-run ``python -m module`` with the same arguments under PYTHONHASHSEED=0 unless it is
    already: PEFT writes target_modules in set order, so fixed string hashes make its
    adapter_config.json the same bytes on every run."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]],
                  {**os.environ, "PYTHONHASHSEED": "0"})


def chat_template_text() -> str:
    return (llama_cpp_dir() / "models" / "templates" / "Qwen3.5-4B.jinja").read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------

# llama.cpp src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN35 (the tokenizer.json regex with the
# case-insensitive group spelled out).
QWEN35_PRE_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5's added tokens, in Qwen's order (ids follow the regular BPE vocabulary, as in the real
# model where <|endoftext|> is 248044 and <|vision_start|>/<|image_pad|> are +9/+12).  The flag is
# `special` as in Qwen's tokenizer.json: the <tag> ones are plain added tokens there.
QWEN35_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


def train_tokenizer(corpus: list[str], vocab_size: int, n_pad: int = 6):
    """Byte-level BPE in Qwen2/3.5 style: Split(qwen35 regex) + ByteLevel, no normalizer.

    The model's vocab_size is `vocab_size`; the BPE part gets vocab_size - n_pad - len(added)
    entries (256 bytes + merges), then Qwen's added tokens, and the last `n_pad` ids stay unused
    (the converter writes them as [PAD<i>] UNUSED, as for the real padded Qwen vocabularies).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    n_regular = vocab_size - n_pad - len(QWEN35_ADDED_TOKENS)
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=n_regular, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(corpus, trainer=trainer)
    got = tok.get_vocab_size()
    if got != n_regular:
        raise RuntimeError(f"BPE training gave {got} tokens, wanted {n_regular}: enlarge the corpus")
    for text, special in QWEN35_ADDED_TOKENS:
        t = AddedToken(text, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
        if special:
            tok.add_special_tokens([t])
        else:
            tok.add_tokens([t])
    assert tok.token_to_id(QWEN35_ADDED_TOKENS[0][0]) == n_regular
    assert tok.get_vocab_size() == vocab_size - n_pad
    return tok


def save_tokenizer_dir(tok, out_dir: Path, model_max_length: int = 4096) -> None:
    """tokenizer.json + tokenizer_config.json (chat_template = pinned Qwen3.5-4B.jinja)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {}
    for text, special in QWEN35_ADDED_TOKENS:
        added[str(tok.token_to_id(text))] = {
            "content": text, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special,
        }
    cfg = {
        # the generic fast tokenizer: loads tokenizer.json as it is (Qwen3_5Tokenizer would add NFC)
        "tokenizer_class": "TokenizersBackend",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template_text(),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")


def load_hf_tokenizer(tok_dir: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tok_dir))


def render_chat(hf_tok, messages: list[dict], add_generation_prompt: bool = False, **kw) -> str:
    return hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


# --------------------------------------------------------------------------------------------
# synthetic corpus
# --------------------------------------------------------------------------------------------

NAMES = ["Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Max", "Emma", "Leo", "Zoe", "Jack", "Ella",
         "Noah", "Ruby", "Finn", "Grace", "Oscar", "Isla", "Hugo", "Nora"]
OBJECTS = ["ball", "book", "cup", "hat", "box", "kite", "pen", "bag", "lamp", "chair", "table",
           "apple", "cake", "boat", "car", "key", "coat", "shoe", "clock", "map", "bell", "spoon"]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "brown", "pink", "orange", "grey"]
PLACES = ["park", "school", "garden", "kitchen", "shop", "library", "beach", "forest", "farm",
          "station", "market", "river", "hill", "house", "town", "field"]
ANIMALS = ["cow", "dog", "cat", "duck", "sheep", "pig", "horse", "snake", "lion", "owl", "frog",
           "bee", "hen", "goat", "mouse", "fox"]
VERBS_PAST = ["saw", "found", "took", "made", "liked", "painted", "lost", "bought", "carried", "washed"]
ADJ = ["big", "small", "old", "new", "happy", "quiet", "tall", "warm", "cold", "soft", "bright", "little"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WEATHER = ["sunny", "rainy", "windy", "cloudy", "cold", "warm", "snowy"]
FOODS = ["bread", "soup", "rice", "cheese", "pizza", "salad", "banana", "carrot", "honey", "pancakes",
         "sandwich", "chocolate", "strawberries", "potatoes", "noodles", "biscuits"]
JOBS = ["teacher", "doctor", "farmer", "baker", "driver", "painter", "singer", "gardener", "pilot",
        "nurse", "builder", "writer", "fisherman", "librarian", "scientist"]
ACTIVITIES = ["reading", "swimming", "running", "singing", "drawing", "cooking", "dancing", "walking",
              "climbing", "sleeping", "writing", "listening to music", "playing football", "building a tower"]
TIMES = ["yesterday", "this morning", "in the afternoon", "after breakfast", "before dinner",
         "every evening", "last summer", "on the weekend", "during the holidays", "at midnight"]
FEELINGS = ["happy", "tired", "hungry", "excited", "surprised", "worried", "sleepy", "proud", "curious"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve"]


def english_sentence(rng: random.Random, rich: bool = False) -> str:
    """One random sentence.  rich=True adds later forms (jobs, foods, activities); the default keeps
    the exact random stream the committed fixtures were made from."""
    n, m = rng.sample(NAMES, 2)
    o, c, p, a, v, j = (rng.choice(OBJECTS), rng.choice(COLOURS), rng.choice(PLACES), rng.choice(ANIMALS),
                        rng.choice(VERBS_PAST), rng.choice(ADJ))
    k = rng.randint(2, 12)
    forms = [
        f"{n} has a {c} {o}.",
        f"The {o} is {c}.",
        f"{n} went to the {p} with {m}.",
        f"{n} {v} a {j} {o} at the {p}.",
        f"There is a {a} in the {p}.",
        f"The {j} {a} is near the {o}.",
        f"{n} saw {NUMBER_WORDS[k]} {a}s at the {p}.",
        f"{m} says that the {o} is {j}.",
        f"{n} says hello to {m}.",
        f"On {rng.choice(DAYS)} it was {rng.choice(WEATHER)}, so {n} stayed at the {p}.",
        f"Where is the {o}? It is in the {p}.",
        f"{n} and {m} like to play in the {p}.",
        f"The {a} sleeps in the {p} at night.",
        f"{n} gave {m} {k} {o}s.",
        f"I think the {c} {o} belongs to {n}.",
        f"We can see a {a} from the {p}.",
        f"{n} counts: " + ", ".join(str(i) for i in range(1, k + 1)) + ".",
        f"{k} plus {k + 1} is {2 * k + 1}.",
        f"Today is {rng.choice(DAYS)}. The weather is {rng.choice(WEATHER)}.",
        f"\"Can I have the {o}?\" asked {n}. \"Yes, you can,\" said {m}.",
        f"The {a} and the {rng.choice(ANIMALS)} are friends.",
        f"{n}'s {o} isn't {c}, it's {rng.choice(COLOURS)}.",
    ]
    if not rich:
        return rng.choice(forms)
    forms += [
        f"{n} is a {rng.choice(JOBS)} and works in the {p}.",
        f"{rng.choice(TIMES).capitalize()}, {n} was {rng.choice(ACTIVITIES)} with {m}.",
        f"{n} likes {rng.choice(ACTIVITIES)} because it makes {n} feel {rng.choice(FEELINGS)}.",
        f"For lunch {n} ate {rng.choice(FOODS)} and {m} had {rng.choice(FOODS)}.",
        f"{n} felt {rng.choice(FEELINGS)} when the {rng.choice(JOBS)} arrived {rng.choice(TIMES)}.",
        f"The {rng.choice(JOBS)} asked {n} to bring the {o} to the {p}.",
        f"Everyone in the {p} remembered the wonderful {rng.choice(FOODS)} that {n} made.",
    ]
    return rng.choice(forms)


def english_paragraph(rng: random.Random, n_min: int = 2, n_max: int = 6, rich: bool = False) -> str:
    return " ".join(english_sentence(rng, rich) for _ in range(rng.randint(n_min, n_max)))


def english_story(rng: random.Random, n_min: int = 3, n_max: int = 7) -> str:
    """A paragraph about a few fixed characters and things, so later words repeat earlier ones
    (a reason for a model to learn to look back and copy)."""
    n, m = rng.sample(NAMES, 2)
    o, o2 = rng.sample(OBJECTS, 2)
    c, c2 = rng.sample(COLOURS, 2)
    p, a, f, j = rng.choice(PLACES), rng.choice(ANIMALS), rng.choice(FOODS), rng.choice(JOBS)
    forms = [
        lambda: f"{n} took the {c} {o} to the {p}.",
        lambda: f"The {o} is {c}.",
        lambda: f"{m} has a {c2} {o2}.",
        lambda: f"{n} and {m} went to the {p}.",
        lambda: f"At the {p}, {n} saw a {a}.",
        lambda: f"The {a} looked at the {c} {o}.",
        lambda: f"{m} liked the {c} {o}.",
        lambda: f"{n} gave the {o} to {m}.",
        lambda: f"Now {m} has the {c} {o}.",
        lambda: f"{m} put the {o2} next to the {o}.",
        lambda: f"{n} is a {j}.",
        lambda: f"{n} ate {f} at the {p} with {m}.",
        lambda: f"Then {n} said: \"I like my {c} {o}.\"",
        lambda: f"Where is the {o}? It is in the {p}.",
        lambda: f"What colour is the {o2}? The {o2} is {c2}.",
        lambda: f"The {a} followed {n} and {m} home.",
        lambda: f"{m} says the {o2} is {c2}.",
    ]
    return " ".join([f"{n} has a {c} {o}."] + [rng.choice(forms)() for _ in range(rng.randint(n_min, n_max))])


def english_corpus(seed: int, n_paragraphs: int, rich: bool = False) -> list[str]:
    rng = random.Random(seed)
    out = [english_paragraph(rng, rich=rich) for _ in range(n_paragraphs)]
    # words of the chat markup, so the tokenizer has merges for them
    out += ["system\nuser\nassistant\nthink\n"] * 20
    return out


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------

def qwen35_text_config(**kw):
    """A Qwen3_5TextConfig with real Qwen3.5 conventions (rope 1e7, partial 0.25, mrope sections)."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    base = dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        hidden_act="silu",
        attention_bias=False,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        bos_token_id=None,
        pad_token_id=None,
        use_cache=True,
    )
    base.update(kw)
    cfg = Qwen3_5TextConfig(**base)
    cfg._attn_implementation = "eager"
    return cfg


def build_model(cfg, seed: int):
    import torch
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    return model.float().eval()


def randomize_weights(model, seed: int, embed_std: float = 0.3, norm_std: float = 0.2) -> None:
    """Visible-scale random weights; nothing left at zero or identity.

    Linear layers N(0, 1/fan_in) (out projections half that scale), embeddings N(0, embed_std),
    zero-centred RMSNorm weights N(0, norm_std) (HF computes x * (1 + w)), the DeltaNet gated norm
    1 + N(0, norm_std), conv N(0, 0.3), A_log = log U(0.1, 2), dt_bias U(-1, 1).
    """
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda t: t[0]):
            shape = p.shape
            if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
                v = torch.randn(shape, generator=g) * embed_std
            elif name.endswith("linear_attn.norm.weight"):
                v = 1.0 + torch.randn(shape, generator=g) * norm_std
            elif name.endswith("norm.weight"):
                v = torch.randn(shape, generator=g) * norm_std
            elif name.endswith("A_log"):
                v = torch.log(torch.rand(shape, generator=g) * 1.9 + 0.1)
            elif name.endswith("dt_bias"):
                v = torch.rand(shape, generator=g) * 2.0 - 1.0
            elif name.endswith("conv1d.weight"):
                v = torch.randn(shape, generator=g) * 0.3
            elif p.ndim == 2:
                fan_in = shape[1]
                scale = 0.5 if (name.endswith("o_proj.weight") or name.endswith("out_proj.weight")
                                or name.endswith("down_proj.weight")) else 1.0
                v = torch.randn(shape, generator=g) * (scale / fan_in ** 0.5)
            else:
                raise RuntimeError(f"no init rule for {name} {tuple(shape)}")
            p.copy_(v)


def hf_logprobs(model, tokens: list[int]):
    """log_softmax of HF float32 logits for one sequence run alone (no padding, no mask)."""
    import torch
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens], dtype=torch.long), use_cache=False)
        lp = torch.log_softmax(out.logits[0].double(), dim=-1).float()
    return lp.numpy()


def save_hf_checkpoint(model, tok_dir: Path, out_dir: Path) -> None:
    """model (safetensors, config.json) + the tokenizer files, ready for the converter."""
    import shutil
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out_dir / f)


# --------------------------------------------------------------------------------------------
# float64 runs of HF models
# --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def true_float64(modeling):
    """Run an HF model of the modeling module ``modeling`` (e.g.
    ``transformers.models.qwen3_5.modeling_qwen3_5``) entirely in float64.  Modeling code has
    float32 islands (RMSNorm via ``x.float()`` or ``.to(torch.float32)``, ``softmax(dtype=
    torch.float32)``, rope, Qwen3.5's torch DeltaNet fallback); inside this context the
    module's ``torch.float32``/``torch.float`` mean float64 and ``Tensor.float()`` means
    ``.double()``.  A TorchFunctionMode records the dtype of every floating tensor an op
    returns, so the caller can prove nothing ran in float32."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Torch64(types.ModuleType):
        def __getattr__(self, k):
            return getattr(torch, k)

    proxy = Torch64("torch_float64")
    proxy.float32 = proxy.float = torch.float64
    seen = set()

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    seen.add(t.dtype)
            return out

    old_torch, old_float = modeling.torch, torch.Tensor.float
    modeling.torch = proxy
    torch.Tensor.float = lambda self, *a, **k: self.double()
    try:
        with Watch():
            yield seen
    finally:
        modeling.torch, torch.Tensor.float = old_torch, old_float


# --------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------

# Patches applied to the converter's classes before it runs.  It recognises pre-tokenizers by
# hashing the token ids of a probe string; a custom vocabulary matches nothing
# (NotImplementedError), and ours is built with the qwen35 regex.
PRE_QWEN35 = '_b.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"'
# convert_lora_to_gguf.py has no --no-mtp; the Qwen3.5 class asserts on MTP layers otherwise.
NO_MTP = "_b.ModelBase.no_mtp = True"

_BOOTSTRAP = """
import runpy, sys
import conversion.base as _b
{patch}
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_converter(script: str, args: list[str], patch: str = PRE_QWEN35) -> str:
    """Run one of the pinned llama.cpp converters (``convert_hf_to_gguf.py``,
    ``convert_lora_to_gguf.py``) in a child process, as users do, with the archive's own
    ``conversion`` and ``gguf-py`` on its PYTHONPATH and ``patch`` applied first; its stderr."""
    llama = llama_cpp_dir()
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(llama), str(llama / "gguf-py")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run([sys.executable, "-c", _BOOTSTRAP.format(patch=patch), str(llama / script),
                        *args], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-8000:])
        raise RuntimeError(f"{script} {' '.join(args)} failed")
    return r.stderr


def convert_to_gguf(hf_dir: Path, out_path: Path, outtype: str, quiet: bool = True) -> Path:
    """Run the pinned convert_hf_to_gguf.py (--no-mtp, pre forced to qwen35) in a subprocess."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log = run_converter("convert_hf_to_gguf.py", [str(hf_dir), "--outfile", str(out_path),
                                                  "--outtype", outtype, "--no-mtp"])
    if not quiet:
        sys.stderr.write(log[-3000:])
    return out_path
