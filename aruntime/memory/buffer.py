"""Buffers: lazily allocated device memory, views into it, and its in-flight accesses."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any

from aruntime.dtype import DType, dtypes
from aruntime.errors import BufferUsageError, DeviceError
from aruntime.helpers import after_all, canonicalize, checkpoint
from aruntime.memory import dlpack
from aruntime.memory.allocator import DEFAULT_SPEC, Allocator, BufferSpec, HostAllocator, defer
from aruntime.memory.hazards import AccessLog
from aruntime.memory.pinning import refuse_pointers

if TYPE_CHECKING:
    from aruntime.device import BaseDevice
    from aruntime.engine import Op

_counter_lock = threading.Lock()


def _no_registry(name: str) -> BaseDevice:
    raise DeviceError(f"cannot open {name}: no device registry is set (importing aruntime sets it)")


_open_device: Callable[[str], BaseDevice] = _no_registry


def open_devices_with(open_device: Callable[[str], BaseDevice]) -> None:
    """Make ``open_device(name)`` the way a buffer opens the device it is named for (the device registry, which
    calls this when it is imported: the memory layer never imports the device layer)."""
    global _open_device
    _open_device = open_device


LAZY_ZEROS_MIN = 64 << 10
"""From this many bytes, :func:`zeroed` maps fresh pages instead of filling a ``bytearray``."""


def zeroed(nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` zero bytes that takes no time to make: from :data:`LAZY_ZEROS_MIN` bytes up,
    anonymous pages the system zeroes when they are first written (by whoever writes them: a copy-out's worker,
    not the event loop), below that a ``bytearray``."""
    if nbytes < LAZY_ZEROS_MIN:
        return memoryview(bytearray(nbytes))
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))


def _checked_view(obj: object, what: str) -> memoryview:
    """A view of the host memory ``obj`` for a blocking copy; a :class:`BufferUsageError` naming ``what`` if it
    has none, or one that holds pointers (see :func:`~aruntime.memory.pinning.refuse_pointers`)."""
    try:
        view = memoryview(obj)  # type: ignore[arg-type]  # checked here: anything else is refused
    except (TypeError, ValueError) as exc:
        raise BufferUsageError(f"{what}: expected a buffer-protocol object, got {type(obj).__name__}: {exc}") from None
    refuse_pointers(view.format, obj)
    return view


