"""The engine benchmarks (benchmarks/bench_engine.py) run end to end in quick mode and print well-formed JSON lines.

Only the shape of the output is checked: timing goals live in the benchmarks, never in tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_rows import quick_rows

ROOT = Path(__file__).resolve().parent.parent
ENGINE_BENCHMARKS = ("roundtrip", "null_ops", "launch_cost", "copies", "compile_warm", "compile_parallel")


@pytest.mark.parametrize("name", ENGINE_BENCHMARKS)
def test_engine_benchmark_quick_json(name: str) -> None:
    loops = {row["loop"] for row in quick_rows(name)}
    assert loops == ({"any"} if name.startswith("compile") else {"asyncio", "uvloop", "trio"})


def test_unknown_benchmark_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--only", "no_such_benchmark"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no benchmark named no_such_benchmark" in proc.stderr
