"""Every public awaitable is a checkpoint (trio's rule, which anyio follows): it checks for cancellation and lets
other tasks run even when its result is ready. Each test awaits one with nothing to wait for in a cancelled scope,
and checks what the cancellation leaves behind: the op still done and its failure still raised later, nothing
allocated, a free done all the same, a device left open, a profile region ended."""

from __future__ import annotations

import array
from collections.abc import Awaitable, Sequence
from pathlib import Path

import anyio
import pytest

from aruntime import BaseDevice, Batcher, Device, Graph, OpError, Scheduler, dtypes, profile
from aruntime.events import recorder
from tests.kernels import ADD_ONE, SPINS, Failing, closed_gate

pytestmark = pytest.mark.anyio


async def cancelled(awaitable: Awaitable[object]) -> bool:
    """Await ``awaitable`` under ``move_on_after(0)``; whether the cancellation was raised in it."""
    with anyio.move_on_after(0) as scope:
        await awaitable
    return scope.cancelled_caught


def in_use(dev: BaseDevice) -> int:
    return dev.memory_stats()["in_use"]


async def test_awaiting_a_finished_op_is_a_checkpoint_and_the_op_keeps_its_result() -> None:
    dev = Device["CPU:31"]
    buf = await dev.allocate(8)
    write = dev.copyin(buf, bytes(range(8)))
    read = dev.copyout(buf)
    await read.settled()
    assert write.done() and read.done()
    assert await cancelled(write)
    assert await cancelled(read)
    assert await cancelled(read.settled())
    assert bytes(await read) == bytes(range(8))  # awaited again, outside the scope
    await dev.free(buf)


async def test_a_failure_only_a_cancelled_awaiter_saw_is_raised_by_synchronize() -> None:
    dev = Device["CPU:32"]
    buf = await dev.allocate(4)
    failing = dev.launch(Failing(dev, "exploding", b""), buf)
    await failing.settled()
    assert await cancelled(failing)
    with pytest.raises(OpError, match="exploding"):
        await dev.synchronize()
    await dev.synchronize()  # raised once
    await dev.free(buf)


async def test_a_failure_only_a_cancelled_awaiter_saw_is_raised_by_the_scheduler_exit() -> None:
    dev = Device["CPU:32"]
    buf = await dev.allocate(4)
    outcome: list[bool] = []
    with pytest.raises(OpError, match="exploding"):
        async with Scheduler() as sched:
            failing = sched.launch(Failing(dev, "exploding", b""), buf)
            await failing.settled()
            outcome.append(await cancelled(failing))
    assert outcome == [True]
    await dev.synchronize()  # the scheduler's exit observed it
    await dev.free(buf)


@pytest.mark.parametrize("kind", ["CPU", "DISK"])
async def test_allocate_is_a_checkpoint_and_a_cancelled_one_allocates_nothing(kind: str, tmp_path: Path) -> None:
    dev = Device["CPU:33" if kind == "CPU" else f"DISK:{tmp_path / 'store'}"]
    before = in_use(dev)
    assert await cancelled(dev.allocate(64))
    assert in_use(dev) == before
    if kind == "DISK":
        await dev.aclose()


async def test_free_with_nothing_pending_is_a_checkpoint_and_frees_all_the_same() -> None:
    dev = Device["CPU:33"]
    before = in_use(dev)
    buf = await dev.allocate(64)
    assert await cancelled(dev.free(buf))
    assert not buf.is_allocated() and in_use(dev) == before


async def test_a_buffer_scope_is_a_checkpoint_on_entry() -> None:
    dev = Device["CPU:34"]
    before = in_use(dev)
    entered = False
    with anyio.move_on_after(0) as scope:
        async with dev.buffer(64):
            entered = True
    assert scope.cancelled_caught and not entered and in_use(dev) == before


async def test_a_buffer_scope_exit_with_nothing_to_wait_for_is_a_checkpoint_and_frees() -> None:
    dev = Device["CPU:34"]
    before = in_use(dev)
    with anyio.CancelScope() as scope:
        async with dev.buffer(64) as buf:
            scope.cancel()  # no checkpoint in the block: the exit is the first
    assert scope.cancelled_caught and not buf.is_allocated() and in_use(dev) == before
    with anyio.CancelScope() as scope:
        async with dev.buffer(64) as buf:
            await dev.free(buf)
            scope.cancel()  # nothing left to free on exit
    assert scope.cancelled_caught and in_use(dev) == before


