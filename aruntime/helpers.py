"""Small shared utilities: environment flags and pinning the memory of Python buffers."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import re
import threading
import types
from collections.abc import Callable, Generator
from typing import Any, ClassVar, TypeVar

from aruntime.errors import BufferUsageError, DeviceError

T = TypeVar("T", int, float, str)


ENV_PREFIX = "ARUNTIME_"
"""Every environment variable aruntime reads is named with this prefix (``ARUNTIME_WAIT_TIMEOUT``...)."""


def getenv(key: str, default: T, minimum: T | None = None, maximum: T | None = None) -> T:
    """Read the environment variable ``ARUNTIME_<key>`` converted to the type of ``default``.

    The one place aruntime reads its settings from the environment (it never
    writes them). Unset or empty reads as ``default``. A value that does not
    convert (a float that is not a number included), or that lies outside
    ``minimum`` .. ``maximum`` (inclusive, where given), raises a ``ValueError``
    naming the variable and what it accepts.
    """
    name = ENV_PREFIX + key
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    kind = type(default)
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {kind.__name__}") from None
    if isinstance(value, float) and value != value:
        raise ValueError(f"environment variable {name}={raw!r} is not a number")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = " and ".join(
            f"{word} {bound!r}" for word, bound in (("at least", minimum), ("at most", maximum)) if bound is not None
        )
        raise ValueError(f"environment variable {name}={raw!r} is out of range: it must be {bounds}")
    return value


class _PyBuffer(ctypes.Structure):
    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
_PYBUF_WRITABLE = 0x0001
_PYBUF_FORMAT = 0x0004
_PYBUF_ND = 0x0008  # with the format, exporters such as memoryview also want the shape asked for


def _bytes_address(data: bytes) -> int | None:
    return ctypes.cast(data, ctypes.c_void_p).value  # type: ignore[arg-type]  # bytes pass as char *


class _Export:
    """A buffer export taken through the C API (for read-only memory), released when collected."""

    __slots__ = ("view",)

    def __init__(self, obj: object, writable: bool) -> None:
        self.view: _PyBuffer | None = None
        view = _PyBuffer()
        try:
            _get_buffer(obj, ctypes.byref(view), _PYBUF_FORMAT | _PYBUF_ND | (_PYBUF_WRITABLE if writable else 0))
        except (BufferError, TypeError, ValueError) as exc:
            need = "a writable, C-contiguous" if writable else "a C-contiguous"
            raise BufferUsageError(f"expected {need} buffer-protocol object, got {type(obj).__name__}: {exc}") from None
        self.view = view

    def __del__(self) -> None:
        view, self.view = self.view, None
        if view is not None:
            _release_buffer(ctypes.byref(view))


# What a buffer format holds pointers with: Python objects (O), addresses (P, ctypes' char * z and wchar_t * Z,
# pointers &, function pointers X{}); Z followed by a float code is a complex number, not a pointer.
_POINTER_CODES = re.compile(r"[OP&zX]|Z(?![efdg])")
_FIELD_NAMES = re.compile(r":[^:]*:")  # the names of a struct format's fields (T{<d:price:})


LAZY_ZEROS_MIN = 64 << 10
"""From this many bytes, :func:`zeroed` maps fresh pages instead of filling a ``bytearray``."""


def zeroed(nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` zero bytes that takes no time to make: from :data:`LAZY_ZEROS_MIN` bytes up,
    anonymous pages the system zeroes when they are first written (by whoever writes them: a copy-out's worker,
    not the event loop), below that a ``bytearray``."""
    if nbytes < LAZY_ZEROS_MIN:
        return memoryview(bytearray(nbytes))
    return memoryview(mmap.mmap(-1, nbytes))


def refuse_pointers(fmt: str, obj: object) -> None:
    """Raise :class:`BufferUsageError` naming ``fmt`` if the buffer format ``fmt`` (of ``obj``) holds pointers.

    Such memory (a numpy object array: format ``'O'``; ``'P'``; a struct format with such a field) holds
    addresses that mean nothing on a device, and writing device bytes into it corrupts the process.
    """
    if _POINTER_CODES.search(_FIELD_NAMES.sub("", fmt)):
        raise BufferUsageError(
            f"{type(obj).__name__} with buffer format {fmt!r} holds pointers (Python objects or addresses), "
            "which cannot be copied to or from a device; convert it to plain numbers first"
        )


Pin = tuple[object, int, int]
"""What :func:`pin` returns: ``(holder, address, nbytes)``."""


