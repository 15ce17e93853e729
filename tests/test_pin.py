"""Pinning host memory for engine threads: zero-copy, held while referenced, clear errors."""

from __future__ import annotations

import array
import ctypes
import gc
import mmap

import pytest

from aruntime import BufferUsageError
from aruntime.helpers import pin


def read(address: int, nbytes: int) -> bytes:
    return ctypes.string_at(address, nbytes)


@pytest.mark.parametrize(
    "make",
    [
        lambda: b"abcdefgh",
        lambda: bytearray(b"abcdefgh"),
        lambda: memoryview(bytearray(b"abcdefgh")),
        lambda: memoryview(b"abcdefgh"),  # read-only: the C-API export path
        lambda: array.array("B", b"abcdefgh"),
    ],
    ids=["bytes", "bytearray", "memoryview", "readonly-memoryview", "array"],
)
def test_pin_is_zero_copy(make: object) -> None:
    obj = make()  # type: ignore[operator]
    holder, address, nbytes = pin(obj)
    assert nbytes == 8 and read(address, 8) == b"abcdefgh"
    if not isinstance(obj, bytes) and not (isinstance(obj, memoryview) and obj.readonly):
        memoryview(obj).cast("B")[0] = ord("z")  # the same memory, not a copy
        assert read(address, 1) == b"z"
    del holder


def test_pinned_bytearray_cannot_be_resized_until_the_holder_is_gone() -> None:
    data = bytearray(64)
    holder, _, _ = pin(data, writable=True)
    with pytest.raises(BufferError):
        data.extend(b"x")
    del holder
    data.extend(b"x")  # released with the holder
    assert len(data) == 65


def test_pin_outlives_the_callers_release_of_its_view() -> None:
    data = bytearray(b"12345678")
    view = memoryview(data)
    holder, address, _ = pin(view)
    view.release()  # the caller's view goes; the pin's own export stays
    with pytest.raises(BufferError):
        data.extend(b"x")
    assert read(address, 8) == b"12345678"
    del holder


def test_readonly_export_is_released_on_collection() -> None:
    data = bytearray(b"12345678")
    readonly = memoryview(data).toreadonly()
    holder, _, _ = pin(readonly)
    del readonly
    with pytest.raises(BufferError):
        data.extend(b"x")
    del holder
    gc.collect()
    data.extend(b"x")


def test_mmap_pins_zero_copy() -> None:
    with mmap.mmap(-1, 4096) as m:
        m[:4] = b"abcd"
        holder, address, nbytes = pin(m, writable=True)
        assert nbytes == 4096 and read(address, 4) == b"abcd"
        del holder


def test_pin_errors_name_what_is_wrong() -> None:
    with pytest.raises(BufferUsageError, match=r"writable.*bytes"):
        pin(b"abc", writable=True)
    with pytest.raises(BufferUsageError, match=r"writable.*memoryview"):
        pin(memoryview(b"abc"), writable=True)
    with pytest.raises(BufferUsageError, match=r"C-contiguous.*memoryview"):
        pin(memoryview(bytearray(8))[::2])
    with pytest.raises(BufferUsageError, match=r"C-contiguous.*int"):
        pin(3)
    released = memoryview(bytearray(8))
    released.release()
    with pytest.raises(BufferUsageError, match="memoryview"):
        pin(released)
