"""The engine layer: timeline signals, queues, the CPU and NULL devices, errors and cancellation."""

from __future__ import annotations

import array
import ctypes
import gc
import logging
import threading
from typing import Any

import anyio
import pytest

from aruntime import (
    Buffer,
    BufferUsageError,
    CompileError,
    DependencyError,
    Device,
    DeviceError,
    OpError,
    SignalTimeout,
    dtypes,
    transfer,
)
from aruntime.device import BaseDevice, Program
from aruntime.engine import CommandQueue, Op, TimelineSignal
from aruntime.events import DependencyEvent, RangeEvent, recorder
from tests.kernels import ACCUMULATE, ADD_ONE, COPY_QUEUE_INTS, SCALE, SPINS, Failing, closed_gate

pytestmark = pytest.mark.anyio


async def test_signal_wakes_async_waiters_from_a_thread() -> None:
    sig = TimelineSignal("test signal", timeout=5)
    seen: list[int] = []

    async def waiter(v: int) -> None:
        await sig.wait_async(v)
        seen.append(v)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for v in (3, 1, 2):
                tg.start_soon(waiter, v)
            await anyio.wait_all_tasks_blocked()
            threading.Thread(target=lambda: [sig.set(v) for v in (1, 2, 3)]).start()
    assert sorted(seen) == [1, 2, 3]


async def test_signal_async_wait_times_out_naming_signal_and_values() -> None:
    sig = TimelineSignal("CPU:7 compute queue", timeout=0.05)
    sig.set(2)
    with pytest.raises(SignalTimeout, match=r"CPU:7 compute queue: wait for value >= 5 .* \(signal value is 2\)"):
        await sig.wait_async(5)


def test_signal_thread_wait_and_timeout() -> None:
    sig = TimelineSignal("copy queue", timeout=0.05)
    threading.Thread(target=sig.set, args=(4,)).start()
    sig.wait(4, timeout=5)
    with pytest.raises(SignalTimeout, match="value >= 9"):
        sig.wait(9)
    with pytest.raises(ValueError, match="must increase"):
        sig.set(3)


async def test_copy_launch_copyout_roundtrip() -> None:
    dev = Device["CPU"]
    prog = await dev.compile(SCALE, outs=(0,))
    x = await dev.allocate(1000, dtypes.float32)
    out = await dev.allocate(1000, dtypes.float32)
    dev.copyin(x, array.array("f", range(1000)))
    dev.launch(prog, out, x, vals=(1000, 0.5))  # not awaited: the copy-out still sees its result
    got = array.array("f", bytes(await dev.copyout(out)))
    assert list(got) == [i * 0.5 for i in range(1000)]
    await dev.free(x)
    await dev.free(out)


async def test_numpy_zero_copy_in_and_into_caller_buffer() -> None:
    np = pytest.importorskip("numpy")
    dev = Device["CPU"]
    prog = await dev.compile(ADD_ONE)
    buf = await dev.allocate(4096)
    src = np.arange(4096, dtype=np.uint8)
    await dev.copyin(buf, src)
    dev.launch(prog, buf, vals=(4096,))
    dest = np.zeros(4096, dtype=np.uint8)
    result = await dev.copyout(buf, into=dest)
    assert result is dest
    assert (dest == (src + 1)).all()
    with pytest.raises(BufferUsageError, match="C-contiguous"):
        dev.copyin(buf, np.zeros(8192, dtype=np.uint8)[::2])
    await dev.free(buf)


async def test_devices_are_independent() -> None:
    a, b = Device["CPU"], Device["CPU:1"]
    assert a is not b and a.compute is not b.compute
    assert Device["cpu:1"] is b
    buf = await b.allocate(8)
    with pytest.raises(BufferUsageError, match="belongs to CPU:1, not CPU"):
        a.copyin(buf, bytes(8))
    await b.free(buf)


