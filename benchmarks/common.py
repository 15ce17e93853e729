"""What the benchmark modules share: the run settings, timing helpers and the result record.

A benchmark module ``benchmarks/bench_<topic>.py`` exports ``BENCHMARKS``, a list
of async callables taking no arguments. Each returns a list of result dicts made
with :func:`result`. The runner calls each once per event loop (asyncio, uvloop,
trio), with :data:`settings` telling it the loop and whether to use small sizes;
a benchmark decorated with :func:`loop_independent` runs only once.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

Result = dict[str, Any]
Benchmark = Callable[[], Awaitable[list[Result]]]

REQUIRED_KEYS = ("name", "value", "unit", "baseline", "ratio", "goal", "loop")
"""The keys every result has (``pass`` too: whether the goal is met, or None when it has no goal)."""


@dataclass
class Settings:
    """The current run: ``quick`` asks for small sizes and few repeats (a smoke test, not a measurement)."""

    quick: bool = False
    loop: str = "asyncio"


settings = Settings()


def loop_independent(fn: Benchmark) -> Benchmark:
    """Mark the benchmark ``fn`` to run once rather than once per event loop."""
    fn.loop_independent = True  # type: ignore[attr-defined]
    return fn


def is_loop_independent(fn: Benchmark) -> bool:
    """Whether ``fn`` was marked with :func:`loop_independent`."""
    return bool(getattr(fn, "loop_independent", False))


def result(
    name: str,
    value: float,
    unit: str,
    baseline: float,
    ratio: float,
    goal: str,
    passed: bool | None,
    **extra: Any,
) -> Result:
    """One measured figure: ``value`` against ``baseline`` measured in the same run, and its goal."""
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "ratio": ratio,
        "goal": goal,
        "pass": passed,
        "loop": settings.loop,
        **extra,
    }


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    """Seconds that ``await fn()`` takes, after a full garbage collection."""
    gc.collect()
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def interleaved(
    ours: Callable[[], Awaitable[object]], base: Callable[[], Awaitable[object]], repeats: int
) -> tuple[float, float]:
    """Median seconds of ``ours`` and of ``base``, run alternately ``repeats`` times each (after one warm-up)."""
    await ours()
    await base()
    ours_s: list[float] = []
    base_s: list[float] = []
    for _ in range(repeats):
        ours_s.append(await timed(ours))
        base_s.append(await timed(base))
    return statistics.median(ours_s), statistics.median(base_s)


async def burst(tasks: int, handle: Callable[[int], Awaitable[object]]) -> tuple[float, list[float]]:
    """Start ``tasks`` tasks blocked on one gate, open it; seconds until all are done, and each one's latency."""
    gate, all_ready = anyio.Event(), anyio.Event()
    latencies = [0.0] * tasks
    ready = 0

    async def one(i: int) -> None:
        nonlocal ready
        ready += 1
        if ready == tasks:
            all_ready.set()
        await gate.wait()
        start = time.perf_counter()
        await handle(i)
        latencies[i] = time.perf_counter() - start

    async with anyio.create_task_group() as tg:
        for i in range(tasks):
            tg.start_soon(one, i)
        await all_ready.wait()
        begin = time.perf_counter()
        gate.set()
    return time.perf_counter() - begin, latencies
