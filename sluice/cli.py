"""`sluice` console script: one subcommand per part, imported lazily so that
`sluice tiny-model` does not pay for the HTTP stack and the gateway never loads torch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _tiny_model(args: argparse.Namespace) -> int:
    from modelfiles.tiny_model import SIZES, write_tiny_model

    out = write_tiny_model(Path(args.out), SIZES[args.size])
    print(f"wrote the {args.size} model to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny-model", help="write the deterministic default checkpoint")
    p.add_argument("--out", required=True, help="directory to write (HF layout)")
    p.add_argument("--size", choices=("tiny", "small", "tiny-draft"), default="tiny",
                   help="tiny (default); small: ~10M parameters, the same tokenizer, "
                        "for load tests where the model must saturate before HTTP on a CPU; "
                        "tiny-draft: tiny's first layer, a draft model for "
                        "--speculative draft:DIR")
    p.set_defaults(func=_tiny_model)

    # Each part adds its own subcommands; their modules import heavy code lazily.
    from backend.cli import register as register_backend
    from gateway.cli import register as register_gateway
    from loadtest.cli import register as register_loadtest

    from .plan_cli import register as register_plan

    register_backend(sub)
    register_gateway(sub)
    register_loadtest(sub)
    register_plan(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
