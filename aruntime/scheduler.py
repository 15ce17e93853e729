"""The scheduler: straight-line async code in, overlapped work across queues and devices out.

Ops enqueued through a :class:`Scheduler` are tracked at once, in program
order; their order comes only from the buffers they read and write (see
:mod:`aruntime.hazards`), so independent copies and kernels run on different
queues and devices at the same time. The scheduler adds what a pipeline or a
server needs on top: a bounded in-flight window and a bounded queue in front
of it (backpressure), failures collected and raised at the latest on exit, and
a shielded, bounded drain when the scope is cancelled.

Its op methods are the devices' (same names, same rule): each returns the
op's handle at once, and ``await handle`` is the result. A server wraps each
request's ops in :meth:`Scheduler.request`, so that the ops of a request whose
client went away, or whose deadline passed, are skipped rather than run.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from aruntime.device import Program, transfer
from aruntime.engine import Op, first_failure
from aruntime.engine.native import submit
from aruntime.engine.ops import DEADLINE, SHARED, SKIP, check_priority, new_gate
from aruntime.errors import BufferUsageError, DeadlineExceeded, DeviceError, OpError, SchedulerFull, SignalTimeout
from aruntime.helpers import after_all, check_seconds, checkpoint
from aruntime.memory import Buffer

if TYPE_CHECKING:
    from aruntime.device import BaseDevice
    from aruntime.graph import Graph, GraphRun


_current_request: contextvars.ContextVar[Request | None] = contextvars.ContextVar("aruntime_request", default=None)


_pumping = threading.local()
"""Per thread, the schedulers whose ``_pump`` runs on it now (by ``id``), each True once asked to go round again."""


class _Queued:
    """Ops a scheduler's window refused, queued in order until it admits them; ``go`` hands them on once it has."""

    __slots__ = ("admitted", "dropped", "go", "ops")

    def __init__(self, ops: Sequence[Op]) -> None:
        self.ops = ops
        self.go: Callable[[], None] | None = None  # given by _queue_for_room
        self.admitted = False
        self.dropped = False  # by Scheduler._drop_queued


def _drop(ops: Sequence[Op]) -> None:
    """Fail ops queued for a scheduler's window that closed: they will not be handed to their engines.

    Each one fails only once the ops it depends on are done: the hazard logs forget an access that a newer one
    covers and is ordered after, so a dropped op counting as done earlier would let its buffer's memory go while an
    older op still uses it."""
    for op in ops:
        assert op.engine is not None  # held for its engine
        op.observed = True
        error = OpError(f"{op.name} was dropped: its scheduler closed before it was admitted")
        fail = functools.partial(op.abandon, op.engine, error)
        pending = [dep for dep in op.deps if not dep.done()]
        if not pending:
            fail()
            continue
        one_done = after_all(len(pending), fail)
        for dep in pending:
            dep.when_done(one_done)


