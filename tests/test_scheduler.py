"""The scheduler: backpressure, failures, cancellation, sharing."""

from __future__ import annotations

import array
from typing import Any

import anyio
import pytest

from aruntime import (
    Buffer,
    DependencyError,
    Device,
    Graph,
    OpError,
    OpSkipped,
    Program,
    Scheduler,
    SchedulerFull,
    dtypes,
)
from tests.kernels import ADD_ONE, COPY_QUEUE_INTS, SCALE, SPINS, Failing, closed_gate, gate_output, gate_started

pytestmark = pytest.mark.anyio


async def _gate(dev_name: str) -> tuple[Any, Any, Program]:
    dev = Device[dev_name]
    prog, flag = await closed_gate(dev)
    return dev, flag, prog


async def _window_case(dev_name: str) -> tuple[Any, Any, Program, Program, Buffer, list[Buffer]]:
    """A gated device, the ADD_ONE kernel, the gate's output and three zeroed 8-byte buffers."""
    dev, flag, gate = await _gate(dev_name)
    add = await dev.compile(ADD_ONE)
    out = await gate_output(dev)
    bufs = [await dev.allocate(8) for _ in range(3)]
    for b in bufs:
        dev.copyin(b, bytes(8))
    return dev, flag, gate, add, out, bufs


async def test_pipeline_results_across_two_devices() -> None:
    devs = [Device["CPU"], Device["CPU:1"]]
    progs = {d.name: await d.compile(SCALE, outs=(0,)) for d in devs}
    n = 256
    handles = []
    async with Scheduler(window=6) as sched:
        for i in range(24):
            d = devs[i % 2]
            x = await d.allocate(n, dtypes.float32)
            y = await d.allocate(n, dtypes.float32)
            sched.copyin(x, array.array("f", [float(i)] * n))
            sched.launch(progs[d.name], y, x, vals=(n, 3.0))
            handles.append(sched.copyout(y))
            assert sched.in_flight <= 6
    for i, h in enumerate(handles):
        assert set(array.array("f", bytes(await h))) == {3.0 * i}


async def test_full_window_queues_ops_in_order_and_room_waits_for_it() -> None:
    dev, flag, gate, add, out, bufs = await _window_case("CPU:1")
    roomy = anyio.Event()
    with anyio.fail_after(10):
        async with Scheduler(window=3) as sched, anyio.create_task_group() as tg:
            sched.launch(gate, out, vals=(flag.handle, SPINS))  # holds the compute queue
            sched.launch(add, bufs[0], vals=(8,))
            sched.launch(add, bufs[1], vals=(8,))
            fourth = sched.launch(add, bufs[2], vals=(8,))  # returned at once, queued: not handed on
            assert (sched.in_flight, sched.queued) == (3, 1)
            assert not fourth.dispatched and not fourth.done()

            async def wait_for_room() -> None:
                await sched.room()
                roomy.set()

            tg.start_soon(wait_for_room)
            await anyio.wait_all_tasks_blocked()
            assert not roomy.is_set()
            await dev.copyin(flag, array.array("i", [1]))  # open the gate: the window drains
            await fourth
            await roomy.wait()
            assert sched.queued == 0
    assert bytes(await dev.copyout(bufs[2])) == b"\x01" * 8


async def test_a_full_queue_refuses_more_until_there_is_room() -> None:
    dev, flag, gate, add, out, bufs = await _window_case("CPU:1")
    with anyio.fail_after(10):
        async with Scheduler(window=1, queue=2) as sched:
            sched.launch(gate, out, vals=(flag.handle, SPINS))  # fills the window
            queued = [sched.launch(add, b, vals=(8,)) for b in bufs[:2]]
            with pytest.raises(SchedulerFull, match=r"2 ops already wait .* window of 1 \(queue=2\)"):
                sched.launch(add, bufs[2], vals=(8,))
            assert sched.queued == 2
            await dev.copyin(flag, array.array("i", [1]))
            await sched.room()
            assert sched.queued == 0 and all(op.done() for op in queued)
            await sched.launch(add, bufs[2], vals=(8,))
    assert [bytes(await dev.copyout(b)) for b in bufs] == [b"\x01" * 8] * 3


async def test_failure_fails_dependents_spares_independents_and_raises_on_exit() -> None:
    dev = Device["CPU"]
    add = await dev.compile(ADD_ONE)
    bad = Failing(dev, "broken", b"")
    a = await dev.allocate(4)
    b = await dev.allocate(4)
    await dev.copyin(b, bytes(4))
    with pytest.raises(OpError, match="kernel blew up"):
        async with Scheduler() as sched:
            sched.launch(bad, a)
            dependent = sched.copyout(a)
            independent = sched.launch(add, b, vals=(4,))
            await independent
            with pytest.raises(DependencyError, match="depends on broken, which failed") as info:
                await dependent
            assert info.value.first == "broken"
    assert bytes(await dev.copyout(b)) == b"\x01" * 4
    await dev.synchronize()  # the scheduler reported the failures: nothing left unobserved


