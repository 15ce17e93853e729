"""Re-exports :mod:`aruntime.memory.allocator`, its new home, until the next release (see docs/migration.md)."""

import warnings

from aruntime.memory.allocator import (
    ALIGNMENT,
    DEFAULT_CACHE_LIMIT,
    DEFAULT_SPEC,
    MAX_BYTES,
    MMAP_MIN,
    Allocator,
    BufferSpec,
    HostAddressed,
    HostAllocator,
    LRUAllocator,
    Mappings,
    defer,
    host_view,
    run_deferred,
)

warnings.warn(
    "aruntime.allocator moved to aruntime.memory.allocator; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "ALIGNMENT",
    "DEFAULT_CACHE_LIMIT",
    "DEFAULT_SPEC",
    "MAX_BYTES",
    "MMAP_MIN",
    "Allocator",
    "BufferSpec",
    "HostAddressed",
    "HostAllocator",
    "LRUAllocator",
    "Mappings",
    "defer",
    "host_view",
    "run_deferred",
]
