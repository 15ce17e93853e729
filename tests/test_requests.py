"""Requests: the ops of a cancelled request, or of one whose deadline passed, are skipped if not started."""

from __future__ import annotations

import array
import random
from typing import Any

import anyio
import pytest

from aruntime import (
    DeadlineExceeded,
    DependencyError,
    Device,
    OpSkipped,
    Scheduler,
    SignalTimeout,
    dtypes,
)
from tests.kernels import ADD_ONE, SPINS, closed_gate, gate_output, gate_started

pytestmark = pytest.mark.anyio


async def _blocked(name: str) -> tuple[Any, Any, Any, Any]:
    """A CPU device whose compute queue is held by a running GATE kernel: (device, flag, gate out, ADD_ONE)."""
    dev = Device[name]
    gate, flag = await closed_gate(dev)
    add = await dev.compile(ADD_ONE)
    out = await gate_output(dev)
    dev.launch(gate, out, vals=(flag.handle, SPINS))
    await gate_started(out)
    return dev, flag, out, add


async def _open(dev: Any, flag: Any) -> None:
    await dev.copyin(flag, array.array("i", [1]))


async def test_a_cancelled_request_skips_its_ops_not_started() -> None:
    dev, flag, _, add = await _blocked("CPU:30")
    before = dev.compute.skipped + dev.copy.skipped
    async with dev.buffer(16) as buf, Scheduler() as sched:
        await dev.copyin(buf, bytes(16))
        ops = []
        with anyio.CancelScope() as scope:
            async with sched.request():
                ops.append(sched.launch(add, buf, vals=(16,)))  # behind the gate: not started
                ops.append(sched.launch(add, buf, vals=(16,)))  # reads what the first wrote
                ops.append(sched.copyout(buf))  # a small copy: right behind them on the compute queue
                scope.cancel()
                await ops[-1]
        assert scope.cancelled_caught
        await _open(dev, flag)
        for op in ops:
            with pytest.raises(OpSkipped, match="was skipped: its request was cancelled before it started"):
                await op
    assert dev.compute.skipped + dev.copy.skipped - before == 3
    await dev.synchronize()  # a skipped op is no failure nobody saw


async def test_a_reader_outside_the_request_never_sees_what_a_skipped_op_did_not_write() -> None:
    dev, flag, _, add = await _blocked("CPU:31")
    async with dev.buffer(16) as buf, Scheduler() as sched:
        await dev.copyin(buf, bytes(16))
        async with sched.request() as request:
            skipped = sched.launch(add, buf, vals=(16,))
            assert request.skip()  # nothing outside reads it yet
        outside = dev.copyout(buf)  # submitted after the skip: fails, naming the skipped op
        await _open(dev, flag)
        with pytest.raises(OpSkipped):
            await skipped
        with pytest.raises(DependencyError, match=r"kernel"):
            await outside


async def test_a_request_read_by_work_outside_it_is_not_skipped() -> None:
    dev, flag, _, add = await _blocked("CPU:32")
    async with dev.buffer(16) as buf, Scheduler() as sched:
        await dev.copyin(buf, bytes(16))
        with anyio.CancelScope() as scope:
            async with sched.request() as request:
                ran = sched.launch(add, buf, vals=(16,))
                outside = dev.copyout(buf)  # another reader, outside the request
                scope.cancel()
                await ran
        assert not request.skipped
        await _open(dev, flag)
        await ran
        assert bytes(await outside) == bytes([1]) * 16


async def test_a_deadline_wakes_the_awaiter_and_skips_what_had_not_started() -> None:
    dev, flag, _, add = await _blocked("CPU:33")
    async with dev.buffer(16) as buf, Scheduler() as sched:
        await dev.copyin(buf, bytes(16))
        ops = []
        with anyio.fail_after(10):  # the gate stays closed: the awaiter wakes from the deadline alone
            with pytest.raises(DeadlineExceeded, match=r"deadline of 0.05 s passed") as caught:
                async with sched.request(deadline=0.05):
                    ops.append(sched.launch(add, buf, vals=(16,)))
                    ops.append(sched.copyout(buf))
                    await ops[-1]
        assert isinstance(caught.value, SignalTimeout)
        assert not any(op.done() for op in ops)
        await _open(dev, flag)
        for op in ops:
            with pytest.raises(OpSkipped):
                await op
        assert isinstance(ops[0].error, DeadlineExceeded)


async def test_an_op_running_when_its_deadline_passes_finishes_and_is_done() -> None:
    dev = Device["CPU:34"]
    gate, flag = await closed_gate(dev)
    async with dev.buffer(1, dtypes.int32) as out, Scheduler() as sched:
        await dev.copyin(out, bytes(4))  # no -1 left by an earlier gate (see gate_started)
        with pytest.raises(DeadlineExceeded):
            async with sched.request(deadline=0.05):
                running = sched.launch(gate, out, vals=(flag.handle, SPINS))
                await gate_started(out)
                await running
        await _open(dev, flag)
        assert await running is None and running.error is None
        assert list(await dev.copyout(out)) == [1]


