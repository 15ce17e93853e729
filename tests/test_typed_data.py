"""Typed data: copy-outs carry the buffer's dtype, numpy arrays go in and out as they are, DLPack both ways."""

from __future__ import annotations

import array
import gc
import struct

import anyio
import numpy as np
import pytest

import aruntime
from aruntime import Buffer, BufferUsageError, Device, Graph, Scheduler, dtypes
from tests.kernels import SCALE, SPINS, closed_gate

pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------------------------------------------------
# copy-out results


@pytest.mark.parametrize(
    ("dtype", "fmt", "values"),
    [
        (dtypes.float32, "f", [1.5, -2.0, 3.25]),
        (dtypes.float64, "d", [1e300, -2.0, 0.5]),
        (dtypes.int8, "b", [-128, 0, 127]),
        (dtypes.uint16, "H", [0, 1, 65535]),
        (dtypes.int32, "i", [-(2**31), 7, 2**31 - 1]),
        (dtypes.uint64, "Q", [0, 1, 2**64 - 1]),
        (dtypes.bool, "?", [True, False, True]),
    ],
)
async def test_a_copy_out_is_a_memoryview_of_the_dtype(dtype: aruntime.DType, fmt: str, values: list[object]) -> None:
    dev = Device["CPU"]
    async with dev.buffer(3, dtype) as buf:
        await dev.copyin(buf, struct.pack(f"3{fmt}", *values))
        out = await dev.copyout(buf)
        assert isinstance(out, memoryview) and out.format == fmt and out.shape == (3,)
        assert out.tolist() == values
        assert np.asarray(out).dtype == np.dtype(fmt)


async def test_dtypes_memoryview_cannot_cast_to_come_back_as_bytes() -> None:
    dev = Device["CPU"]
    async with dev.buffer(2, dtypes.bfloat16) as buf:
        await dev.copyin(buf, b"\x80\x3f\x00\x40")
        out = await dev.copyout(buf)
        assert out.format == "B" and out.nbytes == 4 and bytes(out) == b"\x80\x3f\x00\x40"


async def test_a_vector_dtype_comes_back_one_row_per_element() -> None:
    dev = Device["CPU"]
    async with dev.buffer(2, dtypes.float32.vec(4)) as buf:
        await dev.copyin(buf, array.array("f", range(8)))
        out = await dev.copyout(buf)
        assert (out.format, out.shape) == ("f", (2, 4))
        assert out.tolist() == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]


async def test_scheduler_and_graph_results_are_typed_too() -> None:
    dev = Device["CPU"]
    prog = await dev.compile(SCALE, outs=(0,))
    async with dev.buffer(3, dtypes.float32) as x, dev.buffer(3, dtypes.float32) as y:
        async with Scheduler() as sched:
            sched.copyin(x, np.array([1, 2, 3], dtype=np.float32))
            sched.launch(prog, y, x, vals=(3, 2.0))
            assert (await sched.copyout(y)).tolist() == [2.0, 4.0, 6.0]
        graph = Graph()
        graph.copyin(x, "x")
        graph.launch(prog, y, x, vals=(3, 10.0))
        graph.copyout(y, "y")
        got = (await graph.replay(x=np.array([1, 2, 3], dtype=np.float32)))["y"]
        assert got.format == "f" and got.tolist() == [10.0, 20.0, 30.0]


# ---------------------------------------------------------------------------------------------------------
# numpy arrays in and out


async def test_numpy_arrays_are_sources_and_destinations() -> None:
    dev = Device["CPU"]
    async with dev.buffer(6, dtypes.int32) as buf:
        await dev.copyin(buf, np.arange(6, dtype=np.int32).reshape(2, 3))  # any C-contiguous shape
        dest = np.zeros((3, 2), dtype=np.int32)
        assert await dev.copyout(buf, into=dest) is dest
        assert dest.ravel().tolist() == [0, 1, 2, 3, 4, 5]
        readonly = np.arange(6, dtype=np.int32)[::-1].copy()
        readonly.flags.writeable = False
        await dev.copyin(buf, readonly)  # a read-only source is fine
        assert (await dev.copyout(buf)).tolist() == [5, 4, 3, 2, 1, 0]


async def test_bad_numpy_destinations_and_sources_are_refused() -> None:
    dev = Device["CPU"]
    async with dev.buffer(4, dtypes.float32) as buf:
        strided = np.zeros(8, dtype=np.float32)[::2]
        with pytest.raises(BufferUsageError, match=r"copyout into: expected a writable, C-contiguous .* ndarray"):
            dev.copyout(buf, into=strided)
        readonly = np.zeros(4, dtype=np.float32)
        readonly.flags.writeable = False
        with pytest.raises(BufferUsageError, match=r"copyout into: .*read-only"):
            dev.copyout(buf, into=readonly)
        with pytest.raises(BufferUsageError, match="destination has 8 bytes"):
            dev.copyout(buf, into=np.zeros(2, dtype=np.float32))
        with pytest.raises(BufferUsageError, match="C-contiguous"):
            dev.copyin(buf, np.zeros((4, 2), dtype=np.float32)[:, 0])
        with pytest.raises(BufferUsageError, match="source has 8 bytes"):
            dev.copyin(buf, np.zeros(2, dtype=np.float32))


# ---------------------------------------------------------------------------------------------------------
# DLPack export


async def test_numpy_from_dlpack_shares_a_cpu_buffer() -> None:
    dev = Device["CPU"]
    async with dev.buffer(4, dtypes.float32) as buf:
        await dev.copyin(buf, np.array([1, 2, 3, 4], dtype=np.float32))
        assert buf.__dlpack_device__() == (1, 0)
        view = np.from_dlpack(buf)
        assert view.dtype == np.float32 and view.shape == (4,) and view.flags.writeable
        assert view.tolist() == [1.0, 2.0, 3.0, 4.0]
        view[:] = 7  # the buffer's own memory
        assert (await dev.copyout(buf)).tolist() == [7.0] * 4
        await dev.copyin(buf, np.zeros(4, dtype=np.float32))
        assert view.tolist() == [0.0] * 4
        del view


