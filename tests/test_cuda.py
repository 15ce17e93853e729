"""The CUDA backend without a GPU: the clear error when no driver is found, launch argument packing, and the
pinned staging ring on host memory. (With a GPU, the conformance suite runs the rest.)"""

from __future__ import annotations

import ctypes

import pytest

from aruntime import Device, DeviceError
from aruntime.backends.cuda import CHUNK, STAGING, StagingPool, pack_args


def has_gpu() -> bool:
    try:
        Device["CUDA"]
    except DeviceError:
        return False
    return True


@pytest.mark.skipif(has_gpu(), reason="a CUDA device opens here")
def test_without_a_driver_opening_cuda_says_why() -> None:
    with pytest.raises(DeviceError, match=r"CUDA: no usable NVIDIA driver|CUDA needs cuda-core"):
        Device["CUDA"]
    assert "CUDA" in Device.kinds()
    assert "CUDA" not in Device.available()


def test_launch_arguments_are_packed_by_parameter_size() -> None:
    args = pack_args(
        "launch k", [8, 8, 1, 2, 4, 8, 4, 8], [0x1000, 0x2000], [-128, 32767, -(1 << 31), 1 << 62, 0.5, -2.5]
    )
    assert [type(a) for a in args] == [
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_int8,
        ctypes.c_int16,
        ctypes.c_int32,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_double,
    ]
    assert [a.value for a in args] == [0x1000, 0x2000, -128, 32767, -(1 << 31), 1 << 62, 0.5, -2.5]


@pytest.mark.parametrize(
    ("sizes", "pointers", "vals", "error", "message"),
    [
        ([8, 8], [1], [], TypeError, r"takes 2 parameter\(s\), got 1 buffer\(s\) and 0 scalar\(s\)"),
        ([4], [1], [], TypeError, "parameter 0 is 4 bytes, not a pointer for buffer 0"),
        ([1], [], [128], ValueError, "scalar 0 = 128 does not fit in its 1-byte parameter"),
        ([4], [], [1 << 31], ValueError, "does not fit in its 4-byte"),
        ([2], [], [1.0], TypeError, "scalar 0 is a float, but its parameter is 2 bytes"),
        ([16], [], [1], TypeError, "scalar 0 is an int, but its parameter is 16 bytes"),
    ],
)
def test_launch_arguments_that_do_not_fit_the_kernel_are_refused(
    sizes: list[int], pointers: list[int], vals: list[int | float], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        pack_args("launch k", sizes, pointers, vals)


class FakeStream:
    """Host memory standing in for the device: a DMA is a memmove done when its event is waited for."""

    def __init__(self) -> None:
        self.queued: list[tuple[int, int, int]] = []
        self.log: list[tuple[str, int]] = []  # ("dma", slot address) / ("wait", event)
        self.events = 0
        self.buffers: list[ctypes.Array[ctypes.c_char]] = []

    def alloc(self, size: int) -> tuple[int, object]:
        buf = ctypes.create_string_buffer(size)
        self.buffers.append(buf)
        return ctypes.addressof(buf), buf

    def dma(self, dst: int, src: int, n: int) -> None:
        self.queued.append((dst, src, n))

    def record(self) -> object:
        self.events += 1
        return (self.events, len(self.queued))

    def wait(self, event: object) -> None:
        assert isinstance(event, tuple)
        _, upto = event
        for dst, src, n in self.queued[:upto]:
            ctypes.memmove(dst, src, n)
        del self.queued[:upto]
        self.log.append(("wait", event[0]))

    def drain(self) -> None:
        self.wait((0, len(self.queued)))


@pytest.mark.parametrize("nbytes", [1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, (STAGING + 2) * CHUNK + 5])
def test_staging_moves_pageable_memory_in_chunks_with_a_bounded_ring(nbytes: int) -> None:
    stream = FakeStream()
    pool = StagingPool(STAGING, CHUNK, stream.alloc, stream.record, stream.wait)
    data = (bytes(range(7, 256)) * (nbytes // 249 + 1))[:nbytes]
    src = ctypes.create_string_buffer(data, nbytes)
    device = ctypes.create_string_buffer(nbytes)
    pool.copy_in(ctypes.addressof(device), ctypes.addressof(src), nbytes, stream.dma)
    chunks = -(-nbytes // CHUNK)
    assert len(stream.queued) <= STAGING  # never more chunks in flight than staging buffers
    assert stream.events == chunks
    stream.drain()
    assert device.raw == data
    back = ctypes.create_string_buffer(nbytes)
    pool.copy_out(ctypes.addressof(back), ctypes.addressof(device), nbytes, stream.dma)
    assert back.raw == data  # copy_out returns once every chunk is in its destination


def test_a_staging_buffer_is_reused_only_after_its_dma_is_done() -> None:
    stream = FakeStream()
    pool = StagingPool(2, 4, stream.alloc, stream.record, stream.wait)
    src = ctypes.create_string_buffer(b"abcdefghijkl", 12)
    device = ctypes.create_string_buffer(12)
    pool.copy_in(ctypes.addressof(device), ctypes.addressof(src), 12, stream.dma)
    # the third chunk reuses the first buffer: it waited for the first chunk's event, not the second's
    assert stream.log == [("wait", 1)]
    stream.drain()
    assert device.raw == b"abcdefghijkl"
