"""Fault injection: a failing compile, a failing kernel (alone and inside a graph replay), an allocation
that fails (flush and retry, then a clear error), a failing copy, and waits that time out. Each reaches the
awaiter of the op it hit, with an error naming the device, the queue and the op, and later work succeeds."""

from __future__ import annotations

import array
import ctypes
from typing import Any

import anyio
import pytest

from aruntime import BaseDevice, Device, dtypes
from aruntime.errors import AllocationError, CompileError, OpError, SignalTimeout
from aruntime.graph import Graph
from aruntime.scheduler import Scheduler
from tests.kernels import ADD_ONE, SPINS, Failing, closed_gate


async def still_works(dev: BaseDevice) -> None:
    """A copy-in, a kernel and a copy-out give the right bytes on ``dev``."""
    prog = await dev.compile(ADD_ONE)
    buf = await dev.allocate(16)
    await dev.copyin(buf, bytes(range(16)))
    await dev.launch(prog, buf, vals=(16,))
    assert bytes(await dev.copyout(buf)) == bytes(range(1, 17))
    await dev.free(buf)


@pytest.mark.anyio
async def test_a_failing_compile_reaches_its_caller_and_the_next_compile_works() -> None:
    dev = Device["CPU:61"]
    with pytest.raises(CompileError, match=r"(?s)failed with exit code \d+:\n.*error"):
        await dev.compile("void kernel(int *x) { x[0] = ; }")
    await still_works(dev)


@pytest.mark.anyio
async def test_a_failing_kernel_names_device_queue_and_op() -> None:
    dev = Device["CPU:61"]
    buf = await dev.allocate(4)
    with anyio.fail_after(10), pytest.raises(OpError) as info:
        await dev.launch(Failing(dev, "exploding", b""), buf)
    assert str(info.value) == "exploding failed on CPU:61 compute queue: ArithmeticError('kernel blew up')"
    assert isinstance(info.value.__cause__, ArithmeticError)
    await dev.synchronize()  # awaited: nothing left unobserved
    await still_works(dev)


@pytest.mark.anyio
async def test_a_kernel_failing_in_a_graph_replay_is_named_with_its_queue_once() -> None:
    dev = Device["CPU:62"]
    x = await dev.allocate(4, dtypes.float32)
    graph = Graph()
    graph.copyin(x, "x")
    graph.launch(Failing(dev, "exploding", b""), x)
    graph.copyout(x, "y")
    with anyio.fail_after(10), pytest.raises(OpError) as info:
        await graph.replay(x=array.array("f", [1, 2, 3, 4]))
    message = str(info.value)
    assert message.startswith(f"Graph #{graph.id} replay 0 (")
    assert "exploding" in message and message.count("compute queue") == 1 and "ArithmeticError" in message
    assert f"Graph #{graph.id}" in repr(graph)  # one spelling
    await dev.settle()
    for op_engine in (dev.compute, dev.copy):
        op_engine.take_failures()
    await still_works(dev)


@pytest.mark.anyio
async def test_an_allocation_that_fails_flushes_the_cache_retries_then_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = Device["CPU:63"]
    dev.flush_cache()  # nothing of 8192 bytes to hit in the cache
    cached = await dev.allocate(4096)
    await dev.free(cached)  # something in the cache to flush
    alloc = dev.allocator
    real = alloc._alloc
    failures = [1]

    def flaky(size: int, spec: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise MemoryError("injected")
        return real(size, spec)

    monkeypatch.setattr(alloc, "_alloc", flaky)
    before = dev.memory_stats()
    buf = await dev.allocate(8192)  # fails once, the cache is flushed, the retry succeeds
    after = dev.memory_stats()
    assert after["flushes"] == before["flushes"] + 1 and after["cached"] == 0
    failures[0] = 2
    with pytest.raises(AllocationError, match="CPU:63: out of memory allocating 8192 bytes") as info:
        await dev.allocate(8192)
    assert isinstance(info.value.__cause__, MemoryError)
    monkeypatch.setattr(alloc, "_alloc", real)
    await dev.free(buf)
    await still_works(dev)


@pytest.mark.anyio
async def test_a_failing_copy_names_device_queue_and_op() -> None:
    dev = Device["CPU:64"]
    buf = await dev.allocate(1 << 20)  # too big to ride on the compute queue: the copy queue runs it

    def broken(dst: int, src: int, nbytes: int) -> None:
        raise OSError("injected copy fault")

    dev.copy_fn = broken  # type: ignore[method-assign]
    try:
        op = dev.copyin(buf, bytes(1 << 20))
    finally:
        del dev.copy_fn
    with anyio.fail_after(10), pytest.raises(OpError) as info:
        await op
    assert str(info.value) == f"copyin {1 << 20} B failed on CPU:64 copy queue: OSError('injected copy fault')"
    await still_works(dev)


@pytest.mark.anyio
async def test_waits_that_time_out_name_the_queue_and_the_held_op_and_the_device_recovers() -> None:
    dev = Device["CPU:65"]
    prog, flag = await closed_gate(dev)
    out = await dev.allocate(1 << 19, dtypes.int32)  # 2 MiB: its copy-out goes on the copy queue
    small = await dev.allocate(16)
    dev.timeout = 0.2
    try:
        kernel = dev.launch(prog, out, vals=(flag.handle, SPINS))
        with pytest.raises(SignalTimeout, match=r"CPU:65 compute queue: wait for value >= \d+ did not pass within 0.2"):
            await kernel
        async with Scheduler(window=2) as sched:
            held = sched.copyout(out)  # behind the kernel on another queue: held off its queue
            with pytest.raises(SignalTimeout, match=r"copyout 2097152 B on CPU:65 copy queue: still held .* 0.2 s"):
                await held
            sched.copyout(out)  # the window is full
            sched.copyin(small, bytes(16))  # waits in the scheduler's queue
            assert sched.queued == 1
            with pytest.raises(
                SignalTimeout,
                match=r"scheduler room: the window of 2 ops was full and its oldest op, copyout 2097152 B, did",
            ):
                await sched.room()
            ctypes.c_int32.from_address(flag.handle).value = 1
    finally:
        dev.timeout = 30
    with anyio.fail_after(20):
        assert await kernel is None
        await still_works(dev)