def pin(obj: object, writable: bool = False) -> Pin:
    """Hold the memory of a buffer-protocol object for as long as the returned ``holder`` lives.

    Returns ``(holder, address, nbytes)``. While ``holder`` is referenced the
    object can be neither resized nor freed, so an engine thread may copy to or
    from ``address`` without the GIL. Zero-copy for bytes, bytearray,
    memoryview, array, mmap and C-contiguous numpy arrays; ``writable``
    refuses read-only memory. Raises :class:`BufferUsageError` for anything
    else (no buffer protocol, not C-contiguous, a format that holds pointers:
    see :func:`refuse_pointers`).
    """
    if type(obj) is bytes and not writable:  # immutable and referenced: its address cannot change
        return obj, _bytes_address(obj) or 0, len(obj)
    try:
        view = memoryview(obj)  # type: ignore[arg-type]  # our own view: its export outlives the caller's release()
        # the view holds the export for as long as it lives; the anchor only reads the address
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):  # read-only, not C-contiguous, empty, or no buffer protocol
        pass
    else:
        refuse_pointers(view.format, obj)
        return view, address, view.nbytes
    export = _Export(obj, writable)
    view_struct = export.view
    assert view_struct is not None
    refuse_pointers((view_struct.format or b"B").decode(), obj)
    return export, int(view_struct.buf or 0), int(view_struct.len)


_KIND = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_EXPECTED = "expected KIND, KIND:N with N >= 0, or KIND:ARG (a path for DISK)"


def canonicalize(name: str) -> str:
    """The canonical device name: ``KIND``, ``KIND:N`` (N > 0, a device index) or ``KIND:ARG``.

    The kind (letters, digits, ``_``) is upper-cased; an index of 0 is dropped
    and leading zeros go (``"cpu:0" -> "CPU"``, ``"cpu:010" -> "CPU:10"``); any
    other argument (a path: ``"disk:/tmp/A" -> "DISK:/tmp/A"``) is kept, less a
    final ``":0"`` (``"disk:/tmp/x:0" -> "DISK:/tmp/x"``). A malformed name (no
    kind, an empty argument, a negative index) is a :class:`DeviceError`; which
    arguments a kind takes is checked when the device opens.
    """
    if not isinstance(name, str):
        raise DeviceError(f"invalid device name {name!r}: not a str; {_EXPECTED}")
    kind, sep, rest = name.partition(":")
    if not _KIND.fullmatch(kind):
        raise DeviceError(f"invalid device name {name!r}: no kind before ':'; {_EXPECTED}")
    if sep and not rest:
        raise DeviceError(f"invalid device name {name!r}: nothing after ':'; {_EXPECTED}")
    if rest.startswith("-") and rest[1:].isdecimal():
        raise DeviceError(f"invalid device name {name!r}: a device index must be >= 0; {_EXPECTED}")
    if rest.isdecimal() and rest.isascii():
        index = int(rest)
        return kind.upper() + (f":{index}" if index else "")
    if rest.endswith(":0") and not (rest[:-2].isdecimal() and rest[:-2].isascii()):
        rest = rest[:-2]
    return kind.upper() + sep + rest


def is_index(arg: str) -> bool:
    """Whether the argument of a canonical device name is a device index (or absent)."""
    return arg == "" or (arg.isdecimal() and arg.isascii())


def after_all(count: int, callback: Callable[[], None]) -> Callable[[], None]:
    """A function that calls ``callback`` on its ``count``-th call, from whichever thread makes it."""
    left = [count]
    lock = threading.Lock()

    def one() -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        callback()

    return one


@types.coroutine
def checkpoint() -> Generator[Any, None, None]:
    """Check for cancellation and let the event loop run other tasks once: ``await checkpoint()``, or
    ``yield from checkpoint()`` in a generator-based ``__await__``.

    Every public awaitable of aruntime passes through one, even when its result is ready (trio's rule, which
    anyio follows). On asyncio and uvloop it is the bare yield of ``asyncio.sleep(0)``: the task runs again on
    the loop's next turn, and a cancellation delivered meanwhile (an anyio cancel scope cancels the task) raises
    here. On trio it is ``trio.lowlevel.checkpoint()``. It does what ``anyio.lowlevel.checkpoint()`` does without
    looking the event loop up by name and without its three coroutine frames (about 1 µs less per await on
    asyncio).
    """
    if asyncio._get_running_loop() is not None:
        yield
    else:
        import trio

        yield from trio.lowlevel.checkpoint().__await__()  # noqa: ASYNC105  (awaited: this is a generator coroutine)
