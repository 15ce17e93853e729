"""Pinning host memory for engine threads: zero-copy, held while referenced, clear errors, no pointers."""

from __future__ import annotations

import array
import ctypes
import gc
import mmap
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from aruntime import Buffer, BufferUsageError, Device, dtypes
from aruntime.memory.pinning import pin


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


# ---- memory that holds pointers ------------------------------------------------------------------


def read_only(arr: Any) -> Any:
    arr.flags.writeable = False
    return arr


POINTERS = {
    "object": lambda np: np.array([object(), None, 3]),
    "read-only object": lambda np: read_only(np.array([object(), None, 3])),
    "struct with an object field": lambda np: np.zeros(2, dtype=[("price", "f8"), ("note", "O")]),
    "subarray of objects": lambda np: np.zeros(2, dtype="f4,(2,3)O"),
    "ctypes void *": lambda np: (ctypes.c_void_p * 2)(),
    "ctypes int *": lambda np: (ctypes.POINTER(ctypes.c_int) * 2)(),
    "ctypes char *": lambda np: (ctypes.c_char_p * 2)(),
    "ctypes py_object": lambda np: (ctypes.py_object * 2)(),
}


@pytest.mark.parametrize("make", POINTERS.values(), ids=POINTERS.keys())
def test_memory_that_holds_pointers_is_refused_naming_its_format(make: Any) -> None:
    obj = make(pytest.importorskip("numpy"))
    with pytest.raises(BufferUsageError, match=r"with buffer format '[^']*[OP&z][^']*' holds pointers"):
        pin(obj)
    if not memoryview(obj).readonly:
        with pytest.raises(BufferUsageError, match="holds pointers"):
            pin(obj, writable=True)


def test_plain_data_whose_format_spells_pointer_letters_is_accepted() -> None:
    np = pytest.importorskip("numpy")
    plain = (
        np.zeros(2, "c16"),  # 'Zd': a complex number, not a wchar_t *
        np.zeros(2, dtype=[("Price", "f8"), ("P", "i4"), ("O", "u1")]),  # field names are not codes
        np.zeros(3, "U2"),
    )
    for arr in plain:
        _, _, nbytes = pin(arr, writable=True)
        assert nbytes == arr.nbytes


def test_copyin_from_an_object_array_is_refused_before_anything_is_copied() -> None:
    np = pytest.importorskip("numpy")
    dev = Device["CPU"]
    buf = Buffer("CPU", 3, dtypes.int64, initial_value=bytes(24))
    with pytest.raises(BufferUsageError, match="ndarray with buffer format 'O' holds pointers"):
        dev.copyin(buf, np.array([object(), object(), object()]))
    assert bytes(buf.as_buffer()) == bytes(24)  # no object address reached device memory
    buf.deallocate()


COPYOUT_INTO_OBJECTS = """
import anyio
import numpy as np
from aruntime import BufferUsageError, Device, dtypes

async def main():
    dev = Device["CPU"]
    buf = await dev.allocate(3, dtypes.int64)
    await dev.copyin(buf, np.array([16, 32, 48], dtype=np.int64))  # no object lives at these addresses
    into = np.array([object(), object(), object()])
    try:
        await dev.copyout(buf, into=into)
    except BufferUsageError as exc:
        print(exc)
    print(repr(into[0])[:7])  # reads the slot: an address written there is a crash

anyio.run(main)
"""


def test_copyout_into_an_object_array_is_refused() -> None:
    pytest.importorskip("numpy")
    proc = subprocess.run(  # a child process: writing device bytes over object pointers would crash the tests
        [sys.executable, "-c", textwrap.dedent(COPYOUT_INTO_OBJECTS)],
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}"
    assert proc.stdout.splitlines() == [
        "copyout into: ndarray with buffer format 'O' holds pointers (Python objects or addresses), which cannot "
        "be copied to or from a device; convert it to plain numbers first",
        "<object",
    ]
