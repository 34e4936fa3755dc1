"""The Python API: what the ``pytrain`` command does, as functions the command itself calls.

    result = pytrain.train("config/demo.toml", overrides={"train.max_steps": 50})
    with pytrain.load(result.config.model.path, adapter=result.adapter) as model:
        print(model.generate([{"role": "user", "content": "What does the cow say?"}]))
    pytrain.export(result.config.model.path, result.adapter, format="peft", out="peft-adapter")

Why one module for both: the command line and a Python caller go the same way (config
resolution, the run, evaluation, export), so what one does the other does, bit for bit; the
command adds only its messages and exit statuses.  Errors are the package's own exceptions
(``ConfigError`` naming file:line, ``DataError``, ``RunError``, ...; all ``PytrainError``).

Nothing here loads ggml at import time: ``import pytrain`` stays light, and the native
library loads on the first call that needs it.  In the layer order (tests/test_layers.py)
this module sits above ``train`` and below ``cli``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from pytrain.errors import PytrainError

if TYPE_CHECKING:                  # names for the annotations only: importing them loads ggml
    import numpy as np

    from pytrain.config import Config, DataConfig
    from pytrain.data.tokenizer import Tokenizer
    from pytrain.formats.merge import MergeReport
    from pytrain.models.lora import LoraAdapter
    from pytrain.models.model import Model
    from pytrain.run.loop import RunResult as _RunOutcome

__all__ = ["EvalResult", "ExportOutputError", "ExportResult", "LoadedModel",
           "PreferenceEvalResult", "RunResult", "export", "load", "load_adapter",
           "resolve_config", "train"]

EXPORT_FORMATS = ("peft", "gguf-merged")


# --------------------------------------------------------------------------- config

def resolve_config(config: str | os.PathLike[str] | Config | Mapping[str, Any],
                   overrides: Mapping[str, Any] | Iterable[str] | None = None) -> Config:
    """The checked ``Config`` a run uses, from a TOML file, a ``Config``, or a dict of the
    file's tables, with ``overrides`` applied.

    ``overrides``: ``{"section.key": value}`` with Python values (``{"train.max_steps": 50,
    "output.dir": tmp}``), checked like the file's keys and named in errors as
    ``overrides['train.max_steps']``; the command line passes its ``--set section.key=value``
    strings here instead (values read as TOML literals).  A ``Config`` without overrides is
    used as it is; with overrides its resolved values are checked again with them applied
    (seeds that followed ``train.seed`` keep the value they were resolved to).
    Raises ``ConfigError`` (file:line or the override, and the key).
    """
    from pytrain.config import Config, load_config
    if not isinstance(config, Config):
        return load_config(config, overrides or ())
    if not overrides:
        return config
    tables = {name: {k: v for k, v in values.items() if v is not None}
              for name, values in config.to_dict().items()}
    cfg = load_config(tables, overrides)
    cfg.source = config.source
    cfg.origins = {**config.origins, **{k: v for k, v in cfg.origins.items()
                                        if not v.startswith("<dict>")}}
    return cfg


# --------------------------------------------------------------------------- train

@dataclass
class RunResult:
    """What a finished run left, as the CLI prints it at the end: the files (paths in the run
    folder; ``None`` where the run wrote no such file) and the numbers."""
    out_dir: Path                    # output.dir
    adapter: Path                    # adapter.gguf: the last step's adapter (llama.cpp --lora)
    steps: int                       # the last step trained
    metrics: Path                    # metrics.jsonl: a line per step and per validation
    plot: Path                       # loss.png
    config: Config                   # the resolved config (saved as config.toml)
    peft: Path | None = None         # peft/: the last adapter as PEFT (output.formats "peft")
    best_adapter: Path | None = None  # adapter.best.gguf: the best validation's adapter
    best_peft: Path | None = None    # peft-best/: the same as PEFT
    best_step: int | None = None     # step of the lowest validation loss
    best_loss: float | None = None   # that loss
    early_stop: str | None = None    # why the run stopped early, if it did
    final_eval: dict | None = None   # the last validation: loss, accuracy, perplexity, n_valid
    samples: Path | None = None      # samples.jsonl (train.sample_every)

    @classmethod
    def of(cls, res: _RunOutcome, cfg: Config) -> RunResult:
        """The public result of the trainer's own (``pytrain.run.loop.RunResult``)."""
        from pytrain.run.loop import BEST_PEFT
        from pytrain.run.samples import SAMPLES_FILE
        out = Path(res.out_dir)
        peft = "peft" in cfg.output.formats
        best = res.best or {}
        samples = out / SAMPLES_FILE
        return cls(out, Path(res.adapter), res.steps, out / "metrics.jsonl", out / "loss.png",
                   cfg, peft=out / "peft" if peft else None,
                   best_adapter=Path(best["adapter"]) if best else None,
                   best_peft=out / BEST_PEFT if best and peft else None,
                   best_step=best.get("step"), best_loss=best.get("loss"),
                   early_stop=res.early_stop, final_eval=res.final_eval,
                   samples=samples if samples.exists() else None)


