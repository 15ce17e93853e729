"""The scheduler benchmarks (benchmarks/bench_scheduler.py) run end to end in quick mode and print well-formed JSON.

Only the shape of the output is checked: timing goals live in the benchmarks, never in tests.
"""

from __future__ import annotations

import array
from pathlib import Path

from benchmarks.bench_scheduler import BLOCK, _expected
from benchmarks.common import percentile
from tests.bench_rows import quick_rows

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ("scheduler_pipeline", "scheduler_serving", "scheduler_graph_replay")
ROWS = {
    "pipeline_speedup",
    "pipeline_makespan_vs_ideal",
    "serving_throughput",
    "serving_p50",
    "serving_p99",
    "serving_sched_throughput",
    "serving_sched_p50",
    "serving_sched_p99",
    "serving_batched_throughput",
    "serving_ceiling",
    "graph_replay_cpu",
    "graph_replay_null",
}


def test_scheduler_benchmarks_quick_json() -> None:
    seen: dict[str, set[str]] = {}
    for row in quick_rows(*BENCHMARKS):
        if row["name"].endswith("_throughput"):
            assert 0 < row["p50_ms"] <= row["p99_ms"] and 0 < row["baseline_p50_ms"] <= row["baseline_p99_ms"]
        seen.setdefault(row["name"], set()).add(row["loop"])
    assert set(seen) == ROWS
    assert all(loops == {"asyncio", "uvloop", "trio"} for loops in seen.values()), seen


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0


def test_expected_pipeline_output_counts_partial_passes() -> None:
    assert _expected([1.0, 1.0], 0) == array.array("f", [1.0, 1.0]).tobytes()
    assert _expected([1.0, 1.0], 1) == array.array("f", [1.5, 1.0]).tobytes()  # a partial pass: element 0 only
    assert _expected([1.0, 1.0], 2 * BLOCK + 1) == array.array("f", [1.875, 1.75]).tobytes()  # 1 -> 1.5 -> 1.75
