"""Running ``benchmarks/run.py --quick --json`` from the tests and checking the shape of what it prints."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import REQUIRED_KEYS

ROOT = Path(__file__).resolve().parent.parent


def quick_json(*names: str, loops: str = "asyncio,uvloop,trio") -> list[dict[str, Any]]:
    """The rows the named benchmarks print in quick mode on ``loops``, each checked for the keys every row has."""
    only = [arg for name in names for arg in ("--only", name)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--json", "--loops", loops, *only],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert rows, f"{names} printed no results"
    for row in rows:
        assert set(REQUIRED_KEYS) <= set(row), row
    return rows


def quick_rows(*names: str) -> list[dict[str, Any]]:
    """:func:`quick_json` on every loop, each row's figures also checked to be positive numbers."""
    rows = quick_json(*names)
    for row in rows:
        for key in ("value", "baseline", "ratio"):
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0, row
        assert isinstance(row["name"], str) and isinstance(row["unit"], str) and isinstance(row["goal"], str)
        assert row["pass"] in (True, False, None)
    return rows
