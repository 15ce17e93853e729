"""The profiling-overhead benchmark runs and reports its figure in the agreed shape (no timing goal here)."""

from __future__ import annotations

import math

import pytest

from aruntime.events import recorder
from benchmarks import bench_profile

pytestmark = pytest.mark.anyio


async def test_profile_overhead_reports_a_ratio_and_leaves_the_recorder_alone() -> None:
    mark = len(recorder.events)
    result = await bench_profile.bench_profile_overhead(n=2_000, repeats=1)
    assert set(result) == {"name", "value", "unit", "baseline", "ratio", "goal"}
    assert result["name"] == "profile_overhead" and result["unit"] == "x" and result["goal"] == "<= 1.10"
    assert result["value"] == result["ratio"] and math.isfinite(result["ratio"]) and result["ratio"] > 0
    assert result["baseline"] > 0  # ops/s with recording off
    assert not recorder.enabled and len(recorder.events) == mark
    assert bench_profile.profile_overhead in bench_profile.BENCHMARKS
