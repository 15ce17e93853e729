"""The device registry and the device base class with the awaitable API."""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.metadata
import multiprocessing
import pkgutil
import threading
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

import anyio

from aruntime.allocator import Allocator, BufferSpec
from aruntime.buffer import Buffer, BufferScope, typed
from aruntime.compiler import Compiler, check_source
from aruntime.dtype import DType, dtypes
from aruntime.engine import COPY, EXEC, Command, CommandQueue, CopyFn, Engine, Op, first_failure, make_engine
from aruntime.errors import BufferUsageError, DeviceError, SignalTimeout
from aruntime.events import DependencyEvent, DeviceEvent, recorder
from aruntime.helpers import after_all, canonicalize, checkpoint, getenv, is_index, pin

PRIORITY = ("CUDA", "CPU", "CL")
"""Kinds tried in order for the default device (other kinds, NULL included, are the default only through
``ARUNTIME_<KIND>=1``, file-backed kinds never; CPU goes before CL, whose usual driver, PoCL, runs on the same CPU:
set ARUNTIME_CL=1 to make CL the default)."""

Bound = tuple[Callable[..., object], tuple[Any, ...]]
"""What :meth:`Program.bind` returns: the callable an engine runs for one launch, and its arguments."""


class Window(Protocol):
    """Where ops wait for room before they are handed to their engines (a :class:`~aruntime.scheduler.Scheduler`):
    ``_admit(ops)`` admits them now (True) or refuses them (False); ``_queue_for_room(ops, go)`` then calls
    ``go``, from any thread, once they are admitted."""

    def _admit(self, ops: Sequence[Op]) -> bool: ...

    def _queue_for_room(self, ops: Sequence[Op], go: Callable[[], None]) -> None: ...


class Program:
    """A compiled kernel of one device; :meth:`bind` says what the compute engine calls for a launch."""

    def __init__(self, device: BaseDevice, name: str, lib: bytes, outs: Sequence[int] | None = None) -> None:
        self.device = device
        self.name = name
        self.lib = lib
        self.outs = None if outs is None else tuple(outs)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device.name}>"

    def bind(self, addresses: Sequence[int], vals: Sequence[int | float]) -> Bound:
        """What the compute engine calls for a launch on these buffer handles and scalars, and the arguments.

        By default the program itself, with the handles and then the scalars. A
        backend may return the kernel itself instead (no Python frame per
        launch). A submitted launch holds the callable, not the program, until
        it has run, so the callable must keep alive whatever the kernel needs.
        """
        return self, (*addresses, *vals)

    def __call__(self, *args: Any) -> None:
        """Run the kernel with :meth:`bind`'s arguments (on an engine thread); a backend that binds to
        something else need not define it."""
        raise NotImplementedError(f"{self!r}: launch it on its device, or call what bind() returns")