async def test_cancelled_scope_drops_queued_ops_skips_those_not_started_and_waits_for_running() -> None:
    dev, flag, gate = await _gate("CPU:2")
    add = await dev.compile(ADD_ONE)
    out = await gate_output(dev)
    buf = await dev.allocate(16)
    await dev.copyin(buf, bytes(16))
    submitted: list[Any] = []
    dropped: list[Any] = []
    in_drain = anyio.Event()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def pipeline(task_status: Any) -> None:
                with anyio.CancelScope() as scope:
                    task_status.started(scope)
                    async with Scheduler(window=2) as sched:
                        submitted.append(sched.launch(gate, out, vals=(flag.handle, SPINS)))
                        submitted.append(sched.launch(add, buf, vals=(16,)))  # admitted, not started: skipped
                        dropped.append(sched.launch(add, buf, vals=(16,)))  # queued: never submitted
                        await anyio.sleep_forever()
                in_drain.set()

            scope = await tg.start(pipeline)
            await anyio.wait_all_tasks_blocked()
            await gate_started(out)
            last = dev.compute.last
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            assert not in_drain.is_set(), "the scope must wait for the running kernel"
            await dev.copyin(flag, array.array("i", [1]))
            await in_drain.wait()
    assert len(submitted) == 2 and all(op.done() for op in submitted)
    assert submitted[0].error is None and isinstance(submitted[1].error, OpSkipped)
    assert dev.compute.skipped >= 1
    assert dev.compute.last == last and buf.is_allocated()
    with pytest.raises(OpError, match="was dropped: its scheduler closed before it was admitted"):
        await dropped[0]
    with pytest.raises(DependencyError):  # like a failed write: what it should have written is not valid
        await dev.copyout(buf)
    await dev.synchronize()  # a dropped op is no failure nobody saw
    await dev.copyin(buf, bytes(16))  # written again: valid
    assert bytes(await dev.copyout(buf)) == bytes(16)


async def test_a_dropped_op_is_done_only_after_the_ops_it_waits_for() -> None:
    dev, flag, gate = await _gate("CPU:6")
    out = await gate_output(dev)
    with anyio.fail_after(10):
        with pytest.raises(RuntimeError, match="the pipeline failed"):
            async with Scheduler(window=1, drain_timeout=0.1) as sched:
                kernel = sched.launch(gate, out, vals=(flag.handle, SPINS))  # fills the window, writes out
                dropped = sched.copyin(out, bytes(4))  # queued; the hazard log keeps it in place of the kernel
                await gate_started(out)  # running: it is waited for, not skipped
                raise RuntimeError("the pipeline failed")
        # the drain gave up on the kernel, which still writes out: the dropped copy-in must not count as done
        # yet, or freeing out would hand its memory back while the kernel uses it
        assert not kernel.done() and not dropped.done()
        in_use = dev.allocator.in_use
        out.deallocate()
        assert dev.allocator.in_use == in_use  # released once the kernel is done, not now
        await dev.copyin(flag, array.array("i", [1]))
        assert await kernel is None
        with pytest.raises(OpError, match="was dropped: its scheduler closed before it was admitted"):
            await dropped


async def test_many_tasks_share_one_scheduler() -> None:
    dev = Device["CPU:3"]
    prog = await dev.compile(SCALE, outs=(0,))
    results: dict[int, set[float]] = {}

    async def request(sched: Scheduler, i: int) -> None:
        x = await dev.allocate(64, dtypes.float32)
        y = await dev.allocate(64, dtypes.float32)
        sched.copyin(x, array.array("f", [float(i)] * 64))
        sched.launch(prog, y, x, vals=(64, 2.0))
        results[i] = set(array.array("f", bytes(await sched.copyout(y))))

    async with Scheduler(window=16) as sched, anyio.create_task_group() as tg:
        for i in range(100):
            tg.start_soon(request, sched, i)
    assert results == {i: {2.0 * i} for i in range(100)}