class Scheduler:
    """An async context manager that submits ops with backpressure and collects their failures.

    Every op method (:meth:`copyin`, :meth:`copyout`, :meth:`transfer`,
    :meth:`launch`, :meth:`replay`) returns the op's handle at once; ``await
    handle`` gives its result (for a copy-out, the data). ``window`` bounds the
    ops in flight (handed to their queues, or waiting only for the ops they
    depend on). An op enqueued while the window is full waits in the
    scheduler's queue, in order, and is handed on as soon as an older op is
    done; at most ``queue`` ops wait there, and enqueueing one more raises
    :class:`~aruntime.errors.SchedulerFull`. A producer that does not await its
    results calls ``await sched.room()`` once per round, which waits until the
    queue is empty and the window has room, so that what it holds stays bounded.

    Leaving the context waits for all work and raises the first failure nobody
    awaited. If the scope is cancelled or fails, ops still in the queue are
    dropped (awaiting one raises an :class:`~aruntime.errors.OpError`) and those
    in flight are waited for (shielded, at most ``drain_timeout`` seconds), so
    nothing in use is freed; those in flight that have not started are skipped
    (see :meth:`request`). Entering, leaving, :meth:`room` and :meth:`drain`
    are checkpoints even when there is nothing to wait for.

    ``priority`` is that of its ops (0, normal, or -1, high; see
    :meth:`BaseDevice.queue <aruntime.device.BaseDevice.queue>`), and each op method
    takes its own. The window admits ops in the order they come, whatever their
    priority: latency-sensitive work goes through a scheduler of its own.
    """

    __slots__ = (
        "__weakref__",
        "_drain_timeout",
        "_failed",
        "_inflight",
        "_lock",
        "_open",
        "_own_gate",
        "_queue",
        "_queued",
        "_requests",
        "_reserved",
        "_waiting",
        "_watching",
        "_window",
        "priority",
    )  # read in place by the native submission path

    _request_var = _current_request
    """The context variable of the current task's request (the native submission path reads it)."""

    def __init__(self, window: int = 1024, queue: int = 4096, drain_timeout: float = 30.0, priority: int = 0) -> None:
        self.priority = check_priority(priority, "Scheduler")
        self.window = window
        self.queue = queue
        self.drain_timeout = drain_timeout
        self._inflight: deque[Op] = deque()  # admitted, in the order they were
        self._waiting: deque[_Queued] = deque()  # refused by _admit, in the order they were
        self._reserved: dict[int, _Queued] = {}  # by its first op's id: the entries _queue_for_room is yet to fill
        self._queued = 0  # ops in _waiting
        self._watching = False  # whether the oldest op in flight will call _pump when it is done
        self._lock = submit.new_lock()  # engine threads retire and admit too
        self._failed: list[Op] = []
        self._open = False
        self._own_gate = new_gate()  # the gate of ops submitted outside any request
        self._requests: set[Request] = set()  # open requests

    @property
    def window(self) -> int:
        """The most ops in flight at once (a positive int); a new value applies from the next op admitted."""
        return self._window

    @window.setter
    def window(self, window: int) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window < 1 << 62:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self._window = window

    @property
    def queue(self) -> int:
        """The most ops waiting for room in the window before an op method raises :class:`SchedulerFull`
        (a non-negative int)."""
        return self._queue

    @queue.setter
    def queue(self, queue: int) -> None:
        if not isinstance(queue, int) or isinstance(queue, bool) or not 0 <= queue < 1 << 62:
            raise ValueError(f"queue must be a non-negative int, got {queue!r}")
        self._queue = queue

    @property
    def drain_timeout(self) -> float:
        """Seconds that leaving on a failure or a cancellation waits for the ops in flight (positive)."""
        return self._drain_timeout

    @drain_timeout.setter
    def drain_timeout(self, drain_timeout: float) -> None:
        self._drain_timeout = check_seconds("drain_timeout", drain_timeout)

    async def __aenter__(self) -> Scheduler:
        await checkpoint()
        if self._open:
            raise RuntimeError("this scheduler is already open")
        self._open = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is None:
                await self._wait_all()
            else:
                for request in list(self._requests):
                    request.skip()
                _skip(self._own_gate)
                self._drop_queued()
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.drain_timeout):
                    await self._wait_all()
        finally:
            self._open = False
            self._own_gate = new_gate()
        if exc_type is None:
            self._raise_failures()

    def request(self, deadline: float | None = None) -> Request:
        """A scope for one request's ops: ``async with sched.request(deadline=0.5): ...``.

        The ops the current task enqueues through this scheduler inside the block belong to the request. If
        the block is left by an exception (the task was cancelled: its client went away; a failure), the
        request's ops that have not started are *skipped*: their queue passes over them (their commands do
        not run, their queue's signal still advances, the hazards they took part in resolve as if they ran)
        and each fails with :class:`~aruntime.errors.OpSkipped`, counted in its engine's ``skipped``. Ops
        already running finish. An op outside the request that reads what a skipped op would have written fails
        with a :class:`~aruntime.errors.DependencyError` naming it; so that it never comes to that when
        the reader came first, a request some of whose output is read by work outside it (another request, an
        op outside any) is not skipped at all.

        ``deadline`` (seconds from entering) bounds the whole block: when it passes, the block is cancelled and
        raises :class:`~aruntime.errors.DeadlineExceeded` (a ``SignalTimeout``), and the queues skip the
        request's ops not started by then, without waiting for the event loop. A skipped op counts as
        observed: it is raised neither at the scheduler's exit nor by ``synchronize``.

        The native and Python engines (CPU, NULL, DISK devices) skip; CL and CUDA queues run what was handed to
        their driver. A request belongs to one task (a context variable carries it; a task started inside it
        belongs to it while it is open), and a request opened inside another of the same scheduler joins it: one
        skip covers both, and while the inner block is open the earlier of the two deadlines applies to the
        ops of both. Graph replays are never skipped, and a request that a replay reads from is not either.
        """
        return Request(self, None if deadline is None else check_seconds("deadline", deadline))

    def _open_request(self) -> Request | None:
        """The current task's innermost request of this scheduler that is still open (a task started inside a
        request that has ended since is in none)."""
        request = _current_request.get()
        while request is not None and (request.scheduler is not self or request not in self._requests):
            request = request.enclosing
        return request

    def _gate(self) -> array[int]:
        """The gate of an op submitted now: its task's open request's, else the scheduler's own."""
        request = self._open_request()
        return self._own_gate if request is None else request.gate

    @property
    def in_flight(self) -> int:
        """Ops admitted into the window and not known to be done."""
        with self._lock:
            self._retire()
            return len(self._inflight)

    @property
    def queued(self) -> int:
        """Ops enqueued and waiting for room in the window."""
        return self._queued

    # ---- the window (engine threads call _pump) ---------------------------------------------------

    def _retire(self) -> None:
        """Drop the done ops at the head of the window (under the lock)."""
        fast = submit.loaded()
        if fast is not None:  # the same in C
            fast.retire_window(self._inflight, self._failed)
            return
        inflight = self._inflight
        while inflight and inflight[0].done():
            op = inflight.popleft()
            if op.error is not None:
                self._failed.append(op)

    def _admit(self, ops: Sequence[Op]) -> bool:
        """Admit ``ops`` into the window now if it has room and nothing is queued (True), else queue them (False:
        :meth:`_queue_for_room` then says what hands them on). Called by the device for each op it tracks for this
        scheduler, under :func:`~aruntime.memory.hazards.logs_held`'s lock with the op's accesses: ops are
        admitted in the order they found one another in, also from several threads, so that no op in the window
        waits for one still queued behind it."""
        with self._lock:
            if not self._waiting:
                inflight = self._inflight
                if len(inflight) >= self._window:
                    self._retire()
                if len(inflight) < self._window:
                    inflight.extend(ops)
                    return True
            entry = _Queued(ops)
            self._waiting.append(entry)
            self._queued += len(ops)
            self._reserved[id(ops[0])] = entry
            return False

    def _queue_for_room(self, ops: Sequence[Op], go: Callable[[], None]) -> None:
        """``go`` hands on ``ops``, queued by :meth:`_admit`: it is called, from any thread, once they are admitted
        (now, if they were meanwhile)."""
        with self._lock:
            entry = self._reserved.pop(id(ops[0]), None)
            if entry is None:
                raise RuntimeError(f"{ops[0].name}: not queued for room by this scheduler")
            admitted, dropped = entry.admitted, entry.dropped  # decided here: _drop_queued reads go under the lock
            if not admitted and not dropped:
                entry.go = go
        if admitted:
            go()
        elif dropped:  # while it was being submitted: its dependencies are known now
            _drop(ops)
        else:
            self._pump()

    def _pump(self) -> Op | None:
        """Admit queued ops while the window has room, then watch the oldest op in flight if some are left.

        Returns None if an op enqueued now would be admitted at once, else the oldest op in flight. A call made on
        this thread while it runs (the watched op was done already, an admitted op's callbacks) makes it go round
        again instead of nesting: threads finishing ops while it runs never grow the stack."""
        running = _pumping.__dict__.setdefault("now", {})
        key = id(self)
        if key in running:
            running[key] = True
            return None
        try:
            while True:
                running[key] = False
                oldest = self._pump_once()
                if not running[key]:
                    return oldest
        finally:
            del running[key]

    def _pump_once(self) -> Op | None:
        ready = []
        with self._lock:
            self._retire()
            waiting, inflight = self._waiting, self._inflight
            while waiting and len(inflight) < self._window:
                entry = waiting.popleft()
                self._queued -= len(entry.ops)
                inflight.extend(entry.ops)
                entry.admitted = True
                if entry.go is not None:  # else _queue_for_room calls it
                    ready.append(entry.go)
            full = bool(waiting) or len(inflight) >= self._window  # then inflight is not empty (window >= 1)
            oldest = inflight[0] if full else None
            watch = oldest if waiting and not self._watching else None
            if watch is not None:
                self._watching = True
        for go in ready:
            go()
        if watch is not None:
            try:
                watch.when_done(self._watched_done)
            except BaseException:
                with self._lock:
                    self._watching = False  # nothing watches it: the next _pump does
                raise
        return oldest

    def _watched_done(self) -> None:
        with self._lock:
            self._watching = False
        self._pump()

    def _drop_queued(self) -> None:
        """Fail every queued op once the ops it depends on are done (see :func:`_drop`)."""
        with self._lock:
            dropped, self._waiting = self._waiting, deque()
            self._queued = 0
            for entry in dropped:
                entry.dropped = True  # one still being submitted (no go yet): _queue_for_room drops it
            submitted = [entry.ops for entry in dropped if entry.go is not None]
        for ops in submitted:
            _drop(ops)

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError("the scheduler is not open: use `async with Scheduler() as sched:`")
        if self._queued < self._queue:
            return
        with self._lock:
            self._retire()
            full = bool(self._waiting) or len(self._inflight) >= self.window
        if full:
            raise SchedulerFull(
                f"{self._queued} ops already wait for room in the scheduler's window of {self.window} "
                f"(queue={self.queue}): `await sched.room()` before enqueueing more"
            )

    # ---- waiting ------------------------------------------------------------------------------------

    async def room(self) -> None:
        """Wait until an op enqueued now is admitted at once: nothing queued, fewer than ``window`` in flight.
        A checkpoint even when there is room."""
        await checkpoint()
        while (oldest := self._pump()) is not None:
            try:
                await oldest.settled()
            except SignalTimeout as exc:
                raise SignalTimeout(
                    f"scheduler room: the window of {self.window} ops was full and its oldest op, "
                    f"{oldest.name}, did not finish in time: {exc}"
                ) from exc

    async def _wait_all(self) -> None:
        await checkpoint()  # also when nothing is left to wait for
        while True:
            with self._lock:
                self._retire()
                ops = [op for entry in self._waiting for op in entry.ops]
                ops.extend(self._inflight)
            # the newest op not done first: by the time it is, most of the others are (one wake-up, not one each)
            newest = next((op for op in reversed(ops) if not op.done()), None)
            if newest is None:
                return
            await newest.settled()

    def _raise_failures(self) -> None:
        with self._lock:
            self._retire()
            failed = [op for op in self._failed if not op.observed]
            self._failed = []
        if failed:
            raise first_failure(failed, "failed in this scheduler (dependents included)")

    async def drain(self) -> None:
        """Wait for everything enqueued so far; raise the first failure nobody awaited."""
        await self._wait_all()
        self._raise_failures()

    # ---- ops ----------------------------------------------------------------------------------------

    def copyin(self, buf: Buffer, data: Any, priority: int | None = None) -> Op:
        """Enqueue a copy of host ``data`` into ``buf`` (see :meth:`BaseDevice.copyin`); ``priority``: the
        scheduler's unless given (so for each op method)."""
        fast = submit.loaded()
        if fast is not None:
            made: Op | None = fast.sched_copy(self, buf, data, False, priority)
            if made is not None:
                return made  # the same, in C
        self._check_open()
        return _owner(buf, "copyin").copyin(
            buf, data, window=self, priority=self.priority if priority is None else priority
        )

    def copyout(self, buf: Buffer, into: Any = None, priority: int | None = None) -> Op:
        """Enqueue a copy of ``buf`` to the host; awaiting the handle gives the data (see
        :meth:`BaseDevice.copyout`)."""
        fast = submit.loaded()
        if fast is not None:
            made: Op | None = fast.sched_copy(self, buf, into, True, priority)
            if made is not None:
                return made  # the same, in C
        self._check_open()
        return _owner(buf, "copyout").copyout(
            buf, into, window=self, priority=self.priority if priority is None else priority
        )

    def transfer(self, dst: Buffer, src: Buffer, priority: int | None = None) -> Op:
        """Enqueue a device-to-device copy of ``src`` into ``dst`` (see :func:`aruntime.transfer`)."""
        self._check_open()
        return transfer(dst, src, window=self, priority=self.priority if priority is None else priority)

    def launch(
        self,
        prog: Program,
        *bufs: Buffer,
        vals: Sequence[int | float] = (),
        outs: Sequence[int] | None = None,
        priority: int | None = None,
    ) -> Op:
        """Enqueue a kernel on its device's compute queue (see :meth:`BaseDevice.launch`)."""
        fast = submit.loaded()
        if fast is not None:
            made: Op | None = fast.sched_launch(self, prog, bufs, vals, outs, priority)
            if made is not None:
                return made  # the same, in C
        self._check_open()
        if not isinstance(prog, Program):
            raise DeviceError(f"launch: {prog!r} is not a program (Device.compile makes one)")
        return prog.device.launch(
            prog, *bufs, vals=vals, outs=outs, window=self, priority=self.priority if priority is None else priority
        )

    def replay(self, graph: Graph, buffers: dict[Buffer, Buffer] | None = None, **inputs: Any) -> GraphRun:
        """Enqueue a replay of a captured :class:`~aruntime.graph.Graph` (see :meth:`Graph.replay`)."""
        self._check_open()
        return graph._replay(buffers, inputs, self)