async def test_bad_requests_are_refused() -> None:
    async with Scheduler() as sched:
        for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
            with pytest.raises(ValueError, match="deadline must be a positive number of seconds, finite and below 1e9"):
                sched.request(deadline=bad)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="the scheduler is not open"):
        async with sched.request():
            pass


@pytest.mark.parametrize("requests", [2_000, pytest.param(10_000, marks=pytest.mark.slow)])
async def test_cancelling_requests_at_random_points_leaves_memory_at_its_baseline(requests: int) -> None:
    """Many concurrent requests, each cancelled at a random point (before, during or after its ops): every
    awaiter wakes, nothing is left in flight, and the allocator's bytes in use return to where they were."""
    dev = Device["CPU:35"]
    add = await dev.compile(ADD_ONE)
    rng = random.Random(requests)
    baseline = dev.allocator.in_use
    finished = 0

    async def one(sched: Scheduler, cancel_at: int) -> None:
        nonlocal finished
        with anyio.CancelScope() as scope:
            async with sched.request(), dev.buffer(256) as buf:
                for step in range(4):
                    if step == cancel_at:
                        scope.cancel()
                    if step < 3:
                        op = sched.copyin(buf, bytes(256)) if step == 0 else sched.launch(add, buf, vals=(256,))
                    else:
                        op = sched.copyout(buf)
                    if rng.random() < 0.5:
                        await op
        finished += 1

    with anyio.fail_after(requests / 10):
        async with Scheduler(window=256) as sched, anyio.create_task_group() as tg:
            for _ in range(requests):
                tg.start_soon(one, sched, rng.randrange(5))
    assert finished == requests
    await dev.synchronize()
    assert dev.allocator.in_use == baseline


async def test_a_request_that_ended_in_time_leaves_its_running_work_alone_past_its_deadline() -> None:
    dev, flag, _, add = await _blocked("CPU:36")
    async with dev.buffer(16) as buf, Scheduler() as sched:
        await dev.copyin(buf, bytes(16))
        async with sched.request(deadline=0.05):
            left = sched.launch(add, buf, vals=(16,))  # not awaited: the block ends at once, in time
        await anyio.sleep(0.1)  # the deadline passes while the op is still queued behind the gate
        await _open(dev, flag)
        assert await left is None and left.error is None
        assert bytes(await dev.copyout(buf)) == bytes([1]) * 16


async def test_a_request_read_outside_it_is_not_skipped_at_its_deadline_either() -> None:
    dev, flag, _, add = await _blocked("CPU:37")
    async with dev.buffer(16) as buf, Scheduler() as sched:
        await dev.copyin(buf, bytes(16))
        with pytest.raises(DeadlineExceeded):
            async with sched.request(deadline=0.05):
                ran = sched.launch(add, buf, vals=(16,))
                outside = dev.copyout(buf)  # another reader, outside the request
                await ran
        await _open(dev, flag)
        assert await ran is None
        assert bytes(await outside) == bytes([1]) * 16


async def test_a_nested_request_joins_the_enclosing_one() -> None:
    dev, flag, _, add = await _blocked("CPU:38")
    async with dev.buffer(16) as buf, Scheduler() as sched:
        await dev.copyin(buf, bytes(16))
        with anyio.CancelScope() as scope:
            async with sched.request() as outer:
                first = sched.launch(add, buf, vals=(16,))
                async with sched.request() as inner:
                    second = sched.launch(add, buf, vals=(16,))  # reads what the outer request's op writes
                    assert inner.gate is outer.gate
                    scope.cancel()
                    await second
        assert outer.skipped and inner.skipped
        await _open(dev, flag)
        for op in (first, second):
            with pytest.raises(OpSkipped):
                await op


async def test_a_task_started_in_a_request_that_has_ended_submits_outside_it() -> None:
    dev = Device["CPU:39"]
    add = await dev.compile(ADD_ONE)
    async with dev.buffer(16) as buf, Scheduler() as sched:
        await dev.copyin(buf, bytes(16))
        ops: list[Any] = []
        async with anyio.create_task_group() as tg:
            started = anyio.Event()
            go = anyio.Event()

            async def later() -> None:
                started.set()
                await go.wait()
                ops.append(sched.launch(add, buf, vals=(16,)))

            async with sched.request() as request:
                tg.start_soon(later)
                await started.wait()
            request.skip()  # what the ended request submitted is skipped; the task's later op is not its
            go.set()
        assert await ops[0] is None
        assert bytes(await dev.copyout(buf)) == bytes([1]) * 16