async def test_a_cancelled_buffer_scope_exit_keeps_the_memory_while_an_op_uses_it() -> None:
    dev = Device["CPU:35"]
    gate, flag = await closed_gate(dev)
    before = in_use(dev)
    with anyio.fail_after(10):
        with anyio.CancelScope() as scope:
            async with dev.buffer(1 << 16, dtypes.int32) as out:
                running = dev.launch(gate, out, vals=(flag.handle, SPINS))
                scope.cancel()  # the exit is cancelled while the kernel runs on the buffer
        assert scope.cancelled_caught and not out.is_allocated()
        assert in_use(dev) == before + (1 << 18)
        await dev.copyin(flag, array.array("i", [1]))
        await running
    assert in_use(dev) == before
    await dev.free(flag)


async def test_synchronize_and_settle_on_an_idle_device_are_checkpoints() -> None:
    dev = Device["CPU:36"]
    await dev.synchronize()
    assert await cancelled(dev.synchronize())
    assert await cancelled(dev.settle())


async def test_compile_is_a_checkpoint_when_the_program_is_cached() -> None:
    dev = Device["CPU:36"]
    await dev.compile(ADD_ONE)
    assert await cancelled(dev.compile(ADD_ONE))


async def test_entering_a_device_and_closing_it_are_checkpoints() -> None:
    dev = Device["CPU:37"]
    entered = False
    with anyio.move_on_after(0) as scope:
        async with dev:
            entered = True
    assert scope.cancelled_caught and not entered
    assert await cancelled(dev.aclose())
    assert dev.state == "open"  # cancelled before it closed: still usable, and closable
    await dev.free(await dev.allocate(8))
    await dev.aclose()
    assert dev.state == "closed"
    assert await cancelled(dev.aclose())  # closing a closed device too


async def test_scheduler_awaitables_are_checkpoints() -> None:
    dev = Device["CPU:38"]
    entered = False
    with anyio.move_on_after(0) as scope:
        async with Scheduler():
            entered = True
    assert scope.cancelled_caught and not entered
    buf = await dev.allocate(8)
    async with Scheduler() as sched:
        assert await cancelled(sched.room())
        assert await cancelled(sched.drain())
        op = sched.copyin(buf, bytes(8))
        await op.settled()
        assert await cancelled(op)
    with anyio.CancelScope() as scope:
        async with Scheduler():
            scope.cancel()  # the exit, with nothing to wait for, is the first checkpoint
    assert scope.cancelled_caught
    await dev.free(buf)


async def test_awaiting_a_finished_replay_is_a_checkpoint() -> None:
    dev = Device["CPU:38"]
    buf = await dev.allocate(8)
    graph = Graph()
    graph.copyin(buf, "x")
    graph.copyout(buf, "y")
    run = graph.replay(x=bytes(range(8)))
    for part in run.ops:
        await part.settled()
    assert run.done()
    assert await cancelled(run)
    assert bytes((await run)["y"]) == bytes(range(8))
    await dev.free(buf)


async def test_batcher_awaitables_are_checkpoints() -> None:
    batches: list[list[int]] = []

    async def run(items: list[int]) -> Sequence[int]:
        batches.append(items)
        return items

    entered = False
    with anyio.move_on_after(0) as scope:
        async with Batcher(run):
            entered = True
    assert scope.cancelled_caught and not entered
    async with Batcher(run) as batcher:
        assert await cancelled(batcher(1))  # the item still runs with its batch
    assert batches == [[1]]
    with anyio.CancelScope() as scope:
        async with Batcher(run):
            scope.cancel()
    assert scope.cancelled_caught


async def test_profile_regions_are_checkpoints_and_a_cancelled_one_still_ends() -> None:
    recording = recorder.enabled
    entered = False
    with anyio.move_on_after(0) as scope:
        async with profile():
            entered = True
    assert scope.cancelled_caught and not entered
    with anyio.CancelScope() as scope:
        async with profile(sync=False):
            scope.cancel()  # the exit is the first checkpoint
    assert scope.cancelled_caught and recorder.enabled == recording
    with anyio.fail_after(10), anyio.CancelScope() as scope:
        async with profile():
            scope.cancel()
            await anyio.sleep_forever()  # cancelled in the block: the exit still ends the region
    assert scope.cancelled_caught and recorder.enabled == recording


async def test_a_producer_of_finished_ops_lets_other_tasks_run() -> None:
    dev = Device["CPU:39"]
    prog = await dev.compile(ADD_ONE)
    buf = await dev.allocate(8)
    ops = [dev.launch(prog, buf, vals=(8,)) for _ in range(100)]
    await ops[-1].settled()  # one queue, in order: all done
    awaited = 0
    seen: list[int] = []

    async def other() -> None:
        seen.append(awaited)

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        for op in ops:
            await op
            awaited += 1
    assert seen and seen[0] < len(ops), "the other task ran only once the producer was done"
    await dev.free(buf)
