"""Profiling overhead: NULL-device ops with recording on against the same ops with recording off.

``profile_overhead``: 100k NULL-device launches of an empty kernel submitted,
then each awaited, once with the profile recorder off and once with it on
(as under ``ARUNTIME_PROFILE=1``), alternating, in the same run. The figure is the
ratio of the median times (on / off); the goal is at most 1.10. Recorded
events are discarded after each "on" run, outside the timed region.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from aruntime import Device, Program
from aruntime.device import BaseDevice
from aruntime.events import recorder
from benchmarks.common import Result, result, settings

EMPTY_KERNEL = "void kernel(void) {}"
GOAL = 1.10


async def _once(dev: BaseDevice, prog: Program, n: int, record: bool) -> float:
    """Seconds for ``n`` launches submitted then awaited, with the recorder on or off."""
    was, mark = recorder.enabled, len(recorder.events)
    gc.collect()
    recorder.enabled = record
    try:
        start = time.perf_counter()
        ops = [dev.launch(prog) for _ in range(n)]
        for op in ops:
            await op
        elapsed = time.perf_counter() - start
    finally:
        recorder.enabled = was
        if not was:
            del recorder.events[mark:]
    return elapsed


async def bench_profile_overhead(n: int = 100_000, repeats: int = 5) -> dict[str, Any]:
    """Time ``n`` NULL ops with recording off and on, alternating ``repeats`` times; the ratio of the medians.

    Returns ``{"name", "value", "unit", "baseline", "ratio", "goal"}``: ``value``
    and ``ratio`` are on/off time (``x``), ``baseline`` is ops/s with recording off.
    """
    dev = Device["NULL"]
    prog = await dev.compile(EMPTY_KERNEL)
    await _once(dev, prog, max(n // 10, 1), False)  # warm up both paths
    await _once(dev, prog, max(n // 10, 1), True)
    off: list[float] = []
    on: list[float] = []
    for i in range(repeats):
        pair = (False, True) if i % 2 == 0 else (True, False)
        for record in pair:
            (on if record else off).append(await _once(dev, prog, n, record))
    t_off, t_on = statistics.median(off), statistics.median(on)
    ratio = t_on / t_off
    return {
        "name": "profile_overhead",
        "value": ratio,
        "unit": "x",
        "baseline": n / t_off,
        "ratio": ratio,
        "goal": f"<= {GOAL:.2f}",
    }


async def profile_overhead() -> list[Result]:
    """The runner's entry: :func:`bench_profile_overhead` at full size (small with ``--quick``)."""
    n, repeats = (5_000, 1) if settings.quick else (100_000, 5)
    r = await bench_profile_overhead(n, repeats)
    return [result(r["name"], r["value"], r["unit"], r["baseline"], r["ratio"], r["goal"], r["ratio"] <= GOAL, ops=n)]


BENCHMARKS = [profile_overhead]
