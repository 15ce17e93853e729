"""Allocators: the backend hooks, the LRU cache in front of them, and host memory."""

from __future__ import annotations

import ctypes
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from aruntime.errors import AllocationError
from aruntime.helpers import getenv

if TYPE_CHECKING:
    from aruntime.dtype import ImageDType

H = TypeVar("H")


@dataclass(frozen=True)
class BufferSpec:
    """How a buffer is allocated; part of the allocator's cache key.

    ``external_ptr`` wraps memory the caller owns (never freed by aruntime);
    ``nolru`` frees at once instead of caching for reuse.
    """

    image: ImageDType | None = None
    uncached: bool = False
    cpu_access: bool = False
    host: bool = False
    nolru: bool = False
    external_ptr: int | None = None


DEFAULT_SPEC = BufferSpec()
"""The spec of a buffer that asks for nothing special."""


class Allocator(Generic[H]):
    """Allocates device memory through a backend's underscore hooks.

    A backend implements ``_alloc``, ``_free``, ``_copyin`` and ``_copyout``, and
    optionally ``_as_buffer`` (zero-copy host view), ``_offset`` (views) and
    ``_transfer`` (device to device). ``in_use`` counts the bytes of live buffers.
    Transfers between host-mapped devices need no ``_transfer``: they run the
    source device's ``copy_fn`` on the two handles.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.in_use = 0

    def alloc(self, size: int, spec: BufferSpec | None = None) -> H:
        """Allocate ``size`` bytes (> 0)."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"{self.device}: allocation size must be a positive int, got {size!r}")
        return self._alloc(size, spec or DEFAULT_SPEC)

    def free(self, handle: H, size: int, spec: BufferSpec | None = None) -> None:
        """Release a handle from :meth:`alloc` of the same size and spec."""
        self._free(handle, size, spec or DEFAULT_SPEC)

    def _alloc(self, size: int, spec: BufferSpec) -> H:
        raise NotImplementedError(f"{type(self).__name__} cannot allocate")

    def _free(self, handle: H, size: int, spec: BufferSpec) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot free")

    def _copyin(self, dest: H, src: memoryview) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot copy in")

    def _copyout(self, dest: memoryview, src: H) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot copy out")


class LRUAllocator(Allocator[H]):
    """Keeps freed handles keyed by (size, spec) and hands them out again.

    ``nolru`` in the spec, or ``ARUNTIME_LRU=0`` in the environment when the allocator is
    made (the device opens), frees at once. When
    the backend runs out of memory, the whole cache is really freed and the
    allocation retried once. Safe to use from several threads.
    """

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.cache: defaultdict[tuple[int, BufferSpec], list[H]] = defaultdict(list)
        self.lru = bool(getenv("LRU", 1))
        """Whether freed handles are kept for reuse (env ``ARUNTIME_LRU``, default 1)."""
        self._lock = threading.Lock()

    @property
    def cached_bytes(self) -> int:
        """Bytes held in the cache for reuse."""
        with self._lock:
            return sum(size * len(handles) for (size, _), handles in self.cache.items())

    def alloc(self, size: int, spec: BufferSpec | None = None) -> H:
        spec = spec or DEFAULT_SPEC
        with self._lock:
            handles = self.cache.get((size, spec))
            if handles:
                return handles.pop()
        try:
            return super().alloc(size, spec)
        except MemoryError:
            self.free_cache()
            try:
                return super().alloc(size, spec)
            except MemoryError as exc:
                raise AllocationError(f"{self.device}: out of memory allocating {size} bytes") from exc

    def free(self, handle: H, size: int, spec: BufferSpec | None = None) -> None:
        spec = spec or DEFAULT_SPEC
        if spec.nolru or spec.external_ptr is not None or not self.lru:
            super().free(handle, size, spec)
            return
        with self._lock:
            self.cache[(size, spec)].append(handle)

    def free_cache(self) -> None:
        """Really free every cached handle."""
        with self._lock:
            entries, self.cache = list(self.cache.items()), defaultdict(list)
        for (size, spec), handles in entries:
            for handle in handles:
                super().free(handle, size, spec)


_libc = ctypes.CDLL(None)
_posix_memalign = _libc.posix_memalign
_posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_posix_memalign.restype = ctypes.c_int
_libc_free = _libc.free
_libc_free.argtypes = [ctypes.c_void_p]
_libc_free.restype = None

ALIGNMENT = 64


def host_view(address: int, size: int) -> memoryview:
    """A writable byte memoryview over ``size`` bytes of host memory at ``address``."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class HostAddressed:
    """The copy and view hooks of an allocator whose handles are host addresses (mix in before the allocator)."""

    def _copyin(self, dest: int, src: memoryview) -> None:
        host_view(dest, src.nbytes)[:] = src.cast("B")

    def _copyout(self, dest: memoryview, src: int) -> None:
        dest.cast("B")[:] = host_view(src, dest.nbytes)

    def _offset(self, handle: int, size: int, offset: int) -> int:
        return handle + offset


class HostAllocator(HostAddressed, LRUAllocator[int]):
    """Host memory (64-byte aligned, so also 16-byte aligned); handles are addresses."""

    def _alloc(self, size: int, spec: BufferSpec) -> int:
        if spec.external_ptr is not None:
            return spec.external_ptr
        ptr = ctypes.c_void_p()
        if _posix_memalign(ctypes.byref(ptr), ALIGNMENT, size) != 0 or not ptr.value:
            raise MemoryError(f"{self.device}: host allocation of {size} bytes failed")
        return ptr.value

    def _free(self, handle: int, size: int, spec: BufferSpec) -> None:
        if spec.external_ptr is None:
            _libc_free(handle)

    def _as_buffer(self, handle: int, size: int) -> memoryview:
        return host_view(handle, size)
