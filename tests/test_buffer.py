"""Buffers and allocators (SPEC 2): lazy allocation, views, external memory, pickling, counters, the LRU cache."""

from __future__ import annotations

import ctypes
import dataclasses
import pickle
from collections.abc import Iterator

import pytest

import aruntime.memory.allocator as allocator_mod
from aruntime import AllocationError, Buffer, BufferSpec, BufferUsageError, Device, dtypes
from aruntime.memory.allocator import HostAllocator, LRUAllocator


def cpu_in_use() -> int:
    return Device["CPU"].allocator.in_use


def cpu_cached() -> int:
    alloc = Device["CPU"].allocator
    assert isinstance(alloc, LRUAllocator)
    return alloc.cached_bytes


@pytest.fixture
def host_frees(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every address the host allocator really frees (libc ``free``) while the test runs."""
    freed: list[int] = []
    real_free = allocator_mod._libc_free

    def spy(address: int) -> None:
        freed.append(address)
        real_free(address)

    monkeypatch.setattr(allocator_mod, "_libc_free", spy)
    yield freed


class CapAllocator(LRUAllocator[int]):
    """A fake backend with ``capacity`` bytes: its ``_alloc`` runs out of memory like a real device would."""

    def __init__(self, capacity: int) -> None:
        super().__init__("CAP")
        self.capacity = capacity
        self.live: dict[int, int] = {}
        self.alloc_calls = 0
        self.freed: list[int] = []
        self._next = 0x1000

    def _alloc(self, size: int, spec: BufferSpec) -> int:
        self.alloc_calls += 1
        if sum(self.live.values()) + size > self.capacity:
            raise MemoryError(f"CAP: {size} bytes do not fit")
        self._next += 0x1000
        self.live[self._next] = size
        return self._next

    def _free(self, handle: int, size: int, spec: BufferSpec) -> None:
        assert self.live.pop(handle) == size
        self.freed.append(handle)


# ---------------------------------------------------------------------------------------------------------
# BufferSpec and construction


def test_buffer_spec_is_frozen_hashable_and_part_of_equality() -> None:
    a, b = BufferSpec(nolru=True), BufferSpec(nolru=True)
    assert a == b and hash(a) == hash(b)
    assert BufferSpec() != BufferSpec(uncached=True)
    assert len({BufferSpec(), BufferSpec(host=True), BufferSpec(cpu_access=True), BufferSpec()}) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.nolru = False  # type: ignore[misc]


@pytest.mark.parametrize("size", [0, -4, True, 2.0, "8"])
def test_bad_size_is_a_clear_error(size: object) -> None:
    with pytest.raises(BufferUsageError, match=f"positive number of elements, got {size!r}"):
        Buffer("CPU", size)  # type: ignore[arg-type]


def test_bad_dtype_and_root_offset_are_clear_errors() -> None:
    with pytest.raises(BufferUsageError, match="dtype must be a scalar or vector DType"):
        Buffer("CPU", 4, "float32")  # type: ignore[arg-type]
    with pytest.raises(BufferUsageError, match="dtype must be a scalar or vector DType with a non-zero itemsize"):
        Buffer("CPU", 4, dtypes.void)
    with pytest.raises(BufferUsageError, match="a base buffer has no offset"):
        Buffer("CPU", 4, offset=4)
    with pytest.raises(BufferUsageError, match="spec must be a BufferSpec, got str"):
        Buffer("CPU", 4, spec="host")  # type: ignore[arg-type]


def test_allocation_is_lazy() -> None:
    start = cpu_in_use()
    buf = Buffer("cpu:0", 10, dtypes.float32)
    assert buf.device == "CPU" and buf.nbytes == 40 and buf.size == 10 and buf.dtype is dtypes.float32
    assert not buf.is_allocated()
    assert cpu_in_use() == start
    with pytest.raises(BufferUsageError, match="is not allocated"):
        buf.handle  # noqa: B018
    assert buf.ensure_allocated() is buf and buf.is_allocated()
    handle = buf.handle
    assert buf.ensure_allocated().handle == handle  # no second allocation
    assert cpu_in_use() == start + 40
    with pytest.raises(BufferUsageError, match="already allocated"):
        buf.allocate()
    buf.deallocate()
    assert not buf.is_allocated() and cpu_in_use() == start
    with pytest.raises(BufferUsageError, match="was freed"):
        buf.handle  # noqa: B018
    with pytest.raises(BufferUsageError, match="is not allocated"):
        buf.deallocate()
    buf.allocate()  # a freed buffer can be allocated again
    assert buf.is_allocated()
    buf.deallocate()


def test_initial_value_and_preallocate() -> None:
    buf = Buffer("CPU", 4, dtypes.uint8, initial_value=b"\x01\x02\x03\x04")
    assert buf.is_allocated() and bytes(buf.as_buffer()) == b"\x01\x02\x03\x04"
    assert Buffer("CPU", 4, preallocate=True).is_allocated()
    with pytest.raises(BufferUsageError, match="copyin of 3 bytes"):
        Buffer("CPU", 4, initial_value=b"abc")


def test_host_allocations_are_16_byte_aligned() -> None:
    bufs = [Buffer("CPU", n, spec=BufferSpec(nolru=True), preallocate=True) for n in (1, 3, 17, 33, 4097)]
    assert all(b.handle % 16 == 0 for b in bufs)


# ---------------------------------------------------------------------------------------------------------
# views


def test_views_of_views_point_at_the_root_with_offsets_added() -> None:
    root = Buffer("CPU", 64, dtypes.uint8, initial_value=bytes(range(64)))
    v1 = root.view(8, dtypes.int32, 8)  # bytes 8..40
    v2 = v1.view(4, dtypes.uint8, 4)  # bytes 12..16 of the root
    assert root.base is root and root.offset == 0
    assert v1.base is root and v2.base is root
    assert (v1.offset, v2.offset) == (8, 12)
    assert v2.nbytes == 4 and v2.dtype is dtypes.uint8
    assert v2.ensure_allocated().handle == root.handle + 12
    assert bytes(v2.as_buffer()) == bytes(range(12, 16))
    v2.copyin(memoryview(b"\xff\xfe\xfd\xfc"))
    assert bytes(root.as_buffer())[12:16] == b"\xff\xfe\xfd\xfc"
    assert "view of" in repr(v2)


def test_a_view_allocates_its_root_first_and_does_not_count_bytes() -> None:
    start = cpu_in_use()
    root = Buffer("CPU", 32)
    view = root.view(16, dtypes.uint8, 16)
    assert not view.is_allocated()
    view.allocate()
    assert root.is_allocated() and view.handle == root.handle + 16
    assert cpu_in_use() == start + 32  # only the root's bytes count
    view.deallocate()  # a view lets go of its handle only
    assert root.is_allocated() and not view.is_allocated()
    root.deallocate()
    assert cpu_in_use() == start


def test_view_bounds_are_checked_against_the_root() -> None:
    root = Buffer("CPU", 16)
    with pytest.raises(BufferUsageError, match="out of range of its 16-byte root"):
        root.view(17, dtypes.uint8, 0)
    with pytest.raises(BufferUsageError, match="view of 8 bytes at offset 12 is out of range"):
        root.view(2, dtypes.float32, 12)
    with pytest.raises(BufferUsageError, match="non-negative int, got -1"):
        root.view(1, dtypes.uint8, -1)
    with pytest.raises(BufferUsageError, match=r"non-negative int, got 1\.5"):
        root.view(1, dtypes.uint8, 1.5)  # type: ignore[arg-type]
    inner = root.view(8, dtypes.uint8, 4)  # bytes 4..12
    with pytest.raises(BufferUsageError, match="view of 8 bytes at offset 10 is out of range of its 16-byte root"):
        inner.view(8, dtypes.uint8, 6)  # the offsets add up past the root's end
    # the limit is the root's end, not the parent view's
    assert inner.view(4, dtypes.uint8, 8).offset == 12
    with pytest.raises(BufferUsageError, match="positive number of elements"):
        root.view(0, dtypes.uint8, 0)
    assert not root.is_allocated()  # no failed view touched the root


def test_a_view_of_an_earlier_allocation_of_its_root_is_stale() -> None:
    root = Buffer("CPU", 32, spec=BufferSpec(nolru=True), preallocate=True)
    view = root.view(8, dtypes.uint8, 8).ensure_allocated()
    root.deallocate()
    assert not view.is_allocated()
    with pytest.raises(BufferUsageError, match="was freed"):
        view.handle  # noqa: B018
    root.allocate()
    assert not view.is_allocated()  # its handle came from the old allocation
    assert view.ensure_allocated().handle == root.handle + 8


# ---------------------------------------------------------------------------------------------------------
# external memory


def test_external_ptr_is_used_in_place_and_never_freed(host_frees: list[int]) -> None:
    memory = (ctypes.c_uint8 * 16)(*range(16))
    address = ctypes.addressof(memory)
    start, cached = cpu_in_use(), cpu_cached()
    buf = Buffer("CPU", 16, dtypes.uint8, spec=BufferSpec(external_ptr=address), preallocate=True)
    assert buf.handle == address and cpu_in_use() == start
    assert bytes(buf.as_buffer()) == bytes(range(16))
    buf.copyin(memoryview(b"\xaa" * 16))
    assert bytes(memory) == b"\xaa" * 16
    buf.deallocate()
    assert address not in host_frees
    assert cpu_cached() == cached  # not cached for reuse either
    assert cpu_in_use() == start
    memory[0] = 7  # still ours and intact
    assert bytes(memory) == b"\x07" + b"\xaa" * 15


def test_allocate_with_external_ptr_wraps_libc_memory() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    address = libc.malloc(8)
    try:
        ctypes.memmove(address, b"external", 8)
        buf = Buffer("CPU", 8).allocate(external_ptr=address)
        assert buf.spec.external_ptr == address and bytes(buf.as_buffer()) == b"external"
        buf.deallocate()
        assert ctypes.string_at(address, 8) == b"external"
        clone = pickle.loads(pickle.dumps(buf.allocate(external_ptr=address)))
        assert clone.spec.external_ptr is None and clone.handle != address  # a pickle carries the bytes
        assert bytes(clone.as_buffer()) == b"external"
        buf.deallocate()
    finally:
        libc.free(address)


# ---------------------------------------------------------------------------------------------------------
# copies and as_buffer


def test_copy_sizes_must_match_exactly_and_nothing_is_lost() -> None:
    buf = Buffer("CPU", 4, dtypes.int32, initial_value=bytes(range(16)))
    with pytest.raises(BufferUsageError, match=r"copyin of 15 bytes into .* of 16 bytes"):
        buf.copyin(memoryview(bytes(15)))
    with pytest.raises(BufferUsageError, match=r"copyout of .* \(16 bytes\) into 17 bytes"):
        buf.copyout(memoryview(bytearray(17)))
    assert bytes(buf.as_buffer()) == bytes(range(16))
    out = bytearray(16)
    assert buf.copyout(memoryview(out)).nbytes == 16 and out == bytes(range(16))


def test_copies_need_an_allocated_buffer() -> None:
    buf = Buffer("CPU", 4)
    with pytest.raises(BufferUsageError, match="is not allocated"):
        buf.copyin(memoryview(b"abcd"))
    with pytest.raises(BufferUsageError, match="is not allocated"):
        buf.copyout(memoryview(bytearray(4)))
    with pytest.raises(BufferUsageError, match="is not allocated"):
        buf.as_buffer(allow_zero_copy=True)
    assert not buf.is_allocated()


def test_as_buffer_is_zero_copy_only_when_allowed() -> None:
    buf = Buffer("CPU", 8, initial_value=b"abcdefgh")
    view = buf.as_buffer(allow_zero_copy=True)
    view[0] = ord("X")
    assert bytes(buf.as_buffer()) == b"Xbcdefgh"
    buf.copyin(memoryview(b"12345678"))
    assert bytes(view) == b"12345678"
    copy = buf.as_buffer()
    copy[0] = ord("?")
    assert bytes(buf.as_buffer()) == b"12345678"
    part = buf.view(4, dtypes.uint8, 4).as_buffer(allow_zero_copy=True)
    part[:] = b"WXYZ"
    assert bytes(buf.as_buffer()) == b"1234WXYZ"


def test_as_buffer_copies_where_memory_is_not_host_visible() -> None:
    buf = Buffer("NULL", 4, preallocate=True)  # the NULL device has no host-visible memory
    got = buf.as_buffer(allow_zero_copy=True)
    assert bytes(got) == bytes(4) and not got.readonly


# ---------------------------------------------------------------------------------------------------------
# pickling


def test_pickling_carries_contents_and_views_share_the_new_root() -> None:
    root = Buffer("CPU", 8, dtypes.int16, initial_value=bytes(range(16)))
    v1 = root.view(4, dtypes.int16, 4).ensure_allocated()
    v2 = v1.view(2, dtypes.uint8, 2)  # not allocated
    r, a, b = pickle.loads(pickle.dumps((root, v1, v2)))
    assert (r.device, r.size, r.dtype, r.spec) == ("CPU", 8, dtypes.int16, root.spec)
    assert r.handle != root.handle and bytes(r.as_buffer()) == bytes(range(16))
    assert a.base is r and b.base is r
    assert (a.offset, b.offset, a.dtype, b.dtype) == (4, 6, dtypes.int16, dtypes.uint8)
    assert a.is_allocated() and not b.is_allocated()  # allocation state survives
    assert bytes(a.as_buffer()) == bytes(range(4, 12))
    a.copyin(memoryview(bytes(8)))  # the copies are independent
    assert bytes(root.as_buffer()) == bytes(range(16))
    assert bytes(r.as_buffer())[4:12] == bytes(8)


def test_pickling_a_view_alone_brings_its_root_and_unallocated_stays_unallocated() -> None:
    root = Buffer("CPU", 6, initial_value=b"abcdef")
    view = pickle.loads(pickle.dumps(root.view(2, dtypes.uint8, 3).ensure_allocated()))
    assert view.base.size == 6 and bytes(view.base.as_buffer()) == b"abcdef"
    assert bytes(view.as_buffer()) == b"de"
    lazy = pickle.loads(pickle.dumps(Buffer("CPU", 4, dtypes.float32)))
    assert not lazy.is_allocated() and lazy.nbytes == 16


# ---------------------------------------------------------------------------------------------------------
# counters


def test_in_use_counts_live_root_bytes_and_returns_to_start() -> None:
    start = cpu_in_use()
    bufs = [Buffer("CPU", n, dtypes.float32, preallocate=True) for n in (1, 10, 100)]
    assert cpu_in_use() == start + 444
    views = [b.view(1, dtypes.float32, 0).ensure_allocated() for b in bufs]
    assert cpu_in_use() == start + 444
    for v in views:
        v.deallocate()
    for b in bufs:
        b.deallocate()
    assert cpu_in_use() == start
    # a buffer dropped without deallocate gives its bytes back too
    Buffer("CPU", 64, preallocate=True)
    assert cpu_in_use() == start


# ---------------------------------------------------------------------------------------------------------
# the allocator contract and the LRU cache


def test_allocator_rejects_non_positive_sizes() -> None:
    alloc = HostAllocator("HOST-TEST")
    for size in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=f"HOST-TEST: allocation size must be a positive int, got {size!r}"):
            alloc.alloc(size)  # type: ignore[arg-type]


def test_lru_reuses_handles_by_size_and_spec(host_frees: list[int]) -> None:
    alloc = HostAllocator("HOST-TEST")
    a = alloc.alloc(64)
    alloc.free(a, 64)
    assert alloc.cached_bytes == 64 and host_frees == []
    other_spec = alloc.alloc(64, BufferSpec(uncached=True))  # different spec: not the cached one
    other_size = alloc.alloc(32)  # different size: not the cached one
    assert a not in (other_spec, other_size)
    assert alloc.alloc(64) == a and alloc.cached_bytes == 0
    alloc.free(other_spec, 64, BufferSpec(uncached=True))
    assert alloc.alloc(64, BufferSpec(uncached=True)) == other_spec
    for handle, size, spec in ((a, 64, None), (other_size, 32, None), (other_spec, 64, BufferSpec(uncached=True))):
        alloc.free(handle, size, spec)
    assert alloc.cached_bytes == 160
    alloc.free_cache()
    assert alloc.cached_bytes == 0 and sorted(host_frees) == sorted([a, other_spec, other_size])


def test_buffers_reuse_cached_memory() -> None:
    first = Buffer("CPU", 24, preallocate=True)
    handle = first.handle
    first.deallocate()
    again = Buffer("CPU", 24, preallocate=True)
    assert again.handle == handle
    again.deallocate()


def test_nolru_frees_at_once(host_frees: list[int]) -> None:
    alloc = HostAllocator("HOST-TEST")
    spec = BufferSpec(nolru=True)
    handle = alloc.alloc(48, spec)
    alloc.free(handle, 48, spec)
    assert host_frees == [handle] and alloc.cached_bytes == 0
    buf = Buffer("CPU", 40, spec=spec, preallocate=True)
    address = buf.handle
    buf.deallocate()
    assert host_frees[-1] == address


def test_lru_0_in_the_environment_frees_at_once(monkeypatch: pytest.MonkeyPatch, host_frees: list[int]) -> None:
    monkeypatch.setenv("ARUNTIME_LRU", "0")
    alloc = HostAllocator("HOST-TEST")
    handle = alloc.alloc(48)
    alloc.free(handle, 48)
    assert host_frees == [handle] and alloc.cached_bytes == 0
    monkeypatch.setenv("ARUNTIME_LRU", "1")
    alloc = HostAllocator("HOST-TEST")
    handle = alloc.alloc(48)
    alloc.free(handle, 48)
    assert alloc.cached_bytes == 48 and host_frees == [host_frees[0]]
    alloc.free_cache()


def test_out_of_memory_really_frees_the_cache_and_retries_once() -> None:
    alloc = CapAllocator(capacity=100)
    cached = alloc.alloc(60)
    alloc.free(cached, 60)
    assert alloc.cached_bytes == 60 and cached in alloc.live  # cached, still held by the backend
    calls = alloc.alloc_calls
    fresh = alloc.alloc(70)  # does not fit next to the cached 60 bytes
    assert alloc.alloc_calls == calls + 2  # failed once, then succeeded after the cache was freed
    assert alloc.freed == [cached] and alloc.cached_bytes == 0 and alloc.live == {fresh: 70}


def test_out_of_memory_after_the_retry_reaches_the_caller_and_loses_nothing() -> None:
    alloc = CapAllocator(capacity=100)
    kept = alloc.alloc(80)
    calls = alloc.alloc_calls
    with pytest.raises(AllocationError, match="CAP: out of memory allocating 40 bytes") as info:
        alloc.alloc(40)
    assert isinstance(info.value, MemoryError) and isinstance(info.value.__cause__, MemoryError)
    assert alloc.alloc_calls == calls + 2  # one retry only
    assert alloc.live == {kept: 80}  # the live allocation is untouched
    alloc.free(kept, 80, BufferSpec(nolru=True))
    assert alloc.alloc(100) in alloc.live  # and the allocator still works


def test_a_huge_cpu_allocation_is_an_allocation_error() -> None:
    start = cpu_in_use()
    buf = Buffer("CPU", 1 << 60)
    with pytest.raises(AllocationError, match=f"CPU: out of memory allocating {1 << 60} bytes"):
        buf.allocate()
    assert not buf.is_allocated() and cpu_in_use() == start
    assert cpu_cached() == 0  # the cache was freed before the retry
    assert Buffer("CPU", 8, initial_value=b"still ok").as_buffer().tobytes() == b"still ok"


def test_a_release_deferred_behind_an_op_frees_what_the_handle_came_from() -> None:
    from aruntime.engine import CommandQueue, Op, TimelineSignal

    dev = Device["CPU:3"]
    alloc = dev.allocator
    before_use = alloc.in_use
    buf = Buffer("CPU:3", 64, preallocate=True)
    before_cached = alloc.cached_bytes  # after the allocation, which may have taken a handle from the cache
    gate = TimelineSignal("test gate", timeout=10)
    dev.copy.submit(CommandQueue().wait(gate, 1), Op("gate"))
    op = dev.copyin(buf, bytes(64))  # behind the gate: the memory stays in use
    buf.deallocate()
    outside = ctypes.create_string_buffer(64)
    buf.allocate(external_ptr=ctypes.addressof(outside))  # allocated again before the release runs
    gate.set(1)
    op.wait()
    assert alloc.in_use == before_use  # the device memory went back, counted once
    assert alloc.cached_bytes == before_cached + 64  # into the cache, under the spec it was allocated with
    buf.deallocate()  # caller-owned memory: nothing freed, nothing counted
    assert alloc.in_use == before_use and alloc.cached_bytes == before_cached + 64
