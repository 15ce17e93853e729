"""aruntime: an async, event-driven device runtime.

Devices expose awaitable allocate, copy, compile, launch and synchronize; each
device has a compute and a copy engine whose work overlaps, ordered only by
the buffers each op reads and writes.
"""

from aruntime._version import __version__ as __version__
from aruntime.batching import Batcher
from aruntime.device import BaseDevice, Device, Program, is_dtype_supported, transfer
from aruntime.dtype import DType, dtypes
from aruntime.engine import KernelError, Op
from aruntime.errors import (
    AllocationError,
    AruntimeError,
    BufferUsageError,
    CacheError,
    CompileError,
    DeadlineExceeded,
    DependencyError,
    DeviceError,
    DeviceLost,
    FileTruncated,
    OpError,
    OpSkipped,
    SchedulerFull,
    SignalTimeout,
)
from aruntime.graph import Graph, GraphRun, Param
from aruntime.memory import Buffer, BufferScope, BufferSpec, from_dlpack
from aruntime.profile import Profile, host_range, install_atexit, profile
from aruntime.scheduler import Request, Scheduler

install_atexit()  # ARUNTIME_PROFILE=1: record everything and write the trace at exit

__all__ = [
    "AllocationError",
    "AruntimeError",
    "BaseDevice",
    "Batcher",
    "Buffer",
    "BufferScope",
    "BufferSpec",
    "BufferUsageError",
    "CacheError",
    "CompileError",
    "DType",
    "DeadlineExceeded",
    "DependencyError",
    "Device",
    "DeviceError",
    "DeviceLost",
    "FileTruncated",
    "Graph",
    "GraphRun",
    "KernelError",
    "Op",
    "OpError",
    "OpSkipped",
    "Param",
    "Profile",
    "Program",
    "Request",
    "Scheduler",
    "SchedulerFull",
    "SignalTimeout",
    "dtypes",
    "from_dlpack",
    "host_range",
    "is_dtype_supported",
    "profile",
    "transfer",
]
