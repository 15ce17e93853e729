"""Run the benchmarks: every ``BENCHMARKS`` entry of every ``benchmarks/bench_*.py`` module, on each event loop.

python benchmarks/run.py                  # a table
python benchmarks/run.py --json           # one JSON object per result line
python benchmarks/run.py --only null_ops --loops uvloop
python benchmarks/run.py --quick --json   # small sizes: checks that everything runs, measures nothing
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import Benchmark, Result, is_loop_independent, settings  # noqa: E402

LOOPS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


def discover() -> list[Benchmark]:
    """Every benchmark of every ``bench_*.py`` module, modules in name order."""
    found: list[Benchmark] = []
    for path in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        module = importlib.import_module(f"benchmarks.{path.stem}")
        found.extend(module.BENCHMARKS)
    return found


def run(bench: Benchmark, loop: str, quick: bool) -> list[Result]:
    """Run ``bench`` on ``loop``; results get ``loop`` filled in (``any`` for a loop-independent benchmark)."""
    settings.quick = quick
    settings.loop = "any" if is_loop_independent(bench) else loop
    backend, options = LOOPS[loop]
    results: list[Result] = anyio.run(bench, backend=backend, backend_options=options)
    return results


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "-" if x is None else str(x)


def print_table(rows: list[Result]) -> None:
    cols = ("name", "loop", "value", "unit", "baseline", "ratio", "goal", "pass")
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object per result")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this benchmark (repeatable)")
    parser.add_argument("--loops", default=",".join(LOOPS), help="comma-separated event loops (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke test)")
    args = parser.parse_args(argv)

    loops = [name.strip() for name in args.loops.split(",") if name.strip()]
    unknown = [name for name in loops if name not in LOOPS]
    if unknown or not loops:
        parser.error(f"--loops: unknown loop(s) {', '.join(unknown)}; choose from {', '.join(LOOPS)}")
    benches = discover()
    if args.only:
        names = {b.__name__ for b in benches}
        missing = sorted(set(args.only) - names)
        if missing:
            parser.error(f"--only: no benchmark named {', '.join(missing)}; known: {', '.join(sorted(names))}")
        benches = [b for b in benches if b.__name__ in args.only]

    rows: list[Result] = []
    for bench in benches:
        for loop in loops[:1] if is_loop_independent(bench) else loops:
            for row in run(bench, loop, args.quick):
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
    if not args.json:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