def train(config: str | os.PathLike[str] | Config | Mapping[str, Any],
          overrides: Mapping[str, Any] | Iterable[str] | None = None, *,
          resume: bool | str | os.PathLike[str] | None = None, overwrite: bool = False,
          progress: bool = True, log: Callable[[str], None] | None = print) -> RunResult:
    """Train a LoRA adapter as ``pytrain train CONFIG`` does; the command calls this.

    ``config``: a TOML file, a ``Config`` or a dict of tables; ``overrides``:
    ``{"section.key": value}`` (see :func:`resolve_config`).  ``resume``: True for the newest
    checkpoint of the run folder, or a checkpoint path (``--resume``); ``overwrite``: replace
    an earlier run in ``output.dir`` (``--overwrite``); ``progress``: the progress bar (drawn
    on a terminal only); ``log``: where the run's lines go (None: nowhere).
    Raises ``ConfigError``, ``DataError``, ``RunError`` (``Interrupted`` after Ctrl-C, with the
    checkpoint it saved), ... as the CLI reports them.
    """
    from pytrain.config import Config
    from pytrain.run import loop as run
    from pytrain.step.distributed import agree, world
    cfg = config if isinstance(config, Config) and not overrides else \
        agree(world(), lambda: resolve_config(config, overrides))
    res = run.train(cfg, progress=progress, log=log or (lambda *a, **k: None),
                    resume=str(resume) if isinstance(resume, os.PathLike) else resume,
                    overwrite=overwrite)
    return RunResult.of(res, cfg)


# --------------------------------------------------------------------------- load

@dataclass
class EvalResult:
    """Validation metrics over the valid targets (the training mask) of a data set."""
    loss: float                      # mean negative log-likelihood per target token
    accuracy: float                  # share of targets that are the argmax
    perplexity: float                # exp(loss)
    n_valid: int                     # target tokens
    examples: int                    # examples evaluated
    split: str | None = None         # "validation" or "training" for a [data] section

    def to_dict(self) -> dict:
        return {"loss": self.loss, "accuracy": self.accuracy, "perplexity": self.perplexity,
                "n_valid": self.n_valid}


