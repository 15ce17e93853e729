"""The scheduler: straight-line async code in, overlapped work across queues and devices out.

Ops enqueued through a :class:`Scheduler` are tracked at once, in program
order; their order comes only from the buffers they read and write (see
:mod:`aruntime.hazards`), so independent copies and kernels run on different
queues and devices at the same time. The scheduler adds what a pipeline or a
server needs on top: a bounded in-flight window and a bounded queue in front
of it (backpressure), failures collected and raised at the latest on exit, and
a shielded, bounded drain when the scope is cancelled.

Its op methods are the devices' (same names, same rule): each returns the
op's handle at once, and ``await handle`` is the result.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from aruntime.device import Program, transfer
from aruntime.engine import Engine, Op, first_failure
from aruntime.errors import OpError, SchedulerFull, SignalTimeout
from aruntime.helpers import after_all, checkpoint
from aruntime.memory import Buffer

if TYPE_CHECKING:
    from aruntime.graph import Graph, GraphRun


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
    nothing in use is freed. Entering, leaving, :meth:`room` and :meth:`drain`
    are checkpoints even when there is nothing to wait for.
    """

    def __init__(self, window: int = 1024, queue: int = 4096, drain_timeout: float = 30.0) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if not isinstance(queue, int) or isinstance(queue, bool) or queue < 0:
            raise ValueError(f"queue must be a non-negative int, got {queue!r}")
        if not isinstance(drain_timeout, (int, float)) or isinstance(drain_timeout, bool) or not drain_timeout > 0:
            raise ValueError(f"drain_timeout must be a positive number of seconds, got {drain_timeout!r}")
        self.window = window
        self.queue = queue
        self.drain_timeout = drain_timeout
        self._inflight: deque[Op] = deque()  # admitted, in the order they were
        self._waiting: deque[tuple[Sequence[Op], Callable[[], None]]] = deque()  # queued: ops and what hands them on
        self._queued = 0  # ops in _waiting
        self._watching = False  # whether the oldest op in flight will call _pump when it is done
        self._lock = threading.Lock()  # engine threads retire and admit too
        self._failed: list[Op] = []
        self._open = False

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
                self._drop_queued()
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.drain_timeout):
                    await self._wait_all()
        finally:
            self._open = False
        if exc_type is None:
            self._raise_failures()

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
        inflight = self._inflight
        while inflight and inflight[0].done():
            op = inflight.popleft()
            if op.error is not None:
                self._failed.append(op)

    def _admit(self, ops: Sequence[Op]) -> bool:
        """Admit ``ops`` into the window now if it has room and nothing is queued (True), else False (then
        :meth:`_queue_for_room` queues them). Called by the device for each op it tracks for this scheduler."""
        with self._lock:
            if self._waiting:
                return False
            inflight = self._inflight
            if len(inflight) >= self.window:
                self._retire()
                if len(inflight) >= self.window:
                    return False
            inflight.extend(ops)
            return True

    def _queue_for_room(self, ops: Sequence[Op], go: Callable[[], None]) -> None:
        """Queue ``ops`` (refused by :meth:`_admit`); ``go`` is called, from any thread, once they are admitted."""
        with self._lock:
            self._waiting.append((ops, go))
            self._queued += len(ops)
        self._pump()

    def _pump(self) -> Op | None:
        """Admit queued ops while the window has room, then watch the oldest op in flight if some are left.

        Returns None if an op enqueued now would be admitted at once, else the oldest op in flight."""
        ready = []
        with self._lock:
            self._retire()
            waiting, inflight = self._waiting, self._inflight
            while waiting and len(inflight) < self.window:
                ops, go = waiting.popleft()
                self._queued -= len(ops)
                inflight.extend(ops)
                ready.append(go)
            full = bool(waiting) or len(inflight) >= self.window  # then inflight is not empty (window >= 1)
            oldest = inflight[0] if full else None
            watch = oldest if waiting and not self._watching else None
            if watch is not None:
                self._watching = True
        for go in ready:
            go()
        if watch is not None:
            watch.when_done(self._watched_done)
        return oldest

    def _watched_done(self) -> None:
        with self._lock:
            self._watching = False
        self._pump()

    def _drop_queued(self) -> None:
        """Fail every queued op: it will not be handed to its engine.

        Each one fails only once the ops it depends on are done: the hazard logs
        forget an access that a newer one covers and is ordered after, so a
        dropped op counting as done earlier would let its buffer's memory go
        while an older op still uses it."""
        with self._lock:
            dropped, self._waiting = self._waiting, deque()
            self._queued = 0
        for ops, _ in dropped:
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

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError("the scheduler is not open: use `async with Scheduler() as sched:`")
        if self._queued < self.queue:
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
                ops = [op for ops, _ in self._waiting for op in ops]
                ops.extend(self._inflight)
            if not ops:
                return
            last: dict[Engine, int] = {}  # an engine runs its ops in order: waiting for its latest covers the rest
            held = []
            for op in ops:
                engine = op.engine
                assert engine is not None
                if not op.dispatched:
                    held.append(op)
                elif op.value > last.get(engine, 0):
                    last[engine] = op.value
            for op in held:
                await op.settled()
            for engine, value in last.items():
                await engine.signal.wait_async(value)

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

    def copyin(self, buf: Buffer, data: Any) -> Op:
        """Enqueue a copy of host ``data`` into ``buf`` (see :meth:`BaseDevice.copyin`)."""
        self._check_open()
        return buf.owner.copyin(buf, data, window=self)

    def copyout(self, buf: Buffer, into: Any = None) -> Op:
        """Enqueue a copy of ``buf`` to the host; awaiting the handle gives the data (see
        :meth:`BaseDevice.copyout`)."""
        self._check_open()
        return buf.owner.copyout(buf, into, window=self)

    def transfer(self, dst: Buffer, src: Buffer) -> Op:
        """Enqueue a device-to-device copy of ``src`` into ``dst`` (see :func:`aruntime.transfer`)."""
        self._check_open()
        return transfer(dst, src, window=self)

    def launch(
        self, prog: Program, *bufs: Buffer, vals: Sequence[int | float] = (), outs: Sequence[int] | None = None
    ) -> Op:
        """Enqueue a kernel on its device's compute queue (see :meth:`BaseDevice.launch`)."""
        self._check_open()
        return prog.device.launch(prog, *bufs, vals=vals, outs=outs, window=self)

    def replay(self, graph: Graph, buffers: dict[Buffer, Buffer] | None = None, **inputs: Any) -> GraphRun:
        """Enqueue a replay of a captured :class:`~aruntime.graph.Graph` (see :meth:`Graph.replay`)."""
        self._check_open()
        return graph._replay(buffers, inputs, self)
