"""``async with dev.buffer(n, dtype) as buf``: allocated for the block, freed on exit (errors and cancellation
included), never while an op may still use it."""

from __future__ import annotations

import array

import anyio
import pytest

from aruntime import BufferUsageError, Device, dtypes
from tests.kernels import SPINS, closed_gate

pytestmark = pytest.mark.anyio


async def test_the_block_gets_an_allocated_buffer_freed_on_exit() -> None:
    dev = Device["CPU:5"]
    before = dev.allocator.in_use
    async with dev.buffer(4, dtypes.float32) as buf:
        assert buf.is_allocated() and (buf.size, buf.dtype, buf.device) == (4, dtypes.float32, "CPU:5")
        assert dev.allocator.in_use == before + 16
        await dev.copyin(buf, array.array("f", [1, 2, 3, 4]))
        assert (await dev.copyout(buf)).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert not buf.is_allocated() and dev.allocator.in_use == before
    with pytest.raises(BufferUsageError, match="was freed"):
        dev.copyout(buf)


async def test_an_error_in_the_block_frees_and_passes_through() -> None:
    dev = Device["CPU:5"]
    before = dev.allocator.in_use
    with pytest.raises(KeyError, match="mine"):
        async with dev.buffer(64) as buf:
            raise KeyError("mine")
    assert not buf.is_allocated() and dev.allocator.in_use == before


async def test_a_buffer_freed_in_the_block_is_left_alone_on_exit() -> None:
    dev = Device["CPU:5"]
    async with dev.buffer(8) as buf:
        await dev.free(buf)
    assert not buf.is_allocated()


async def test_exit_waits_for_the_ops_that_use_the_buffer() -> None:
    dev = Device["CPU:6"]
    gate, flag = await closed_gate(dev)
    before = dev.allocator.in_use
    left = anyio.Event()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:

            async def block() -> None:
                async with dev.buffer(1, dtypes.int32) as out:
                    dev.launch(gate, out, vals=(flag.handle, SPINS))  # still running when the block ends
                left.set()

            tg.start_soon(block)
            await anyio.wait_all_tasks_blocked()
            assert not left.is_set(), "leaving the block waits while the kernel may still use the buffer"
            await dev.copyin(flag, array.array("i", [1]))
        assert left.is_set()
    assert dev.allocator.in_use == before  # released once the kernel was done
    await dev.free(flag)


async def test_cancellation_frees_but_the_memory_outlives_the_running_op() -> None:
    dev = Device["CPU:7"]
    gate, flag = await closed_gate(dev)
    before = dev.allocator.in_use
    bufs = []
    with anyio.fail_after(10):
        with anyio.CancelScope() as scope:
            async with dev.buffer(1 << 16, dtypes.int32) as out:
                bufs.append(out)
                running = dev.launch(gate, out, vals=(flag.handle, SPINS))
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert not bufs[0].is_allocated()  # unusable at once
        assert dev.allocator.in_use == before + (1 << 18)  # but not released while the kernel runs on it
        await dev.copyin(flag, array.array("i", [9]))
        await running
    assert dev.allocator.in_use == before
    await dev.free(flag)


async def test_a_scope_is_entered_once_at_a_time() -> None:
    dev = Device["CPU:5"]
    scope = dev.buffer(4)
    async with scope:
        with pytest.raises(BufferUsageError, match="already in use"):
            await scope.__aenter__()
    async with scope as again:  # reusable once left
        assert again.is_allocated()
