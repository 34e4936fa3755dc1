"""The `pytrain` command: one subcommand per job, each a thin call into the package."""
from __future__ import annotations

import argparse
import sys

from pytrain.errors import PytrainError


def _doctor(args: argparse.Namespace) -> int:
    from pytrain.cli import doctor
    return doctor.main()


def _inspect(args: argparse.Namespace) -> int:
    from pytrain.cli import inspect_model
    return inspect_model.main(args.model)


def _config(args: argparse.Namespace):
    from pytrain.config import load_config
    return load_config(args.config, args.set or [])


def _plan(args: argparse.Namespace) -> int:
    from pytrain.cli import plan
    args.set = (args.set or []) + ([f"model.device={args.device}"] if args.device else [])
    return plan.main(_config(args), args)


def _profile(args: argparse.Namespace) -> int:
    from pytrain.cli import profile
    return profile.main(_config(args), args)


def _train(args: argparse.Namespace) -> int:
    """Under an MPI launcher, how the job ends is decided by where the error was raised
    (pytrain.train.distributed): a ``CollectiveError`` reached every rank at the same point and
    ends the job normally, said once by rank 0; any other error may be this rank's alone and
    aborts the job, so that no rank waits for it forever."""
    from pytrain.train import run
    from pytrain.train.distributed import CollectiveError, agree, world
    w = world()
    cfg = None
    try:
        cfg = agree(w, lambda: _config(args))
        res = run.train(cfg, progress=not args.no_progress, resume=args.resume,
                        overwrite=args.overwrite)
    except run.Interrupted as e:           # every rank stopped after the same step
        if w.is_main:
            print(f"error: {e}", file=sys.stderr)
        return 130
    except CollectiveError as e:
        if w.size == 1:
            raise
        return w.end_together(f"error: {e}", e.code, cfg and run.run_folder(cfg))
    except BaseException as e:
        if w.size > 1:
            import traceback
            what = (f"error: {e}" if isinstance(e, PytrainError) else
                    "stopped at once by a second interrupt" if isinstance(e, KeyboardInterrupt)
                    else "".join(traceback.format_exception(e)).rstrip())
            w.abort(what, 130 if isinstance(e, KeyboardInterrupt) else 1,
                    cfg and run.run_folder(cfg))
        if isinstance(e, run.RunError):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise           # a KeyboardInterrupt before the run's own handling: main() says it
    if not w.is_main:
        return 0
    print(f"adapter:  {res.adapter}")
    if res.best:
        print(f"best:     {res.best['adapter']} (step {res.best['step']}, validation loss "
              f"{res.best['loss']:.4f})")
    if res.early_stop:
        print(f"stopped:  {res.early_stop}")
    print(f"metrics:  {res.out_dir / 'metrics.jsonl'}")
    print(f"plot:     {res.out_dir / 'loss.png'}")
    if res.final_eval:
        e = res.final_eval
        if "rewards/accuracies" in e:
            print(f"validation: loss {e['loss']:.4f}  reward accuracy "
                  f"{e['rewards/accuracies']:.3f}  margin {e['rewards/margins']:.4f}  over "
                  f"{e['pairs']} pairs")
        else:
            print(f"validation: loss {e['loss']:.4f}  accuracy {e['accuracy']:.3f}  "
                  f"perplexity {e['perplexity']:.2f}  over {e['n_valid']} target tokens")
    return 0


def _load_adapter(model, path):
    """The adapter GGUF or PEFT folder at ``path``, checked against ``model`` and loaded."""
    from pytrain.formats.adapter_files import read_adapter
    from pytrain.models import lora
    tensors, alpha = read_adapter(path, model.arch.name, model.config)
    names = sorted({k.rsplit(".", 1)[0] for k in tensors})
    ranks = {n: tensors[n + ".lora_a"].shape[0] for n in names}   # a rank per pair is allowed
    ad = lora.create(model.runtime, model.config, names, ranks, alpha)
    ad.set(tensors)
    return ad


