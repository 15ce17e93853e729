"""DLPack exchange of host buffers: ``numpy.from_dlpack(buf)`` and :func:`from_dlpack`, without a copy.

The structs are DLPack's C ABI (``dlpack.h``, the unversioned
``DLManagedTensor`` in a capsule named ``"dltensor"``), through ctypes: no
array library is needed to export, and any producer of that ABI (numpy,
PyTorch, CuPy on the host, JAX...) can be imported.
"""

from __future__ import annotations

import ctypes
import math
import threading
from typing import Any, ClassVar

from aruntime.allocator import HostAllocator
from aruntime.buffer import Buffer
from aruntime.dtype import DType, dtypes
from aruntime.errors import BufferUsageError

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
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_NAME = b"dltensor"
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

_exported: dict[int, tuple[Any, ...]] = {}  # managed tensor address -> what it keeps alive, until its deleter runs
_exported_lock = threading.Lock()


def _delete(managed: Any) -> None:
    with _exported_lock:
        _exported.pop(ctypes.addressof(managed.contents), None)


def _capsule_gone(capsule: int) -> None:
    if _capsule_is_valid(capsule, _NAME):  # never consumed (a consumer renames it): the producer lets go
        _delete(ctypes.cast(_capsule_pointer(capsule, _NAME), ctypes.POINTER(DLManagedTensor)))


_deleter = _Deleter(_delete)
_destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_capsule_gone)


def host_address(buf: Buffer) -> int:
    """The host address of ``buf``'s memory; an error unless it is allocated host memory (a CPU buffer)."""
    if not isinstance(buf, Buffer):
        raise BufferUsageError(f"DLPack: expected a Buffer, got {type(buf).__name__}")
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


def export(buf: Buffer, stream: int | None, dl_device: tuple[int, int] | None, copy: bool | None) -> object:
    """``buf.__dlpack__()``: a capsule holding a DLManagedTensor over ``buf``'s memory."""
    address = host_address(buf)
    if stream is not None and stream != -1:
        raise BufferUsageError(f"DLPack: a CPU buffer has no streams, got stream={stream!r}")
    if dl_device is not None and tuple(dl_device) != (CPU, 0):
        raise BufferUsageError(f"DLPack: {buf!r} is on the host (device (1, 0)), not {dl_device!r}")
    if copy:
        raise BufferUsageError("DLPack: a buffer exports its own memory only (copy=True is not supported)")
    buf._wait_idle()  # what is in flight on it is done before anyone reads it
    shape = (ctypes.c_int64 * 2)(buf.size, buf.dtype.count)
    managed = DLManagedTensor()
    tensor = managed.dl_tensor
    tensor.data = address
    tensor.device = DLDevice(CPU, 0)
    tensor.ndim = 2 if buf.dtype.count > 1 else 1
    tensor.dtype = _code(buf.dtype)
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = None  # C-contiguous
    tensor.byte_offset = 0
    managed.deleter = _deleter
    with _exported_lock:
        _exported[ctypes.addressof(managed)] = (buf.base, buf, managed, shape)
    return _capsule_new(ctypes.addressof(managed), _NAME, ctypes.cast(_destructor, ctypes.c_void_p))


def from_dlpack(obj: Any, device: str | None = None) -> Buffer:
    """A buffer over the memory of ``obj``, a host array that exports DLPack (a C-contiguous numpy array...),
    without a copy.

    ``device`` names a CPU device (default: ``CPU``). The buffer is 1-D:
    ``obj``'s element count of the matching dtype. It keeps ``obj``'s memory
    alive while it is allocated (and until its ops are done once freed);
    :meth:`BaseDevice.free` it like any other buffer.
    """
    from aruntime.device import Device

    if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
        raise BufferUsageError(f"from_dlpack: {type(obj).__name__} does not export DLPack (__dlpack__)")
    dev = Device["CPU" if device is None else device]
    if not isinstance(dev.allocator, HostAllocator):
        raise BufferUsageError(f"from_dlpack: {dev.name} is not a host-memory device")
    where = tuple(obj.__dlpack_device__())
    if where[0] != CPU:
        raise BufferUsageError(f"from_dlpack: {type(obj).__name__} is not in host memory (DLPack device {where})")
    try:
        capsule = obj.__dlpack__()
    except (BufferError, TypeError, ValueError) as exc:
        raise BufferUsageError(f"from_dlpack: {type(obj).__name__} refused to export: {exc}") from None
    pointer = _capsule_pointer(id(capsule), _NAME)
    if not pointer:
        raise BufferUsageError("from_dlpack: the capsule is not an unused DLPack tensor")
    tensor = DLManagedTensor.from_address(pointer).dl_tensor
    shape = [tensor.shape[i] for i in range(tensor.ndim)]
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
    dtype = _dtype(tensor.dtype)
    size = math.prod(shape)
    if size == 0:
        raise BufferUsageError(f"from_dlpack: {type(obj).__name__} is empty")
    buf = Buffer(dev.name, size, dtype)
    buf.allocate(external_ptr=int(tensor.data or 0) + int(tensor.byte_offset))
    buf._keep = capsule  # its destructor lets the producer go once the buffer does
    return buf
