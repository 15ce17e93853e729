"""Allocators: the backend hooks, the LRU cache in front of them, and host memory."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from aruntime.errors import AllocationError, BufferUsageError
from aruntime.helpers import getenv

if TYPE_CHECKING:
    from aruntime.dtype import ImageDType

H = TypeVar("H")

MAX_BYTES = (1 << 63) - 1
"""The most bytes one allocation may have on a 64-bit host (what ``ssize_t`` holds)."""


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
    _key: tuple[object, ...] = field(init=False, repr=False, compare=False)  # set in __post_init__

    def __post_init__(self) -> None:
        ptr = self.external_ptr
        if ptr is not None and (not isinstance(ptr, int) or isinstance(ptr, bool) or ptr <= 0):
            raise BufferUsageError(f"BufferSpec external_ptr must be a positive int address or None, got {ptr!r}")
        # its fields as one tuple, the allocator's cache key: hashed and compared in C, where the spec's own
        # hash is a call into Python
        object.__setattr__(self, "_key", (self.image, self.uncached, self.cpu_access, self.host, self.nolru, ptr))


DEFAULT_SPEC = BufferSpec()
"""The spec of a buffer that asks for nothing special."""

_deferred: deque[Callable[[], None]] = deque()
_draining = threading.local()


def defer(work: Callable[[], None]) -> None:
    """Leave ``work`` (a free) to the next allocator call, for finalizers: takes no lock, so it is safe where a
    garbage collection runs a finalizer, under any lock at all (appending to a deque is atomic).

    Every allocator runs what was left at its next ``alloc``, ``free``, ``free_cache``, ``memory_stats`` and
    ``in_use`` read, before it takes its own lock.
    """
    _deferred.append(work)


def run_deferred() -> None:
    """Run the work left by :func:`defer` (errors are dropped, as a finalizer's would be); nothing if this
    thread is running it already (the work frees through allocators, which call this again)."""
    if not _deferred or getattr(_draining, "active", False):
        return
    _draining.active = True
    try:
        while True:
            try:
                work = _deferred.popleft()
            except IndexError:  # another thread took the last one
                return
            with contextlib.suppress(Exception):
                work()
    finally:
        _draining.active = False


class Allocator(Generic[H]):
    """Allocates device memory through a backend's underscore hooks.

    A backend implements ``_alloc``, ``_free``, ``_copyin`` and ``_copyout``, and
    optionally ``_as_buffer`` (zero-copy host view), ``_offset`` (views) and
    ``_transfer`` (device to device). ``in_use`` counts the bytes of live buffers
    (``peak_in_use`` the most it has been). Transfers between host-mapped devices
    need no ``_transfer``: they run the source device's ``copy_fn`` on the two handles.
    Frees left by finalizers (:func:`defer`) run at the start of each public method.
    """

    host_mapped: ClassVar[bool] = False
    """Whether handles are host addresses that any host-mapped device's ``copy_fn`` may read and write."""
    max_bytes: ClassVar[int] = MAX_BYTES
    """The largest allocation, in bytes, this allocator can address."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._in_use = 0
        self.peak_in_use = 0
        """The most bytes ``in_use`` has counted since the allocator was made."""

    @property
    def in_use(self) -> int:
        """Bytes of live buffers (counted by :class:`~aruntime.memory.buffer.Buffer`; file-backed devices count
        none)."""
        run_deferred()
        return self._in_use

    def _count(self, nbytes: int) -> None:
        """Add ``nbytes`` (negative: take them away) to :attr:`in_use`; call it under the lock that orders the
        counts (:class:`~aruntime.memory.buffer.Buffer` does)."""
        self._in_use += nbytes
        if self._in_use > self.peak_in_use:
            self.peak_in_use = self._in_use

    def check_size(self, size: object) -> int:
        """``size`` if it is a byte count this allocator can address, else a :class:`BufferUsageError`."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise BufferUsageError(f"{self.device}: allocation size must be a positive int, got {size!r}")
        if size > self.max_bytes:
            raise BufferUsageError(
                f"{self.device}: an allocation of {size} bytes is beyond what the device can address "
                f"(at most {self.max_bytes} bytes)"
            )
        return size

    def alloc(self, size: int, spec: BufferSpec | None = None) -> H:
        """Allocate ``size`` bytes (> 0, at most :attr:`max_bytes`)."""
        run_deferred()
        return self._alloc(self.check_size(size), spec or DEFAULT_SPEC)

    def free(self, handle: H, size: int, spec: BufferSpec | None = None) -> None:
        """Release a handle from :meth:`alloc` of the same size and spec."""
        run_deferred()
        self._free(handle, size, spec or DEFAULT_SPEC)

    def _alloc(self, size: int, spec: BufferSpec) -> H:
        raise NotImplementedError(f"{type(self).__name__} cannot allocate")

    def _free(self, handle: H, size: int, spec: BufferSpec) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot free")

    def _copyin(self, dest: H, src: memoryview) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot copy in")

    def _copyout(self, dest: memoryview, src: H) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot copy out")

    def memory_stats(self) -> dict[str, int]:
        """Counters of this allocator: ``in_use`` and ``peak_in_use`` bytes (see :class:`LRUAllocator` for more)."""
        run_deferred()
        return {"in_use": self._in_use, "peak_in_use": self.peak_in_use}


DEFAULT_CACHE_LIMIT = 1 << 30
"""Default bytes an LRU allocator keeps cached for reuse (env ``ARUNTIME_LRU_LIMIT``): 1 GiB per device."""

_Entry = tuple[int, BufferSpec, H]  # a cached handle, with its size and spec


class LRUAllocator(Allocator[H]):
    """Keeps freed handles keyed by (size, spec) and hands them out again.

    At most :attr:`cache_limit` bytes stay cached (env ``ARUNTIME_LRU_LIMIT``, default
    1 GiB per device): a free that would go beyond it really frees the handles
    freed longest ago first (a handle bigger than the limit is freed at once).
    ``nolru`` in the spec, or ``ARUNTIME_LRU=0`` in the environment when the allocator is
    made (the device opens), frees at once. When the backend runs out of memory,
    the whole cache is really freed and the allocation retried once. Safe to use
    from several threads. :meth:`memory_stats` reports the counters.
    """

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self._order: OrderedDict[int, _Entry[H]] = OrderedDict()  # free sequence number -> entry, oldest first
        # sequence numbers of the cached handles of each (size, spec's key), oldest first
        self._by_key: dict[tuple[int, tuple[object, ...]], deque[int]] = {}
        self._seq = 0
        self._cached = 0
        self.lru = bool(getenv("LRU", 1, minimum=0, maximum=1))
        """Whether freed handles are kept for reuse (env ``ARUNTIME_LRU``, 0 or 1, default 1)."""
        self._limit = getenv("LRU_LIMIT", DEFAULT_CACHE_LIMIT, minimum=0)
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(("allocations", "frees", "cache_hits", "evictions", "flushes"), 0)

    @property
    def cached_bytes(self) -> int:
        """Bytes held in the cache for reuse."""
        return self._cached

    @property
    def cache_limit(self) -> int:
        """The most bytes kept cached (env ``ARUNTIME_LRU_LIMIT`` when the allocator is made; 0 caches nothing).

        Setting it lower frees the oldest cached handles until the cache fits.
        """
        return self._limit

    @cache_limit.setter
    def cache_limit(self, nbytes: int) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"{self.device}: cache_limit must be a non-negative int of bytes, got {nbytes!r}")
        with self._lock:
            self._limit = nbytes
            evicted = self._evict(0)
        self._release(evicted)

    def memory_stats(self) -> dict[str, int]:
        """``in_use``, ``peak_in_use``, ``cached`` and ``cache_limit`` bytes, and the counts of backend
        ``allocations`` and ``frees``, ``cache_hits``, ``evictions`` (freed to stay within the limit) and
        ``flushes`` (:meth:`free_cache` calls, out-of-memory retries included)."""
        stats = super().memory_stats()  # outside the lock: it runs the deferred frees
        with self._lock:
            return {**stats, "cached": self._cached, "cache_limit": self._limit, **self._stats}

    def alloc(self, size: int, spec: BufferSpec | None = None) -> H:
        if _deferred:
            run_deferred()
        spec = spec or DEFAULT_SPEC
        key = (size, spec._key)
        with self._lock:
            seqs = self._by_key.get(key)
            if seqs:
                handle = self._order.pop(seqs.pop())[2]
                if not seqs:
                    del self._by_key[key]
                self._cached -= size
                self._stats["cache_hits"] += 1
                return handle
        try:
            handle = super().alloc(size, spec)
        except MemoryError:
            self.free_cache()
            try:
                handle = super().alloc(size, spec)
            except MemoryError as exc:
                raise AllocationError(f"{self.device}: out of memory allocating {size} bytes") from exc
        with self._lock:
            self._stats["allocations"] += 1
        return handle

    def free(self, handle: H, size: int, spec: BufferSpec | None = None) -> None:
        if _deferred:
            run_deferred()
        spec = spec or DEFAULT_SPEC
        if spec.nolru or spec.external_ptr is not None or not self.lru or size > self._limit:
            self._release([(size, spec, handle)])
            return
        with self._lock:
            evicted = self._evict(size) if self._cached + size > self._limit else None
            self._seq += 1
            self._order[self._seq] = (size, spec, handle)
            key = (size, spec._key)
            seqs = self._by_key.get(key)
            if seqs is None:
                seqs = self._by_key[key] = deque()
            seqs.append(self._seq)
            self._cached += size
        if evicted:
            self._release(evicted)

    def _evict(self, room: int) -> list[_Entry[H]]:
        """Take the oldest cached entries out (under the lock) until ``room`` more bytes fit in the limit."""
        evicted: list[_Entry[H]] = []
        while self._order and self._cached + room > self._limit:
            _, entry = self._order.popitem(last=False)
            size, spec, _ = entry
            key = (size, spec._key)
            seqs = self._by_key[key]
            seqs.popleft()
            if not seqs:
                del self._by_key[key]
            self._cached -= size
            evicted.append(entry)
        self._stats["evictions"] += len(evicted)
        return evicted

    def _release(self, entries: list[_Entry[H]]) -> None:
        """Really free ``entries`` through the backend (outside the lock)."""
        for size, spec, handle in entries:
            super().free(handle, size, spec)
        if entries:
            with self._lock:
                self._stats["frees"] += len(entries)

    def free_cache(self) -> None:
        """Really free every cached handle (memory from ``mmap`` goes back to the operating system)."""
        run_deferred()
        with self._lock:
            entries = list(self._order.values())
            self._order.clear()
            self._by_key.clear()
            self._cached = 0
            self._stats["flushes"] += 1
        self._release(entries)