@dataclass
class PreferenceEvalResult:
    """DPO or ORPO validation metrics over preference pairs: the objective's loss and TRL's
    reward metrics, the numbers a run's validation computes for the same adapter."""
    objective: str                   # "dpo" or "orpo"
    loss: float                      # the objective's loss, a mean over pairs (+ ORPO's NLL)
    rewards_chosen: float            # TRL's rewards/chosen, a mean over pairs
    rewards_rejected: float
    rewards_margins: float
    rewards_accuracies: float        # share of pairs whose chosen reward is the higher
    pairs: int                       # pairs evaluated
    nll_loss: float | None = None    # ORPO: the chosen completions' NLL per token
    split: str | None = None         # "validation" or "training" for a [data] section

    @classmethod
    def of(cls, m: Mapping[str, Any], objective: str, split: str | None
           ) -> PreferenceEvalResult:
        """From the metrics of ``PreferenceEvaluator.evaluate`` (TRL's names)."""
        return cls(objective, m["loss"], m["rewards/chosen"], m["rewards/rejected"],
                   m["rewards/margins"], m["rewards/accuracies"], m["pairs"],
                   m.get("nll_loss"), split)

    def to_dict(self) -> dict:
        """TRL's names, as a run's validation records in metrics.jsonl have them."""
        return {"loss": self.loss, "rewards/chosen": self.rewards_chosen,
                "rewards/rejected": self.rewards_rejected,
                "rewards/margins": self.rewards_margins,
                "rewards/accuracies": self.rewards_accuracies, "pairs": self.pairs,
                **({"nll_loss": self.nll_loss} if self.nll_loss is not None else {})}


def load_adapter(model: Model, path: str | os.PathLike[str]) -> LoraAdapter:
    """The adapter GGUF or PEFT folder at ``path``, checked against ``model`` and loaded onto
    its device (a rank per pair is allowed, as llama.cpp reads them)."""
    from pytrain.formats.adapter_files import read_adapter
    from pytrain.models import lora
    tensors, alpha = read_adapter(path, model.arch.name, model.config)
    names = sorted({k.rsplit(".", 1)[0] for k in tensors})
    ranks = {n: tensors[n + ".lora_a"].shape[0] for n in names}
    ad = lora.create(model.runtime, model.config, names, ranks, alpha)
    ad.set(tensors)
    return ad