class BaseDevice:
    """A device: allocator, compiler, program type, a compute engine and a copy engine.

    Every op method submits at once and returns the op's handle, an
    :class:`Op`: ``await op`` is its result (the data, for a copy-out).
    Dependencies between ops come from the byte ranges of the buffers they read
    and write, and a wait is emitted only where a hazard crosses engines.
    """

    kind: ClassVar[str] = ""
    file_backed: ClassVar[bool] = False
    program_type: ClassVar[type[Program]] = Program
    allocator_type: ClassVar[type[Allocator[Any]]]
    compiler_type: ClassVar[type[Compiler] | None] = None
    copies_host: ClassVar[bool] = False
    """Whether ``copy_fn`` also copies between this device's memory and host addresses (CL, CUDA): a transfer
    between such a device and a host-mapped one runs on this device's copy engine."""
    routes_transfers: ClassVar[bool] = False
    """Whether this device runs every transfer into or out of it itself, whatever the other device (a remote
    device: the bytes go between hosts)."""
    copy_fn: CopyFn
    """``copy_fn(dst, src, nbytes)`` copies between two of this device's handles (or host addresses)."""

    def __init__(self, name: str) -> None:
        self.check_name(name)
        self.name = name
        self.state = "open"
        """``"open"``, ``"closing"`` (a close is waiting for the work in flight) or ``"closed"``."""
        self._close_lock = threading.Lock()
        self.allocator = self.allocator_type(name)
        self.compiler = None if self.compiler_type is None else self.compiler_type()
        timeout = getenv("WAIT_TIMEOUT", 30.0, minimum=0.001)
        self.inline_copy_max: int = getenv("INLINE_COPY_MAX", 64 << 10, minimum=0)
        """Copies up to this many bytes that depend on a running kernel go on the compute queue (0: never)."""
        self.compute: Engine = self._make_engine("compute", timeout)
        self.copy: Engine = self._make_engine("copy", timeout)

    @classmethod
    def check_name(cls, name: str) -> None:
        """Raise :class:`DeviceError` unless ``name`` (canonical) is a name of this kind: ``KIND`` or ``KIND:N``
        with N a non-negative int. A kind that takes another argument (DISK: a path) overrides it."""
        arg = name.partition(":")[2]
        if not is_index(arg):
            raise DeviceError(
                f"invalid device name {name!r}: a {cls.kind or name.partition(':')[0]} device is named "
                f"KIND or KIND:N with N a non-negative int, not {arg!r}"
            )

    def _make_engine(self, kind: str, timeout: float) -> Engine:
        return make_engine(self.name, kind, timeout, chunk=getenv("COPY_CHUNK", 8 << 20, minimum=1))

    @property
    def timeout(self) -> float:
        """Seconds a wait on this device's queues may take before it fails (``ARUNTIME_WAIT_TIMEOUT``, default 30)."""
        return self.compute.signal.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds > 0:
            raise ValueError(f"{self.name}: timeout must be a positive number of seconds, got {seconds!r}")
        self.compute.signal.timeout = self.copy.signal.timeout = float(seconds)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({self.engine_kind} engine)>"

    @property
    def engine_kind(self) -> str:
        """Which engine runs this device's queues: ``native``, ``python`` or a backend's own (its class name)."""
        from aruntime.engine.native.engine import NativeEngine
        from aruntime.engine.thread import ThreadEngine

        engines = (self.compute, self.copy)
        if all(isinstance(e, NativeEngine) for e in engines):
            return "native"
        if all(isinstance(e, ThreadEngine) for e in engines):
            return "python"
        return "/".join(sorted({type(e).__name__ for e in engines}))

    # ---- capabilities -------------------------------------------------------------------------------

    @property
    def host_mapped(self) -> bool:
        """Whether this device's buffers are host memory (CPU, DISK): a transfer runs between two host-mapped
        devices, or within one device; a NULL buffer is not host memory."""
        return self.allocator.host_mapped

    def is_dtype_supported(self, dtype: DType) -> bool:
        """Whether kernels of this device can use ``dtype``: every dtype but bfloat16 (and its vectors) unless a
        backend says it really supports it."""
        return dtype.scalar() != dtypes.bfloat16

    # ---- memory -------------------------------------------------------------------------------------

    async def allocate(self, size: int, dtype: DType = dtypes.uint8, spec: BufferSpec | None = None) -> Buffer:
        """A new allocated buffer of ``size`` elements of ``dtype`` on this device.

        ``size`` is a positive int (not a bool) and ``size * dtype.itemsize`` at most what the device can
        address (:attr:`Allocator.max_bytes`); ``dtype`` is storable (:meth:`dtypes.is_storable`). A
        file-backed device maps the file on a worker thread (file system calls); others allocate at once.
        A checkpoint first: a cancelled call allocates nothing.
        """
        await checkpoint()
        self.check_usable("allocate")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise BufferUsageError(f"allocate on {self.name}: size must be a positive int of elements, got {size!r}")
        if not dtypes.is_storable(dtype):
            raise BufferUsageError(
                f"allocate on {self.name}: {dtype!r} is not a storable dtype (a scalar or vector with a size; "
                "not void, a pointer or an image)"
            )
        self.allocator.check_size(size * dtype.itemsize)
        make = functools.partial(Buffer, self.name, size, dtype, spec, preallocate=True)
        return await anyio.to_thread.run_sync(make) if self.file_backed else make()

    def buffer(self, size: int, dtype: DType = dtypes.uint8, spec: BufferSpec | None = None) -> BufferScope:
        """``async with dev.buffer(size, dtype) as buf:`` allocates ``buf`` and frees it on exit (also on
        cancellation or an error), with :meth:`free`'s rule: never while an op may still use it."""
        return BufferScope(self, size, dtype, spec)

    def memory_stats(self) -> dict[str, int]:
        """This device's memory counters (see :meth:`LRUAllocator.memory_stats`): bytes ``in_use``,
        ``peak_in_use``, ``cached`` and ``cache_limit``, and counts of allocations, cache hits, frees,
        evictions and flushes."""
        return self.allocator.memory_stats()

    def flush_cache(self) -> None:
        """Really free the memory this device's allocator keeps cached for reuse (large host buffers go back to
        the operating system); live buffers are untouched."""
        free_cache = getattr(self.allocator, "free_cache", None)
        if free_cache is not None:
            free_cache()

    async def free(self, buf: Buffer) -> None:
        """Free ``buf``. It is unusable at once; its memory is released when its in-flight ops finish.

        Waits for that release; cancelling the wait does not stop the release. A checkpoint even with
        nothing to wait for, after the buffer is freed: a cancellation there does not undo the free.
        """
        self._check(buf, "free")
        pending = buf.log.pending()
        buf.deallocate()
        if not pending:
            await checkpoint()
        for op in pending:
            await op.settled()

    # ---- ops ----------------------------------------------------------------------------------------

    def _check(self, buf: Buffer, what: str) -> Any:
        """``buf``'s handle, once ``buf`` is checked to be an allocated buffer of this device."""
        if not isinstance(buf, Buffer):
            raise BufferUsageError(f"{what}: expected a Buffer, got {type(buf).__name__}")
        if buf.device != self.name:
            raise BufferUsageError(f"{what}: {buf!r} belongs to {buf.device}, not {self.name}")
        handle = buf.handle  # raises if unallocated or freed
        owner = buf.base._owner
        if owner is not self and owner is not None:
            raise BufferUsageError(f"{what}: {buf!r} was allocated on a {self.name} that has been closed")
        return handle

    def _submit(
        self,
        engine: Engine,
        name: str,
        body: list[Command],
        reads: Sequence[Buffer],
        writes: Sequence[Buffer],
        keep: Any,
        result: Any = None,
        hold: bool = False,
        window: Window | None = None,
    ) -> Op:
        """Track the op's hazards and hand it to ``engine`` (see :func:`dispatch_when_ready`); through
        ``window`` (held, as with ``hold``) once it admits the op."""
        if self.state != "open":
            self.check_usable(name)
        engine.check_open(name)  # before the hazard logs learn of an op that would never run
        op = Op(name, (), keep, result)
        deps: list[Op] = []
        if reads or writes:
            inputs: list[Op] = []
            for buf in reads:
                buf.log.access(buf.offset, buf.offset + buf.nbytes, False, True, op, engine, deps, inputs)
            for buf in writes:
                buf.log.access(buf.offset, buf.offset + buf.nbytes, True, False, op, engine, deps, inputs)
            if inputs:
                op.inputs = inputs
        admitted = window is None or window._admit((op,))
        if admitted and not deps:
            return engine.push(body, op)
        op.deps = deps
        dispatch_when_ready([(engine, body, op)], hold or window is not None, None if admitted else window)
        return op

    def _copy_engine(self, buf: Buffer, write: bool) -> Engine:
        """The copy queue, except for a small copy that must wait for a kernel anyway: it runs on the
        compute queue right after that kernel, which saves a cross-queue hand-off per op."""
        if buf.nbytes <= self.inline_copy_max and buf.log.conflicts_on(
            self.compute, buf.offset, buf.offset + buf.nbytes, write
        ):
            return self.compute
        return self.copy

    def copyin(self, buf: Buffer, data: Any, hold: bool = False, window: Window | None = None) -> Op:
        """Copy ``data`` (any C-contiguous buffer-protocol object of ``buf.nbytes`` bytes: bytes, array,
        a numpy array...) into ``buf``; ``await`` the op for the copy to be done.

        Zero-copy from the source: it is held, unresizable, until the copy is done.
        Like every op method, it submits at once and returns the awaitable op. A
        queue runs its ops in the order given; with ``hold``, an op that must wait
        for another queue is kept off its queue until then, so later independent
        ops go first (see :func:`dispatch_when_ready`). ``window``: the
        :class:`~aruntime.scheduler.Scheduler` the op goes through (it is held).
        """
        handle = self._check(buf, "copyin")
        holder, address, nbytes = pin(data)
        if nbytes != buf.nbytes:
            raise BufferUsageError(f"copyin: source has {nbytes} bytes, {buf!r} has {buf.nbytes}")
        name = f"copyin {nbytes} B"
        body: list[Command] = [(COPY, name, self.copy_fn, handle, address, nbytes)]
        engine = self._copy_engine(buf, True)
        return self._submit(engine, name, body, (), (buf,), (holder, buf), None, hold, window)

    def copyout(self, buf: Buffer, into: Any = None, hold: bool = False, window: Window | None = None) -> Op:
        """Copy ``buf`` to the host; ``await`` the op for the data.

        The result is ``into`` (a writable, C-contiguous buffer-protocol object of
        ``buf.nbytes`` bytes, such as a numpy array), or else a new memoryview cast
        to the buffer's dtype (``tolist()``, indexing and ``numpy.asarray`` read it
        as numbers; a byte view for a dtype :mod:`memoryview` cannot cast to, such
        as float16 or bfloat16). ``hold``, ``window``: see :meth:`copyin`.
        """
        handle = self._check(buf, "copyout")
        dest = typed(memoryview(bytearray(buf.nbytes)), buf.dtype) if into is None else into
        try:
            holder, address, nbytes = pin(dest, writable=True)
        except BufferUsageError as exc:
            raise BufferUsageError(f"copyout into: {exc}") from None
        if nbytes != buf.nbytes:
            raise BufferUsageError(f"copyout: destination has {nbytes} bytes, {buf!r} has {buf.nbytes}")
        name = f"copyout {nbytes} B"
        body: list[Command] = [(COPY, name, self.copy_fn, address, handle, nbytes)]
        engine = self._copy_engine(buf, False)
        return self._submit(engine, name, body, (buf,), (), (holder, buf), dest, hold, window)

    def _transfer(self, dst: Buffer, src: Buffer, hold: bool, window: Window | None) -> Op:
        """:func:`transfer` on this device's copy engine (the device :func:`transfer_device` picked)."""
        src_dev, dst_dev = src.owner, dst.owner
        src_handle = src_dev._check(src, "transfer")
        dst_handle = dst_dev._check(dst, "transfer")
        if dst.nbytes != src.nbytes:
            raise BufferUsageError(f"transfer: {src!r} has {src.nbytes} bytes, {dst!r} has {dst.nbytes}")
        name = f"transfer {src.nbytes} B {src_dev.name}->{dst_dev.name}"
        body: list[Command] = [(COPY, name, self.copy_fn, dst_handle, src_handle, src.nbytes)]
        return self._submit(self.copy, name, body, (src,), (dst,), (src, dst), None, hold, window)

    async def compile(self, src: str, name: str = "kernel", outs: Sequence[int] | None = None) -> Program:
        """Compile ``src`` off the event loop (through the compile cache) and load kernel ``name``.

        ``outs`` lists the indices of the buffers the kernel writes (default: all).
        """
        if not isinstance(src, str) or not isinstance(name, str):
            raise TypeError("compile: src and name must be str")
        if not (name.isidentifier() and name.isascii()):
            raise ValueError(f"compile on {self.name}: kernel name {name!r} is not a C identifier")
        if outs is not None:
            outs = _indices(f"compile {name}", outs)
        self.check_usable(f"compile {name}")
        if self.compiler is None:
            raise DeviceError(f"{self.name} has no compiler")
        compiler = self.compiler
        check_source(src)
        src = self._kernel_source(src, name)

        def build() -> Program:
            return compiler.compile_cached(src, load=lambda lib: self.program_type(self, name, lib, outs))

        return await anyio.to_thread.run_sync(build)

    def _kernel_source(self, src: str, name: str) -> str:
        """What is compiled for kernel ``name`` of ``src`` (checked to be non-empty text): ``src`` itself; a
        backend may check the kernel's definition here and add to it (the CPU backend adds its entry)."""
        return src

    def _launch_access(
        self, prog: Program, bufs: Sequence[Buffer], outs: Sequence[int] | None
    ) -> tuple[tuple[Buffer, ...], tuple[Buffer, ...]]:
        """Check a launch's program and buffers; split the buffers into (read only, written)."""
        if not isinstance(prog, Program) or prog.device is not self:
            raise DeviceError(f"launch: {prog!r} is not a program of {self.name}")
        for i, buf in enumerate(bufs):
            if not isinstance(buf, Buffer) or buf.device != self.name or not buf.is_allocated():
                self._check(buf, f"launch {prog.name} argument {i}")  # raises the error that fits
        written = prog.outs if outs is None else _indices(f"launch {prog.name}", outs)
        if written is None:  # all written
            return (), tuple(bufs)
        try:
            read_idx, write_idx = _split(len(bufs), written)
        except ValueError:
            raise ValueError(
                f"launch {prog.name}: outs {sorted(written)} out of range for {len(bufs)} buffers"
            ) from None
        return tuple(map(bufs.__getitem__, read_idx)), tuple(map(bufs.__getitem__, write_idx))

    def launch(
        self,
        prog: Program,
        *bufs: Buffer,
        vals: Sequence[int | float] = (),
        outs: Sequence[int] | None = None,
        hold: bool = False,
        window: Window | None = None,
    ) -> Op:
        """Run ``prog`` on ``bufs`` and the scalar ``vals`` on the compute engine; ``await`` the op for the
        kernel to be done.

        ``outs`` (default: the program's, else all) are the indices of the buffers it writes;
        the others are only read. ``hold``, ``window``: see :meth:`copyin`.
        """
        reads, writes = self._launch_access(prog, bufs, outs)
        check_scalars(f"launch {prog.name}", vals)
        fn, args = prog.bind([b._handle for b in bufs], vals)  # checked above: every handle is there
        body: list[Command] = [(EXEC, prog.name, fn, args)]  # the op holds the buffers until it is done
        return self._submit(self.compute, prog.name, body, reads, writes, bufs, None, hold, window)

    # ---- completion ---------------------------------------------------------------------------------

    def _raise_failures(self) -> None:
        failed = self.compute.take_failures() + self.copy.take_failures()
        if failed:
            raise first_failure(failed, f"on {self.name} failed unobserved")

    async def settle(self) -> None:
        """Wait for all work submitted so far (held ops included) to finish; raises nothing."""
        for engine in (self.compute, self.copy):
            while engine.held:  # held ops may hold up others that get held meanwhile: until none is left
                for op in tuple(engine.held):
                    await op.settled()
            await engine.signal.wait_async(engine.last)

    def settle_blocking(self, timeout: float | None = None) -> None:
        """:meth:`settle` for threads outside any event loop; each wait gives up after ``timeout`` seconds."""
        for engine in (self.compute, self.copy):
            while engine.held:
                for op in tuple(engine.held):
                    op.wait_done(timeout)
            engine.signal.wait(engine.last, timeout)

    async def synchronize(self) -> None:
        """Wait for all work submitted so far; raise the first failure nobody awaited."""
        await self.settle()
        self._raise_failures()

    def synchronize_blocking(self) -> None:
        """:meth:`synchronize` for threads outside any event loop."""
        self.settle_blocking()
        self._raise_failures()

    def finalize_profile(self) -> DeviceEvent:
        """Called when profiling finishes: this device's clock offsets against the host clock.

        Each engine's offset is the median of several paired host/engine
        timestamps (see :mod:`aruntime.profile.align`); call it while the device is idle.
        """
        from aruntime.profile.align import engine_offset

        return DeviceEvent(self.name, engine_offset(self.compute), engine_offset(self.copy))

    # ---- closing ------------------------------------------------------------------------------------

    def check_usable(self, what: str) -> None:
        """Raise :class:`DeviceError` naming ``what`` unless this device is open."""
        if self.state != "open":
            raise DeviceError(
                f"{what}: {self.name} is {self.state}; Device[{self.name!r}] opens a new device of that name"
            )

    def _begin_close(self) -> bool:
        """Move open -> closing; False if already closed. Refused from this device's own engine threads."""
        for engine in (self.compute, self.copy):
            if getattr(engine, "_thread", None) is threading.current_thread():
                raise DeviceError(
                    f"close {self.name}: called on its own {engine.signal.name} thread (from a kernel or an "
                    "op callback), which would wait for itself; close it from another thread or task"
                )
        with self._close_lock:
            if self.state == "closed":
                return False
            if self.state == "closing":
                raise DeviceError(f"close {self.name}: another close of it is already waiting")
            self.state = "closing"
            return True

    def _finish_close(self, settled: bool) -> None:
        """closing -> closed once the work in flight is done (stop the engines, free the cache, forget the
        device); closing -> open when the wait failed, so the device stays usable."""
        if not settled:
            self.state = "open"
            return
        self.compute.close()
        self.copy.close()
        self.flush_cache()
        self.state = "closed"
        Device.forget(self)

    def close(self, timeout: float | None = None) -> None:
        """Wait for the work submitted so far (held ops included), stop the engines and forget the device.

        For threads; async code uses :meth:`aclose`. Afterwards ``Device[name]`` opens a new device, and this one
        refuses new work (ops, ``allocate``, ``compile``) with a :class:`DeviceError`. If the wait does not pass
        within ``timeout`` seconds (default: the device's :attr:`timeout`), the :class:`SignalTimeout` is raised
        and the device stays open and usable. Closing a closed device does nothing; closing from one of the
        device's own engine threads (a kernel) is a :class:`DeviceError`.
        """
        if not self._begin_close():
            return
        settled = False
        try:
            self.settle_blocking(timeout)
            settled = True
        finally:
            self._finish_close(settled)

    async def aclose(self) -> None:
        """:meth:`close` for async code: waits for the work in flight without blocking the loop (bounded by
        the device's :attr:`timeout`; a timeout leaves it open), then stops the engines on a worker thread.
        If the awaiting task is cancelled during the wait (a checkpoint even when the device is idle or
        closed), the device stays open; once the wait has passed, the close completes."""
        if not self._begin_close():
            await checkpoint()
            return
        settled = False
        try:
            await self.settle()
            settled = True
        finally:
            if settled:
                with anyio.CancelScope(shield=True):  # a cancellation now must not leave the device closing
                    await anyio.to_thread.run_sync(self._finish_close, True)
            else:
                self._finish_close(False)

    async def __aenter__(self) -> BaseDevice:
        await checkpoint()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def transfer_device(src: BaseDevice, dst: BaseDevice) -> BaseDevice:
    """The device whose copy engine runs a transfer from ``src`` to ``dst``.

    The source's when both are one kind or both are :attr:`~BaseDevice.host_mapped` (``copy_fn`` is a memmove);
    the one that :attr:`~BaseDevice.copies_host` when the other is host-mapped (a device with memory of its own
    copies between it and host addresses); otherwise no copy engine reaches both memories: a
    :class:`BufferUsageError` (a NULL buffer, for one, is not host memory).
    """
    if type(src) is type(dst) or (src.host_mapped and dst.host_mapped):
        return src
    if src.host_mapped and dst.copies_host:
        return dst
    if dst.host_mapped and src.copies_host:
        return src
    lacking = ", ".join(d.name for d in (src, dst) if not d.host_mapped)
    raise BufferUsageError(
        f"transfer {src.name}->{dst.name}: no copy engine reaches both memories ({lacking} buffers are not host "
        "memory); a transfer runs between host-mapped devices (CPU, DISK), between one of them and a device that "
        "copies to host memory (CL, CUDA), or within one kind; copy out to the host and in"
    )


