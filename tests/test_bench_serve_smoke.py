"""The HTTP serving benchmark (benchmarks/bench_serve.py) runs end to end in quick mode, and its load generator
refuses wrong answers.

Only the shape of the output is checked: timing goals live in the benchmarks, never in tests.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests.bench_rows import quick_json

pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")

from benchmarks import bench_serve

ROOT = Path(__file__).resolve().parent.parent
NAMES = {"serve_http_vs_numpy", "serve_http_vs_to_thread", "serve_http_ceiling"}


def test_serve_benchmark_quick_json() -> None:
    rows = quick_json("serve_http", loops="uvloop,trio")
    assert {(r["name"], r["loop"]) for r in rows} == {(n, loop) for n in NAMES for loop in ("uvloop", "trio")}
    for row in rows:
        if row["loop"] == "trio":
            assert row["skipped"] == "uvicorn does not run on trio" and row["pass"] is None
            continue
        for key in ("value", "baseline", "ratio", "p50_ms", "p99_ms", "baseline_p50_ms", "baseline_p99_ms"):
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["p50_ms"] <= row["p99_ms"] and row["pass"] in (True, False, None)
        assert row["server_loop"] == "uvloop" and row["http"] in ("h11", "httptools")
        assert row["connections"] == 64 and row["request_bytes"] == 4096
        # every answer was compared with the expected bytes by the load generator (it fails the run otherwise)
        assert all(row["checked"][handler] >= 100 for handler in bench_serve.HANDLERS), row["checked"]


def test_load_generator_refuses_a_wrong_answer() -> None:
    """Against the echo server, expecting doubled values: the first answer is wrong, the run fails and says so."""

    async def main() -> subprocess.CompletedProcess[bytes]:
        async with contextlib.AsyncExitStack() as stack:
            server = await bench_serve._start("echo", "asyncio", stack)
            command = [sys.executable, "-m", "benchmarks.serve.client", "--port", str(server.port)]
            return await anyio.run_process([*command, "--expect", "scaled"], cwd=ROOT, check=False)

    done = anyio.run(main)
    assert done.returncode == 1 and b"not the expected answer" in done.stderr, done.stderr
