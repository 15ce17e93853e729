"""DLPack's C ABI for host buffers: the capsule ``numpy.from_dlpack(buf)`` reads, and reading a producer's.

The structs are DLPack's C ABI (``dlpack.h``, the unversioned
``DLManagedTensor`` in a capsule named ``"dltensor"``), through ctypes: no
array library is needed to export, and any producer of that ABI (numpy,
PyTorch, CuPy on the host, JAX...) can be imported.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from aruntime.dtype import DType, dtypes
from aruntime.errors import BufferUsageError
from aruntime.memory.allocator import HostAllocator

if TYPE_CHECKING:
    from aruntime.memory.buffer import Buffer

CPU = 1
"""DLPack's ``kDLCPU`` device type."""
_INT, _UINT, _FLOAT, _BFLOAT, _BOOL = 0, 1, 2, 4, 6  # DLPack's type codes


class DLDevice(ctypes.Structure):
    _fields_: ClassVar[list[tuple[str, Any]]] = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
    ]


class DLTensor(ctypes.Structure):
    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class DLPackVersion(ctypes.Structure):
    _fields_: ClassVar[list[tuple[str, Any]]] = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_NAME, _VERSIONED = b"dltensor", b"dltensor_versioned"
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi)
)
# these take the capsule as a plain address: the destructor runs while the capsule is being freed
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)

# managed tensor address -> (the struct, its shape, what ends the buffer's loan), until its deleter runs
_exported: dict[int, tuple[Any, Any, Callable[[], None]]] = {}
_exported_lock = threading.Lock()


def _delete(managed: int | None) -> None:
    """The deleter of every exported tensor (either struct): the consumer is done with the memory."""
    try:
        with _exported_lock:
            entry = _exported.pop(managed or 0, None)
        if entry is not None:
            entry[2]()
    except Exception:  # called from C, late in interpreter shutdown too: nothing to report to
        pass


def _capsule_gone(capsule: int) -> None:
    """The capsule's destructor: a capsule nobody consumed (a consumer renames it) lets its tensor go."""
    for name in (_NAME, _VERSIONED):
        if _capsule_is_valid(capsule, name):
            _delete(_capsule_pointer(capsule, name))


_deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_delete)
_destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_capsule_gone)
_destructor_address: int = ctypes.cast(_destructor, ctypes.c_void_p).value or 0
"""The destructor of the capsules :func:`export` makes: the ctypes one above until
:func:`use_capsule_destructor` gives a native one."""


def use_capsule_destructor(make: Callable[[Callable[[int | None], None]], int]) -> None:
    """Destroy the capsules exported from now on with the native function at ``make(delete)``, which calls
    ``delete`` with the address of an unconsumed capsule's tensor (the C submission path's, see
    :mod:`aruntime.engine.native.submit`, which the first native engine builds). Unlike the ctypes destructor,
    it runs where a consumer that refused the capsule has its own error pending: the ctypes one then fails
    (a ``SystemError`` in place of the consumer's error) and the buffer's loan never ends."""
    global _destructor_address
    _destructor_address = make(_delete)


# a consumer may call the deleter during the interpreter's final collection, after this module is torn down:
# the C callbacks and the table they use must outlive it
for _immortal in (_deleter, _destructor, _exported, _exported_lock, _delete):
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_immortal))


def host_address(buf: Buffer) -> int:
    """The host address of ``buf``'s memory; an error unless it is allocated host memory (a CPU buffer)."""
    handle = buf.handle  # raises if unallocated or freed
    if not isinstance(buf.allocator, HostAllocator):
        raise BufferUsageError(f"DLPack: {buf!r} is not in host memory (only CPU buffers export)")
    return int(handle)


def _code(dtype: DType) -> DLDataType:
    scalar = dtype.scalar()
    if scalar == dtypes.bool:
        code = _BOOL
    elif scalar == dtypes.bfloat16:
        code = _BFLOAT
    elif dtypes.is_float(scalar):
        code = _FLOAT
    elif dtypes.is_unsigned(scalar):
        code = _UINT
    elif dtypes.is_int(scalar):
        code = _INT
    else:
        raise BufferUsageError(f"DLPack: {dtype!r} has no DLPack type")
    return DLDataType(code, scalar.itemsize * 8, 1)


def _dtype(t: DLDataType) -> DType:
    found = [
        d
        for d in (dtypes.bool, *dtypes.fields().values())
        if d.count == 1 and d.itemsize > 0 and d != dtypes.void and (d.itemsize * 8 == t.bits)
    ]
    for d in found:
        try:
            if _code(d).code == t.code:
                return d
        except BufferUsageError:
            continue
    raise BufferUsageError(f"DLPack: no aruntime dtype for type code {t.code} of {t.bits} bits, {t.lanes} lanes")