_libc = ctypes.CDLL(None)
_posix_memalign = _libc.posix_memalign
_posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
_posix_memalign.restype = ctypes.c_int
_libc_free = _libc.free
_libc_free.argtypes = [ctypes.c_void_p]
_libc_free.restype = None

ALIGNMENT = 64
MMAP_MIN = 1 << 20
"""Host allocations of at least this many bytes (env ``ARUNTIME_MMAP_MIN``) are mapped with ``mmap``, not taken from
the malloc heap, so that freeing them gives the memory back to the operating system."""


class Mappings(dict[int, "mmap.mmap"]):
    """Live ``mmap`` mappings of an allocator, keyed by their host address, behind one lock.

    A mapping released while zero-copy views of it (:meth:`view`) still exist is
    unmapped when the last of them goes, so a stale view never reads unmapped memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def add(self, mapping: mmap.mmap) -> int:
        """Keep ``mapping``; returns the host address of its first byte."""
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # the temporary export goes with the anchor
        with self.lock:
            self[address] = mapping
        return address

    def release(self, address: int) -> bool:
        """Close the mapping at ``address`` (or let its last view do so); False if there is none."""
        with self.lock:
            mapping = self.pop(address, None)
        if mapping is None:
            return False
        with contextlib.suppress(BufferError):  # zero-copy views still use it: unmapped when the last one goes
            mapping.close()
        return True

    def view(self, address: int, size: int) -> memoryview | None:
        """A zero-copy view of ``size`` bytes at ``address`` that keeps its mapping alive, or None if they are
        not inside one live mapping."""
        with self.lock:
            for start, mapping in self.items():
                if start <= address and address + size <= start + len(mapping):
                    return memoryview(mapping)[address - start : address - start + size]
        return None

    def live(self) -> list[mmap.mmap]:
        """The live mappings, now."""
        with self.lock:
            return list(self.values())


def host_view(address: int, size: int) -> memoryview:
    """A writable byte memoryview over ``size`` bytes of host memory at ``address``."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class HostAddressed:
    """The copy and view hooks of an allocator whose handles are host addresses (mix in before the allocator)."""

    host_mapped: ClassVar[bool] = True

    def _copyin(self, dest: int, src: memoryview) -> None:
        host_view(dest, src.nbytes)[:] = src.cast("B")

    def _copyout(self, dest: memoryview, src: int) -> None:
        dest.cast("B")[:] = host_view(src, dest.nbytes)

    def _offset(self, handle: int, size: int, offset: int) -> int:
        return handle + offset


