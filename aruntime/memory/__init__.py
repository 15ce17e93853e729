"""Memory: allocators, buffers and the log of their in-flight accesses, pinning host memory, DLPack exchange.

The device layer and the backends reach memory through the names below.
"""

from aruntime.memory.allocator import (
    DEFAULT_SPEC,
    Allocator,
    BufferSpec,
    HostAddressed,
    HostAllocator,
    LRUAllocator,
    Mappings,
    host_view,
)
from aruntime.memory.buffer import Buffer, BufferScope, from_dlpack, open_devices_with, typed, zeroed
from aruntime.memory.hazards import AccessLog, logs_held
from aruntime.memory.pinning import Pin, pin, refuse_pointers

__all__ = [
    "DEFAULT_SPEC",
    "AccessLog",
    "Allocator",
    "Buffer",
    "BufferScope",
    "BufferSpec",
    "HostAddressed",
    "HostAllocator",
    "LRUAllocator",
    "Mappings",
    "Pin",
    "from_dlpack",
    "host_view",
    "logs_held",
    "open_devices_with",
    "pin",
    "refuse_pointers",
    "typed",
    "zeroed",
]
