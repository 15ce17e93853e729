"""Serving under load: cancelled requests that the queues skip, and what live metrics cost.

* ``load_cancel``: 1000 concurrent requests (copy-in, a kernel of about 1 ms, awaited copy-out) through one
  ``Scheduler`` on one CPU device, half of them cancelled right after they submit. With each request in
  ``sched.request()`` the queues skip what the cancelled ones had not started; the baseline is the same run
  without requests (every op runs). Goals: at least 90% of the cancelled requests' ops skipped, and the
  surviving requests' throughput at least 1.6x the baseline's.
* ``load_metrics``: NULL launches submitted and awaited, on a device whose queues time their ops
  (``dev.metrics()``) against one opened with ``ARUNTIME_METRICS=0``: at least 0.95 of its throughput.
"""

from __future__ import annotations

import array
import os
import time
from collections.abc import Awaitable, Callable

import anyio

from aruntime import Buffer, Device, Scheduler
from benchmarks.common import Result, interleaved, ratio_goal, result, settings

WORK = r"""
#include <stdint.h>
void kernel(float *b, int64_t n, int64_t rounds) {
  for (int64_t r = 0; r < rounds; r++) for (int64_t i = 0; i < n; i++) b[i] = b[i] * 0.999f + 1.0f;
}
"""
ELEMENTS = 1024
SKIP_GOAL = 0.9
SPEEDUP_GOAL = 1.6
METRICS_GOAL = 0.95


async def _requests(requests: int, rounds: int, scoped: bool) -> tuple[float, int, int]:
    """Run ``requests`` concurrent requests, every other one cancelled right after it submits: (seconds until
    the last survivor has its answer, survivors answered, the cancelled requests' ops the queues skipped)."""
    dev = Device["CPU"]
    prog = await dev.compile(WORK)
    data = array.array("f", [1.0] * ELEMENTS)
    skipped_before = dev.compute.skipped + dev.copy.skipped
    answered = 0

    async def one(sched: Scheduler, cancel: bool) -> None:
        nonlocal answered
        with anyio.CancelScope() as scope:
            async with dev.buffer(ELEMENTS * 4) as buf:
                if scoped:
                    async with sched.request():
                        await _answer(sched, buf, cancel, scope)
                else:
                    await _answer(sched, buf, cancel, scope)
                answered += 1

    async def _answer(sched: Scheduler, buf: Buffer, cancel: bool, scope: anyio.CancelScope) -> None:
        sched.copyin(buf, data)
        sched.launch(prog, buf, vals=(ELEMENTS, rounds))
        out = sched.copyout(buf)
        if cancel:  # the client left right after asking
            scope.cancel()
            await anyio.sleep_forever()
        await out

    start = time.perf_counter()
    async with Scheduler(window=4 * requests) as sched, anyio.create_task_group() as tg:
        for i in range(requests):
            tg.start_soon(one, sched, i % 2 == 1)
    seconds = time.perf_counter() - start
    skipped = dev.compute.skipped + dev.copy.skipped - skipped_before
    return seconds, answered, skipped


async def load_cancel() -> list[Result]:
    """Half of 1000 requests cancelled: skipped by the queues (requests) against run anyway (no requests)."""
    requests, rounds, repeats = (100, 2000, 1) if settings.quick else (1000, 60_000, 3)
    skips: list[int] = []

    async def scoped() -> None:
        _, answered, skipped = await _requests(requests, rounds, True)
        assert answered == requests // 2, answered
        skips.append(skipped)

    async def unscoped() -> None:
        _, answered, _ = await _requests(requests, rounds, False)
        assert answered == requests // 2, answered

    ours_s, base_s = await interleaved(scoped, unscoped, repeats)
    survivors = requests // 2
    value, baseline = survivors / ours_s, survivors / base_s
    ratio = value / baseline
    share = min(skips) / (3 * (requests - survivors))
    goal, passed = ratio_goal(ratio, ">=", SPEEDUP_GOAL)
    return [
        result("load_cancel_throughput", value, "req/s", baseline, ratio, goal, passed, requests=requests),
        result(
            "load_cancel_skipped",
            share,
            "share",
            1.0,
            share,
            f">= {SKIP_GOAL} of the cancelled requests' ops skipped",
            share >= SKIP_GOAL,
            skipped=skips,
        ),
    ]


async def load_metrics() -> list[Result]:
    """NULL-op throughput with the queues timing their ops against the same with ``ARUNTIME_METRICS=0``."""
    n, repeats = (5_000, 1) if settings.quick else (100_000, 5)
    timed_dev = Device["NULL:21"]
    os.environ["ARUNTIME_METRICS"] = "0"
    try:
        untimed_dev = Device["NULL:22"]
    finally:
        del os.environ["ARUNTIME_METRICS"]
    progs = [await dev.compile("k") for dev in (timed_dev, untimed_dev)]

    def run(i: int) -> Callable[[], Awaitable[None]]:
        async def go() -> None:
            dev, prog = (timed_dev, untimed_dev)[i], progs[i]
            ops = [dev.launch(prog) for _ in range(n)]
            for op in ops:
                await op

        return go

    try:
        on_s, off_s = await interleaved(run(0), run(1), repeats)
    finally:
        await timed_dev.aclose()
        await untimed_dev.aclose()
    value, baseline = n / on_s, n / off_s
    goal, passed = ratio_goal(value / baseline, ">=", METRICS_GOAL)
    return [result("load_metrics", value, "ops/s", baseline, value / baseline, goal, passed, ops=n)]


BENCHMARKS = [load_cancel, load_metrics]
