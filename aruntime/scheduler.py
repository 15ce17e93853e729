"""The scheduler: straight-line async code in, overlapped work across queues and devices out.

Ops enqueued through a :class:`Scheduler` are submitted at once; their order
comes only from the buffers they read and write (see :mod:`aruntime.hazards`),
so independent copies and kernels run on different queues and devices at the
same time. The scheduler adds what a pipeline or a server needs on top: a
bounded in-flight window (backpressure), failures collected and raised at the
latest on exit, and a shielded, bounded drain when the scope is cancelled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from aruntime.buffer import Buffer
from aruntime.device import Program
from aruntime.engine import Engine, Op, first_failure
from aruntime.errors import SignalTimeout

if TYPE_CHECKING:
    from aruntime.graph import Graph, GraphRun


class Scheduler:
    """An async context manager that submits ops with backpressure and collects their failures.

    ``window`` bounds the ops in flight: enqueueing beyond it waits until the
    oldest op is done; tasks that wait are admitted in the order they came.
    Every enqueue returns the op's awaitable handle (for a
    copy-out, awaiting it gives the data). Leaving the context waits for all
    work and raises the first failure nobody awaited. If the scope is cancelled,
    ops not yet submitted are dropped and those already running are waited for
    (shielded, at most ``drain_timeout`` seconds), so nothing in use is freed.
    """

    def __init__(self, window: int = 1024, drain_timeout: float = 30.0) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        if not isinstance(drain_timeout, (int, float)) or isinstance(drain_timeout, bool) or not drain_timeout > 0:
            raise ValueError(f"drain_timeout must be a positive number of seconds, got {drain_timeout!r}")
        self.window = window
        self.drain_timeout = drain_timeout
        self._inflight: deque[Op] = deque()
        self._queued: deque[anyio.Event] = deque()  # tasks waiting for room in the window, first come first served
        self._failed: list[Op] = []
        self._open = False

    async def __aenter__(self) -> Scheduler:
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
                with anyio.CancelScope(shield=True), anyio.move_on_after(self.drain_timeout):
                    await self._wait_all()
        finally:
            self._open = False
        if exc_type is None:
            self._raise_failures()

    @property
    def in_flight(self) -> int:
        """Ops submitted through this scheduler and not known to be done."""
        self._retire()
        return len(self._inflight)

    def _retire(self) -> None:
        inflight = self._inflight
        while inflight and inflight[0].done():
            op = inflight.popleft()
            if op.error is not None:
                self._failed.append(op)

    async def _wait_all(self) -> None:
        inflight = self._inflight
        while inflight:
            last: dict[Engine, int] = {}  # an engine runs its ops in order: waiting for its latest covers the rest
            held = []
            for op in inflight:
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
            self._retire()

    def _raise_failures(self) -> None:
        self._retire()
        failed = [op for op in self._failed if not op.observed]
        self._failed = []
        if failed:
            raise first_failure(failed, "failed in this scheduler (dependents included)")

    async def drain(self) -> None:
        """Wait for everything enqueued so far; raise the first failure nobody awaited."""
        await self._wait_all()
        self._raise_failures()

    def _has_room(self) -> bool:
        """Whether an op may be submitted now, without waiting (and nobody is waiting before it)."""
        if not self._open:
            raise RuntimeError("the scheduler is not open: use `async with Scheduler() as sched:`")
        if self._queued:
            return False
        if len(self._inflight) < self.window:
            return True
        self._retire()
        return len(self._inflight) < self.window

    async def _admit(self) -> None:
        """Wait, in turn, until the window has room.

        Only the task at the head of the queue waits for ops to finish; once it
        is admitted it wakes the next one, so a finishing op wakes one task,
        not every waiting one.
        """
        turn = anyio.Event()
        queued = self._queued
        queued.append(turn)
        try:
            if queued[0] is not turn:
                await turn.wait()
            inflight = self._inflight
            self._retire()
            while len(inflight) >= self.window:
                oldest = inflight[0]
                try:
                    await oldest.settled()
                except SignalTimeout as exc:
                    raise SignalTimeout(
                        f"scheduler admission: the window of {self.window} ops was full and its oldest op, "
                        f"{oldest.name}, did not finish in time: {exc}"
                    ) from exc
                self._retire()
        finally:  # admitted or cancelled: leave the queue, and pass the head on
            head = queued[0] is turn
            queued.remove(turn)
            if head and queued:
                queued[0].set()

    def _track(self, op: Op) -> Op:
        self._inflight.append(op)
        return op

    async def copyin(self, buf: Buffer, data: Any) -> Op:
        """Enqueue a copy of host ``data`` into ``buf`` (waits while the window is full)."""
        if not self._has_room():
            await self._admit()
        return self._track(buf.owner.copyin(buf, data, hold=True))

    async def copyout(self, buf: Buffer, into: Any = None) -> Op:
        """Enqueue a copy of ``buf`` to the host; awaiting the handle gives the data."""
        if not self._has_room():
            await self._admit()
        return self._track(buf.owner.copyout(buf, into, hold=True))

    async def transfer(self, dst: Buffer, src: Buffer) -> Op:
        """Enqueue a device-to-device copy on the source's copy queue."""
        if not self._has_room():
            await self._admit()
        return self._track(src.owner.transfer(dst, src, hold=True))

    async def launch(
        self, prog: Program, *bufs: Buffer, vals: Sequence[int | float] = (), outs: Sequence[int] | None = None
    ) -> Op:
        """Enqueue a kernel on its device's compute queue."""
        if not self._has_room():
            await self._admit()
        return self._track(prog.device.launch(prog, *bufs, vals=vals, outs=outs, hold=True))

    async def replay(self, graph: Graph, buffers: dict[Buffer, Buffer] | None = None, **inputs: Any) -> GraphRun:
        """Enqueue a replay of a captured :class:`~aruntime.graph.Graph` (see :meth:`Graph.replay`)."""
        if not self._has_room():
            await self._admit()
        run = graph.replay(buffers, **inputs)
        for op in run.ops:
            self._track(op)
        return run
