"""``aruntime profile view|summary``: the command-line side of profiling."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``profile`` command (with ``view`` and ``summary``) to ``aruntime``'s subparsers."""
    parser = subparsers.add_parser(
        "profile",
        help="view or summarize a profile trace (record one with ARUNTIME_PROFILE=1)",
        description="Work with Chrome traces written by ARUNTIME_PROFILE=1 or aruntime.profile().",
    )
    sub = parser.add_subparsers(dest="profile_command", required=True)

    view = sub.add_parser("view", help="write a self-contained HTML timeline of a trace and open it")
    view.add_argument("trace", help="a Chrome trace JSON file")
    view.add_argument("-o", "--output", help="where to write the page (default: the trace's path with .html)")
    view.add_argument("--title", help="the page title")
    view.add_argument("--no-open", action="store_true", help="only write the page; do not open a browser")

    summary = sub.add_parser("summary", help="print busy, overlap and idle figures per device")
    summary.add_argument("trace", help="a Chrome trace JSON file")
    summary.add_argument("--json", action="store_true", help="print the summary as JSON")
    summary.add_argument("--top", type=int, default=5, help="how many kernels and copies to list (default 5)")

    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Run ``aruntime profile ...``; returns the exit status."""
    from aruntime.profile.trace import load_trace

    try:
        if args.profile_command == "view":
            from aruntime.profile.viewer import open_in_browser, write_html

            page = write_html(args.trace, args.output, args.title)
            opened = not args.no_open and open_in_browser(page)
            print(f"{'opened' if opened else 'wrote'} {page}")
            return 0
        if args.profile_command == "summary":
            from aruntime.profile.summary import format_summary, summarize

            result = summarize(load_trace(args.trace), max(args.top, 0))
            if args.json:
                print(json.dumps(result, indent=2))
            else:
                print(format_summary(result, args.trace))
            return 0
    except OSError as exc:
        print(
            f"aruntime profile {args.profile_command}: {exc.filename or args.trace}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    except ValueError as exc:
        print(f"aruntime profile {args.profile_command}: {exc}", file=sys.stderr)
        return 2
    raise AssertionError(f"unknown profile command {args.profile_command}")  # pragma: no cover - argparse rejects