class LoadedModel:
    """A GGUF model (and an adapter) loaded for inference: greedy generation, per-token
    log-probabilities and validation metrics, the computations ``pytrain generate`` and
    ``pytrain eval`` run.  Holds device memory until ``close()`` (or the ``with`` block ends).

    ``model``: the underlying ``pytrain.models.model.Model`` (``.logits``, ``.tokenizer``);
    ``adapter``: the loaded LoRA adapter, or None for the base model."""

    def __init__(self, model: Model, adapter: LoraAdapter | None = None,
                 adapter_path: str | os.PathLike[str] | None = None):
        self.model, self.adapter = model, adapter
        self.adapter_path = Path(adapter_path) if adapter_path is not None else None
        self.chat_template: str | None = model.tokenizer.chat_template
        self.chat_template_source = model.path
        self._own_template = False          # a template given instead of the model's
        # why the weights are not loaded as the adapter's run loaded them (``load``), said by
        # ``eval`` to ``_log`` (None: a UserWarning)
        self.weights_note: str | None = None
        self._log: Callable[[str], None] | None = None

    @property
    def path(self) -> str:
        """The GGUF file the model was loaded from."""
        return self.model.path

    @property
    def tokenizer(self) -> Tokenizer:
        """The GGUF's tokenizer (``encode``, ``decode``, ``eog_ids``)."""
        return self.model.tokenizer

    def use_chat_template(self, name_or_file: str | os.PathLike[str], *,
                          option: str = "chat_template") -> None:
        """Render messages with this template instead of the model's: a built-in name
        (``gemma``) or a Jinja file; ``option`` names the setting in errors (the CLI's
        ``--chat-template``)."""
        from pytrain.data.template_files import read_template
        self.chat_template, self.chat_template_source = read_template(os.fspath(name_or_file),
                                                                      option)
        self._own_template = True

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of ``text``, with the model's BOS when it adds one (what ``logprobs``
        and a string prompt of ``generate`` read)."""
        return self.tokenizer.encode(text, add_special=add_special)

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The chat template applied to ``messages`` with the generation prompt (thinking
        off), as the CLI's chat mode renders a prompt."""
        from pytrain.data.chat_template import ChatTemplateError, TemplateSecurityError, render
        if not self.chat_template:
            from pytrain.data.template_files import builtin_names
            raise ChatTemplateError(f"{self.path} has no chat template: load it with "
                                    f"chat_template=NAME (built-in: "
                                    f"{', '.join(builtin_names())}) or FILE, or give a string "
                                    f"prompt (no template)")
        tok = self.tokenizer
        try:
            return render(self.chat_template, list(messages), add_generation_prompt=True,
                          enable_thinking=False, **tok.special_tokens_map())
        except TemplateSecurityError as e:
            raise ChatTemplateError(f"the chat template of {self.chat_template_source}: {e}") \
                from None

    @property
    def _hook(self):
        return self.adapter.hook if self.adapter is not None else None

    def generate(self, prompt: str | Sequence[Mapping[str, Any]], max_tokens: int = 64, *,
                 temperature: float = 0.0, seed: int = 0) -> str:
        """The continuation of ``prompt`` as text (special tokens left out), up to
        ``max_tokens`` tokens or an end-of-generation token.  A string is raw text (BOS
        added, no template); a list of ``{"role", "content"}`` messages is rendered with the
        chat template.  Greedy unless ``temperature`` > 0 (then sampled, reproducible per
        ``seed``)."""
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
        else:
            ids = self.tokenizer.encode(self.render(prompt))
        out = self.model.generate(ids, max_tokens, temperature, seed, lora=self._hook)
        return self.tokenizer.decode(out, skip_special=True)

    def logprobs(self, text_or_ids: str | Sequence[int]) -> np.ndarray:
        """Log-probability (natural log, float64) of each token given the ones before it:
        entry i is log p(token i+1 | tokens 0..i), so n tokens give n-1 values.  A string is
        tokenized as ``tokenize`` does (BOS first when the model adds one)."""
        import numpy as np
        ids = self.tokenize(text_or_ids) if isinstance(text_or_ids, str) else \
            [int(i) for i in text_or_ids]
        if len(ids) < 2:
            raise ValueError(f"logprobs needs at least two tokens, got {len(ids)}")
        logits = self.model.logits(np.array(ids, np.int64), lora=self._hook).astype(np.float64)
        top = logits.max(axis=-1, keepdims=True)
        lse = (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))[:, 0]
        n = len(ids) - 1
        return logits[np.arange(n), ids[1:]] - lse[:n]

    def eval(self, data: str | os.PathLike[str] | Iterable[Mapping[str, Any]] | DataConfig, *,
             batch_size: int = 4, objective: str = "sft", beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             **data_options: Any) -> EvalResult | PreferenceEvalResult:
        """Validation loss, token accuracy and perplexity over the targets of ``data``, masked
        as training masks them, as ``pytrain eval`` computes them.

        ``data``: a data file (JSONL, Parquet, ...), a list of records (``{"messages": ...}``,
        ``{"prompt", "completion"}``, ``{"text"}``), or a config's ``[data]`` section (its
        validation examples, else its training examples: what ``pytrain eval`` reads).
        ``data_options``: keys of ``[data]`` for a file or records (``format``, ``mask``,
        ``max_seq_len``, ``truncation``, ``packing``, ``chat_template``, ``on_error``).

        ``objective`` "dpo" or "orpo" (with ``beta``, ``loss_type``, ``label_smoothing``: the
        ``[train]`` keys): ``data`` holds preference pairs, and the result is a
        ``PreferenceEvalResult``, the objective's loss and reward metrics as a run's
        validation computes them (DPO's reference: this model without the adapter)."""
        from pytrain.config import DataConfig
        if objective != "sft":
            pref = {"objective": objective, "beta": beta, "loss_type": loss_type,
                    "label_smoothing": label_smoothing}
            if not isinstance(data, (DataConfig, str, os.PathLike)):
                return self._eval_records(data, batch_size, {**data_options, **pref})
            return self._eval_pairs(data, batch_size, pref, data_options)
        from pytrain.data import load_data
        from pytrain.step.evaluate import evaluate_examples
        self._say_weights()
        template = self.chat_template if self._own_template else None
        if isinstance(data, DataConfig):
            if data_options:
                raise TypeError(f"eval of a [data] section takes no data options, got "
                                f"{', '.join(sorted(data_options))}")
            cfg, split = data, None
        elif isinstance(data, (str, os.PathLike)):
            cfg, split = _data_config(data, data_options), None
        else:
            return self._eval_records(data, batch_size, data_options)
        if cfg.chat_template:
            template = None
        splits = load_data(cfg, self.tokenizer, template)
        examples = splits.valid or splits.train
        if isinstance(data, DataConfig):
            split = "validation" if splits.valid else "training"
        ev = evaluate_examples(self.model, examples, batch_size, adapter=self.adapter,
                               packing=cfg.packing, max_seq_len=cfg.max_seq_len)
        return EvalResult(ev["loss"], ev["accuracy"], ev["perplexity"], ev["n_valid"],
                          len(examples), split)

    def _eval_pairs(self, data: str | os.PathLike[str] | DataConfig, batch_size: int,
                    settings: dict, options: dict) -> PreferenceEvalResult:
        """``eval`` of preference pairs: their batches, DPO's reference pass and the metrics,
        by a run's own validation code (``PreferenceEvaluator``), so the numbers are the
        run's."""
        from pytrain.config import DataConfig
        from pytrain.data.preference import load_pair_data, make_pair_batches
        from pytrain.step.preference import PreferenceEvaluator, PreferenceSettings
        self._say_weights()
        if isinstance(data, DataConfig):
            if options:
                raise TypeError(f"eval of a [data] section takes no data options, got "
                                f"{', '.join(sorted(options))}")
            cfg = data
        else:
            cfg = _data_config(data, options)
        template = self.chat_template if self._own_template and not cfg.chat_template else None
        splits = load_pair_data(cfg, self.tokenizer, template)
        pairs = splits.valid or splits.train
        split = ("validation" if splits.valid else "training") \
            if isinstance(data, DataConfig) else None
        batches = make_pair_batches(pairs, batch_size, shuffle=False, pad_id=self.model.pad_id)
        ev = PreferenceEvaluator(self.model, self.adapter, PreferenceSettings(**settings))
        try:
            if ev.uses_reference:            # evaluate() reads the "valid" split's
                ev.compute_reference("valid", pairs, batch_size)
            m = ev.evaluate(batches)
        finally:
            ev.close()
        return PreferenceEvalResult.of(m, settings["objective"], split)

    def _say_weights(self) -> None:
        """An evaluation of weights loaded otherwise than the adapter's run loaded them gives
        another number than the run's: said, with the settings that match."""
        if self.weights_note is None:
            return
        if self._log is not None:
            self._log(self.weights_note)
        else:
            import warnings
            warnings.warn(self.weights_note, UserWarning, stacklevel=3)

    def _eval_records(self, records: Iterable[Mapping[str, Any]], batch_size: int,
                      options: dict) -> EvalResult:
        """Records written to a temporary JSONL file and read back as a file is: one reader,
        so records and files are masked and checked alike."""
        import json
        import tempfile
        with tempfile.TemporaryDirectory(prefix="pytrain-eval-") as tmp:
            path = Path(tmp) / "records.jsonl"
            with open(path, "w", encoding="utf-8") as f:
                for r in records:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
            return self.eval(path, batch_size=batch_size, **options)

    def close(self) -> None:
        """Free the weights, the adapter and the device."""
        if self.model is not None:
            self.model.close()
            self.model = self.adapter = None

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _data_config(path: str | os.PathLike[str], options: Mapping[str, Any]) -> DataConfig:
    """A checked ``[data]`` section reading ``path`` whole as its training file."""
    from pytrain.config import load_config
    given = {"data.train": path, **{f"data.{k}": v for k, v in options.items()}}
    return load_config(None, given, partial=True).data