def check_scalars(what: str, vals: object, skip: type | None = None) -> None:
    """Raise unless ``vals`` is a list or tuple of launch scalars (see :func:`check_scalar`); items that are
    instances of ``skip`` are left for the caller."""
    if not isinstance(vals, (list, tuple)):
        raise TypeError(f"{what}: vals must be a tuple or list of scalars, got {type(vals).__name__}")
    for i, val in enumerate(vals):
        if skip is None or not isinstance(val, skip):
            check_scalar(what, i, val)


def check_scalar(what: str, index: int, val: object) -> None:
    """Raise unless ``val`` can be a launch's scalar ``index``: a float, or an int that fits in int64."""
    if isinstance(val, float):
        return
    if not isinstance(val, int):
        raise TypeError(f"{what}: scalar {index} must be int or float, got {type(val).__name__}")
    if not -(1 << 63) <= val < 1 << 63:
        raise ValueError(f"{what}: scalar {index} = {val} does not fit in a 64-bit signed int")


def _indices(what: str, outs: object) -> tuple[int, ...]:
    """``outs`` as a tuple of buffer indices, or a TypeError naming ``what``."""
    items = tuple(outs) if isinstance(outs, Iterable) and not isinstance(outs, (str, bytes)) else None
    indices = tuple(i for i in items if type(i) is int) if items is not None else ()
    if items is None or len(indices) != len(items):
        raise TypeError(f"{what}: outs must be a sequence of buffer indices (int), got {outs!r}")
    return indices