def export(
    buf: Buffer,
    stream: int | None,
    max_version: tuple[int, int] | None,
    dl_device: tuple[int, int] | None,
    copy: bool | None,
) -> object:
    """``buf.__dlpack__()``: a capsule holding a managed DLPack tensor over ``buf``'s memory (the versioned
    struct when the consumer's ``max_version`` allows it, the unversioned one otherwise)."""
    address = host_address(buf)
    for what, pair in (("max_version", max_version), ("dl_device", dl_device)):
        if pair is not None and not _int_pair(pair):
            raise BufferUsageError(f"DLPack: {what} must be None or a pair of ints, got {pair!r}")
    if stream is not None and stream != -1:
        raise BufferUsageError(f"DLPack: a CPU buffer has no streams, got stream={stream!r}")
    if dl_device is not None and tuple(dl_device) != (CPU, 0):
        raise BufferUsageError(f"DLPack: {buf!r} is on the host (device (1, 0)), not {dl_device!r}")
    if copy:
        raise BufferUsageError("DLPack: a buffer exports its own memory only (copy=True is not supported)")
    dtype = _code(buf.dtype)
    buf._wait_idle()  # what is in flight on it is done before anyone reads it
    versioned = max_version is not None and max_version[0] >= 1
    managed: Any = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    if versioned:
        managed.version = DLPackVersion(1, 0)
        managed.flags = 0  # writable, not a copy
    shape = (ctypes.c_int64 * 2)(buf.size, buf.dtype.count)
    tensor = managed.dl_tensor
    tensor.data = address
    tensor.device = DLDevice(CPU, 0)
    tensor.ndim = 2 if buf.dtype.count > 1 else 1
    tensor.dtype = dtype
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = None  # C-contiguous
    tensor.byte_offset = 0
    managed.deleter = ctypes.cast(_deleter, ctypes.c_void_p)
    key = ctypes.addressof(managed)
    with _exported_lock:
        _exported[key] = (managed, shape, buf._lend())
    return _capsule_new(key, _VERSIONED if versioned else _NAME, _destructor_address)


def _int_pair(x: object) -> bool:
    """Whether ``x`` is a tuple of two ints: a DLPack version or device."""
    return isinstance(x, tuple) and len(x) == 2 and all(type(i) is int for i in x)


def consume(obj: Any) -> tuple[object, int, int, DType]:
    """Take the DLPack tensor ``obj`` exports (for :func:`~aruntime.memory.buffer.from_dlpack`): its capsule
    (which keeps the memory alive), the address of its data, its element count and its dtype; an error unless
    it is a non-empty, C-contiguous host tensor of scalars."""
    where = obj.__dlpack_device__()
    if not _int_pair(where):
        raise BufferUsageError(
            f"from_dlpack: {type(obj).__name__}.__dlpack_device__() gave {where!r}, not a pair of ints"
        )
    if where[0] != CPU:
        raise BufferUsageError(f"from_dlpack: {type(obj).__name__} is not in host memory (DLPack device {where})")
    try:
        capsule = obj.__dlpack__()
    except (BufferError, TypeError, ValueError) as exc:
        raise BufferUsageError(f"from_dlpack: {type(obj).__name__} refused to export: {exc}") from None
    if not _capsule_is_valid(id(capsule), _NAME):
        raise BufferUsageError(f"from_dlpack: {type(obj).__name__}.__dlpack__() gave no unused DLPack tensor")
    pointer = _capsule_pointer(id(capsule), _NAME)
    tensor = DLManagedTensor.from_address(pointer).dl_tensor
    shape = [tensor.shape[i] for i in range(tensor.ndim)]
    size = math.prod(shape)
    if size == 0:
        raise BufferUsageError(f"from_dlpack: {type(obj).__name__} is empty")
    if tensor.strides:
        expected, contiguous = 1, True
        for i in reversed(range(tensor.ndim)):
            if shape[i] != 1 and tensor.strides[i] != expected:
                contiguous = False
            expected *= shape[i]
        if not contiguous:
            raise BufferUsageError(f"from_dlpack: {type(obj).__name__} is not C-contiguous")
    if tensor.dtype.lanes != 1:
        raise BufferUsageError(f"from_dlpack: vector elements ({tensor.dtype.lanes} lanes) are not supported")
    return capsule, int(tensor.data or 0) + int(tensor.byte_offset), size, _dtype(tensor.dtype)
