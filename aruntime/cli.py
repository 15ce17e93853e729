"""The ``aruntime`` command (also ``python -m aruntime``).

A user error (a bad option, a file that cannot be read, a missing optional
package) is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from aruntime._version import __version__
from aruntime.errors import AruntimeError


class UsageError(AruntimeError, ValueError):
    """A command-line mistake; ``main`` prints it as one line and exits with status 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``aruntime demo: ... (see aruntime demo --help)``."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> Parser:
    """The ``aruntime`` parser with every subcommand."""
    parser = Parser(prog="aruntime", description="An async, event-driven device runtime.")
    parser.add_argument("--version", action="version", version=f"aruntime {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    sub.add_parser("check", help="open every device kind and run [1,2,3]*2 on it")
    from aruntime.demo import add_arguments

    add_arguments(sub.add_parser("demo", help="stream a dataset from disk through every CPU device, verified"))
    cache = sub.add_parser("cache", help="where the compile cache is, its size, and clearing it")
    cache.add_argument("action", choices=("info", "clear"), help="info: path and size; clear: delete it")
    from aruntime.profile.cli import register as register_profile

    register_profile(sub)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; returns the exit status."""
    if args.command == "check":
        from aruntime.check import run_check

        return run_check()
    if args.command == "demo":
        from aruntime.demo import run_demo

        return run_demo(args)
    if args.command == "cache":
        from aruntime.compile import cache_clear, cache_info

        print(cache_info() if args.action == "info" else cache_clear())
        return 0
    return int(args.handler(args))  # profile


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a user error, printed as one line)."""
    args: argparse.Namespace | None = None
    try:
        args = build_parser().parse_args(argv)
        return run(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    except (AruntimeError, OSError) as exc:
        command = f"aruntime {args.command}" if args is not None else "aruntime"
        print(f"{command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aruntime: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