class HostAllocator(HostAddressed, LRUAllocator[int]):
    """Host memory (64-byte aligned, so also 16-byte aligned); handles are addresses.

    Allocations of at least ``mmap_min`` bytes (env ``ARUNTIME_MMAP_MIN``, default 1 MiB,
    read when the allocator is made) are private anonymous ``mmap`` mappings
    (page aligned), smaller ones come from ``posix_memalign``. A mapping freed
    while a zero-copy view of it (:meth:`_as_buffer`) still exists is unmapped
    when the last such view goes, so a stale view never reads unmapped memory.
    """

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.mmap_min = getenv("MMAP_MIN", MMAP_MIN, minimum=1)
        self._maps = Mappings()

    def _alloc(self, size: int, spec: BufferSpec) -> int:
        if spec.external_ptr is not None:
            return spec.external_ptr
        if size >= self.mmap_min:
            try:
                mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
            except (OSError, OverflowError) as exc:
                raise MemoryError(f"{self.device}: mapping {size} bytes failed: {exc}") from exc
            return self._maps.add(mapping)
        ptr = ctypes.c_void_p()
        if _posix_memalign(ctypes.byref(ptr), ALIGNMENT, size) != 0 or not ptr.value:
            raise MemoryError(f"{self.device}: host allocation of {size} bytes failed")
        return ptr.value

    def _free(self, handle: int, size: int, spec: BufferSpec) -> None:
        if spec.external_ptr is not None:
            return
        if not self._maps.release(handle):  # what it came from, whatever mmap_min says now
            _libc_free(handle)

    def _as_buffer(self, handle: int, size: int) -> memoryview:
        return (self._maps.view(handle, size) if self._maps else None) or host_view(handle, size)
