"""Pinning the memory of Python buffers: hold a buffer-protocol object's memory while an engine thread copies it."""

from __future__ import annotations

import ctypes
import functools
import re
from typing import Any, ClassVar

from aruntime.errors import BufferUsageError
from aruntime.helpers import bytes_address


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


@functools.lru_cache(maxsize=256)
def _holds_pointers(fmt: str) -> bool:
    return _POINTER_CODES.search(_FIELD_NAMES.sub("", fmt)) is not None


def refuse_pointers(fmt: str, obj: object) -> None:
    """Raise :class:`BufferUsageError` naming ``fmt`` if the buffer format ``fmt`` (of ``obj``) holds pointers.

    Such memory (a numpy object array: format ``'O'``; ``'P'``; a struct format with such a field) holds
    addresses that mean nothing on a device, and writing device bytes into it corrupts the process.
    """
    if _holds_pointers(fmt):
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
        return obj, bytes_address(obj), len(obj)
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