def load(model_path: str | os.PathLike[str], adapter: str | os.PathLike[str] | None = None, *,
         device: str = "auto", threads: int | None = None, type_policy: str | None = None,
         compute_type: str | None = None, chat_template: str | os.PathLike[str] | None = None,
         log: Callable[[str], None] | None = None) -> LoadedModel:
    """Load a GGUF model, and ``adapter`` (an adapter GGUF or a PEFT folder) on it, for
    ``generate``, ``logprobs`` and ``eval``; close it when done (or use ``with``).

    ``device``: cpu, cuda, vulkan or auto; ``threads``: CPU threads; ``type_policy`` and
    ``compute_type`` as the config's keys.  Left None, the weights are loaded as the run that
    wrote ``adapter`` loaded them (its adapter GGUF records the types: ``auto`` may have
    dequantized them for training), so that ``eval`` gives that run's validation loss; else
    "auto" and "f32".  Where they are loaded otherwise (other settings given, too little
    memory, no bf16 here), ``eval`` says so and what matches: to ``log``, by default as a
    ``UserWarning``.  ``chat_template``: a built-in template name or a Jinja file instead of
    the model's (needed where the GGUF has none).
    """
    from pytrain.run import type_choice as tc
    rec = tc.read_record(adapter) if adapter is not None else None
    notes: list[str] = []
    model = _load_model(model_path, device, threads, type_policy, compute_type, rec,
                        notes.append)
    try:
        lora = load_adapter(model, adapter) if adapter is not None else None
        loaded = LoadedModel(model, lora, adapter)
        loaded._log = log
        differ = rec and tc.difference(rec, model)
        if differ:
            why = "; ".join(notes) or (f'type_policy "{type_policy}"' if type_policy else
                                       f'compute_type "{compute_type}"' if compute_type else
                                       f"on {model.runtime.device}")
            loaded.weights_note = (f"{adapter}: {differ} ({why}), so losses and logits differ "
                                   f"from its run's by that rounding; to load them as the run "
                                   f"did, {tc.matching_settings(rec)}")
        if chat_template is not None:
            loaded.use_chat_template(chat_template)
    except BaseException:
        model.close()
        raise
    return loaded