def _owner(buf: Buffer, what: str) -> BaseDevice:
    """The device of ``buf``, for an op ``what`` on it; a :class:`BufferUsageError` where it is no buffer."""
    if not isinstance(buf, Buffer):
        raise BufferUsageError(f"{what}: expected a Buffer, got {type(buf).__name__}")
    return buf.owner


def _skip(gate: array[int]) -> bool:
    """Tell the queues to skip the not yet started ops of ``gate``, unless work outside reads them."""
    if gate[SHARED]:
        return False
    gate[SKIP] = 1
    return True


class Request:
    """The ops one task submits through a scheduler inside ``async with sched.request():`` (see
    :meth:`Scheduler.request`). A request opened inside another of the same scheduler joins it: one skip
    covers both, and while it is open the earlier of their deadlines applies to the ops of both."""

    def __init__(self, scheduler: Scheduler, deadline: float | None) -> None:
        self.scheduler = scheduler
        self.deadline = deadline
        """Seconds the block may take (None: no bound)."""
        self.gate = new_gate()
        self.enclosing: Request | None = None
        """The task's request (of any scheduler) this one was opened in."""
        self._scope: anyio.CancelScope | None = None
        self._token: contextvars.Token[Request | None] | None = None
        self._entered = False
        self._deadline_before = 0  # the gate's deadline before this block set its own

    @property
    def skipped(self) -> bool:
        """Whether the queues were told to skip this request's ops not started."""
        return bool(self.gate[SKIP])

    def skip(self) -> bool:
        """Skip this request's ops that have not started (as leaving the block by an exception does); False,
        and nothing skipped, where work outside the request reads what they write."""
        return _skip(self.gate)

    async def __aenter__(self) -> Request:
        await checkpoint()
        if not self.scheduler._open:
            raise RuntimeError("the scheduler is not open: use `async with Scheduler() as sched:`")
        if self._entered:
            raise RuntimeError("a request is entered once: make a new one with sched.request()")
        self._entered = True
        self.enclosing = _current_request.get()
        outer = self.scheduler._open_request()  # of the same scheduler: this one joins it
        if outer is not None:
            self.gate = outer.gate
        self._deadline_before = self.gate[DEADLINE]
        if self.deadline is not None:
            end = min(time.monotonic_ns() + int(self.deadline * 1e9), 1 << 62)
            self.gate[DEADLINE] = min(end, self._deadline_before or end)
            self._scope = anyio.CancelScope(deadline=anyio.current_time() + self.deadline)
            self._scope.__enter__()
        self._token = _current_request.set(self)
        self.scheduler._requests.add(self)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        swallowed = False
        try:
            self.scheduler._requests.discard(self)
            if exc_type is not None:
                if self._scope is not None and self._scope.cancel_called:  # the deadline ended the block: the loop's
                    self.gate[DEADLINE] = min(self.gate[DEADLINE], time.monotonic_ns())  # timer may run a bit early
                self.skip()
            else:  # ended in time: what it left running is bounded by the enclosing request only
                self.gate[DEADLINE] = self._deadline_before
            if self._token is not None:
                with contextlib.suppress(ValueError):  # left in another context (a framework's): that one's value
                    _current_request.reset(self._token)
        finally:
            if self._scope is not None:
                swallowed = bool(self._scope.__exit__(exc_type, exc, tb))
        if self._scope is not None and self._scope.cancelled_caught:
            raise DeadlineExceeded(
                f"request deadline of {self.deadline:g} s passed: its ops that had not started were skipped"
            )
        return swallowed
