"""The ``aruntime`` command (also ``python -m aruntime``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="aruntime", description="An async, event-driven device runtime.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="open every device kind and run [1,2,3]*2 on it")
    from aruntime.demo import add_arguments

    add_arguments(sub.add_parser("demo", help="stream a dataset from disk through every CPU device, verified"))
    from aruntime.profile.cli import register as register_profile

    register_profile(sub)
    args = parser.parse_args(argv)
    if args.command == "check":
        from aruntime.check import run_check

        return run_check()
    if args.command == "demo":
        from aruntime.demo import run_demo

        return run_demo(args)
    if args.command == "profile":
        return int(args.handler(args))
    parser.error(f"unknown command {args.command}")  # pragma: no cover - argparse rejects it first


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
