"""aruntime: an async, event-driven device runtime.

Devices expose awaitable allocate, copy, compile, launch and synchronize; each
device has a compute and a copy engine whose work overlaps, ordered only by
the buffers each op reads and writes.
"""

from aruntime.allocator import BufferSpec
from aruntime.buffer import Buffer
from aruntime.device import BaseDevice, Device, Program, is_dtype_supported
from aruntime.dtype import DType, dtypes
from aruntime.engine import Op
from aruntime.errors import (
    AllocationError,
    AruntimeError,
    BufferUsageError,
    CacheError,
    CompileError,
    DependencyError,
    DeviceError,
    OpError,
    SignalTimeout,
)

__all__ = [
    "AllocationError",
    "AruntimeError",
    "BaseDevice",
    "Buffer",
    "BufferSpec",
    "BufferUsageError",
    "CacheError",
    "CompileError",
    "DType",
    "DependencyError",
    "Device",
    "DeviceError",
    "Op",
    "OpError",
    "Program",
    "SignalTimeout",
    "dtypes",
    "is_dtype_supported",
]