def _eval(args: argparse.Namespace) -> int:
    """The base model (no LoRA in the graph), or it with ``--adapter``: no optimizer state."""
    from pytrain.data import load_data, make_batches
    from pytrain.models.model import load_model
    from pytrain.train.evaluate import Evaluator
    cfg = _config(args)
    model = load_model(cfg.model.path, cfg.model.device, cfg.model.threads, cfg.model.type_policy)
    try:
        splits = load_data(cfg.data, model.tokenizer)
        examples = splits.valid or splits.train
        batches = make_batches(examples, cfg.train.batch_size, cfg.data.packing, 0,
                               shuffle=False, max_seq_len=cfg.data.max_seq_len,
                               pad_id=model.pad_id)
        adapter = _load_adapter(model, args.adapter) if args.adapter else None
        evaluator = Evaluator(model, adapter)
        try:
            ev = evaluator.evaluate(batches)
        finally:
            evaluator.close()
    finally:
        model.close()
    which = "validation" if splits.valid else "training"
    print(f"{which} set ({len(examples)} examples, {ev['n_valid']} target tokens): "
          f"loss {ev['loss']:.4f}  accuracy {ev['accuracy']:.3f}  perplexity {ev['perplexity']:.2f}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pytrain.data.chat_template import ChatTemplateError, TemplateSecurityError, render
    from pytrain.data.template_files import builtin_names, read_template
    from pytrain.models.model import load_model
    model = load_model(args.model, args.device, args.threads)
    tok = model.tokenizer
    adapter = _load_adapter(model, args.adapter) if args.adapter else None
    if args.raw:
        ids = tok.encode(args.prompt, add_special=True)
    else:
        template, source = tok.chat_template, args.model
        if args.chat_template:
            template, source = read_template(args.chat_template, "--chat-template")
        elif not template:
            raise ChatTemplateError(f"{args.model} has no chat template: pass --chat-template "
                                    f"NAME (built-in: {', '.join(builtin_names())}) or FILE, "
                                    f"or --raw")
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": args.prompt}]
        try:
            text = render(template, msgs, add_generation_prompt=True,
                          enable_thinking=False, **tok.special_tokens_map())
        except TemplateSecurityError as e:
            raise ChatTemplateError(f"the chat template of {source}: {e}") from None
        ids = tok.encode(text)
    out = model.generate(ids, args.max_new_tokens, args.temperature, args.seed,
                         lora=adapter.hook if adapter else None)
    print(tok.decode(out, skip_special=True))
    return 0


def _output_problem(out, folder: bool) -> str | None:
    """What is wrong with ``-o OUT`` before anything is written: an existing folder where a
    file goes (or the reverse), a parent that is a file; None when it can be written."""
    from pathlib import Path
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


def _export(args: argparse.Namespace) -> int:
    """Merge an adapter into its base model (``--merge``), or write a GGUF adapter as a PEFT
    folder (``--format peft``)."""
    from pathlib import Path

    from pytrain.formats.adapter_files import read_adapter
    from pytrain.formats.adapter_gguf import AdapterError
    from pytrain.formats.merge import MergeError, merge_adapter
    from pytrain.models.model_file import open_model
    fmt = args.format or ("merged" if args.merge else None)
    if fmt is None or (args.merge and fmt != "merged"):
        print("error: pass --merge (the adapter merged into the base model: -o OUT.gguf) or "
              "--format peft (the adapter as a PEFT folder: -o DIR)", file=sys.stderr)
        return 2
    problem = _output_problem(args.output, folder=fmt == "peft")
    if problem:
        print(f"error: -o/--output {args.output}: {problem}", file=sys.stderr)
        return 1
    arch, _meta, _infos, config = open_model(args.model)
    if fmt == "peft":
        return _export_peft(args, arch, config)
    try:
        tensors, alpha = read_adapter(args.adapter, arch, config)
    except AdapterError as e:
        raise MergeError(f"{e} -- refusing to merge it into {args.model}") from e
    src = Path(args.adapter)
    report = merge_adapter(args.model, tensors, alpha, args.output, args.merged_type,
                           adapter_name=src.name or str(src), source=str(src))
    print(report.summary())
    return 0


def _export_peft(args: argparse.Namespace, arch: str, config) -> int:
    """The adapter (GGUF or PEFT) as the PEFT folder training writes with output.formats =
    ["peft"]: adapter_config.json + adapter_model.safetensors, checked against the model."""
    from pathlib import Path

    from pytrain.formats.adapter_files import read_adapter
    from pytrain.formats.adapter_peft import write_peft_adapter
    tensors, alpha = read_adapter(args.adapter, arch, config)
    ranks = sorted({t.shape[0] for k, t in tensors.items() if k.endswith(".lora_a")})
    if len(ranks) != 1:
        print(f"error: {args.adapter}: pairs of ranks {', '.join(map(str, ranks))}; a PEFT "
              f"adapter has one rank", file=sys.stderr)
        return 1
    out = write_peft_adapter(args.output, tensors, alpha, ranks[0],
                             base_model_name_or_path=Path(args.model).name,
                             model_config=config, arch=arch)
    print(f"wrote {out}: {len(tensors) // 2} adapted tensors, rank {ranks[0]}, alpha {alpha:g} "
          f"(PEFT: PeftModel.from_pretrained(model, \"{out}\"))")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pytrain._version import __version__
    ap = argparse.ArgumentParser(prog="pytrain", description=__doc__)
    ap.add_argument("--version", action="version", version=f"pytrain {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="ggml version, pinned archive, backends, devices, CPU features")
    p.set_defaults(func=_doctor)
    p = sub.add_parser("inspect", help="architecture, layers, tensor types and sizes, MTP "
                       "blocks and LoRA targets of a GGUF model (loads no weights)")
    p.add_argument("model", help="path to a .gguf model")
    p.set_defaults(func=_inspect)

    def config_args(p):
        p.add_argument("config", help="TOML config file")
        p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                       help="override a config value (repeatable)")
    p = sub.add_parser("train", help="LoRA fine-tune from a TOML config")
    config_args(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="continue from the newest checkpoint of the run folder, or from "
                        "CHECKPOINT (a step-N folder or a checkpoints folder)")
    p.add_argument("--overwrite", action="store_true",
                   help="start a new run in an output.dir that holds an earlier one: once the "
                        "new run is checked, the earlier run's files move to replaced-TIME/, "
                        "deleted when the new run writes its first checkpoint (without it such "
                        "a folder is refused)")
    p.set_defaults(func=_train)
    p = sub.add_parser("plan", help="the memory a run needs on its device (weights, LoRA, "
                       "optimizer state, compute buffer), the recompute choice and why, and "
                       "whether it fits (exit 0) or not (exit 3); loads no weights")
    config_args(p)
    from pytrain.cli import plan, profile
    plan.add_arguments(p)
    p.set_defaults(func=_plan)
    p = sub.add_parser("profile", help="the config's first training step computed node by "
                       "node: time by part of the model and by op")
    config_args(p)
    profile.add_arguments(p)
    p.set_defaults(func=_profile)
    p = sub.add_parser("eval", help="validation loss, token accuracy and perplexity over the "
                       "valid targets of the config's data")
    config_args(p)
    p.add_argument("--adapter", help="adapter GGUF to evaluate (default: the base model)")
    p.set_defaults(func=_eval)
    p = sub.add_parser("generate", help="greedy or sampled generation, with an adapter")
    p.add_argument("model", help="path to a .gguf model")
    p.add_argument("--adapter", help="LoRA adapter GGUF")
    p.add_argument("--prompt", required=True, help="user message (or raw text with --raw)")
    p.add_argument("--system", help="system message")
    p.add_argument("--raw", action="store_true", help="no chat template")
    from pytrain.data.template_files import builtin_names
    p.add_argument("--chat-template", metavar="NAME|FILE", help="a chat template instead of "
                   "the model's (needed where the GGUF has none): a built-in one by name ("
                   + ", ".join(builtin_names()) + ") or a Jinja file")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=_generate)
    _add_export_parser(sub)
    return ap


