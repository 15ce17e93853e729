"""The engine benchmarks (benchmarks/bench_engine.py) run end to end in quick mode and print well-formed JSON lines.

Only the shape of the output is checked: timing goals live in the benchmarks, never in tests.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import REQUIRED_KEYS

ROOT = Path(__file__).resolve().parent.parent
ENGINE_BENCHMARKS = ("roundtrip", "null_ops", "copies", "compile_warm", "compile_parallel")


@pytest.mark.parametrize("name", ENGINE_BENCHMARKS)
def test_engine_benchmark_quick_json(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--json", "--only", name],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines, f"{name} printed no results"
    loops = set()
    for line in lines:
        row = json.loads(line)
        assert set(REQUIRED_KEYS) <= set(row), line
        for key in ("value", "baseline", "ratio"):
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0, line
        assert isinstance(row["name"], str) and isinstance(row["unit"], str) and isinstance(row["goal"], str)
        assert row["pass"] in (True, False, None)
        loops.add(row["loop"])
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