async def test_compute_and_copy_engines_overlap() -> None:
    """A kernel spins until a copy on the same device's copy engine opens its gate: only overlap ends it."""
    dev = Device["CPU"]
    gate_prog, flag = await closed_gate(dev)
    out = await dev.allocate(1, dtypes.int32)
    with anyio.fail_after(10):
        kernel = dev.launch(gate_prog, out, vals=(flag.handle, SPINS))
        await anyio.wait_all_tasks_blocked()
        await dev.copyin(flag, array.array("i", [7]))  # runs while the kernel is still spinning
        await kernel
    assert array.array("i", bytes(await dev.copyout(out)))[0] == 7
    await dev.free(flag)
    await dev.free(out)


async def test_compile_error_carries_compiler_message() -> None:
    with pytest.raises(CompileError, match=r"error: .*undeclared_thing"):
        await Device["CPU"].compile("void kernel(int *o) { o[0] = undeclared_thing; }")


async def test_many_compiles_at_once() -> None:
    dev = Device["CPU"]
    progs: list[Program] = []

    async def build(i: int) -> None:
        progs.append(await dev.compile(f"void kernel(int *o) {{ o[0] = {i}; }}\n"))

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(build, i)
    assert len(progs) == 6


async def test_bad_arguments_raise_before_anything_is_enqueued() -> None:
    dev = Device["CPU"]
    prog = await dev.compile(ADD_ONE)
    buf = await dev.allocate(16)
    before = (dev.compute.last, dev.copy.last)
    with pytest.raises(BufferUsageError, match="source has 15 bytes"):
        dev.copyin(buf, bytes(15))
    with pytest.raises(BufferUsageError, match="destination has 17 bytes"):
        dev.copyout(buf, into=bytearray(17))
    with pytest.raises(TypeError, match="scalar 0 must be int or float"):
        dev.launch(prog, buf, vals=("16",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scalar 0 = 9223372036854775808 does not fit in a 64-bit"):
        dev.launch(prog, buf, vals=(1 << 63,))
    with pytest.raises(TypeError, match="launch kernel: vals must be a tuple or list of scalars, got int"):
        dev.launch(prog, buf, vals=16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"outs must be a sequence of buffer indices \(int\), got \['0'\]"):
        dev.launch(prog, buf, vals=(16,), outs=["0"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"outs \[3\] out of range for 1 buffers"):
        dev.launch(prog, buf, vals=(16,), outs=(3,))
    with pytest.raises(TypeError, match="compile kernel: outs must be a sequence of buffer indices"):
        await dev.compile(ADD_ONE, outs=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"compile kernel: outs \[-1\] must be buffer indices \(>= 0\)"):
        await dev.compile(ADD_ONE, outs=(-1,))
    with pytest.raises(BufferUsageError, match="positive"):
        await dev.allocate(0)
    with pytest.raises(BufferUsageError, match="positive"):
        await dev.allocate(-4)
    with pytest.raises(DeviceError, match="not a program of CPU:1"):
        Device["CPU:1"].launch(prog, buf)
    await dev.free(buf)
    with pytest.raises(BufferUsageError, match="was freed"):
        dev.launch(prog, buf, vals=(16,))
    with pytest.raises(BufferUsageError, match="was freed"):
        dev.copyout(buf)
    assert (dev.compute.last, dev.copy.last) == before


async def test_failure_reaches_awaiter_and_device_stays_usable() -> None:
    dev = Device["CPU"]
    bad = Failing(dev, "bad", b"")
    good = await dev.compile(ADD_ONE)
    buf = await dev.allocate(4)
    await dev.copyin(buf, bytes(4))
    with pytest.raises(OpError, match="kernel blew up") as info:
        await dev.launch(bad, buf)
    assert isinstance(info.value.__cause__, ArithmeticError)
    dev.launch(good, buf, vals=(4,))
    assert bytes(await dev.copyout(buf)) == b"\x01" * 4
    await dev.synchronize()  # the failure was observed: nothing to raise


async def test_unawaited_failure_raises_at_synchronize_then_clears() -> None:
    dev = Device["CPU:1"]
    buf = await dev.allocate(4)
    dev.launch(Failing(dev, "bad", b""), buf)
    with pytest.raises(OpError, match="bad failed on CPU:1 compute queue"):
        await dev.synchronize()
    await dev.synchronize()
    await dev.free(buf)


async def test_dependent_op_fails_naming_the_first_failure() -> None:
    dev = Device["CPU"]
    buf = await dev.allocate(4)
    dev.launch(Failing(dev, "producer", b""), buf)
    with pytest.raises(OpError, match="depends on producer, which failed"):
        await dev.copyout(buf)
    with pytest.raises(OpError, match="producer"):
        await dev.synchronize()
    await dev.free(buf)


async def test_cancelled_wait_leaves_op_running_and_memory_held() -> None:
    gc.collect()  # buffers other tests dropped are released now, not while this test counts
    dev = Device["CPU:7"]  # a device no other test uses: its counters are this test's alone
    alloc = dev.allocator
    gate, flag = await closed_gate(dev)
    in_use = alloc.in_use
    out = await dev.allocate(1, dtypes.int32)
    op = dev.launch(gate, out, vals=(flag.handle, SPINS))
    with anyio.move_on_after(0.01) as scope:  # cancel the wait; the kernel keeps spinning
        await op
    assert scope.cancelled_caught and not op.done()
    handle = out.handle
    with anyio.move_on_after(0.01):  # cancel-then-free: the release is deferred until the op is done
        await dev.free(out)
    assert not out.is_allocated()
    assert alloc.in_use == in_use + 4, "memory of a running op must not be released"
    other = await dev.allocate(1, dtypes.int32)  # cancel-then-reuse: the held handle is not handed out
    assert other.handle != handle
    with anyio.fail_after(10):
        await dev.copyin(flag, array.array("i", [1]))
        await op
    assert alloc.in_use == in_use + 4  # `out` released, `other` live
    await dev.free(other)
    await dev.free(flag)
    assert alloc.in_use == in_use - 4


def test_await_from_another_loop_and_thread(anyio_backend: Any) -> None:
    """An op submitted from one event loop is awaited on another loop in another thread."""
    backend, options = anyio_backend
    dev = Device["NULL"]
    result: list[Any] = []

    async def submit() -> Any:
        buf = await dev.allocate(64)
        return dev.copyout(buf)

    op = anyio.run(submit, backend=backend, backend_options=options)

    def other() -> None:
        async def wait() -> None:
            result.append(await op)

        anyio.run(wait, backend="trio" if backend == "asyncio" else "asyncio")

    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert result and len(result[0]) == 64
    assert op.wait(timeout=1) is result[0]


async def test_profile_ranges_recorded_per_engine() -> None:
    dev = Device["CPU:2"]
    prog = await dev.compile(ADD_ONE)
    buf = await dev.allocate(64)
    recorder.enabled = True
    try:
        mark = len(recorder.events)
        await dev.copyin(buf, bytes(64))
        await dev.launch(prog, buf, vals=(64,))
    finally:
        recorder.enabled = False
    ranges = [e for e in recorder.events[mark:] if isinstance(e, RangeEvent) and e.device == "CPU:2"]
    assert [(r.name, r.is_copy) for r in ranges] == [("copyin 64 B", True), ("kernel", False)]
    assert all(r.start <= r.end for r in ranges) and ranges[0].end <= ranges[1].start
    await dev.free(buf)


async def test_null_device_completes_ops() -> None:
    dev = Device["NULL"]
    assert isinstance(dev, BaseDevice)
    prog = await dev.compile("anything")
    buf = await dev.allocate(1 << 20)
    ops = [dev.launch(prog, buf) for _ in range(1000)]
    for op in ops:
        await op
    assert all(op.done() for op in ops)
    await dev.synchronize()
    await dev.free(buf)


async def test_cross_queue_wait_times_out_naming_device_queue_and_values() -> None:
    dev = Device["CPU:3"]
    gate, flag = await closed_gate(dev)
    out = await dev.allocate(COPY_QUEUE_INTS, dtypes.int32)  # too big to ride on the compute queue
    with pytest.raises(ValueError, match="positive number of seconds"):
        dev.timeout = 0
    dev.timeout = 0.2
    try:
        with anyio.fail_after(10):
            kernel = dev.launch(gate, out, vals=(flag.handle, SPINS))
            reader = dev.copyout(out)  # waits on the compute queue, which is stuck behind the gate
            await dev.copy.signal.wait_async(reader.value, timeout=5)  # the copy engine gives up after 0.2 s
            with pytest.raises(OpError, match=r"CPU:3 compute queue: wait for value >= \d+ did not pass within 0.2 s"):
                await reader
            await dev.copyin(flag, array.array("i", [1]))
            await kernel
    finally:
        dev.timeout = 30
    assert isinstance(reader.error, OpError) and isinstance(reader.error.__cause__, SignalTimeout)
    assert array.array("i", bytes(await dev.copyout(out)))[0] == 1


async def test_small_copy_after_a_kernel_rides_on_the_compute_queue() -> None:
    dev = Device["CPU:1"]
    prog = await dev.compile(ADD_ONE)
    gate, flag = await closed_gate(dev)
    gate_out = await dev.allocate(1, dtypes.int32)
    small = await dev.allocate(1024)
    large = await dev.allocate(dev.inline_copy_max + 1)
    await dev.copyin(small, bytes(1024))
    await dev.copyin(large, bytes(large.nbytes))
    assert dev.copyout(small).engine is dev.copy  # nothing to wait for: the copy queue
    with anyio.fail_after(10):
        dev.launch(gate, gate_out, vals=(flag.handle, SPINS))  # holds the compute queue until opened
        dev.launch(prog, small, vals=(1024,))
        dev.launch(prog, large, vals=(large.nbytes,))
        small_out, large_out = dev.copyout(small), dev.copyout(large)  # both behind a kernel not yet run
        assert small_out.engine is dev.compute and large_out.engine is dev.copy
        await dev.copyin(flag, array.array("i", [1]))
        assert bytes(await small_out) == b"\x01" * 1024 and bytes(await large_out) == b"\x01" * large.nbytes
    await dev.free(small)
    await dev.free(large)


async def test_a_closed_device_is_forgotten_and_reopens() -> None:
    dev = Device["CPU:6"]
    buf = await dev.allocate(8)
    buf2 = await dev.allocate(8)
    await dev.copyin(buf, bytes(8))
    await dev.free(buf)
    last = dev.copy.last
    dev.close()
    assert "CPU:6" not in Device.opened
    with pytest.raises(DeviceError, match="copyin 8 B: CPU:6 is closed"):
        dev.copyin(buf2, bytes(8))
    assert dev.copy.last == last  # the refused op took no place on the timeline
    dev.close()  # twice is harmless
    again = Device["CPU:6"]
    assert again is not dev
    buf = await again.allocate(8)
    await again.copyin(buf, b"abcdefgh")
    assert bytes(await again.copyout(buf)) == b"abcdefgh"
    await again.free(buf)


async def test_a_cross_queue_wait_is_recorded_as_a_dependency() -> None:
    dev = Device["CPU:2"]
    gate, flag = await closed_gate(dev)
    out = await dev.allocate(COPY_QUEUE_INTS, dtypes.int32)  # too big to ride on the compute queue
    recorder.enabled = True
    try:
        mark = len(recorder.events)
        with anyio.fail_after(10):
            kernel = dev.launch(gate, out, vals=(flag.handle, SPINS))
            reader = dev.copyout(out)  # the kernel cannot have finished: the copy queue must wait for it
            await dev.copyin(flag, array.array("i", [1]))
            await reader
    finally:
        recorder.enabled = False
    deps = [e for e in recorder.events[mark:] if isinstance(e, DependencyEvent)]
    assert deps == [DependencyEvent(kernel.id, reader.id)]


async def test_bytes_of_a_failed_write_stay_invalid_until_written_again() -> None:
    dev = Device["CPU:2"]
    buf = await dev.allocate(16)
    other = await dev.allocate(16)
    await dev.copyin(other, bytes(range(16)))
    with pytest.raises(OpError, match="kernel blew up"):
        await dev.launch(Failing(dev, "producer", b""), buf)  # finished (and failed) before what follows
    with pytest.raises(DependencyError, match="depends on producer, which failed"):
        await dev.copyout(buf)  # reads what the failed op should have written
    with pytest.raises(DependencyError, match="producer"):
        await transfer(other, buf)
    with pytest.raises(DependencyError, match="producer"):
        await dev.copyout(other)  # the transfer that should have written it failed in turn
    await dev.copyin(buf, b"k" * 16)  # a write makes the bytes valid again
    assert bytes(await dev.copyout(buf)) == b"k" * 16
    await dev.copyin(other, b"j" * 16)
    assert bytes(await dev.copyout(other)) == b"j" * 16
    await dev.synchronize()
    await dev.free(buf)
    await dev.free(other)


async def test_awaited_failures_do_not_pile_up_without_synchronize() -> None:
    dev = Device["CPU:3"]
    bad = Failing(dev, "bad", b"")
    for _ in range(600):
        with pytest.raises(OpError):
            await dev.launch(bad)
    assert len(dev.compute.failed) <= 257  # observed failures are dropped, not kept until a synchronize
    await dev.synchronize()  # and none is raised again


async def test_a_chained_command_queue_runs_as_one_unit_in_order() -> None:
    """wait, timestamp, copy, exec, signal: one submission, run in order on the engine's thread."""
    dev = Device["CPU:1"]
    prog = await dev.compile(ADD_ONE)
    buf = await dev.allocate(8)
    src = bytearray(b"\x05" * 8)
    gate = TimelineSignal("test gate", timeout=5)
    done = TimelineSignal("test done", timeout=5)
    stamps: list[float] = []
    cq = (
        CommandQueue()
        .wait(gate, 1)
        .timestamp(stamps)
        .copy("fill", ctypes.memmove, buf.handle, ctypes.addressof(ctypes.c_char.from_buffer(src)), 8)
        .exec("add one", *prog.bind([buf.handle], [8]))
        .timestamp(stamps)
        .signal(done, 1)
    )
    op = dev.compute.submit(cq, Op("chained", keep=(src, buf)))
    with anyio.fail_after(10):
        await anyio.wait_all_tasks_blocked()
        assert not op.done() and not stamps  # held by its first command
        gate.set(1)
        await op
        await done.wait_async(1)
    assert len(stamps) == 2 and stamps[0] <= stamps[1]
    assert bytes(await dev.copyout(buf)) == b"\x06" * 8
    await dev.free(buf)


def test_a_failing_signal_callback_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    signal = TimelineSignal("test signal", timeout=5)
    called: list[str] = []
    finished = threading.Event()

    def broken() -> None:
        raise RuntimeError("callback bug")

    signal.on_reach(1, broken)
    signal.on_reach(1, lambda: called.append("second"))
    signal.on_reach(2, lambda: (called.append("later"), finished.set()))
    with caplog.at_level(logging.ERROR, logger="aruntime"):
        signal.set(2)
        assert finished.wait(5)  # callbacks registered outside a loop may run on another thread
    assert called == ["second", "later"] and signal.value == 2
    assert "test signal: a callback for value 2 failed" in caplog.text and "callback bug" in caplog.text


async def test_an_op_held_for_an_engine_closed_meanwhile_fails_instead_of_hanging() -> None:
    dev = Device["CPU:7"]
    prog = await dev.compile(ADD_ONE)
    buf = await dev.allocate(8)
    gate = TimelineSignal("test gate", timeout=10)
    dev.copy.submit(CommandQueue().wait(gate, 1), Op("gate"))
    filled = dev.copyin(buf, bytes(8))  # behind the gate, on the copy queue
    held = dev.launch(prog, buf, vals=(8,), hold=True)  # held until the copy is done
    assert not held.dispatched
    dev.compute.close()  # what a concurrent close does while the launch is held
    gate.set(1)
    with anyio.fail_after(10):
        await filled
        with pytest.raises(OpError, match="CPU:7 compute queue is closed") as info:
            await held
        assert isinstance(info.value.__cause__, DeviceError)
        await dev.settle()  # nothing is left held
    assert held.done() and not dev.compute.held
    await dev.synchronize()  # the failure was seen by its awaiter: nothing more to raise
    dev.close()


async def test_synchronize_raises_the_root_failure_before_its_dependents() -> None:
    dev = Device["CPU:8"]
    prog = await dev.compile(ACCUMULATE, outs=(0,))
    out, src = await dev.allocate(8), await dev.allocate(8)
    inline_before, dev.inline_copy_max = dev.inline_copy_max, 0  # the copy-in on the copy queue, so its failure
    # is listed after the kernel's

    def broken_copy(dst: int, src: int, nbytes: int) -> None:
        raise OSError("disk on fire")

    try:
        dev.copy_fn = broken_copy  # type: ignore[method-assign]
        dev.copyin(src, bytes(8))
        del dev.copy_fn
        dev.launch(prog, out, src, vals=(8,), outs=(0,))
        with anyio.fail_after(10), pytest.raises(OpError, match="disk on fire") as info:
            await dev.synchronize()
        assert not isinstance(info.value, DependencyError)
        assert "1 more op(s) on CPU:8 failed unobserved" in getattr(info.value, "__notes__", [""])[0]
    finally:
        dev.inline_copy_max = inline_before


def test_a_held_wait_that_times_out_names_its_own_limit() -> None:
    dev = Device["CPU:8"]
    gate = TimelineSignal("test gate", timeout=10)
    dev.copy.submit(CommandQueue().wait(gate, 1), Op("gate"))
    buf = Buffer("CPU:8", 8, preallocate=True)
    dev.copyin(buf, bytes(8))
    held = dev.launch(Failing(dev, "after the copy", b""), buf, hold=True)  # held behind the gated copy
    with pytest.raises(SignalTimeout, match=r"still held .* after 0\.2 s"):
        held.wait_done(0.2)
    gate.set(1)
    with pytest.raises(OpError, match="kernel blew up"):
        held.wait(10)


def test_a_crashed_python_engine_fails_its_ops_and_refuses_new_work(monkeypatch: pytest.MonkeyPatch) -> None:
    from aruntime.engine import ThreadEngine

    def broken(self: ThreadEngine, op: Op, error: BaseException | None) -> None:
        raise RuntimeError("engine bug")

    monkeypatch.setattr(ThreadEngine, "_complete", broken)  # before the worker starts, which binds it
    engine = ThreadEngine("TEST", "copy", timeout=5)
    gate = TimelineSignal("test gate", timeout=5)
    first = engine.submit(CommandQueue().wait(gate, 1), Op("first"))
    queued = engine.submit(CommandQueue(), Op("queued"))
    gate.set(1)
    for op in (first, queued):
        with pytest.raises(OpError, match=rf"{op.name} failed on TEST copy queue: .*crashed: RuntimeError"):
            op.wait(5)
    with pytest.raises(DeviceError, match="crashed"):
        engine.submit(CommandQueue(), Op("later"))
