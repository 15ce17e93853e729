"""A soak: a long stream of ops through a Scheduler on NULL and on CPU. After a warm-up, RSS and the
allocator's counters stay flat (within 5%); the figures are printed. The default run streams 20,000 ops
per device; ``--run-slow`` streams 1,000,000."""

from __future__ import annotations

import gc

import anyio
import pytest

from aruntime import BaseDevice, Device
from aruntime.scheduler import Scheduler
from tests.kernels import ADD_ONE
from tests.reliability.measure import rss

NBUF = 64
SIZE = 256


async def stream(dev: BaseDevice, ops: int) -> None:
    """``ops`` ops in rounds of copy-in, launch, copy-out over a ring of buffers, with a buffer freed and
    allocated again every round (so the allocator cache is exercised too)."""
    prog = await dev.compile(ADD_ONE)
    bufs = [await dev.allocate(SIZE) for _ in range(NBUF)]
    data = bytes(range(SIZE))
    done = 0
    async with Scheduler(window=256) as sched:
        while done < ops:
            for i in range(NBUF):
                buf = bufs[i]
                sched.copyin(buf, data)
                sched.launch(prog, buf, vals=(SIZE,))
                last = sched.copyout(buf)
                done += 3
            result = bytes(await last)
            assert not dev.host_mapped or result == bytes((b + 1) & 0xFF for b in data)  # NULL computes nothing
            old = bufs[done % NBUF]
            old.deallocate()
            bufs[done % NBUF] = await dev.allocate(SIZE)
    for buf in bufs:
        await dev.free(buf)


async def soak(name: str, ops: int) -> tuple[float, dict[str, int], dict[str, int]]:
    dev = Device[name]
    with anyio.fail_after(max(120, ops / 2000)):
        await stream(dev, ops // 5)  # warm-up
        gc.collect()
        rss0, stats0 = rss(), dev.memory_stats()
        await stream(dev, ops - ops // 5)
        gc.collect()
        rss1, stats1 = rss(), dev.memory_stats()
    growth = (rss1 - rss0) / rss0
    print(
        f"soak {name}: {ops} ops, RSS {rss0 >> 20} -> {rss1 >> 20} MiB ({growth:+.2%}), in use "
        f"{stats0['in_use']} -> {stats1['in_use']} B, cached {stats0['cached']} -> {stats1['cached']} B, "
        f"backend allocations {stats0['allocations']} -> {stats1['allocations']}"
    )
    return growth, stats0, stats1


def check_flat(growth: float, before: dict[str, int], after: dict[str, int]) -> None:
    assert growth < 0.05
    assert after["in_use"] == before["in_use"]
    assert after["cached"] <= before["cached"] * 1.05 + SIZE
    assert after["allocations"] <= before["allocations"] * 1.05 + 1  # the cache serves the stream


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["NULL:81", "CPU:81"])
async def test_a_short_soak_stays_flat(name: str) -> None:
    check_flat(*await soak(name, 20_000))


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("name", ["NULL:82", "CPU:82"])
async def test_a_million_ops_stay_flat(name: str) -> None:
    check_flat(*await soak(name, 1_000_000))
