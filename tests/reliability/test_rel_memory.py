"""Bounded memory: the LRU cache's cap and eviction order, the memory counters, large host buffers from mmap
(RSS goes back on a flush), and what a submission flood without a scheduler costs."""

from __future__ import annotations

import gc

import anyio
import pytest

from aruntime import Device
from aruntime.engine import CommandQueue, Op, TimelineSignal
from aruntime.memory.allocator import DEFAULT_CACHE_LIMIT, MMAP_MIN, HostAllocator
from tests.reliability.measure import rss


def test_the_cache_keeps_at_most_its_limit_and_evicts_the_least_recently_freed_first() -> None:
    alloc = HostAllocator("CAP-TEST")
    assert alloc.cache_limit == DEFAULT_CACHE_LIMIT
    alloc.cache_limit = 1000
    a, b, c = alloc.alloc(300), alloc.alloc(400), alloc.alloc(500)
    for handle, size in ((a, 300), (b, 400), (c, 500)):
        alloc.free(handle, size)
    stats = alloc.memory_stats()
    assert stats["cached"] == 900 and stats["evictions"] == 1 and stats["frees"] == 1  # a went, b and c stay
    assert alloc.alloc(400) == b and alloc.alloc(500) == c  # cache hits
    assert alloc.memory_stats()["cache_hits"] == 2 and alloc.cached_bytes == 0
    big = alloc.alloc(2000)
    alloc.free(big, 2000)  # bigger than the whole limit: freed at once
    assert alloc.cached_bytes == 0
    alloc.free(b, 400)
    alloc.free(c, 500)
    evictions = alloc.memory_stats()["evictions"]
    alloc.cache_limit = 450  # lowering the limit evicts the oldest until the rest fits
    assert alloc.cached_bytes == 0  # b (oldest) went, then c did not fit alone either
    assert alloc.memory_stats()["evictions"] == evictions + 2
    alloc.cache_limit = 0  # caches nothing
    d = alloc.alloc(64)
    alloc.free(d, 64)
    assert alloc.cached_bytes == 0


def test_lru_limit_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARUNTIME_LRU_LIMIT", "4096")
    alloc = HostAllocator("ENV-CAP")
    assert alloc.cache_limit == 4096
    handles = [alloc.alloc(1024) for _ in range(8)]
    for h in handles:
        alloc.free(h, 1024)
    assert alloc.cached_bytes == 4096 and alloc.memory_stats()["evictions"] == 4
    alloc.free_cache()


@pytest.mark.anyio
async def test_device_memory_stats_count_use_peak_hits_and_flushes() -> None:
    dev = Device["CPU:41"]
    base = dev.memory_stats()
    a = await dev.allocate(1000)
    b = await dev.allocate(3000)
    s = dev.memory_stats()
    assert s["in_use"] == base["in_use"] + 4000 and s["peak_in_use"] >= base["in_use"] + 4000
    assert s["allocations"] == base["allocations"] + 2
    await dev.free(a)
    await dev.free(b)
    s = dev.memory_stats()
    assert s["in_use"] == base["in_use"] and s["cached"] == base["cached"] + 4000
    again = await dev.allocate(1000)
    assert dev.memory_stats()["cache_hits"] == base["cache_hits"] + 1
    await dev.free(again)
    dev.flush_cache()
    s = dev.memory_stats()
    assert s["cached"] == 0 and s["flushes"] == base["flushes"] + 1 and s["frees"] == base["frees"] + 2
    assert s["peak_in_use"] >= base["in_use"] + 4000  # the peak stays


@pytest.mark.anyio
async def test_a_flush_gives_large_host_buffers_back_to_the_operating_system() -> None:
    dev = Device["CPU:42"]
    size = 8 << 20
    assert size >= MMAP_MIN
    gc.collect()
    before = rss()
    bufs = [await dev.allocate(size) for _ in range(8)]  # 64 MiB
    for buf in bufs:
        await dev.copyin(buf, b"\x01" * size)  # touched: resident
    touched = rss()
    for buf in bufs:
        await dev.free(buf)
    cached = rss()
    assert dev.memory_stats()["cached"] == 8 * size
    dev.flush_cache()
    flushed = rss()
    print(f"RSS: before {before >> 20} MiB, touched {touched >> 20}, cached {cached >> 20}, flushed {flushed >> 20}")
    assert touched - before >= 48 << 20  # the buffers were resident
    assert cached - flushed >= 48 << 20  # and the flush returned them
    assert dev.memory_stats()["cached"] == 0


@pytest.mark.anyio
async def test_a_submission_flood_without_a_scheduler_costs_memory_per_op_and_gives_it_back() -> None:
    dev = Device["NULL:43"]
    bufs = [await dev.allocate(64) for _ in range(64)]
    data = bytes(64)
    n = 20_000
    gate = TimelineSignal("flood gate", 30)
    dev.copy.submit(CommandQueue().wait(gate, 1), Op("flood gate"))  # nothing finishes until the flood is in
    gc.collect()
    before = rss()
    ops = [dev.copyin(bufs[i % 64], data) for i in range(n)]
    flooded = rss()
    gate.set(1)
    with anyio.fail_after(30):
        await dev.settle()
    assert all(op.done() and op.error is None for op in ops)
    del ops
    gc.collect()
    after = rss()
    per_op = (flooded - before) / n
    print(f"flood of {n} ops in flight: {per_op:.0f} B of RSS per op; {(after - before) >> 10} KiB kept after")
    assert per_op < 4096  # about 600 B measured: a flood is bounded only by what the caller submits
    assert after - before < (flooded - before) // 2 + (1 << 20)  # most of it is given back


@pytest.mark.anyio
async def test_a_zero_copy_view_keeps_a_flushed_large_buffer_mapped() -> None:
    dev = Device["CPU:44"]
    buf = await dev.allocate(2 << 20)
    await dev.copyin(buf, b"\x07" * (2 << 20))
    view = buf.as_buffer(allow_zero_copy=True)
    await dev.free(buf)
    dev.flush_cache()  # really freed: the mapping stays only for the view
    assert dev.memory_stats()["cached"] == 0
    assert view[0] == 7 and view[-1] == 7  # reads the bytes, not unmapped memory
    view.release()
