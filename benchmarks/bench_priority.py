"""Queue priorities: latency-sensitive requests on a device that a bulk pipeline keeps saturated.

* ``priority_flood``: a bulk pipeline (chains of copy-in, a kernel of about 2 ms, awaited copy-out; 24 chains) keeps one
  CPU device's compute and copy queues full; waves of 200 concurrent small requests (copy-in, a kernel of
  about 20 µs, awaited copy-out) run on it at high priority (``priority=-1``), then at normal priority.
  Goals: the high-priority requests' p99 latency at most 2x their p99 on the idle device, at least 5x better
  than the same requests at normal priority in the same run, and the bulk pipeline's throughput at most 15%
  below its throughput alone.
"""

from __future__ import annotations

import array
import time

import anyio

from aruntime import Device, Program
from aruntime.device import BaseDevice
from benchmarks.common import Result, percentile, result, settings

WORK = r"""
#include <stdint.h>
void kernel(float *b, int64_t n, int64_t rounds) {
  for (int64_t r = 0; r < rounds; r++) for (int64_t i = 0; i < n; i++) b[i] = b[i] * 0.999f + 1.0f;
}
"""
BULK_ELEMENTS = 64 << 10  # 256 KiB per bulk buffer
SMALL_ELEMENTS = 1024
IDLE_GOAL = 2.0
NORMAL_GOAL = 5.0
LOSS_GOAL = 0.15


async def _rounds_for(dev: BaseDevice, prog: Program, elements: int, seconds: float) -> int:
    """The kernel rounds over ``elements`` floats that take about ``seconds`` on ``dev``."""
    async with dev.buffer(elements * 4) as buf:
        await dev.copyin(buf, array.array("f", [1.0] * elements))
        start = time.perf_counter()
        await dev.launch(prog, buf, vals=(elements, 16))
        per_round = (time.perf_counter() - start) / 16
    return max(1, round(seconds / per_round))


async def _wave(dev: BaseDevice, prog: Program, rounds: int, requests: int, priority: int) -> list[float]:
    """``requests`` concurrent small requests at ``priority``: each one's latency (s)."""
    data = array.array("f", [1.0] * SMALL_ELEMENTS)
    latencies: list[float] = []

    async def one() -> None:
        async with dev.buffer(SMALL_ELEMENTS * 4) as buf:
            start = time.perf_counter()
            dev.copyin(buf, data, priority=priority)
            dev.launch(prog, buf, vals=(SMALL_ELEMENTS, rounds), priority=priority)
            await dev.copyout(buf, priority=priority)
            latencies.append(time.perf_counter() - start)

    async with anyio.create_task_group() as tg:
        for _ in range(requests):
            tg.start_soon(one)
    return latencies


async def priority_flood() -> list[Result]:
    """High-priority requests under a bulk flood: against the idle device, normal priority, and bulk alone."""
    requests, waves, chains = (20, 1, 2) if settings.quick else (200, 5, 24)
    dev = Device["CPU:30"]
    prog = await dev.compile(WORK)
    bulk_rounds = await _rounds_for(dev, prog, BULK_ELEMENTS, 0.5e-3 if settings.quick else 2e-3)
    small_rounds = await _rounds_for(dev, prog, SMALL_ELEMENTS, 20e-6)
    bulk_data = array.array("f", [1.0] * BULK_ELEMENTS)
    done = 0
    running = True

    async def chain() -> None:
        nonlocal done
        async with dev.buffer(BULK_ELEMENTS * 4) as buf:
            while running:
                dev.copyin(buf, bulk_data)
                dev.launch(prog, buf, vals=(BULK_ELEMENTS, bulk_rounds))
                await dev.copyout(buf)
                done += 1

    idle: list[float] = []
    for _ in range(waves):
        idle += await _wave(dev, prog, small_rounds, requests, -1)
    high: list[float] = []
    normal: list[float] = []
    async with anyio.create_task_group() as tg:
        for _ in range(chains):
            tg.start_soon(chain)
        await anyio.sleep(0.2)  # the flood is up
        alone_s, alone, high_s, during = 0.0, 0, 0.0, 0
        for _ in range(waves):
            before, start = done, time.perf_counter()
            await anyio.sleep(0.1)
            alone += done - before
            alone_s += time.perf_counter() - start
            before, start = done, time.perf_counter()
            high += await _wave(dev, prog, small_rounds, requests, -1)
            during += done - before
            high_s += time.perf_counter() - start
            normal += await _wave(dev, prog, small_rounds, requests, 0)
        running = False
    p99_idle, p99_high, p99_normal = (percentile(x, 99) * 1e3 for x in (idle, high, normal))
    vs_idle, vs_normal = p99_high / p99_idle, p99_normal / p99_high
    rate_alone, rate_during = alone / alone_s, during / high_s
    loss = 1 - rate_during / rate_alone
    return [
        result(
            "priority_flood_vs_idle",
            p99_high,
            "ms p99",
            p99_idle,
            vs_idle,
            f"ratio <= {IDLE_GOAL}",
            vs_idle <= IDLE_GOAL,
            requests=requests,
            waves=waves,
        ),
        result(
            "priority_flood_vs_normal",
            p99_high,
            "ms p99",
            p99_normal,
            vs_normal,
            f"normal/high >= {NORMAL_GOAL}",
            vs_normal >= NORMAL_GOAL,
            requests=requests,
            waves=waves,
        ),
        result(
            "priority_flood_bulk",
            rate_during,
            "chains/s",
            rate_alone,
            1 - loss,
            f"loss <= {LOSS_GOAL:.0%}",
            loss <= LOSS_GOAL,
            chains=chains,
        ),
    ]


BENCHMARKS = [priority_flood]
