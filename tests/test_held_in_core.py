"""Ops a Scheduler holds for a dependency on another queue reach their queue without the event loop.

On the native engine the core receives such an op with what it waits for and appends it to its queue from
the worker thread that meets its last dependency; on the Python engine the engine thread that completes the
dependency hands it over. Either way the loop does not take part: these tests block the loop's thread while
the work runs.
"""

from __future__ import annotations

import array
import ctypes

import anyio
import pytest

from aruntime import Buffer, DependencyError, Device, DeviceError, OpError, Scheduler, dtypes
from aruntime.engine import KernelError
from tests.kernels import COPY_QUEUE_INTS, INC, SPINS, closed_gate

pytestmark = pytest.mark.anyio

FAIL = r"""
#include <stdint.h>
int kernel(int32_t *b, int64_t n) { for (int64_t i = 0; i < n; i++) b[i] = -1; return 7; }
"""
OPS = 10_000


async def test_a_chain_across_four_queues_completes_with_the_loop_blocked() -> None:
    """10,000 ops, each reading what the one before wrote, alternate between two devices' compute and copy
    queues: a kernel on one device, a transfer to the other, a kernel there, a transfer back. The loop's thread
    blocks on the last op from the moment the chain is submitted, so no op can wait for a loop turn."""
    devs = Device["CPU:3"], Device["CPU:4"]
    progs = [await dev.compile(INC, outs=(0,)) for dev in devs]
    n = 16
    async with devs[0].buffer(n, dtypes.int32) as a, devs[1].buffer(n, dtypes.int32) as b:
        await devs[0].copyin(a, array.array("i", range(n)))
        ops = []
        async with Scheduler(window=OPS, queue=0) as sched:
            for _ in range(OPS // 4):
                ops.append(sched.launch(progs[0], a, vals=(n,)))
                ops.append(sched.transfer(b, a))
                ops.append(sched.launch(progs[1], b, vals=(n,)))
                ops.append(sched.transfer(a, b))
            engines = {op.engine for op in ops}
            assert engines == {devs[0].compute, devs[0].copy, devs[1].compute, devs[1].copy}
            ops[-1].wait_done(timeout=60)  # the loop's thread blocks: nothing can run on the loop meanwhile
            assert all(op.done() for op in ops)
            assert all(op.error is None for op in ops)
        assert list(await devs[0].copyout(a)) == [i + OPS // 2 for i in range(n)]


async def test_a_held_op_whose_dependency_failed_fails_and_the_queue_goes_on() -> None:
    dev = Device["CPU:3"]
    fail = await dev.compile(FAIL, outs=(0,))
    big = COPY_QUEUE_INTS  # the copy-out goes on the copy queue and waits there for the kernel
    async with dev.buffer(big, dtypes.int32) as buf, dev.buffer(4, dtypes.int32) as other:
        with pytest.raises(KernelError):
            async with Scheduler() as sched:
                failing = sched.launch(fail, buf, vals=(big,))
                reader = sched.copyout(buf)
                independent = sched.copyin(other, array.array("i", [1, 2, 3, 4]))
                reader.wait_done(timeout=30)  # handed on and failed with the loop blocked
                with pytest.raises(DependencyError) as info:
                    await reader
                assert info.value.first == failing.name
                await independent
        assert list(await dev.copyout(other)) == [1, 2, 3, 4]


async def test_a_held_op_whose_queue_stopped_fails_instead_of_being_lost() -> None:
    """An engine that stopped while an op waited for a dependency: the op fails once the dependency is done,
    naming the closed queue; awaiting it does not hang."""
    dev = Device["CPU:5"]
    gate, flag = await closed_gate(dev)
    big = await dev.allocate(COPY_QUEUE_INTS, dtypes.int32)
    with anyio.fail_after(20):
        async with Scheduler() as sched:
            writer = sched.launch(gate, big, vals=(flag.handle, SPINS))
            held = sched.copyout(big)
            assert not held.dispatched
            await anyio.to_thread.run_sync(dev.copy.close)  # the copy queue stops with the op still held
            _open(flag)
            await writer
            with pytest.raises((DeviceError, OpError), match="closed") as info:
                await held
            assert "copy queue" in str(info.value)
        await dev.aclose()


async def test_cancelling_a_scope_with_held_ops_leaves_memory_at_its_baseline() -> None:
    dev = Device["CPU:6"]
    gate, flag = await closed_gate(dev)
    inc = await dev.compile(INC, outs=(0,))
    baseline = dev.memory_stats()["in_use"]
    with anyio.fail_after(20):
        with anyio.CancelScope() as scope:
            async with dev.buffer(COPY_QUEUE_INTS, dtypes.int32) as buf, Scheduler() as sched:
                sched.launch(gate, buf, vals=(flag.handle, SPINS))
                held = [sched.copyout(buf) for _ in range(8)]
                held.append(sched.launch(inc, buf, vals=(COPY_QUEUE_INTS,)))
                assert not any(op.done() for op in held)
                _open(flag)
                scope.cancel()  # the scheduler's exit drains what is in flight, the buffer's exit frees it
                await anyio.sleep_forever()
        assert scope.cancelled_caught
    assert all(op.done() for op in held)
    await dev.synchronize()
    assert dev.memory_stats()["in_use"] == baseline


def _open(flag: Buffer) -> None:
    """Open a gate from the host (its flag is host memory of a CPU device), without any queue."""
    ctypes.c_int32.from_address(flag.handle).value = 1


async def test_awaiting_the_end_of_a_held_chain_wakes_the_loop_a_few_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leaving a scheduler with 400 ops held in the core waits for them with a few wake-ups of the loop (for the
    newest op: the core tells the loop when it is handed on, then when it is done), not one per op."""
    from aruntime.engine import NativeEngine
    from aruntime.engine.native.notify import Notified

    devs = Device["CPU:3"], Device["CPU:4"]
    if not isinstance(devs[0].compute, NativeEngine):
        pytest.skip("the Python engine hands held ops on from its own threads")
    progs = [await dev.compile(INC, outs=(0,)) for dev in devs]
    n = 1 << 18  # each op takes longer than a loop's wake-up: a loop woken per op would be woken hundreds of times
    runs = 0  # what the loop's notifier ran: each a wake-up of the loop, or part of one
    run = Notified._run

    def counted(self: Notified, sig: object, item: object) -> None:
        nonlocal runs
        runs += 1
        run(self, sig, item)  # type: ignore[arg-type]

    async with devs[0].buffer(n, dtypes.int32) as a, devs[1].buffer(n, dtypes.int32) as b:
        await devs[0].copyin(a, array.array("i", range(n)))
        gate, flag = await closed_gate(devs[0])
        started = await devs[0].allocate(1, dtypes.int32)
        ops = []
        monkeypatch.setattr(Notified, "_run", counted)
        async with Scheduler() as sched:
            sched.launch(gate, started, vals=(flag.handle, SPINS))  # holds devs[0]'s compute queue
            for _ in range(100):
                ops.append(sched.launch(progs[0], a, vals=(n,)))
                ops.append(sched.transfer(b, a))
                ops.append(sched.launch(progs[1], b, vals=(n,)))
                ops.append(sched.transfer(a, b))
            assert not ops[-1].dispatched  # held in the core behind the gate
            ctypes.c_int32.from_address(flag.handle).value = 1
        # leaving waited for all of them
        assert all(op.done() for op in ops)
        assert runs <= 8, runs
        assert list(await devs[0].copyout(a)) == [i + 200 for i in range(n)]


async def test_a_task_awaiting_a_held_op_is_resumed_by_the_notifier_itself() -> None:
    """A task awaits a copy-out held in the core behind a gated kernel. The core tells the loop's notifier when the
    op is handed on and when it is done; the notifier resumes the task as it drains, without a call through the
    loop's thread-safe entry point (a write to the loop's wake-up descriptor and one more turn)."""
    from aruntime.engine import NativeEngine
    from aruntime.engine.native.signal import _loop_waker

    dev = Device["CPU:3"]
    if not isinstance(dev.compute, NativeEngine):
        pytest.skip("the Python engine's threads wake the loop through its thread-safe entry point")
    n = COPY_QUEUE_INTS  # the copy-out goes on the copy queue: held for the kernel on the compute queue
    inc = await dev.compile(INC, outs=(0,))
    gate, flag = await closed_gate(dev)
    started = await dev.allocate(1, dtypes.int32)
    waker = _loop_waker()
    assert waker is not None
    entered: list[object] = []
    enter = waker._call_soon
    async with dev.buffer(n, dtypes.int32) as buf, Scheduler() as sched:
        await dev.copyin(buf, array.array("i", [5] * n))
        for i in range(3):
            ctypes.c_int32.from_address(flag.handle).value = 0  # closed again
            sched.launch(gate, started, vals=(flag.handle, SPINS))
            sched.launch(inc, buf, vals=(n,))
            out = sched.copyout(buf)
            assert not out.dispatched
            waker._call_soon = lambda fn: (entered.append(fn), enter(fn))  # type: ignore[method-assign]
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_open_soon, flag)
                    assert list(await out) == [6 + i] * n
            finally:
                waker._call_soon = enter  # type: ignore[method-assign]
    await dev.free(started)
    assert entered == []


async def test_settling_a_held_op_the_core_has_finished_is_still_a_checkpoint() -> None:
    """A copy-out held in the core, handed on and run while nothing on the loop looked at it: ``settled()`` finds
    its callback called back at once, and is still a checkpoint (a cancelled scope cancels it)."""
    from aruntime.engine import NativeEngine

    dev = Device["CPU:3"]
    if not isinstance(dev.compute, NativeEngine):
        pytest.skip("the Python engine keeps no ops pending in a core")
    n = COPY_QUEUE_INTS
    inc = await dev.compile(INC, outs=(0,))
    gate, flag = await closed_gate(dev)
    started = await dev.allocate(1, dtypes.int32)
    async with dev.buffer(n, dtypes.int32) as buf, Scheduler() as sched:
        await dev.copyin(buf, array.array("i", [5] * n))
        sched.launch(gate, started, vals=(flag.handle, SPINS))
        sched.launch(inc, buf, vals=(n,))
        out = sched.copyout(buf)
        assert out.cell is not None  # pending in the core, behind the gate
        _open(flag)
        with anyio.fail_after(20):  # the core hands it on and its queue runs it: nothing tells the loop
            while not (out.cell[out.at] and out.engine.signal.value >= out.cell[out.at]):  # noqa: ASYNC110
                await anyio.sleep(0.001)
        with anyio.move_on_after(0) as scope:
            await out.settled()
        assert scope.cancelled_caught
        assert list(await out) == [6] * n
    await dev.free(started)


async def _open_soon(flag: Buffer) -> None:
    _open(flag)  # run once the task that started this one is suspended on its held op


async def test_ops_pending_in_the_core_are_retired_in_batches() -> None:
    """Every kernel of a scheduled pipeline waits for its copy-in on the other queue, so its compute queue gets
    all of its ops through the core and none straight: those that are done are still retired in batches, as a
    queue's other ops are (what they keep alive is let go, and each retire looks at a batch, not at every op
    the queue was ever given)."""
    from aruntime.engine import NativeEngine
    from aruntime.engine.native.engine import RETIRE_EVERY

    dev = Device["CPU:3"]
    if not isinstance(dev.compute, NativeEngine):
        pytest.skip("the Python engine keeps no ops pending in a core")
    prog = await dev.compile(INC, outs=(0,))
    n = COPY_QUEUE_INTS  # copies on the copy queue
    async with dev.buffer(n, dtypes.int32) as buf:
        async with Scheduler() as sched:
            for i in range(300):
                sched.copyin(buf, array.array("i", [i] * n))
                sched.launch(prog, buf, vals=(n,))
                out = sched.copyout(buf)
                if i % 10 == 9:
                    assert list(await out) == [i + 1] * n  # all of this round is done
                    assert len(dev.compute._pended) <= RETIRE_EVERY + 1
        assert dev.compute.held == set()
        assert out.engine is dev.copy


async def test_many_tasks_each_awaiting_an_op_held_in_the_core() -> None:
    """500 tasks each await their own copy-out, held in the core behind a kernel that waits for a gate: once the
    gate opens every one gets its own data (the loop is told which ops were handed on, whatever their order)."""
    dev = Device["CPU:3"]
    n, tasks = 16, 500
    inc = await dev.compile(INC, outs=(0,))
    gate, flag = await closed_gate(dev)
    started = await dev.allocate(1, dtypes.int32)
    bufs = [await dev.allocate(n, dtypes.int32) for _ in range(tasks)]
    for i, buf in enumerate(bufs):
        await dev.copyin(buf, array.array("i", [i] * n))
    got: dict[int, list[int]] = {}
    async with Scheduler() as sched:
        sched.launch(gate, started, vals=(flag.handle, SPINS))
        outs = []
        for buf in bufs:
            sched.launch(inc, buf, vals=(n,))  # on the gated compute queue
            outs.append(sched.copyout(buf))  # held: it waits for the kernel on another queue

        async def one(i: int) -> None:
            got[i] = list(await outs[i])

        async with anyio.create_task_group() as tg:
            for i in range(tasks):
                tg.start_soon(one, i)
            await anyio.wait_all_tasks_blocked()
            assert not got
            ctypes.c_int32.from_address(flag.handle).value = 1
    assert got == {i: [i + 1] * n for i in range(tasks)}
    for buf in (*bufs, started, flag):
        await dev.free(buf)