async def test_enqueue_outside_the_context_is_an_error() -> None:
    sched = Scheduler()
    buf = await Device["CPU"].allocate(4)
    with pytest.raises(RuntimeError, match="not open"):
        sched.copyin(buf, bytes(4))
    with pytest.raises(ValueError, match="window must be a positive int"):
        Scheduler(window=0)
    with pytest.raises(ValueError, match="queue must be a non-negative int, got -1"):
        Scheduler(queue=-1)
    with pytest.raises(
        ValueError, match="drain_timeout must be a positive number of seconds, finite and below 1e9, got -1"
    ):
        Scheduler(drain_timeout=-1)


async def test_queued_ops_are_admitted_in_order_whoever_awaits_them() -> None:
    dev, flag, gate, add, out, bufs = await _window_case("CPU:2")
    done: list[int] = []
    ops: list[Any] = []
    with anyio.fail_after(10):
        async with Scheduler(window=1) as sched, anyio.create_task_group() as tg:
            sched.launch(gate, out, vals=(flag.handle, SPINS))  # fills the window

            async def enqueue(i: int, task_status: Any) -> None:
                with anyio.CancelScope() as scope:
                    task_status.started(scope)
                    ops.append(op := sched.launch(add, bufs[i], vals=(8,)))
                    await op
                    done.append(i)

            scopes = []
            for i in range(3):
                scopes.append(await tg.start(enqueue, i))
                await anyio.wait_all_tasks_blocked()  # queued in this order
            assert sched.queued == 3
            scopes[1].cancel()  # the middle task stops waiting; its op stays enqueued and runs
            await anyio.wait_all_tasks_blocked()
            assert done == []
            await dev.copyin(flag, array.array("i", [1]))
    assert sorted(done) == [0, 2]  # the tasks wake in the loop's order, the ops ran in theirs:
    assert ops[0].value < ops[1].value < ops[2].value  # handed to the compute queue in the order enqueued
    assert [bytes(await dev.copyout(b)) for b in bufs] == [b"\x01" * 8] * 3


async def test_held_op_lets_later_independent_work_on_its_queue_go_first() -> None:
    dev, flag, gate = await _gate("CPU:4")
    out = await dev.allocate(COPY_QUEUE_INTS, dtypes.int32)  # too big to ride on the compute queue
    other = await dev.allocate(64)
    with anyio.fail_after(10):
        async with Scheduler() as sched:
            kernel = sched.launch(gate, out, vals=(flag.handle, SPINS))
            reader = sched.copyout(out)  # must wait for the kernel: held off the copy queue
            assert not reader.dispatched and not reader.done()
            await sched.copyin(other, b"x" * 64)  # behind it in program order, done before it
            assert not kernel.done() and not reader.dispatched
            waiter = anyio.Event()

            async def sync() -> None:
                await dev.synchronize()  # waits for held ops too
                waiter.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(sync)
                await anyio.wait_all_tasks_blocked()
                assert not waiter.is_set()
                await dev.copyin(flag, array.array("i", [5]))
            assert reader.dispatched and reader.done()
            assert array.array("i", bytes(await reader))[0] == 5


async def test_held_op_behind_a_failure_fails_with_the_first_cause() -> None:
    dev = Device["CPU:4"]
    buf = await dev.allocate(1 << 17)  # too big to ride on the compute queue
    with pytest.raises(OpError, match="kernel blew up"):
        async with Scheduler() as sched:
            sched.launch(Failing(dev, "broken", b""), buf)
            reader = sched.copyout(buf)
            with pytest.raises(DependencyError, match="depends on broken"):
                await reader
    await dev.synchronize()
    await dev.free(buf)


async def test_a_scheduler_follows_a_device_that_was_closed_and_reopened() -> None:
    before = Buffer("CPU:9", 8, preallocate=True)
    async with Scheduler() as sched:
        await sched.copyin(before, bytes(8))
        Device["CPU:9"].close()
        after = Buffer("CPU:9", 8, preallocate=True)  # on the device opened under that name now
        await sched.copyin(after, b"abcdefgh")
        assert bytes(await sched.copyout(after)) == b"abcdefgh"


async def test_a_replay_waits_in_the_queue_like_any_op() -> None:
    dev, flag, gate, add, out, bufs = await _window_case("CPU:3")
    graph = Graph()
    graph.copyin(bufs[0], "data")
    graph.launch(add, bufs[0], vals=(8,))
    graph.copyout(bufs[0], "result")
    with anyio.fail_after(10):
        async with Scheduler(window=1) as sched:
            sched.launch(gate, out, vals=(flag.handle, SPINS))  # fills the window
            run = sched.replay(graph, data=bytes(range(8)))
            assert sched.queued == len(run.ops) and not run.done()
            await dev.copyin(flag, array.array("i", [1]))
            assert bytes((await run)["result"]) == bytes(range(1, 9))
