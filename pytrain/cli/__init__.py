"""The `pytrain` command: one subcommand per job, each a thin call into the package."""
# train, eval, generate and export call the Python API (pytrain.api): one path for both
from __future__ import annotations

import argparse
import signal
import sys
import threading

from pytrain.errors import PytrainError


def _doctor(args: argparse.Namespace) -> int:
    from pytrain.cli import doctor
    return doctor.main()


def _inspect(args: argparse.Namespace) -> int:
    from pytrain.cli import inspect_model
    return inspect_model.main(args.model)


def _config(args: argparse.Namespace):
    from pytrain.api import resolve_config
    return resolve_config(args.config, args.set or [])


def _plan(args: argparse.Namespace) -> int:
    from pytrain.cli import plan
    args.set = (args.set or []) + ([f"model.device={args.device}"] if args.device else [])
    return plan.main(_config(args), args)


def _profile(args: argparse.Namespace) -> int:
    from pytrain.cli import profile
    return profile.main(_config(args), args)


def _train(args: argparse.Namespace) -> int:
    """Under an MPI launcher, how the job ends is decided by where the error was raised
    (pytrain.step.distributed): a ``CollectiveError`` reached every rank at the same point and
    ends the job normally, said once by rank 0; any other error may be this rank's alone and
    aborts the job, so that no rank waits for it forever."""
    from pytrain import api
    from pytrain.run import loop as run
    from pytrain.step.distributed import CollectiveError, agree, world
    w = world()
    cfg = None
    try:
        cfg = agree(w, lambda: _config(args))
        res = api.train(cfg, progress=not args.no_progress, resume=args.resume,
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
    if res.best_adapter:
        print(f"best:     {res.best_adapter} (step {res.best_step}, validation loss "
              f"{res.best_loss:.4f})")
    if res.early_stop:
        print(f"stopped:  {res.early_stop}")
    print(f"metrics:  {res.metrics}")
    print(f"plot:     {res.plot}")
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
    from pytrain.api import load_adapter
    return load_adapter(model, path)


def _eval(args: argparse.Namespace) -> int:
    """The base model (no LoRA in the graph), or it with ``--adapter``: no optimizer state."""
    from pytrain import api
    cfg = _config(args)
    m = cfg.model
    # "auto", a run's own choice: the types the adapter's run loaded (recorded in it)
    with api.load(m.path, args.adapter, device=m.device, threads=m.threads,
                  type_policy=None if m.type_policy == "auto" else m.type_policy,
                  log=lambda note: print(f"note: {note}", file=sys.stderr)) as model:
        if cfg.train.objective != "sft":           # preference pairs: the objective's metrics
            return _eval_preference(model, cfg)
        ev = model.eval(cfg.data, batch_size=cfg.train.batch_size)
    print(f"{ev.split} set ({ev.examples} examples, {ev.n_valid} target tokens): "
          f"loss {ev.loss:.4f}  accuracy {ev.accuracy:.3f}  perplexity {ev.perplexity:.2f}")
    return 0


def _eval_preference(model, cfg) -> int:
    """A DPO or ORPO config's validation pairs: its objective's loss and reward metrics, the
    run's own validation numbers for the same adapter."""
    t = cfg.train
    ev = model.eval(cfg.data, batch_size=t.batch_size, objective=t.objective, beta=t.beta,
                    loss_type=t.loss_type, label_smoothing=t.label_smoothing)
    nll = f"  nll {ev.nll_loss:.4f}" if ev.nll_loss is not None else ""
    print(f"{ev.split} set ({ev.pairs} pairs, {ev.objective}): loss {ev.loss:.4f}  reward "
          f"accuracy {ev.rewards_accuracies:.3f}  margin {ev.rewards_margins:.4f}  chosen "
          f"{ev.rewards_chosen:.4f}  rejected {ev.rewards_rejected:.4f}{nll}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pytrain import api
    from pytrain.data.chat_template import ChatTemplateError
    from pytrain.data.template_files import builtin_names
    with api.load(args.model, args.adapter, device=args.device, threads=args.threads,
                  type_policy=args.type_policy) as model:
        if args.raw:
            prompt = args.prompt
        else:
            if args.chat_template:
                model.use_chat_template(args.chat_template, option="--chat-template")
            elif not model.chat_template:
                raise ChatTemplateError(f"{args.model} has no chat template: pass "
                                        f"--chat-template NAME (built-in: "
                                        f"{', '.join(builtin_names())}) or FILE, or --raw")
            prompt = ([{"role": "system", "content": args.system}] if args.system else []) + \
                [{"role": "user", "content": args.prompt}]
        text = model.generate(prompt, args.max_new_tokens, temperature=args.temperature,
                              seed=args.seed)
    print(text)
    return 0


def _export(args: argparse.Namespace) -> int:
    """Merge an adapter into its base model (``--merge``), or write a GGUF adapter as a PEFT
    folder (``--format peft``)."""
    from pytrain import api
    fmt = args.format or ("merged" if args.merge else None)
    if fmt is None or (args.merge and fmt != "merged"):
        print("error: pass --merge (the adapter merged into the base model: -o OUT.gguf) or "
              "--format peft (the adapter as a PEFT folder: -o DIR)", file=sys.stderr)
        return 2
    try:
        res = api.export(args.model, args.adapter, out=args.output,
                         format="peft" if fmt == "peft" else "gguf-merged",
                         merged_type=args.merged_type)
    except api.ExportOutputError as e:
        print(f"error: -o/--output {args.output}: {e.problem}", file=sys.stderr)
        return 1
    print(res.summary)
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
                       "valid targets of the config's data (dpo, orpo: the objective's loss "
                       "and reward metrics over its pairs)")
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
    p.add_argument("--type-policy", choices=("auto", "f32", "keep", "bf16"), default=None,
                   help="types the base weights are loaded as (model.type_policy); default: as "
                        "the adapter's run loaded them (recorded in the adapter), else auto. "
                        "keep decodes a quantized base faster, in less memory")
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
    p.add_argument("--merged-type", choices=("auto", "keep", "f16", "f32"), default="auto",
                   help="type of the adapted tensors: keep = the base tensor's type (quantized "
                        "bases are requantized with ggml, error reported); auto = keep, but F16 "
                        "for a tensor whose requantization would erase the update (said); or "
                        "f16/f32; other tensors are copied unchanged (default: auto)")
    p.set_defaults(func=_export)


def _interrupt(signum, frame) -> None:
    """Ctrl-C outside a training run (whose own handler replaces this one while it runs).
    Python raises KeyboardInterrupt at the next bytecode, which C code that clears errors
    can swallow (generate then went on with its next token, and a held loop never ended);
    ggml's abort flag, set first, stops the next graph compute too, so nothing computes on
    after the signal whatever happens to the exception."""
    runtime = sys.modules.get("pytrain.ggml.runtime")
    if runtime is not None:
        runtime.request_abort()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGINT, _interrupt) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C outside a training run's own handling (generate, eval, export, loading):
        # they write nothing until they are done, so there is nothing to say but that
        print(f"error: pytrain {args.command} interrupted", file=sys.stderr)
        runtime = sys.modules.get("pytrain.ggml.runtime")
        if runtime is not None:
            runtime.request_abort(False)      # an in-process caller computes again after this
        return 130
    except (PytrainError, OSError) as e:
        # bad config, data, model or adapter files, a missing device or file: one clear line;
        # anything else is a bug in pytrain and keeps its traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
