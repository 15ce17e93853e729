"""The serving-under-load benchmarks (benchmarks/bench_load.py) run end to end in quick mode.

Only the shape of the output is checked: timing goals live in the benchmarks, never in tests.
"""

from __future__ import annotations

from tests.bench_rows import quick_json


def test_load_benchmarks_quick_json() -> None:
    rows = quick_json("load_cancel", "load_metrics")
    names = {(row["name"], row["loop"]) for row in rows}
    expected = {"load_cancel_throughput", "load_cancel_skipped", "load_metrics"}
    assert names == {(name, loop) for name in expected for loop in ("asyncio", "uvloop", "trio")}
    for row in rows:
        if row["name"] == "load_cancel_skipped":  # at the quick size the queue may keep up: nothing to skip
            assert 0.0 <= row["value"] <= 1.0, row
        else:
            assert row["value"] > 0, row
