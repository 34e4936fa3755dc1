"""The `pytrain` command: one subcommand per job, each a thin call into the package."""
from __future__ import annotations

import argparse
import sys


def _doctor(args: argparse.Namespace) -> int:
    from pytrain import doctor
    return doctor.main()


def _inspect(args: argparse.Namespace) -> int:
    from pytrain import inspect_model
    return inspect_model.main(args.model)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pytrain", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="ggml version, pinned archive, backends, devices, CPU features")
    p.set_defaults(func=_doctor)
    p = sub.add_parser("inspect", help="architecture, layers, tensor types and sizes, MTP "
                       "blocks and LoRA targets of a GGUF model (loads no weights)")
    p.add_argument("model", help="path to a .gguf model")
    p.set_defaults(func=_inspect)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