def _load_model(path, device: str, threads: int | None, type_policy: str | None,
                compute_type: str | None, rec: dict | None, say: Callable[[str], None]) -> Model:
    """The model with the weight types ``load`` describes: the record ``rec`` of the adapter's
    run followed unless settings are given; a bf16 run's compute falls back to f32 (said)
    where this machine has none."""
    from pytrain.models.model import load_model
    from pytrain.models.precision import ComputeTypeError
    from pytrain.run.type_choice import as_recorded
    follow = rec is not None and type_policy is None
    dequantize = as_recorded(rec, say) if follow else None
    ct = compute_type or (rec["compute_type"] if follow else "f32")
    try:
        return load_model(path, device=device, threads=threads, type_policy=type_policy or "auto",
                          compute_type=ct, dequantize=dequantize)
    except ComputeTypeError as e:
        if compute_type is not None or ct == "f32":
            raise
        say(f"bf16 compute cannot run here: {e}")
    return load_model(path, device=device, threads=threads, dequantize=dequantize)


# --------------------------------------------------------------------------- export

class ExportOutputError(PytrainError):
    """``out`` cannot be written as asked (a folder where the merged file goes, a folder of
    other files a PEFT folder would replace, ...); found before anything is written."""

    def __init__(self, out: str | os.PathLike[str], problem: str):
        super().__init__(f"out {os.fspath(out)}: {problem}")
        self.out, self.problem = out, problem


@dataclass
class ExportResult:
    """What ``export`` wrote: ``path`` (the PEFT folder or the merged GGUF), its ``format``,
    and ``summary``, the lines ``pytrain export`` prints."""
    path: Path
    format: str
    summary: str
    report: MergeReport | None = None     # per merged tensor: update size, rounding error


