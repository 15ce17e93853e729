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
from aruntime.profile import Profile, host_range, install_atexit, profile

install_atexit()  # PROFILE=1: record everything and write the trace at exit

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
    "Profile",
    "Program",
    "SignalTimeout",
    "dtypes",
    "host_range",
    "is_dtype_supported",
    "profile",
]
