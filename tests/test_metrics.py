"""Live queue metrics (``dev.metrics()``): they add up, and they say what the queues did."""

from __future__ import annotations

import array
import json

import anyio
import pytest

from aruntime import Device, OpSkipped, Scheduler, dtypes
from aruntime.engine.metrics import bucket, floor, summary
from tests.kernels import ADD_ONE, SPINS, closed_gate, gate_started

pytestmark = pytest.mark.anyio


def _adds_up(queue: dict[str, object]) -> bool:
    parts = [queue[key] for key in ("done", "skipped", "running", "queued")]
    return sum(parts) == queue["submitted"]  # type: ignore[arg-type]


def test_buckets_hold_their_values_within_an_eighth() -> None:
    for ns in [0, 1, 7, 8, 9, 15, 16, 100, 1_000, 123_456, 10**9, 3 * 10**12]:
        low = floor(bucket(ns))
        assert low <= ns and (ns - low) <= ns / 8
        assert floor(bucket(ns) + 1) > ns
    assert summary([0] * 10)["p50_us"] is None
    counts = [0] * 600
    for ns in range(1, 101):  # 1..100 µs, once each
        counts[bucket(ns * 1000)] += 1
    out = summary(counts)
    assert out["count"] == 100
    assert 50 * 7 / 8 <= out["p50_us"] <= 50 and 99 * 7 / 8 <= out["p99_us"] <= 99


async def test_queue_metrics_add_up_while_work_waits_and_runs() -> None:
    dev = Device["CPU:40"]
    gate, flag = await closed_gate(dev)
    add = await dev.compile(ADD_ONE)
    async with dev.buffer(1, dtypes.int32) as out, dev.buffer(64) as buf:
        await dev.copyin(out, bytes(4))  # no -1 left by an earlier gate (see gate_started)
        await dev.copyin(buf, bytes(64))
        before = dev.metrics()["compute"]
        running = dev.launch(gate, out, vals=(flag.handle, SPINS))
        await gate_started(out)
        behind = [dev.launch(add, buf, vals=(64,)) for _ in range(5)]
        now = dev.metrics()["compute"]
        assert _adds_up(now)
        assert now["submitted"] - before["submitted"] == 6
        assert now["running"] == 1 and now["queued"] == 5
        await dev.copyin(flag, array.array("i", [1]))
        await running
        for op in behind:
            await op
        after = dev.metrics()["compute"]
    assert _adds_up(after)
    assert after["done"] - before["done"] == 6 and after["running"] == after["queued"] == 0
    assert after["run_time"]["count"] - before["run_time"]["count"] == 6
    assert after["queue_time"]["count"] - before["queue_time"]["count"] == 6
    assert after["run_time"]["p50_us"] <= after["run_time"]["p90_us"] <= after["run_time"]["p99_us"]
    assert after["busy_s"] > before["busy_s"] and 0 < after["busy_share"] <= 1.0
    json.dumps(dev.metrics())  # plain data


async def test_skipped_ops_are_counted() -> None:
    dev = Device["CPU:41"]
    gate, flag = await closed_gate(dev)
    add = await dev.compile(ADD_ONE)
    async with dev.buffer(1, dtypes.int32) as out, dev.buffer(64) as buf, Scheduler() as sched:
        await dev.copyin(out, bytes(4))  # no -1 left by an earlier gate (see gate_started)
        await dev.copyin(buf, bytes(64))
        dev.launch(gate, out, vals=(flag.handle, SPINS))
        await gate_started(out)
        before = dev.metrics()["compute"]
        with anyio.CancelScope() as scope:
            async with sched.request():
                ops = [sched.launch(add, buf, vals=(64,)) for _ in range(3)]
                scope.cancel()
                await ops[-1]
        await dev.copyin(flag, array.array("i", [1]))
        for op in ops:
            with pytest.raises(OpSkipped):
                await op
        after = dev.metrics()["compute"]
    assert _adds_up(after)
    assert after["skipped"] - before["skipped"] == 3
    assert after["done"] - before["done"] == 1  # the gate kernel


async def test_with_metrics_off_queues_count_but_do_not_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARUNTIME_METRICS", "0")
    dev = Device["NULL:7"]
    monkeypatch.delenv("ARUNTIME_METRICS")
    try:
        prog = await dev.compile("k")
        for _ in range(10):
            await dev.launch(prog)
        queue = dev.metrics()["compute"]
        assert queue["done"] == queue["submitted"] == 10 and _adds_up(queue)
        assert queue["run_time"] == {"count": 0, "p50_us": None, "p90_us": None, "p99_us": None}
        assert queue["queue_time"]["count"] == 0 and queue["busy_s"] == 0
    finally:
        await dev.aclose()