def output_problem(out: str | os.PathLike[str], folder: bool) -> str | None:
    """What is wrong with the output path before anything is written: an existing folder
    where a file goes (or the reverse), a parent that is a file; None when it can be
    written."""
    out = Path(out)
    if out.is_dir() and not folder:
        return f"is a folder; give the merged model's file name (for example {out / 'merged.gguf'})"
    if out.exists() and folder and not out.is_dir():
        return "is a file; give a folder for the PEFT adapter"
    if folder and out.is_dir():      # the folder is replaced whole: never a folder of other files
        from pytrain.formats.adapter_peft import CONFIG_NAME, WEIGHTS_NAME
        others = sorted(p.name for p in out.iterdir() if p.name not in (CONFIG_NAME, WEIGHTS_NAME))
        if others:
            more = ", ..." if len(others) > 3 else ""
            return (f"holds other files ({', '.join(others[:3])}{more}), which writing the "
                    f"PEFT folder would delete; give a new folder")
    for parent in out.parents:
        if parent.exists():
            return None if parent.is_dir() else f"{parent} is a file, not a folder"
    return None


def export(model_path: str | os.PathLike[str], adapter: str | os.PathLike[str], *,
           out: str | os.PathLike[str], format: str = "peft", merged_type: str = "auto"
           ) -> ExportResult:
    """Write ``adapter`` (a GGUF or PEFT adapter of ``model_path``) as ``format``, as
    ``pytrain export`` does; the command calls this.

    ``"peft"``: a PEFT folder ``out`` (adapter_config.json + adapter_model.safetensors) that
    ``PeftModel.from_pretrained`` loads.  ``"gguf-merged"``: the base model with the adapter
    merged in, one GGUF file ``out`` (written atomically), the adapted tensors as
    ``merged_type`` says (keep: the base tensor's type; auto: keep, but F16 for a quantized
    tensor whose requantization would erase the update; f16; f32).
    Raises ``ExportOutputError`` before writing anything when ``out`` cannot be written,
    ``AdapterError``/``MergeError`` for an adapter that does not fit the model.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {', '.join(map(repr, EXPORT_FORMATS))}, "
                         f"got {format!r}")
    if merged_type not in ("auto", "keep", "f16", "f32"):
        raise ValueError(f"merged_type must be 'auto', 'keep', 'f16' or 'f32', got "
                         f"{merged_type!r}")
    problem = output_problem(out, folder=format == "peft")
    if problem:
        raise ExportOutputError(out, problem)
    from pytrain.formats.adapter_files import read_adapter
    from pytrain.models.model_file import open_model
    arch, _meta, _infos, config = open_model(model_path)
    if format == "peft":
        return _export_peft(model_path, adapter, out, arch, config)
    from pytrain.formats.adapter_gguf import AdapterError
    from pytrain.formats.merge import MergeError, merge_adapter
    try:
        tensors, alpha = read_adapter(adapter, arch, config)
    except AdapterError as e:
        raise MergeError(f"{e} -- refusing to merge it into {model_path}") from e
    src = Path(adapter)
    report = merge_adapter(model_path, tensors, alpha, out, merged_type,
                           adapter_name=src.name or str(src), source=str(src))
    return ExportResult(Path(out), format, report.summary(), report)


def _export_peft(model_path, adapter, out, arch: str, config) -> ExportResult:
    """The adapter (GGUF or PEFT) as the PEFT folder training writes with output.formats =
    ["peft"], checked against the model; one rank for all pairs, as PEFT has."""
    from pytrain.formats.adapter_files import read_adapter
    from pytrain.formats.adapter_gguf import AdapterError
    from pytrain.formats.adapter_peft import write_peft_adapter
    tensors, alpha = read_adapter(adapter, arch, config)
    ranks = sorted({t.shape[0] for k, t in tensors.items() if k.endswith(".lora_a")})
    if len(ranks) != 1:
        raise AdapterError(f"{adapter}: pairs of ranks {', '.join(map(str, ranks))}; a PEFT "
                           f"adapter has one rank")
    written = write_peft_adapter(out, tensors, alpha, ranks[0],
                                 base_model_name_or_path=Path(model_path).name,
                                 model_config=config, arch=arch)
    summary = (f"wrote {written}: {len(tensors) // 2} adapted tensors, rank {ranks[0]}, alpha "
               f"{alpha:g} (PEFT: PeftModel.from_pretrained(model, \"{written}\"))")
    return ExportResult(Path(written), format="peft", summary=summary)
