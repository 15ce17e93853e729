"""What every device kind must do (see tests/conformance/kinds.py for the kinds and their kernels).

Run it on a backend of your own with ``ARUNTIME_KINDS=MYKIND python -m pytest tests/conformance``.
"""

from __future__ import annotations

import array
import gc
import struct

import anyio
import pytest

import aruntime
from aruntime import (
    AllocationError,
    BufferUsageError,
    CompileError,
    DependencyError,
    DeviceError,
    OpError,
    SignalTimeout,
    dtypes,
)
from aruntime.engine import CommandQueue, Op, TimelineSignal
from aruntime.events import DeviceEvent, RangeEvent, now_us
from aruntime.graph import Graph, Param
from aruntime.memory.allocator import LRUAllocator
from aruntime.profile import profile
from tests.conformance.kinds import Kind
from tests.kernels import Failing

pytestmark = pytest.mark.anyio

SIZES = (1, 3, 7, 4097, (1 << 16) + 3, (1 << 20) + 1)


def pattern(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


def gate_op(engine_owner: Kind, signal: TimelineSignal) -> Op:
    """An op on the kind's copy queue that waits until ``signal`` reaches 1 (what follows queues behind it)."""
    return engine_owner.dev.copy.submit(CommandQueue().wait(signal, 1), Op("gate"))


# ---- memory ---------------------------------------------------------------------------------------


async def test_allocate_and_free_count_bytes_in_use(kind: Kind) -> None:
    gc.collect()
    dev = kind.dev
    before = dev.allocator.in_use
    buf = await dev.allocate(1000, dtypes.float32)
    assert buf.is_allocated() and buf.nbytes == 4000
    assert dev.allocator.in_use == before + (0 if dev.file_backed else 4000)
    await dev.free(buf)
    assert not buf.is_allocated() and dev.allocator.in_use == before
    with pytest.raises(BufferUsageError, match="was freed"):
        dev.copyout(buf)


async def test_the_lru_cache_reuses_memory_and_is_flushed_when_memory_runs_out(
    kind: Kind, monkeypatch: pytest.MonkeyPatch
) -> None:
    alloc = kind.dev.allocator
    if not isinstance(alloc, LRUAllocator) or not alloc.lru:
        pytest.skip(f"{kind.name} frees at once: its allocator keeps no cache")
    gc.collect()  # buffers other tests dropped go to the cache now, not while this test counts
    alloc.free_cache()
    buf = await kind.dev.allocate(12345)
    handle = buf.handle
    await kind.dev.free(buf)
    assert alloc.cached_bytes == 12345
    again = await kind.dev.allocate(12345)
    assert again.handle is handle  # the cached memory, handed out again
    assert alloc.cached_bytes == 0
    await kind.dev.free(again)
    real, calls = alloc._alloc, []

    def out_of_memory_once(size: int, spec: object) -> object:
        calls.append(alloc.cached_bytes)
        if len(calls) == 1:
            raise MemoryError("simulated: the device is full")
        return real(size, spec)  # type: ignore[arg-type]

    monkeypatch.setattr(alloc, "_alloc", out_of_memory_once)
    other = await kind.dev.allocate(999)  # a size the cache does not hold: the backend is asked, and is full
    assert calls[0] >= 12345 and calls[1:] == [0], "the cache must be freed before the one retry"
    await kind.dev.free(other)


async def test_allocating_more_than_the_device_has_raises(kind: Kind) -> None:
    kind.need_data()
    with pytest.raises(AllocationError, match=kind.dev.name):
        await kind.dev.allocate(1 << 50)


# ---- copies and views -----------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
async def test_copies_of_odd_sizes_round_trip(kind: Kind, size: int) -> None:
    kind.need_data()
    dev = kind.dev
    buf = await dev.allocate(size)
    data = pattern(size, size)
    await dev.copyin(buf, data)
    assert bytes(await dev.copyout(buf)) == data
    into = bytearray(size)
    assert await dev.copyout(buf, into) is into and bytes(into) == data
    await dev.free(buf)


@pytest.mark.parametrize("offset", [1, 3, 13, 4095])
async def test_views_at_odd_offsets_reach_their_part_of_the_root(kind: Kind, offset: int) -> None:
    kind.need_data()
    dev = kind.dev
    root = await dev.allocate(8192)
    await dev.copyin(root, bytes(8192))
    view = root.view(77, dtypes.uint8, offset)
    inner = view.view(5, dtypes.uint8, 2)  # a view of a view: the offsets add up
    await dev.copyin(view, b"v" * 77)
    await dev.copyin(inner, b"i" * 5)
    whole = bytes(await dev.copyout(root))
    assert whole[:offset] == bytes(offset) and whole[offset + 77 :] == bytes(8192 - offset - 77)
    assert whole[offset : offset + 77] == b"vv" + b"i" * 5 + b"v" * 70
    assert bytes(await dev.copyout(inner)) == b"i" * 5
    with pytest.raises(BufferUsageError, match="out of range"):
        root.view(2, dtypes.uint8, 8191)
    await dev.free(root)


# ---- kernels --------------------------------------------------------------------------------------


async def test_a_kernel_reads_and_writes_buffers(kind: Kind) -> None:
    kernels = kind.need_kernels()
    dev = kind.dev
    scale = await dev.compile(kernels["scale"], "scale", outs=(0,))
    n = 1000
    x, y = await dev.allocate(n, dtypes.float32), await dev.allocate(n, dtypes.float32)
    dev.copyin(x, array.array("f", range(n)))
    dev.launch(scale, y, x, vals=(n, 0.5))
    assert list(array.array("f", bytes(await dev.copyout(y)))) == [i * 0.5 for i in range(n)]
    await dev.free(x)
    await dev.free(y)


async def test_a_kernel_gets_every_scalar_kind_at_its_extremes(kind: Kind) -> None:
    kernels = kind.need_kernels()
    dev = kind.dev
    prog = await dev.compile(kernels["scalars"], "scalars", outs=(0, 1))
    ints, floats = await dev.allocate(2, dtypes.int64), await dev.allocate(1, dtypes.float64)
    low, high, value = -(1 << 63), (1 << 63) - 1, -1.5e300
    await dev.launch(prog, ints, floats, vals=(low, value, high))
    assert struct.unpack("<2q", await dev.copyout(ints)) == (low, high)
    assert struct.unpack("<d", await dev.copyout(floats)) == (value,)
    await dev.free(ints)
    await dev.free(floats)


async def test_a_kernel_on_a_view_changes_only_the_view(kind: Kind) -> None:
    kernels = kind.need_kernels()
    dev = kind.dev
    prog = await dev.compile(kernels["add_one"], "add_one")
    offset = 2 * kind.unit
    root = await dev.allocate(offset + 64 + 10)
    await dev.copyin(root, bytes(root.nbytes))
    await dev.launch(prog, root.view(64, dtypes.uint8, offset), vals=(64,))
    assert bytes(await dev.copyout(root)) == bytes(offset) + b"\x01" * 64 + bytes(10)
    await dev.free(root)


async def test_bad_launch_scalars_raise_before_anything_is_enqueued(kind: Kind) -> None:
    if kind.kernels is None:
        pytest.skip(f"{kind.name} runs no kernels")
    dev = kind.dev
    prog = await dev.compile((kind.kernels or {}).get("add_one", "any"), "add_one")
    buf = await dev.allocate(8)
    before = (dev.compute.last, dev.copy.last)
    with pytest.raises(TypeError, match="scalar 0"):
        dev.launch(prog, buf, vals=("8",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scalar 0"):
        dev.launch(prog, buf, vals=(1 << 64,))
    with pytest.raises(TypeError, match="vals"):
        dev.launch(prog, buf, vals=8)  # type: ignore[arg-type]
    assert (dev.compute.last, dev.copy.last) == before
    await dev.free(buf)


async def test_a_compile_error_carries_the_compiler_message(kind: Kind) -> None:
    kind.need_kernels()
    with pytest.raises(CompileError, match="bogus_type"):
        await kind.dev.compile("void broken(void) { bogus_type x; }", "broken")


# ---- transfers ------------------------------------------------------------------------------------


async def test_transfers_to_and_from_every_kind(kind: Kind, other_kind: Kind) -> None:
    kind.need_data()
    other_kind.need_data()
    dev = kind.dev
    dst_dev = other_kind.need_other() if other_kind.name == kind.name else other_kind.dev
    data = pattern(5000, 7)
    a, b = await dev.allocate(5000), await dst_dev.allocate(5000)
    await dev.copyin(a, data)
    try:
        forward = aruntime.transfer(b, a)
    except (DeviceError, BufferUsageError) as exc:  # a backend's refusal, or no copy engine reaches both memories
        await dev.free(a)
        await dst_dev.free(b)
        pytest.skip(f"no transfer between {dev.name} and {dst_dev.name}: {exc}")
    await forward
    assert bytes(await dst_dev.copyout(b)) == data
    back = await dev.allocate(4000)
    await aruntime.transfer(back, b.view(4000, dtypes.uint8, 1000))  # and back, from a view at an offset
    assert bytes(await dev.copyout(back)) == data[1000:]
    for buf in (a, back):
        await dev.free(buf)
    await dst_dev.free(b)


# ---- errors, failures, cancellation, timeouts -----------------------------------------------------


async def test_a_failing_op_names_device_queue_and_op_and_the_device_stays_usable(kind: Kind) -> None:
    dev = kind.dev
    buf = await dev.allocate(16)
    if kind.kernels is None:
        with pytest.raises(DeviceError, match=dev.name):
            dev.launch(Failing(dev, "bad", b""), buf)
        await dev.free(buf)
        return
    with pytest.raises(OpError, match=f"bad failed on {dev.name} compute queue") as info:
        await dev.launch(Failing(dev, "bad", b""), buf)
    assert isinstance(info.value.__cause__, ArithmeticError)
    await dev.copyin(buf, b"x" * 16)
    if kind.moves_data:
        assert bytes(await dev.copyout(buf)) == b"x" * 16
    await dev.synchronize()  # the failure was awaited: nothing left to raise
    await dev.free(buf)


async def test_a_failure_propagates_to_what_depends_on_it(kind: Kind) -> None:
    if kind.kernels is None:
        pytest.skip(f"{kind.name} runs no kernels")
    dev = kind.dev
    buf, other = await dev.allocate(16), await dev.allocate(16)
    dev.launch(Failing(dev, "producer", b""), buf)
    reader = dev.copyout(buf)
    chained = aruntime.transfer(other, buf)
    with pytest.raises(DependencyError, match="depends on producer, which failed"):
        await reader
    with pytest.raises(DependencyError, match="producer"):
        await chained
    with pytest.raises(OpError, match="producer failed on"):
        await dev.synchronize()  # the root failure, never awaited itself
    await dev.synchronize()
    await dev.copyin(buf, b"k" * 16)  # a write makes the bytes valid again
    await dev.copyout(buf)
    await dev.free(buf)
    await dev.free(other)


async def test_a_cancelled_wait_leaves_the_op_running_and_its_memory_held(kind: Kind) -> None:
    gc.collect()
    dev = kind.dev
    alloc = dev.allocator
    counted = 0 if dev.file_backed else 4096
    gate = TimelineSignal("gate", 30.0)
    opened = gate_op(kind, gate)
    before = alloc.in_use
    buf = await dev.allocate(4096)
    op = dev.copyin(buf, pattern(4096))  # on the copy queue, behind the gate
    with anyio.move_on_after(0.02) as scope:
        await op
    assert scope.cancelled_caught and not op.done()
    handle = buf.handle
    with anyio.move_on_after(0.02):
        await dev.free(buf)  # cancelled too: the release waits for the op, which is still queued
    assert not buf.is_allocated()
    assert alloc.in_use == before + counted, "memory of a queued op must not be released"
    other = await dev.allocate(4096)
    assert other.handle is not handle and other.handle != handle
    gate.set(1)
    with anyio.fail_after(10):
        await opened
        await op
        await dev.settle()
    assert alloc.in_use == before + counted  # `buf` released, `other` live
    await dev.free(other)
    assert alloc.in_use == before


async def test_a_wait_that_never_passes_times_out_and_the_queue_goes_on(kind: Kind) -> None:
    dev = kind.dev
    held = TimelineSignal("gate", 30.0)
    waited = gate_op(kind, held)
    with pytest.raises(SignalTimeout, match=f"{dev.name} copy queue"):
        await dev.copy.signal.wait_async(waited.value, timeout=0.01)  # an awaiter's own limit
    held.set(1)
    gate = TimelineSignal("gate that stays shut", 0.2)
    stuck = gate_op(kind, gate)
    buf = await dev.allocate(64)
    behind = dev.copyin(buf, pattern(64))
    with anyio.fail_after(10):
        await waited
        with pytest.raises(OpError, match=r"gate that stays shut: wait for value >= 1 did not pass within 0.2 s"):
            await stuck
        await behind  # the queue went on after the failed wait
    assert isinstance(stuck.error, OpError) and isinstance(stuck.error.__cause__, SignalTimeout)
    if kind.moves_data:
        assert bytes(await dev.copyout(buf)) == pattern(64)
    await dev.free(buf)


# ---- profiling ------------------------------------------------------------------------------------


async def test_profile_ranges_on_both_queues_are_on_the_host_clock(kind: Kind) -> None:
    dev = kind.dev
    n = dev.inline_copy_max + 1  # too big to ride on the compute queue after the kernel
    buf = await dev.allocate(n)
    prog = None
    if kind.kernels is not None:
        prog = await dev.compile(kind.kernels.get("add_one", "any"), "add_one")
    await dev.synchronize()
    start = now_us()
    async with profile() as prof:
        dev.copyin(buf, pattern(n))
        if prog is not None:
            dev.launch(prog, buf, vals=(n,))
        await dev.copyout(buf)
    end = now_us()
    offsets = [e for e in prof.events if isinstance(e, DeviceEvent) and e.device == dev.name]
    assert len(offsets) == 1
    ranges = [e for e in prof.events if isinstance(e, RangeEvent) and e.device == dev.name]
    names = [(r.name, r.is_copy) for r in ranges]
    kernel = [("add_one", False)] if prog is not None else []
    assert names == [(f"copyin {n} B", True), *kernel, (f"copyout {n} B", True)]
    slack = 2000.0  # µs: how far the clock alignment may be off
    for r in ranges:
        off = offsets[0].copy_offset if r.is_copy else offsets[0].comp_offset
        assert r.start <= r.end
        assert start - slack <= r.start + off and r.end + off <= end + slack, (r, off, start, end)
    assert ranges[0].end <= ranges[-1].start  # one queue's ranges, in its order, on its own clock
    await dev.free(buf)


# ---- graphs ---------------------------------------------------------------------------------------


async def test_a_graph_replays_with_new_inputs_and_parameters(kind: Kind) -> None:
    kind.need_data()
    dev = kind.dev
    n = 256
    x, y = await dev.allocate(n, dtypes.float32), await dev.allocate(n, dtypes.float32)
    graph = Graph()
    graph.copyin(x, "x")
    if kind.kernels is not None:
        scale = await dev.compile(kind.kernels["scale"], "scale", outs=(0,))
        graph.launch(scale, y, x, vals=(n, Param("s")))
        factor = 2.0
    else:
        graph.transfer(y, x)
        factor = 1.0
    graph.copyout(y, "y")
    params = {"s": 2.0} if kind.kernels is not None else {}
    for k in range(3):
        result = await graph.replay(x=array.array("f", [float(k)] * n), **params)
        assert set(array.array("f", bytes(result["y"]))) == {k * factor}
    runs = [graph.replay(x=array.array("f", [float(k)] * n), **params) for k in (5, 6)]  # two in flight
    assert [set(array.array("f", bytes((await r)["y"]))) for r in runs] == [{5 * factor}, {6 * factor}]
    await dev.free(x)
    await dev.free(y)
