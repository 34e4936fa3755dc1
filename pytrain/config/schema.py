"""The config's sections and keys: types, defaults, choices, checks and help text (one
dataclass per TOML section; ``describe`` prints them all)."""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, get_type_hints

from pytrain.errors import PytrainError

FORMATS = ("chat", "completion", "text", "auto")
MASKS = ("assistant_only", "completion_only", "all")
# Which masks make sense for which record format; the first is the format's default.
MASKS_FOR_FORMAT = {"chat": ("assistant_only", "all"),
                    "completion": ("completion_only", "all"),
                    "text": ("all",)}
OUTPUT_FORMATS = ("gguf", "peft")


def mask_for(fmt: str, mask: str | None = None) -> str:
    """The mask of records of format ``fmt``: ``mask`` (data.mask) or the format's default."""
    return mask if mask is not None else MASKS_FOR_FORMAT[fmt][0]


class ConfigError(PytrainError, ValueError):
    """A config file or override that is not valid; the message names key, file and line."""


def _opt(default: Any = None, help: str = "", *, choices: Sequence[Any] | None = None,
         check: Callable[[Any], str | None] | None = None, path: bool = False,
         factory: Callable[[], Any] | None = None, or_name: bool = False,
         names: bool = False) -> Any:
    """A dataclass field with help text, allowed values, a range check and a path flag;
    ``or_name``: a bare word (no folder, no suffix) that is no file there stays a name (a
    built-in chat template's); ``names``: a list of names, which ``--set`` may give as one
    bare word of them separated by commas or spaces (a list of text takes a bare word as
    one item)."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "check": check,
            "path": path, "or_name": or_name, "names": names}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _positive(v: Any) -> str | None:
    return None if v is None or v > 0 else "must be > 0"


def _non_negative(v: Any) -> str | None:
    return None if v is None or v >= 0 else "must be >= 0"


def _device(v: str) -> str | None:
    if v in ("cpu", "cuda", "vulkan", "auto"):
        return None
    host, _, port = v[len("rpc:"):].rpartition(":") if v.startswith("rpc:") else ("", "", "")
    if host and port.isdigit():
        return None
    return "must be 'cpu', 'cuda', 'vulkan', 'auto' or 'rpc:HOST:PORT'"


def _unit_interval(v: float) -> str | None:
    return None if 0.0 <= v < 1.0 else "must be in [0, 1)"


# ------------------------------------------------------------------------------- sections
@dataclass
class ModelConfig:
    """The frozen base model."""

    path: str | None = _opt(None, "GGUF model file (required)", path=True)
    device: str = _opt("auto", "compute device: cpu, cuda, vulkan, auto (cuda when available), or "
                       "rpc:HOST:PORT (the device a `python -m pytrain.rpc_server` serves)",
                       check=_device)
    threads: int | None = _opt(None, "CPU threads (unset: ggml's default)", check=_positive)
    type_policy: str = _opt("auto", "types the frozen weights are loaded as: auto (what every "
                            "op of the training graph supports on the device; for training, F32 "
                            "or F16 instead where a step was measured faster so and it fits "
                            "half the memory budget; with train.compute_type = bf16, "
                            "quantized types as BF16 copies where so measured faster and they "
                            "fit), f32, or keep (as stored; may be unsupported; with bf16 "
                            "compute: the quantized matrices kept, the float ones BF16)",
                            choices=("auto", "f32", "keep"))


@dataclass
class DataConfig:
    """Training and validation data and how it becomes batches."""

    train: str | None = _opt(None, "training data (required): a JSONL file, a Parquet file or "
                             "folder of Parquet files, or a datasets.save_to_disk folder (the "
                             "last two need pip install 'pytrain[datasets]'); rows in OpenAI "
                             "messages, ShareGPT conversations, Alpaca instruction/input/output, "
                             "prompt/completion or text columns", path=True)
    validation: str | None = _opt(None, "validation data, as data.train (unset or \"none\": "
                                  "none)", path=True)
    split: float = _opt(0.0, "fraction of the training examples held out for validation when "
                        "there is no validation file (0: none)", check=_unit_interval)
    format: str = _opt("auto", "record format: chat ({\"messages\": [...]}), completion "
                       "({\"prompt\", \"completion\"}), text ({\"text\"}), or auto (decided per "
                       "file from its first valid record)", choices=FORMATS)
    max_seq_len: int = _opt(1024, "longest example in tokens (and the packed row length)",
                            check=lambda v: None if v >= 2 else "must be >= 2")
    truncation: str = _opt("right", "longer examples: right (keep the start), left (keep the "
                           "end) or drop (skip them); counted either way",
                           choices=("right", "left", "drop"))
    packing: bool = _opt(False, "pack several examples into each row of max_seq_len tokens "
                         "(each keeps its own sample id, so no target crosses a sample)")
    mask: str | None = _opt(None, "which tokens are targets: assistant_only, completion_only "
                            "or all (unset: follows the format: assistant_only for chat, "
                            "completion_only for completion, all for text)", choices=MASKS)
    chat_template: str | None = _opt(None, "the chat template of chat records: a built-in "
                                     "one by name (gemma: Gemma's turn format, for Gemma GGUFs "
                                     "that carry no template) or a Jinja file (unset: the "
                                     "model's tokenizer.chat_template)", path=True, or_name=True)
    shuffle_seed: int | None = _opt(None, "seed of the batch order and the validation split "
                                    "(unset: train.seed)")
    on_error: str = _opt("stop", "bad records (malformed JSON, wrong types, unknown roles): stop "
                         "with an error naming file:line, or skip and count them",
                         choices=("stop", "skip"))


@dataclass
class LoraConfig:
    """The LoRA adapter: which tensors, what size, how initialised."""

    rank: int = _opt(16, "adapter rank r", check=_positive)
    alpha: float = _opt(32.0, "scale numerator: the update is (alpha / rank) * B A",
                        check=_positive)
    dropout: float = _opt(0.0, "PEFT's lora_dropout: each adapter's input dropped at this "
                          "rate in training (masks drawn on the host from lora.seed and the "
                          "step, so a resumed run draws the same); not with preference "
                          "objectives, for which TRL disables dropout", check=_unit_interval)
    targets: list[str] | None = _opt(None, "short tensor names to adapt (attn_q, attn_k, "
                                     "attn_v, attn_output, ffn_*, ...; `pytrain inspect` lists "
                                     "a model's); unset: the architecture's default, attention "
                                     "q/k/v/o", names=True)
    skip_ssm: bool = _opt(True, "never adapt the DeltaNet (linear-attention) layers; adapting "
                          "the recurrence destabilises sequential hybrids such as Qwen3.5")
    init: str = _opt("peft", "initialisation: peft (A Kaiming-uniform, B zero) or gaussian "
                     "(A ~ N(0, 1/rank), B zero); B = 0 so training starts at the base model",
                     choices=("peft", "gaussian"))
    use_rslora: bool = _opt(False, "rank-stabilised LoRA (PEFT's use_rslora): scale alpha / "
                            "sqrt(rank) instead of alpha / rank; the adapter GGUF holds "
                            "alpha·sqrt(rank), so llama.cpp applies the same scale")
    loraplus_lr_ratio: float | None = _opt(None, "LoRA+ (PEFT's create_loraplus_optimizer): "
                                           "the B matrices learn at train.lr times this ratio "
                                           "(the paper suggests 16; unset: plain LoRA)",
                                           check=_positive)
    seed: int | None = _opt(None, "seed of the adapter initialisation and dropout "
                            "(unset: train.seed)")


@dataclass
class TrainConfig:
    """Optimisation: steps, batch, AdamW, schedule, evaluation and saving cadence."""

    epochs: int = _opt(1, "passes over the training data (ignored when max_steps is set)",
                       check=_positive)
    max_steps: int | None = _opt(None, "optimizer steps to run; overrides epochs",
                                 check=_positive)
    batch_size: int = _opt(4, "examples (or packed rows) per micro-batch", check=_positive)
    grad_accum: int = _opt(1, "micro-batches per optimizer step; the loss is the token mean "
                           "over all of them", check=_positive)
    lr: float = _opt(1e-4, "peak learning rate", check=_positive)
    schedule: str = _opt("constant", "learning-rate schedule after warmup",
                         choices=("constant", "linear", "cosine"))
    warmup: int = _opt(0, "linear warmup steps from 0 to lr", check=_non_negative)
    weight_decay: float = _opt(0.0, "AdamW decoupled weight decay", check=_non_negative)
    max_grad_norm: float = _opt(1.0, "clip the global gradient norm to this (0 disables)",
                                check=_non_negative)
    seed: int = _opt(0, "run seed (also the default for data.shuffle_seed and lora.seed)")
    eval_every: int = _opt(0, "validate every N optimizer steps (0: only at the end)",
                           check=_non_negative)
    save_every: int = _opt(0, "checkpoint every N optimizer steps (0: only at the end)",
                           check=_non_negative)
    early_stopping_patience: int = _opt(0, "stop the run after this many validations in a "
                                        "row without a validation loss lower than the best by "
                                        "more than early_stopping_min_delta, as transformers' "
                                        "EarlyStoppingCallback (0: never; needs validation "
                                        "data and eval_every)", check=_non_negative)
    early_stopping_min_delta: float = _opt(0.0, "the least decrease of the validation loss "
                                           "that counts as an improvement for early stopping "
                                           "(EarlyStoppingCallback's early_stopping_threshold)",
                                           check=_non_negative)
    sample_every: int = _opt(0, "greedy generations from a few fixed prompts every N "
                             "optimizer steps, before the first and after the last, into "
                             "samples.jsonl and under the progress bar (0: never)",
                             check=_non_negative)
    sample_prompts: list[str] | None = _opt(None, "the prompts of the samples: a user message "
                                            "each (through the chat template when the "
                                            "training records are: chat records, "
                                            "conversational preference pairs; else raw "
                                            "text); "
                                            "unset: the prompts of the first sample_count "
                                            "validation examples (training examples without "
                                            "validation data)")
    sample_count: int = _opt(3, "how many examples' prompts the samples take when "
                             "sample_prompts is unset", check=_positive)
    sample_max_tokens: int = _opt(48, "the longest sample completion, in tokens",
                                  check=_positive)
    log_every: int = _opt(10, "print a line every N optimizer steps: the mean training loss "
                          "of those steps, learning rate, gradient norm, tokens/s (every "
                          "step is in metrics.jsonl regardless)", check=_positive)
    adam_beta1: float = _opt(0.9, "AdamW beta1", check=_unit_interval)
    adam_beta2: float = _opt(0.999, "AdamW beta2", check=_unit_interval)
    adam_eps: float = _opt(1e-8, "AdamW epsilon", check=_positive)
    recompute: str = _opt("auto", "activation memory: off (one graph per step keeps every "
                          "activation), layers (keep each layer's input only and recompute the "
                          "layer in the backward: a second forward, a fraction of the memory), "
                          "auto (layers when the one-graph step's compute buffer would need "
                          "over half of the memory left: the device's free memory, on CPU "
                          "also the container's cgroup limit, or train.memory_gib)",
                          choices=("auto", "off", "layers"))
    compute_type: str = _opt("f32", "precision of the products with the frozen weight "
                             "matrices: f32, or bf16 (CPU only: the matrices stored as BF16 and "
                             "multiplied on the CPU's bf16 units through oneDNN, forward and "
                             "backward, their other operand rounded to bf16, sums in f32; the "
                             "LoRA matrices, norms, attention and the loss stay f32; a "
                             "quantized type becomes BF16 copies where a bf16 step was measured "
                             "faster so and they fit in half the memory budget, else it keeps "
                             "its type and kernels; needs model.type_policy = auto or keep)",
                             choices=("f32", "bf16"))
    memory_gib: float | None = _opt(None, "memory (GiB, weights included) recompute = auto "
                                    "may plan a step for; unset: what the device has free "
                                    "(on CPU the least of available memory and the "
                                    "container's cgroup limit)", check=_positive)
    objective: str = _opt("sft", "what the run trains: sft (the masked cross-entropy of the "
                          "targets), dpo or orpo (preference pairs: {\"prompt\", \"chosen\", "
                          "\"rejected\"} records, TRL's formats; only completion tokens count)",
                          choices=("sft", "dpo", "orpo"))
    beta: float = _opt(0.1, "dpo: the KL strength beta of TRL's DPOTrainer; orpo: the weight "
                       "lambda of the odds-ratio term (TRL's ORPOConfig.beta)", check=_positive)
    loss_type: str = _opt("sigmoid", "dpo: TRL's loss_type: sigmoid (DPO), ipo (on "
                          "length-normalised log-ratios), hinge, or robust (with "
                          "label_smoothing)", choices=("sigmoid", "ipo", "hinge", "robust"))
    label_smoothing: float = _opt(0.0, "dpo robust: the assumed fraction of flipped "
                                  "preference labels, in [0, 0.5)",
                                  check=lambda v: None if 0.0 <= v < 0.5 else "must be in [0, 0.5)")
    loss_bug_repro: bool = _opt(False, "reproduces the unfixed masking bug for the regression "
                                "experiments ONLY: pad labels trained, division by all rows, "
                                "prompt not masked; never for real training")


@dataclass
class OutputConfig:
    """Where the run writes adapters, checkpoints, logs and the resolved config."""

    dir: str | None = _opt(None, "run folder (unset: runs/<config name> under the working "
                           "directory)", path=True)
    formats: list[str] = _opt(help="adapter formats written: gguf (llama.cpp --lora) and/or "
                              "peft (adapter_model.safetensors + adapter_config.json)",
                              factory=lambda: ["gguf"], names=True)
    keep_checkpoints: int = _opt(3, "periodic checkpoints kept (0: keep all)",
                                 check=_non_negative)
    tensorboard: bool = _opt(False, "also write TensorBoard event files into the run folder "
                             "(scalars of the steps and validations, the samples as text); "
                             "needs pip install 'pytrain[tensorboard]'")


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "lora": LoraConfig,
                             "train": TrainConfig, "output": OutputConfig}
REQUIRED = ("model.path", "data.train")


@dataclass
class Config:
    """A whole, validated run configuration; ``source`` is the file it came from, if any."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    source: str | None = field(default=None, compare=False)
    # "section.key" -> where its value came from ("file:line" or "--set ..."), for error()
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (JSON-ready; unset values are None), one entry per section."""
        return {name: {f.name: _copy(getattr(getattr(self, name), f.name))
                       for f in dataclasses.fields(cls)}
                for name, cls in SECTIONS.items()}

    def to_toml(self) -> str:
        """The config as TOML that :func:`load_config` reads back to an equal Config (paths
        are absolute; unset values are left out, TOML having no null)."""
        lines = [f"# resolved pytrain config{f' (from {self.source})' if self.source else ''}"]
        for name, values in self.to_dict().items():
            lines.append(f"\n[{name}]")
            for k, v in values.items():
                if v is not None:
                    lines.append(f"{k} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"

    def error(self, section: str, key: str, msg: str) -> ConfigError:
        """An error about ``section.key`` found after loading (a LoRA target the model does
        not have), located like a loading error: the file and line, or the ``--set``."""
        name = f"{section}.{key}"
        where = self.origins.get(name) or self.source or "<defaults>"
        return ConfigError(f"{where}: {name}: {msg}")


def _copy(v: Any) -> Any:
    return list(v) if isinstance(v, list) else v


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


# ------------------------------------------------------------------------------- help
def describe() -> str:
    """Every section and key with its type, default and help text (for ``--help`` output)."""
    out = []
    for section, cls in SECTIONS.items():
        out.append(f"[{section}]  {(cls.__doc__ or '').strip()}")
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tname = re.sub(r"<class '(\w+)'>|typing\.", r"\1", str(hints[f.name]))
            dflt = "unset" if default is None else _toml_value(default)
            out.append(f"  {f.name} ({tname}, default {dflt}): {f.metadata['help']}")
            if f.metadata.get("choices"):
                out.append(f"      one of: {', '.join(map(str, f.metadata['choices']))}")
        out.append("")
    return "\n".join(out)
