"""The device base class: the awaitable op methods, and what a backend overrides.

A backend subclass sets the class attributes (``kind``, ``allocator_type``, ``compiler_type``,
``program_type``, ``copy_fn``...) and may override :meth:`BaseDevice.check_name`,
:meth:`BaseDevice._kernel_source`, :meth:`BaseDevice._make_engine` and :meth:`BaseDevice.is_dtype_supported`.
Closing, settling and the profile hook live in :mod:`~aruntime.device.closing`,
:mod:`~aruntime.device.settling` and :mod:`~aruntime.device.profiling`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import anyio

from aruntime.compile import Compiler, check_source
from aruntime.device.args import _indices, _split, check_scalars
from aruntime.device.closing import Closing
from aruntime.device.profiling import ProfileHooks
from aruntime.device.program import Program
from aruntime.dtype import DType, dtypes
from aruntime.engine import (
    COPY,
    EXEC,
    Command,
    CopyFn,
    Engine,
    NativeEngine,
    Op,
    ThreadEngine,
    Window,
    dispatch_when_ready,
    gate_of,
    make_engine,
)
from aruntime.engine.ops import check_priority, protect
from aruntime.errors import BufferUsageError, DeviceError
from aruntime.helpers import check_seconds, checkpoint, getenv, is_index
from aruntime.memory import Allocator, Buffer, BufferScope, BufferSpec, logs_held, pin, typed, zeroed


class BaseDevice(Closing, ProfileHooks):
    """A device: allocator, compiler, program type, a compute engine and a copy engine.

    Every op method submits at once and returns the op's handle, an
    :class:`Op`: ``await op`` is its result (the data, for a copy-out).
    Dependencies between ops come from the byte ranges of the buffers they read
    and write, and a wait is emitted only where a hazard crosses engines.
    Closing, settling and the profile hook come from its bases,
    :class:`~aruntime.device.closing.Closing` (with :class:`~aruntime.device.settling.Settling`) and
    :class:`~aruntime.device.profiling.ProfileHooks`.
    """

    __slots__ = (
        "_allocator",
        "_compute",
        "_copy",
        "_inline_copy_max",
        "name",
        "state",
    )  # read in place when submitting

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
    holds_ops: ClassVar[bool] = True
    """Whether an op submitted with ``hold`` is kept off its queue while it waits for another queue (a remote
    device's ops wait on its host instead)."""
    has_priorities: ClassVar[bool] = True
    """Whether its op methods take ``priority=-1`` (high-priority queues; a remote device's do not)."""
    copy_fn: CopyFn
    """``copy_fn(dst, src, nbytes)`` copies between two of this device's handles (or host addresses)."""

    def __init__(self, name: str) -> None:
        self.check_name(name)
        self.name = name
        super().__init__()
        self._allocator = self.allocator_type(name)
        self.compiler = None if self.compiler_type is None else self.compiler_type()
        timeout = getenv("WAIT_TIMEOUT", 30.0, minimum=0.001)
        self.inline_copy_max = getenv("INLINE_COPY_MAX", 1 << 20, minimum=0)
        self._compute = self._make_engine("compute", timeout)
        self._copy = self._make_engine("copy", timeout)
        self.engines: tuple[Engine, ...] = (self._compute, self._copy)
        """Every queue of the device: compute, copy, then the high-priority ones opened so far (see
        :meth:`queue`)."""
        self._high_lock = threading.Lock()

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
        """A new engine for the ``kind`` queue: ``compute``, ``copy``, or either with ``_high`` (a high-priority
        queue; its :attr:`Engine.priority` says so)."""
        chunk = getenv("COPY_CHUNK", 8 << 20, minimum=1)
        return make_engine(self.name, kind, timeout, chunk=chunk, shared=self._shares_workers())

    def _shares_workers(self) -> bool:
        """Whether this device's native queues may run on the shared workers (see :func:`make_engine`): those
        of a kind whose commands never block a worker for long on anything but its own work (CPU, NULL)."""
        return False

    def queue(self, kind: str, priority: int = 0) -> Engine:
        """The engine that runs this device's ``kind`` ops (``"compute"`` or ``"copy"``) of ``priority``.

        Priority 0 is :attr:`compute` or :attr:`copy`. Priority -1 (high) is a queue of its own, opened on first
        use: before the normal queue of its kind takes its next op, it lets the high one run what it can, so
        high-priority ops overtake queued normal ones at the next op boundary (a running op is never
        interrupted). Ops that touch the same memory stay ordered whatever their priority: the hazard between
        them is a dependency across queues. Another priority is a ``ValueError``; -1 on a device that has no
        such queues (:attr:`has_priorities`), or on one that is no longer open, a :class:`DeviceError`.
        """
        if type(priority) is int and priority == 0:  # the default path: nothing more to check
            if kind == "compute":
                return self._compute
            if kind == "copy":
                return self._copy
        if kind not in ("compute", "copy"):
            raise ValueError(f"{self.name}: queue kind must be 'compute' or 'copy', got {kind!r}")
        check_priority(priority, f"{kind} queue of {self.name}")
        return self._high_queue(kind) or self._open_high(kind)

    def _high_queue(self, kind: str) -> Engine | None:
        """The high-priority ``kind`` queue if it is open, else None."""
        for engine in self.engines[2:]:
            if engine.kind == f"{kind}_high":
                return engine
        return None

    def _open_high(self, kind: str) -> Engine:
        """Open the high-priority ``kind`` queue (see :meth:`queue`)."""
        if not self.has_priorities:
            raise DeviceError(f"{self.name}: a {self.kind} device has no high-priority queues; use priority 0")
        with self._high_lock:
            opened = self._high_queue(kind)  # by another thread meanwhile
            if opened is not None:
                return opened
            self.check_usable(f"open the high-priority {kind} queue")
            high = self._make_engine(f"{kind}_high", self.timeout)
            (self._compute if kind == "compute" else self._copy).yield_to(high)
            self.engines = (*self.engines, high)
        return high

    @property
    def timeout(self) -> float:
        """Seconds a wait on this device's queues may take before it fails (``ARUNTIME_WAIT_TIMEOUT``, default 30)."""
        return self._compute.signal.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        checked = check_seconds(f"{self.name}: timeout", seconds)
        for engine in self.engines:
            engine.signal.timeout = checked

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} ({self.engine_kind} engine)>"

    @property
    def engine_kind(self) -> str:
        """Which engine runs this device's queues: ``native``, ``python`` or a backend's own (its class name)."""
        engines = (self._compute, self._copy)
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
        return self._allocator.host_mapped

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
        self._allocator.check_size(size * dtype.itemsize)
        if self.file_backed:  # maps the file: system calls, on a worker thread
            make = functools.partial(Buffer, self.name, size, dtype, spec, preallocate=True)
            return await anyio.to_thread.run_sync(make)
        return Buffer(self.name, size, dtype, spec, preallocate=True)

    # what a device is made of never changes while it is open: its ops, buffers and programs rely on it
    @property
    def allocator(self) -> Allocator[Any]:
        """The allocator of this device's memory."""
        return self._allocator

    @property
    def compute(self) -> Engine:
        """The compute queue (normal priority; see :meth:`queue`)."""
        return self._compute

    @property
    def copy(self) -> Engine:
        """The copy queue (normal priority; see :meth:`queue`)."""
        return self._copy

    @property
    def inline_copy_max(self) -> int:
        """Copies up to this many bytes that depend on a running kernel go on the compute queue (0: never); env
        ``ARUNTIME_INLINE_COPY_MAX``, default 1 MiB. A non-negative int."""
        return self._inline_copy_max

    @inline_copy_max.setter
    def inline_copy_max(self, nbytes: int) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes < 1 << 63:
            raise ValueError(f"{self.name}: inline_copy_max must be a non-negative int of bytes, got {nbytes!r}")
        self._inline_copy_max = nbytes

    def buffer(self, size: int, dtype: DType = dtypes.uint8, spec: BufferSpec | None = None) -> BufferScope:
        """``async with dev.buffer(size, dtype) as buf:`` allocates ``buf`` and frees it on exit (also on
        cancellation or an error), with :meth:`free`'s rule: never while an op may still use it."""
        return BufferScope(self, size, dtype, spec)

    def memory_stats(self) -> dict[str, int]:
        """This device's memory counters (see :meth:`LRUAllocator.memory_stats`): bytes ``in_use``,
        ``peak_in_use``, ``cached`` and ``cache_limit``, and counts of allocations, cache hits, frees,
        evictions and flushes."""
        return self._allocator.memory_stats()

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Live metrics of this device's queues, ``{"compute": {...}, "copy": {...}}`` (and ``"compute_high"``,
        ``"copy_high"`` once those queues are open, see :meth:`queue`), kept without a profile
        (see :meth:`Engine.metrics <aruntime.engine.Engine.metrics>`): ops submitted, queued, running, done and
        skipped, the share of time each queue was busy since the previous call, and percentiles of how long ops
        waited in the queue and ran. Plain data (ints, floats, None), ready for JSON or a metrics exporter."""
        return {engine.kind: engine.metrics() for engine in self.engines}

    def flush_cache(self) -> None:
        """Really free the memory this device's allocator keeps cached for reuse (large host buffers go back to
        the operating system); live buffers are untouched."""
        free_cache = getattr(self._allocator, "free_cache", None)
        if free_cache is not None:
            free_cache()

    async def free(self, buf: Buffer) -> None:
        """Free ``buf``. It is unusable at once; its memory is released when its in-flight ops finish.

        Waits for that release; cancelling the wait does not stop the release. A checkpoint even with
        nothing to wait for, after the buffer is freed: a cancellation there does not undo the free.
        """
        self._check(buf, "free")
        pending = buf._deallocate()
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
        if hold is not False and hold is not True:
            raise TypeError(f"{name}: hold must be a bool, got {hold!r}")
        fast = engine.fast
        if fast is not None and not hold:
            made: Op | None = fast.submit(engine, name, body, reads, writes, keep, result, window)
            if made is not None:
                return made
        engine.check_open(name)  # before the hazard logs learn of an op that would never run
        gate = gate_of(window)
        op = Op(name, (), keep, result)
        op.hold(engine)  # bound before another thread can find it (in a hazard log, in a window): held till then
        try:
            if gate is not None and engine.reads_gates:
                op.gate = gate
            deps: list[Op] = []
            inputs: list[Op] = []
            admitted = True
            if reads or writes or window is not None:
                with logs_held():  # its accesses, and its place in the window, at once
                    for buf in reads:
                        buf.log.access(buf.offset, buf.offset + buf.nbytes, False, True, op, engine, deps, inputs)
                    for buf in writes:
                        buf.log.access(buf.offset, buf.offset + buf.nbytes, True, False, op, engine, deps, inputs)
                    admitted = window is None or window._admit((op,))
            if inputs:
                op.inputs = deps if inputs == deps else inputs  # one list for both where they agree (a copy-out)
                protect(inputs, gate)
            if admitted and not deps:
                return engine.push(body, op)
            op.deps = deps
            held = (hold and self.holds_ops) or window is not None
            dispatch_when_ready([(engine, body, op)], held, None if admitted else window)
        except BaseException as exc:
            op.drop_unsubmitted(engine, exc)
            raise
        return op

    def _copy_engine(self, buf: Buffer, write: bool, priority: int) -> Engine:
        """The copy queue of ``priority``, except for a small copy that must wait for a kernel anyway: it runs
        on the compute queue of that priority right after that kernel, which saves a cross-queue hand-off per
        op."""
        copy = self.queue("copy", priority)
        compute = self._compute if copy is self._copy else self._high_queue("compute")
        if (
            compute is not None
            and buf.nbytes <= self._inline_copy_max
            and buf.log.conflicts_on(compute, buf.offset, buf.offset + buf.nbytes, write)
        ):
            return compute
        return copy

    def copyin(self, buf: Buffer, data: Any, hold: bool = False, window: Window | None = None, priority: int = 0) -> Op:
        """Copy ``data`` (any C-contiguous buffer-protocol object of ``buf.nbytes`` bytes: bytes, array,
        a numpy array...) into ``buf``; ``await`` the op for the copy to be done.

        Zero-copy from the source: it is held, unresizable, until the copy is done.
        Like every op method, it submits at once and returns the awaitable op. A
        queue runs its ops in the order given; with ``hold``, an op that must wait
        for another queue is kept off its queue until then, so later independent
        ops go first (see :func:`dispatch_when_ready`). ``window``: the
        :class:`~aruntime.scheduler.Scheduler` the op goes through (it is held).
        ``priority``: 0 (normal) or -1 (high: it overtakes queued normal ops, see
        :meth:`queue`).
        """
        fast = self._copy.fast
        if fast is not None:
            made: Op | None = fast.copy(self, buf, data, False, hold, window, priority)
            if made is not None:
                return made
        handle = self._check(buf, "copyin")
        try:
            holder, address, nbytes = pin(data)
        except BufferUsageError as exc:
            raise BufferUsageError(f"copyin source: {exc}") from None
        if nbytes != buf.nbytes:
            raise BufferUsageError(f"copyin: source has {nbytes} bytes, {buf!r} has {buf.nbytes}")
        name = f"copyin {nbytes} B"
        body: list[Command] = [(COPY, name, self.copy_fn, handle, address, nbytes)]
        engine = self._copy_engine(buf, True, priority)
        return self._submit(engine, name, body, (), (buf,), (holder, buf), None, hold, window)

    def copyout(
        self, buf: Buffer, into: Any = None, hold: bool = False, window: Window | None = None, priority: int = 0
    ) -> Op:
        """Copy ``buf`` to the host; ``await`` the op for the data.

        The result is ``into`` (a writable, C-contiguous buffer-protocol object of
        ``buf.nbytes`` bytes, such as a numpy array), or else a new memoryview cast
        to the buffer's dtype (``tolist()``, indexing and ``numpy.asarray`` read it
        as numbers; a byte view for a dtype :mod:`memoryview` cannot cast to, such
        as float16 or bfloat16). ``hold``, ``window``, ``priority``: see :meth:`copyin`.
        """
        fast = self._copy.fast
        if fast is not None:
            made: Op | None = fast.copy(self, buf, into, True, hold, window, priority)
            if made is not None:
                return made
        handle = self._check(buf, "copyout")
        dest = typed(zeroed(buf.nbytes), buf.dtype) if into is None else into
        try:
            holder, address, nbytes = pin(dest, writable=True)
        except BufferUsageError as exc:
            raise BufferUsageError(f"copyout into: {exc}") from None
        if nbytes != buf.nbytes:
            raise BufferUsageError(f"copyout: destination has {nbytes} bytes, {buf!r} has {buf.nbytes}")
        name = f"copyout {nbytes} B"
        body: list[Command] = [(COPY, name, self.copy_fn, address, handle, nbytes)]
        engine = self._copy_engine(buf, False, priority)
        return self._submit(engine, name, body, (buf,), (), (holder, buf), dest, hold, window)

    def _transfer(self, dst: Buffer, src: Buffer, hold: bool, window: Window | None, priority: int = 0) -> Op:
        """:func:`transfer` on this device's copy engine (the device :func:`transfer_device` picked)."""
        src_dev, dst_dev = src.owner, dst.owner
        for dev in (src_dev, dst_dev):  # the other device too: a closed one takes no new work
            if dev.state != "open":
                dev.check_usable("transfer")
        src_handle = src_dev._check(src, "transfer")
        dst_handle = dst_dev._check(dst, "transfer")
        if dst.nbytes != src.nbytes:
            raise BufferUsageError(f"transfer: {src!r} has {src.nbytes} bytes, {dst!r} has {dst.nbytes}")
        name = f"transfer {src.nbytes} B {src_dev.name}->{dst_dev.name}"
        body: list[Command] = [(COPY, name, self.copy_fn, dst_handle, src_handle, src.nbytes)]
        return self._submit(self.queue("copy", priority), name, body, (src,), (dst,), (src, dst), None, hold, window)

    async def compile(self, src: str, name: str = "kernel", outs: Sequence[int] | None = None) -> Program:
        """Compile ``src`` off the event loop (through the compile cache) and load kernel ``name``.

        ``outs`` lists the indices of the buffers the kernel writes (default: all). Cancelling the wait returns at
        once; the compiler runs on to its end (at most ``ARUNTIME_COMPILE_TIMEOUT`` seconds, default 300, then
        it is killed and the compile is a :class:`CompileError`), and what it built goes to the cache.
        """
        if not isinstance(src, str) or not isinstance(name, str):
            raise TypeError("compile: src and name must be str")
        if not (name.isidentifier() and name.isascii()):
            raise ValueError(f"compile on {self.name}: kernel name {name!r} is not a C identifier")
        if outs is not None:
            outs = _indices(f"compile {name}", outs)
            if any(i < 0 for i in outs):
                raise ValueError(f"compile {name}: outs {list(outs)} must be buffer indices (>= 0)")
        self.check_usable(f"compile {name}")
        if self.compiler is None:
            raise DeviceError(f"{self.name} has no compiler")
        compiler = self.compiler
        check_source(src)
        src = self._kernel_source(src, name)

        def build() -> Program:
            return compiler.compile_cached(src, load=lambda lib: self.program_type(self, name, lib, outs))

        return await anyio.to_thread.run_sync(build, abandon_on_cancel=True)

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
        priority: int = 0,
    ) -> Op:
        """Run ``prog`` on ``bufs`` and the scalar ``vals`` on the compute engine; ``await`` the op for the
        kernel to be done.

        ``outs`` (default: the program's, else all) are the indices of the buffers it writes;
        the others are only read. ``hold``, ``window``, ``priority``: see :meth:`copyin`.
        """
        fast = self._compute.fast
        if fast is not None:
            made: Op | None = fast.launch(self, prog, bufs, vals, outs, hold, window, priority)
            if made is not None:
                return made
        engine = self.queue("compute", priority)
        reads, writes = self._launch_access(prog, bufs, outs)
        plain = check_scalars(f"launch {prog.name}", vals)
        body = [self._launch_command(prog, bufs, plain, writes)]  # the op holds the buffers until it is done
        return self._submit(engine, prog.name, body, reads, writes, bufs, None, hold, window)

    def _launch_command(
        self, prog: Program, bufs: Sequence[Buffer], vals: Sequence[int | float], writes: Sequence[Buffer]
    ) -> Command:
        """The command of a checked launch that writes ``writes``: ``EXEC`` of what ``prog.bind`` returns."""
        fn, args = prog.bind([b._handle for b in bufs], vals)  # checked: every handle is there
        return (EXEC, prog.name, fn, args)