async def test_the_unversioned_protocol_and_views_export_too() -> None:
    dev = Device["CPU"]
    async with dev.buffer(8, dtypes.int16) as buf:
        await dev.copyin(buf, np.arange(8, dtype=np.int16))
        part = buf.view(3, dtypes.int16, 4)
        capsule = part.__dlpack__()  # no max_version: the unversioned struct, in a "dltensor" capsule
        assert "dltensor" in repr(capsule) and "versioned" not in repr(capsule)
        del capsule  # never consumed: its destructor lets the buffer go
        assert np.from_dlpack(part).tolist() == [2, 3, 4]
        vec = await dev.allocate(2, dtypes.float32.vec(2))
        assert np.from_dlpack(vec).shape == (2, 2)
        await dev.free(vec)


async def test_an_export_waits_for_the_ops_in_flight() -> None:
    dev = Device["CPU:8"]
    gate, flag = await closed_gate(dev)
    async with dev.buffer(1, dtypes.int32) as out:
        kernel = dev.launch(gate, out, vals=(flag.handle, SPINS))
        exported: list[tuple[list[int], bool]] = []

        def read() -> tuple[list[int], bool]:
            return np.from_dlpack(out).tolist(), kernel.done()  # what the export saw, when it returned

        async def export() -> None:  # blocks its thread until the kernel is done
            exported.append(await anyio.to_thread.run_sync(read))

        async with anyio.create_task_group() as tg:
            tg.start_soon(export)
            await anyio.wait_all_tasks_blocked()
            await dev.copyin(flag, array.array("i", [42]))  # opens the gate: the kernel writes 42
        assert exported == [([42], True)]
    await dev.free(flag)


async def test_a_freed_buffer_keeps_its_memory_while_numpy_holds_it() -> None:
    dev = Device["CPU:9"]
    buf = await dev.allocate(1 << 12, dtypes.uint8, aruntime.BufferSpec(nolru=True))
    before = dev.allocator.in_use
    view = np.from_dlpack(buf)
    await dev.free(buf)
    assert not buf.is_allocated() and dev.allocator.in_use == before  # not released yet
    view[:] = 1  # still valid memory
    del view
    gc.collect()
    assert dev.allocator.in_use == before - (1 << 12)


async def test_only_host_buffers_export() -> None:
    null = await Device["NULL"].allocate(4)
    with pytest.raises(BufferUsageError, match="not in host memory"):
        null.__dlpack__()
    with pytest.raises(BufferUsageError, match="not in host memory"):
        null.__dlpack_device__()
    cpu = Buffer("CPU", 4)
    with pytest.raises(BufferUsageError, match="is not allocated"):
        np.from_dlpack(cpu)
    cpu.allocate()
    with pytest.raises(BufferUsageError, match="no streams"):
        cpu.__dlpack__(stream=3)
    with pytest.raises(BufferUsageError, match="copy=True"):
        cpu.__dlpack__(copy=True)
    cpu.deallocate()
    await Device["NULL"].free(null)


# ---------------------------------------------------------------------------------------------------------
# DLPack import


async def test_from_dlpack_wraps_an_array_without_a_copy() -> None:
    dev = Device["CPU"]
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)
    buf = aruntime.from_dlpack(arr)
    assert (buf.device, buf.size, buf.dtype) == ("CPU", 12, dtypes.float64)
    assert buf.handle == arr.ctypes.data
    await dev.copyin(buf, np.full(12, 2.5))
    assert arr.ravel().tolist() == [2.5] * 12
    assert (await dev.copyout(buf)).tolist() == [2.5] * 12
    await dev.free(buf)
    arr[0, 0] = 1.0  # still the caller's, intact
    assert arr[0, 0] == 1.0


async def test_from_dlpack_keeps_the_array_alive_while_the_buffer_lives() -> None:
    buf = aruntime.from_dlpack(np.full(1 << 16, 3, dtype=np.uint8), device="cpu:1")  # nobody else holds the array
    gc.collect()
    assert buf.device == "CPU:1"
    assert bytes(await Device["CPU:1"].copyout(buf)) == b"\x03" * (1 << 16)
    await Device["CPU:1"].free(buf)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(np.int8, dtypes.int8), (np.uint32, dtypes.uint32), (np.float16, dtypes.float16), (np.bool_, dtypes.bool)],
)
def test_from_dlpack_maps_dtypes(dtype: type, expected: aruntime.DType) -> None:
    buf = aruntime.from_dlpack(np.zeros(3, dtype=dtype))
    assert buf.dtype == expected and buf.size == 3
    buf.deallocate()


def test_from_dlpack_refuses_what_it_cannot_wrap() -> None:
    with pytest.raises(BufferUsageError, match="bytearray does not export DLPack"):
        aruntime.from_dlpack(bytearray(4))
    with pytest.raises(BufferUsageError, match="not C-contiguous"):
        aruntime.from_dlpack(np.zeros((4, 4), dtype=np.float32)[:, 1])
    with pytest.raises(BufferUsageError, match="is empty"):
        aruntime.from_dlpack(np.zeros(0, dtype=np.float32))
    with pytest.raises(BufferUsageError, match="NULL is not a host-memory device"):
        aruntime.from_dlpack(np.zeros(4, dtype=np.float32), device="NULL")
    with pytest.raises(BufferUsageError, match="no aruntime dtype"):
        aruntime.from_dlpack(np.zeros(2, dtype=np.complex64))