@functools.lru_cache(maxsize=256)
def _split(count: int, written: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (read-only, written) indices of ``count`` launch buffers of which ``written`` are written."""
    if not all(0 <= i < count for i in written):
        raise ValueError(f"{written} out of range")
    return tuple(i for i in range(count) if i not in written), tuple(sorted(set(written)))


def transfer(dst: Buffer, src: Buffer, hold: bool = False, window: Window | None = None) -> Op:
    """Copy ``src`` into ``dst``, a buffer of another device (or the same), on the copy queue of the device
    :func:`transfer_device` picks (the source's, between host-memory devices); ``await`` the op for the copy to
    be done.

    Both must be allocated and of the same size; the destination device's later
    work on ``dst`` waits for it. ``hold``, ``window``: see :meth:`BaseDevice.copyin`.
    """
    if not isinstance(src, Buffer):
        raise BufferUsageError(f"transfer: expected a Buffer source, got {type(src).__name__}")
    if not isinstance(dst, Buffer):
        raise BufferUsageError(f"transfer: expected a Buffer destination, got {type(dst).__name__}")
    src_dev, dst_dev = src.owner, dst.owner
    for dev in (dst_dev, src_dev):
        if dev.routes_transfers:
            return dev._transfer(dst, src, hold, window)
    return transfer_device(src_dev, dst_dev)._transfer(dst, src, hold, window)


def dispatch_when_ready(
    ops: Sequence[tuple[Engine, list[Command], Op]], hold: bool, window: Window | None = None
) -> None:
    """Hand ``ops`` (each with its engine and commands, its ``deps`` set) to their engines together,
    as soon as their dependencies allow (and ``window``, which refused them, admits them); until then
    they are held (see :meth:`Op.hold`).

    Without ``hold`` they go as soon as every dependency has been handed over, and
    wait commands cover cross-queue hazards (a queue runs in the order it is given
    work). With ``hold`` an op also waits off-queue, without a wait command, until
    its dependencies on other queues are done, so that later independent work on
    its queue is not stuck behind it; this is how a :class:`~aruntime.scheduler.Scheduler`,
    whose ``window`` also admits ops in order as room frees, overlaps
    straight-line code. A single held op whose dependencies all run on engines that
    :attr:`~aruntime.engine.Engine.pends` is handed over by the engine itself: on the
    native engine the core appends it to its queue from the worker thread that meets
    the last dependency, with no trip through the event loop. Otherwise (several ops
    at once, a refusing ``window``, another kind of engine) a callback on the
    dependencies' completion hands them over: on the native engine it runs on the
    event loop that submitted them (one turn of that loop; the callback thread outside
    any loop), on the Python engine on the engine thread that completed the dependency.
    """
    mine: Collection[int] = {id(op) for _, _, op in ops} if len(ops) > 1 else ()  # one op never depends on itself
    blockers: list[tuple[Op, bool, Op]] = []  # (op, wait only for the dependency's dispatch, dependency)
    for engine, _, op in ops:
        for dep in op.deps:
            if id(dep) in mine or dep.done():
                continue
            if hold and dep.engine is not engine:
                blockers.append((op, False, dep))
            elif not dep.dispatched:
                blockers.append((op, True, dep))
    if not blockers and window is None:
        _dispatch(ops, mine)
        return
    if window is None and len(ops) == 1 and ops[0][0].pends and all(_pends_with(dep) for _, _, dep in blockers):
        engine, body, op = ops[0]
        if recorder.enabled:
            recorder.events.extend(DependencyEvent(dep.id, op.id) for _, on, dep in blockers if not on)
        try:
            engine.pend(body, op, [(on, dep) for _, on, dep in blockers])
        except DeviceError as exc:  # its engine was closed meanwhile
            op.abandon(engine, exc)
        return
    for engine, _, op in ops:
        op.hold(engine)
    if recorder.enabled:
        recorder.events.extend(DependencyEvent(dep.id, op.id) for op, on, dep in blockers if not on)
    one_ready = after_all(len(blockers) + (window is not None), lambda: _dispatch(ops, mine))
    for _, on_dispatch, dep in blockers:
        (dep.when_dispatched if on_dispatch else dep.when_done)(one_ready)
    if window is not None:
        window._queue_for_room([op for _, _, op in ops], one_ready)


def _pends_with(dep: Op) -> bool:
    """Whether an op pending in an engine's core can wait for ``dep`` there: ``dep`` runs on such an engine
    too, and has been handed to it or is pending in it."""
    engine = dep.engine
    return engine is not None and engine.pends and (dep.cell is not None or dep.dispatched)


def _dispatch(ops: Sequence[tuple[Engine, list[Command], Op]], mine: Collection[int]) -> None:
    for engine, body, op in ops:
        waits = _cross_engine_waits(op.deps, engine, mine)
        if waits:
            cq = CommandQueue()
            for dep_engine, value in waits.items():
                cq.wait(dep_engine.signal, value)
            if recorder.enabled:
                recorder.events.extend(
                    DependencyEvent(d.id, op.id) for d in op.deps if d.engine in waits and id(d) not in mine
                )
            body = cq.cmds + body
        try:
            engine.push(body, op)
        except DeviceError as exc:  # its engine was closed while it was held
            op.abandon(engine, exc)


def _cross_engine_waits(deps: Sequence[Op], engine: Engine, mine: Collection[int]) -> dict[Engine, int]:
    """For each other engine among the ``deps`` not done (and not among ``mine``), the latest value ``engine``
    must wait for. Dependencies on ``engine`` itself need no wait: its queue runs in order."""
    waits: dict[Engine, int] = {}
    for dep in deps:
        dep_engine = dep.engine
        if (
            dep_engine is not engine
            and dep_engine is not None
            and dep.value > waits.get(dep_engine, 0)
            and id(dep) not in mine
            and not dep.done()
        ):
            waits[dep_engine] = dep.value
    return waits


class _Registry:
    """``Device[name]`` opens a device once and returns the same object after."""

    def __init__(self) -> None:
        self._opened: dict[str, BaseDevice] = {}
        self._lock = threading.RLock()
        self._default: str | None = None

    canonicalize = staticmethod(canonicalize)

    def kinds(self) -> dict[str, str]:
        """Every known kind -> where its backend comes from (a module or an entry point)."""
        import aruntime.backends as pkg

        found = {m.name.upper(): f"aruntime.backends.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)}
        for ep in importlib.metadata.entry_points(group="aruntime.backends"):
            found.setdefault(ep.name.upper(), ep.value)
        return found

    def backend(self, kind: str) -> type[BaseDevice]:
        """The device class of ``kind``."""
        where = self.kinds().get(kind)
        if where is None:
            raise DeviceError(f"unknown device kind {kind!r}; known kinds: {', '.join(sorted(self.kinds()))}")
        module, _, attr = where.partition(":")
        try:
            obj = getattr(importlib.import_module(module), attr or "device_class")
        except Exception as exc:  # an import error, a missing class, or the module's own failure
            raise DeviceError(f"backend {where} for {kind} could not be loaded: {exc}") from exc
        if not (isinstance(obj, type) and issubclass(obj, BaseDevice)):
            raise DeviceError(f"backend {where} for {kind} is not a BaseDevice subclass")
        return obj

    def __getitem__(self, name: str | None) -> BaseDevice:
        name = self.DEFAULT if name is None else canonicalize(name)
        dev = self._opened.get(name)
        if dev is not None:
            return dev
        with self._lock:
            if name in self._opened:
                return self._opened[name]
            cls = self.backend(name.partition(":")[0])
            if not cls.file_backed and multiprocessing.current_process().name != "MainProcess":
                raise DeviceError(f"{name}: compute devices are opened only in the main process")
            dev = self._opened[name] = cls(name)
            return dev

    def forget(self, dev: BaseDevice) -> None:
        """Drop a closed device from the opened set."""
        with self._lock:
            if self._opened.get(dev.name) is dev:
                del self._opened[dev.name]

    @property
    def opened(self) -> tuple[str, ...]:
        """Names of the devices opened so far."""
        return tuple(self._opened)

    def devices(self) -> Iterator[BaseDevice]:
        """The devices opened so far."""
        return iter(tuple(self._opened.values()))

    def available(self) -> list[str]:
        """Kinds that open on this machine (file-backed ones need only load), default priority first."""
        kinds = sorted(self.kinds(), key=lambda k: (PRIORITY.index(k) if k in PRIORITY else len(PRIORITY), k))
        ok = []
        for kind in kinds:
            try:
                if not self.backend(kind).file_backed:
                    self[kind]
            except Exception:
                continue
            ok.append(kind)
        return ok

    @property
    def DEFAULT(self) -> str:
        """The default device: the kind whose ``ARUNTIME_<KIND>`` is 1, else the first of :data:`PRIORITY`
        that opens (a child process finds it by the same rule; nothing is written to the environment)."""
        if self._default is not None:
            return self._default
        kinds = self.kinds()
        chosen = [k for k in kinds if getenv(k, "") == "1" and not self.backend(k).file_backed]
        if len(chosen) > 1:
            names = ", ".join(f"ARUNTIME_{k}" for k in sorted(chosen))
            raise DeviceError(f"several device kinds are set to 1 in the environment: {names}")
        if not chosen:
            errors = []
            for kind in PRIORITY:
                if kind not in kinds:
                    continue
                try:
                    self[kind]
                except Exception as exc:
                    errors.append(f"{kind}: {exc}")
                    continue
                chosen = [kind]
                break
            if not chosen:
                raise DeviceError("no device could be opened: " + ("; ".join(errors) or "no backends found"))
        self._default = chosen[0]
        return self._default


Device = _Registry()
"""The device registry: ``Device["CPU:1"]``, ``Device.DEFAULT``, ``Device.opened``."""


def is_dtype_supported(dtype: DType, device: str | None = None) -> bool:
    """Whether ``device`` (default: the default device) supports ``dtype``; opens the device if needed."""
    if not isinstance(dtype, DType):
        raise TypeError(f"is_dtype_supported: expected a DType, got {type(dtype).__name__}")
    return Device[device].is_dtype_supported(dtype)


def _unfinished(dev: BaseDevice) -> str:
    """What is still in flight on ``dev``'s queues, for a message (empty if nothing is): per queue, how many ops
    were submitted and not done and how many are held, and the names of the first ones its engine can name."""
    parts = []
    for engine in (dev.compute, dev.copy):
        running = max(0, engine.last - engine.signal.value)
        held = sorted(op.name for op in tuple(engine.held))
        if running or held:
            named = [op.name for op in engine._unfinished()] + held
            names = f" ({', '.join(named[:5])}{', ...' if len(named) > 5 else ''})" if named else ""
            parts.append(f"{engine.signal.name}: {running} op(s) submitted and {len(held)} held{names}")
    return "; ".join(parts)


EXIT_NOTICE = 1.0
"""Seconds the wait at interpreter exit lasts before it says what it waits for (see :func:`finish_at_exit`)."""


def _settle_at_exit(dev: BaseDevice) -> None:
    """Wait for ``dev``'s work in flight (each wait bounded by its timeout), saying what is waited for, in a
    warning, once the wait has lasted :data:`EXIT_NOTICE` seconds."""
    try:
        dev.settle_blocking(min(EXIT_NOTICE, dev.timeout))
    except SignalTimeout:
        if dev.timeout <= EXIT_NOTICE:
            raise
        unfinished = _unfinished(dev)
        if unfinished:
            warnings.warn(
                f"aruntime at exit: waiting up to {dev.timeout:g} s for the work in flight on {dev.name}: "
                f"{unfinished} (Ctrl-C stops waiting and drops it)",
                RuntimeWarning,
                stacklevel=1,
            )
        dev.settle_blocking()


def finish_at_exit() -> None:
    """At interpreter exit: wait for the work in flight on every open device (each wait bounded by the
    device's timeout, and said in a warning when it lasts more than :data:`EXIT_NOTICE` seconds), warn naming
    what did not finish (it is dropped) and the failures nobody awaited, and write file-backed devices'
    mappings back to their files (``msync``). A :class:`KeyboardInterrupt` (Ctrl-C) stops the waiting: what
    is still in flight on every device is dropped, and named. Registered with :mod:`atexit` on import."""
    interrupted = False
    for dev in Device.devices():
        dropped = "interrupted by Ctrl-C" if interrupted else None
        if not interrupted:
            try:
                _settle_at_exit(dev)
            except KeyboardInterrupt:
                interrupted, dropped = True, "interrupted by Ctrl-C"
            except Exception as exc:
                dropped = f"{type(exc).__name__}: {exc}"
        unfinished = _unfinished(dev) if dropped is not None else ""
        if unfinished:
            warnings.warn(
                f"aruntime at exit: work in flight on {dev.name} did not finish and is dropped: {unfinished} "
                f"({dropped})",
                RuntimeWarning,
                stacklevel=1,
            )
        failed = dev.compute.take_failures() + dev.copy.take_failures()
        if failed:
            error = first_failure(failed, "failed on it")
            warnings.warn(
                f"aruntime at exit: {len(failed)} op(s) on {dev.name} failed and nobody awaited them; the first: "
                f"{error}",
                RuntimeWarning,
                stacklevel=1,
            )
        if dev.file_backed:
            flush = getattr(dev.allocator, "flush", None)
            if flush is not None:
                flush()


atexit.register(finish_at_exit)