def _add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="merge a LoRA adapter into its base model (--merge: "
                       "one GGUF that needs no --lora, llama.cpp loads it as a plain model), "
                       "or write it as a PEFT folder (--format peft)")
    p.add_argument("model", help="base model .gguf the adapter was trained on")
    p.add_argument("--adapter", required=True,
                   help="LoRA adapter: a GGUF file or a PEFT adapter folder")
    p.add_argument("--merge", action="store_true",
                   help="write W + (alpha/r)·B·A for every adapted tensor (= --format merged)")
    p.add_argument("--format", choices=("merged", "peft"),
                   help="merged: the merged model GGUF (as --merge); peft: the adapter as a "
                        "PEFT folder (adapter_config.json + adapter_model.safetensors) that "
                        "PeftModel.from_pretrained loads")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="merged model file to write (atomically; never the base file itself), "
                        "or the PEFT folder")
    p.add_argument("--merged-type", choices=("keep", "f16", "f32"), default="keep",
                   help="type of the adapted tensors: keep = the base tensor's type (quantized "
                        "bases are requantized with ggml, error reported), or f16/f32; other "
                        "tensors are copied unchanged (default: keep)")
    p.set_defaults(func=_export)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C outside a training run's own handling (generate, eval, export, loading):
        # they write nothing until they are done, so there is nothing to say but that
        print(f"error: pytrain {args.command} interrupted", file=sys.stderr)
        return 130
    except (PytrainError, OSError) as e:
        # bad config, data, model or adapter files, a missing device or file: one clear line;
        # anything else is a bug in pytrain and keeps its traceback
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