def typed(view: memoryview, dtype: DType) -> memoryview:
    """``view`` (bytes) cast to ``dtype``'s struct format, one row per element for a vector dtype; the byte view
    itself for a dtype without a format :mod:`memoryview` can cast to (float16 before Python 3.12, bfloat16)."""
    scalar = dtype.scalar()
    fmt = scalar.fmt
    if fmt is None or (fmt == "B" and dtype.count == 1):
        return view
    shape = [view.nbytes // dtype.itemsize, dtype.count] if dtype.count > 1 else [view.nbytes // scalar.itemsize]
    try:
        cast: memoryview = view.cast(fmt, shape)  # type: ignore[call-overload]  # fmt is a struct format character
    except (TypeError, ValueError):
        return view
    return cast


def _end_loan(root: Buffer) -> None:
    with _counter_lock:
        root._loans -= 1
        then = root._after_loans if root._loans == 0 else None
        if then is not None:
            root._after_loans = None
    if then is not None:
        then()


def _let_go(keep: object) -> None:
    """Called once the ops on external memory are done: what held ``keep`` (this call) lets go of it."""


def _release(allocator: Allocator[Any], handle: Any, nbytes: int, spec: BufferSpec, counted: bool) -> None:
    """Free a root buffer's memory (once no op uses it any more)."""
    allocator.free(handle, nbytes, spec)
    if counted:
        with _counter_lock:
            allocator._count(-nbytes)


_FIXED = frozenset(("base", "device", "dtype", "handle", "log", "nbytes", "offset", "size", "spec"))
"""What a buffer is (read-only): a subclass of :class:`Buffer` may not redefine it."""


class Buffer:
    """``size`` elements of ``dtype`` on ``device``; allocated on first need, not at construction.

    A view (``base`` given, or from :meth:`view`) shares its root buffer's
    memory at a byte ``offset``; views of views point at the root with the
    offsets added, and are bounds-checked against it.
    """

    __slots__ = (
        "__weakref__",
        "_after_loans",
        "_base",
        "_device",
        "_dtype",
        "_freed",
        "_generation",
        "_handle",
        "_keep",
        "_loans",
        "_log",
        "_nbytes",
        "_offset",
        "_owner",
        "_size",
        "_spec",
    )  # slots: the native submission path reads them where they lie

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        redefined = sorted(_FIXED.intersection(vars(cls)))
        if redefined:  # the queues, the hazard logs and the allocator read them as Buffer defines them
            raise TypeError(f"{cls.__name__} redefines {', '.join(redefined)} of Buffer, which a subclass keeps")

    def __init__(
        self,
        device: str,
        size: int,
        dtype: DType = dtypes.uint8,
        spec: BufferSpec | None = None,
        initial_value: bytes | None = None,
        base: Buffer | None = None,
        offset: int = 0,
        preallocate: bool = False,
    ) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise BufferUsageError(f"buffer size must be a positive number of elements, got {size!r}")
        if not dtypes.is_storable(dtype):
            raise BufferUsageError(
                f"buffer dtype must be a scalar or vector DType with a non-zero itemsize (not a pointer or an "
                f"image), got {dtype!r}"
            )
        self._device = canonicalize(device)
        self._size = size
        self._dtype = dtype
        self._nbytes = size * dtype.itemsize
        if spec is not None and not isinstance(spec, BufferSpec):
            raise BufferUsageError(f"buffer spec must be a BufferSpec, got {type(spec).__name__}")
        self._spec = spec or DEFAULT_SPEC
        self._handle: Any = None
        self._freed = False
        self._owner: BaseDevice | None = None
        self._generation = 0  # a root counts its allocations; a view records the one its handle came from
        self._keep: object = None  # what keeps external memory alive (see aruntime.from_dlpack)
        self._loans = 0  # zero-copy exports (DLPack) of a root's memory that their consumers still hold
        self._after_loans: Callable[[], None] | None = None  # what a free left to do once the last one ends
        if base is None:
            if offset != 0:
                raise BufferUsageError("a base buffer has no offset; pass base= to make a view")
            self._base: Buffer | None = None
            self._offset = 0
            self._log = AccessLog()
        else:
            if not isinstance(base, Buffer):
                raise BufferUsageError(f"a view's base must be a Buffer, got {type(base).__name__}")
            if not isinstance(offset, int) or isinstance(offset, bool):
                raise BufferUsageError(f"a view's offset must be an int of bytes, got {offset!r}")
            root = base.base
            if base.device != self._device:  # both canonical
                raise BufferUsageError(f"a view on {self._device} cannot share a buffer of {base.device}")
            self._base = root
            self._offset = base.offset + offset  # a root's offset is 0
            if offset < 0 or self._offset + self._nbytes > root.nbytes:
                raise BufferUsageError(
                    f"view of {self._nbytes} bytes at offset {self._offset} is out of range of its "
                    f"{root.nbytes}-byte root buffer"
                )
            self._log = root.log
        if preallocate or initial_value is not None:
            self.allocate()
            if initial_value is not None:
                self.copyin(memoryview(initial_value))

    def __repr__(self) -> str:
        view = f" view of {self._base!r} at {self._offset}" if self._base is not None else ""
        return f"<Buffer {self._device} {self._size} x {self._dtype!r}{view}>"

    # what a buffer is never changes once it is made: the queues, the hazard logs and the allocator rely on it
    @property
    def device(self) -> str:
        """The canonical name of the device this buffer lives on."""
        return self._device

    @property
    def size(self) -> int:
        """The number of elements."""
        return self._size

    @property
    def dtype(self) -> DType:
        """The type of each element."""
        return self._dtype

    @property
    def nbytes(self) -> int:
        """``size * dtype.itemsize``."""
        return self._nbytes

    @property
    def offset(self) -> int:
        """Where a view starts in its root buffer, in bytes (0 for a root)."""
        return self._offset

    @property
    def spec(self) -> BufferSpec:
        """How the memory is allocated (see :class:`BufferSpec`)."""
        return self._spec

    @property
    def log(self) -> AccessLog:
        """The in-flight accesses to the root buffer's memory (shared by its views)."""
        return self._log

    @property
    def base(self) -> Buffer:
        """The root buffer that owns the memory (``self`` for a root)."""
        return self if self._base is None else self._base

    @property
    def owner(self) -> BaseDevice:
        """The device this buffer lives on (opened on first use; a root keeps the one it was allocated on)."""
        owner = (self if self._base is None else self._base)._owner
        return _open_device(self._device) if owner is None else owner

    @property
    def allocator(self) -> Allocator[Any]:
        """The allocator of this buffer's device."""
        return self.owner.allocator

    @property
    def handle(self) -> Any:
        """The backend's handle of this buffer's memory; an error if not allocated.

        A view of an allocated root gets its handle on first use.
        """
        if not self.is_allocated():
            if self._base is not None and self._base.is_allocated():
                return self.allocate()._handle
            state = "was freed" if self.base._freed else "is not allocated"
            raise BufferUsageError(f"{self!r} {state}")
        return self._handle

    def is_allocated(self) -> bool:
        """Whether the memory exists now (for a view: whether its root's does)."""
        if self._base is not None and (not self._base.is_allocated() or self._generation != self._base._generation):
            return False  # a handle derived from an earlier allocation of the root is stale
        return self._handle is not None

    def ensure_allocated(self) -> Buffer:
        """Allocate unless already allocated."""
        return self if self.is_allocated() else self.allocate()

    def allocate(self, external_ptr: int | None = None) -> Buffer:
        """Allocate the memory (a view: its root first); ``external_ptr`` wraps caller-owned memory."""
        if self.is_allocated():
            raise BufferUsageError(f"{self!r} is already allocated")
        base = self._base
        if base is not None:
            allocator = self.allocator
            base.ensure_allocated()
            offset = getattr(allocator, "_offset", None)
            if offset is None:
                raise BufferUsageError(f"{self._device} does not support buffer views")
            self._handle = offset(base._handle, self._nbytes, self._offset)
            self._generation = base._generation
            return self
        owner = _open_device(self._device)  # (re)allocate on the device opened under this name now
        allocator = owner.allocator
        spec = self._spec
        if external_ptr is not None:
            spec = replace(spec, external_ptr=external_ptr)
        self._handle = allocator.alloc(self._nbytes, spec)
        self._owner = owner
        self._spec = spec
        self._freed = False
        self._generation += 1
        if spec.external_ptr is None and not owner.file_backed:
            with _counter_lock:
                allocator._count(self._nbytes)
        return self

    def deallocate(self) -> None:
        """Free the memory; if ops still use it, the memory is released only once they finish.

        A view only lets go of its handle. The buffer reads as unallocated at once.
        """
        self._deallocate()

    def _deallocate(self) -> list[Op]:
        """:meth:`deallocate`, returning the ops still in flight on the memory (a view: on its root's)."""
        if self._handle is None:
            raise BufferUsageError(f"{self!r} is not allocated")
        pending = self._log.pending()
        handle, self._handle = self._handle, None
        if self._base is not None:
            return pending
        self._freed = True
        lent = self._loans > 0  # read again under the lock below where it is
        spec = self._spec
        if spec.external_ptr is not None:  # caller-owned memory: nothing to free, let go of what keeps it
            release: Callable[[], None] = partial(_let_go, self._keep)
            self._keep = None
        else:  # what the handle came from, fixed now: the buffer may be allocated again before the release runs
            owner = self.owner
            memory = (owner.allocator, handle, self._nbytes, spec, not owner.file_backed)
            if not (pending or lent):
                _release(*memory)
                return pending
            release = partial(_release, *memory)
        with _counter_lock:
            lent = self._loans > 0
            one_done = after_all(len(pending) + lent, release) if pending or lent else None
            if lent:
                self._after_loans = one_done
        if one_done is None:
            release()
            return pending
        for op in pending:
            op.when_done(one_done)
        return pending

    def _lend(self) -> Callable[[], None]:
        """Count a zero-copy export of the root's memory; the function returned ends it (from any thread, a
        finalizer included: the end is left to the next allocator call, see :func:`~aruntime.memory.allocator.defer`).
        Freeing the buffer releases the memory only once every export has ended."""
        root = self.base
        with _counter_lock:
            root._loans += 1
        return partial(defer, partial(_end_loan, root))

    def __del__(self) -> None:
        # a finalizer may run under any lock (a collection starts wherever Python allocates), one a free takes
        # included: the free is left to the next allocator call, which runs it outside every lock
        if getattr(self, "_handle", None) is not None and self._base is None:
            defer(self.deallocate)

    def view(self, size: int, dtype: DType, offset: int) -> Buffer:
        """A view of ``size`` elements of ``dtype`` at byte ``offset`` into this buffer."""
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise BufferUsageError(f"view offset must be a non-negative int, got {offset!r}")
        return Buffer(self._device, size, dtype, base=self, offset=offset)

    def _wait_idle(self) -> None:
        for op in self._log.pending():
            op.wait_done()

    def copyin(self, src: memoryview) -> Buffer:
        """Copy ``src`` (exactly ``nbytes`` long) into the buffer, blocking this thread."""
        src = _checked_view(src, "copyin source")
        if src.nbytes != self._nbytes:
            raise BufferUsageError(f"copyin of {src.nbytes} bytes into {self!r} of {self._nbytes} bytes")
        handle = self.handle
        self._wait_idle()
        self.allocator._copyin(handle, src)
        return self

    def copyout(self, dest: memoryview) -> memoryview:
        """Copy the buffer into ``dest`` (exactly ``nbytes`` long), blocking this thread."""
        dest = _checked_view(dest, "copyout destination")
        if dest.nbytes != self._nbytes:
            raise BufferUsageError(f"copyout of {self!r} ({self._nbytes} bytes) into {dest.nbytes} bytes")
        handle = self.handle
        self._wait_idle()
        self.allocator._copyout(dest, handle)
        return dest

    def as_buffer(self, allow_zero_copy: bool = False) -> memoryview:
        """The contents: a zero-copy view where the memory is host-visible and allowed, else a copy."""
        as_buffer = getattr(self.allocator, "_as_buffer", None)
        if allow_zero_copy and as_buffer is not None:
            handle = self.handle
            self._wait_idle()
            view: memoryview = as_buffer(handle, self._nbytes)
            return view
        return self.copyout(zeroed(self._nbytes))

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> object:
        """Export the buffer as a DLPack capsule (``numpy.from_dlpack(buf)`` is a zero-copy view of it).

        Only buffers of host-memory devices (CPU) export; the buffer's ops still
        running are waited for first (blocking). Freeing the buffer releases its
        memory only once every consumer has let go of it. A 1-D tensor of
        ``size`` elements (``size x count`` for a vector dtype), writable.
        """
        return dlpack.export(self, stream, max_version, dl_device, copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(1, 0)``, DLPack's CPU device, for a buffer of host memory; an error for other buffers."""
        dlpack.host_address(self)
        return (1, 0)

    def __reduce__(self) -> tuple[Any, ...]:
        if self._base is not None:
            args = (self._device, self._size, self._dtype, None, None, self._base, self._offset, self.is_allocated())
            return (Buffer, args)
        contents = bytes(self.as_buffer()) if self.is_allocated() else None
        spec = replace(self._spec, external_ptr=None)
        return (Buffer, (self._device, self._size, self._dtype, spec, contents))


def from_dlpack(obj: Any, device: str | None = None) -> Buffer:
    """A buffer over the memory of ``obj``, a host array that exports DLPack (a C-contiguous numpy array...),
    without a copy.

    ``device`` names a CPU device (default: ``CPU``). The buffer is 1-D:
    ``obj``'s element count of the matching dtype. It keeps ``obj``'s memory
    alive while it is allocated (and until its ops are done once freed);
    :meth:`BaseDevice.free` it like any other buffer.
    """
    if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
        raise BufferUsageError(f"from_dlpack: {type(obj).__name__} does not export DLPack (__dlpack__)")
    dev = _open_device("CPU" if device is None else device)
    if not isinstance(dev.allocator, HostAllocator):
        raise BufferUsageError(f"from_dlpack: {dev.name} is not a host-memory device")
    capsule, address, size, dtype = dlpack.consume(obj)
    buf = Buffer(dev.name, size, dtype)
    buf.allocate(external_ptr=address)
    buf._keep = capsule  # its destructor lets the producer go once the buffer does
    return buf


class BufferScope:
    """What :meth:`BaseDevice.buffer` returns: ``async with`` it to hold a buffer for the block.

    Entering and leaving are checkpoints, like :meth:`BaseDevice.allocate` and :meth:`BaseDevice.free`: a
    cancelled exit has freed the buffer all the same, and its memory is released once its ops are done.
    """

    def __init__(self, device: BaseDevice, size: int, dtype: DType, spec: BufferSpec | None) -> None:
        self.device = device
        self.size = size
        self.dtype = dtype
        self.spec = spec
        self.buffer: Buffer | None = None

    async def __aenter__(self) -> Buffer:
        if self.buffer is not None:
            raise BufferUsageError("this buffer scope is already in use")
        self.buffer = await self.device.allocate(self.size, self.dtype, self.spec)
        return self.buffer

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        buf, self.buffer = self.buffer, None
        if buf is not None and buf.is_allocated():  # the block may have freed it already
            await self.device.free(buf)  # unusable now, released once its ops are done, even if this is cancelled
        else:
            await checkpoint()  # an exit is a checkpoint, with or without a buffer to free
