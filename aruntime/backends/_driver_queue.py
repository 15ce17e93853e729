"""What backends whose hardware runs the commands share (CL, CUDA): the driver-queue engine and device.

An engine here is one in-order hardware queue (an OpenCL command queue, a CUDA stream) and the thread
that completes its ops. :meth:`DriverEngine._submit` turns an op's commands into driver calls, in
order:

* ``WAIT`` on a signal that another engine of the same kind sets becomes a wait on that engine's
  event for the op (an OpenCL event wait list, ``cuStreamWaitEvent``), ordered by the driver with no
  host wait. A wait on any other signal is a host wait: by default a host-set event (an OpenCL user
  event) that the completion thread sets once the signal passes; a :class:`ThreadedDriverEngine`
  waits on its submission thread instead.
* ``SIGNAL`` and ``TIMESTAMP`` become marker events; the completion thread sets the signal or reads
  the event's time when the event has passed.
* ``EXEC`` and ``COPY`` become the backend's driver calls (:meth:`DriverEngine._command`).

A command the driver refuses fails the op (:meth:`DriverEngine._driver_error` maps the driver's
exception); the signals it was to set are set when its queue gets there. The completion thread waits
for each op's events in order (:meth:`DriverEngine._wait_event`, without the GIL: no Python runs on a
driver thread), checks its inputs again, records its ranges and completes it.

A new such backend subclasses :class:`DriverEngine` (or :class:`ThreadedDriverEngine`) with its driver
calls and :class:`DriverDevice` with its allocator, compiler and program type. :class:`StagingPool` is
the ring of pinned staging buffers for copies from and to pageable host memory.
"""

from __future__ import annotations

import queue as queues
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from aruntime.device import BaseDevice
from aruntime.engine import (
    SIGNAL,
    TIMESTAMP,
    WAIT,
    Command,
    CopyFault,
    Engine,
    Op,
    TimelineSignal,
    check_deps,
    fault_error,
    host_copy,
)
from aruntime.errors import DeviceError
from aruntime.events import recorder

Step = tuple[Any, ...]
"""What the completion thread does at one point of an op: (WAIT, signal, value, host event),
(SIGNAL, signal, value, event or None) or (TIMESTAMP, sink, event)."""
Span = tuple[str, Any, Any]
"""A command's profile range: its name and the events at its start and at its end."""
Submitted = tuple[Op | None, list[Step], Any, list[Span], BaseException | None]
"""What the completion thread gets per op: the op (None: only steps to do), its steps, the event that
ends it (or None), its ranges and the error its submission met."""

_engines: weakref.WeakValueDictionary[int, DriverEngine] = weakref.WeakValueDictionary()  # id(signal) -> engine


class DriverEngine(Engine):
    """One in-order hardware queue, enqueued on from the submitting thread, and the thread that completes its ops.

    A backend implements the driver calls: :meth:`_marker`, :meth:`_command`, :meth:`_order_after`,
    :meth:`_wait_event`, :meth:`_clock_us` and :meth:`_span_ns`; :meth:`_host_event` and
    :meth:`_set_host_event` for host waits; optionally :meth:`_end`, :meth:`_driver_error` and
    :meth:`_on_thread`. It calls :meth:`_start` at the end of its ``__init__``.
    """

    def __init__(self, device: str, kind: str, timeout: float) -> None:
        super().__init__(device, kind, timeout)
        self._events: dict[int, Any] = {}  # op value -> the event that ends it, until the op is complete
        self._completions: queues.SimpleQueue[Submitted | None] = queues.SimpleQueue()
        self._threads: list[threading.Thread] = []
        _engines[id(self.signal)] = self

    def _start(self) -> None:
        """Start the engine's threads (the backend's queue exists by now)."""
        self._threads.append(threading.Thread(target=self._complete_loop, name=self.signal.name, daemon=True))
        for t in self._threads:
            t.start()

    # ---- the driver calls a backend implements ----------------------------------------------------

    def _marker(self, timed: bool, wait_for: list[Any]) -> Any:
        """Enqueue an event after ``wait_for`` and the work so far (``timed``: one the clock can read)."""
        raise NotImplementedError

    def _command(self, cmd: Command, wait_for: list[Any]) -> tuple[Any, Span | None]:
        """Enqueue an ``EXEC`` or ``COPY`` command after ``wait_for``; the event it ends with (or None) and its
        profile range (or None)."""
        raise NotImplementedError

    def _order_after(self, event: Any, wait_for: list[Any]) -> None:
        """Order what follows after ``event``, an event of an engine of this kind, on the device."""
        raise NotImplementedError

    def _host_event(self) -> Any:
        """A new event that the host sets (what follows a host wait waits on it)."""
        raise NotImplementedError

    def _set_host_event(self, event: Any) -> None:
        """Set a :meth:`_host_event`."""
        raise NotImplementedError

    def _wait_event(self, event: Any) -> BaseException | None:
        """Block (without the GIL) until ``event`` has passed; the error if it or the work before it failed."""
        raise NotImplementedError

    def _clock_us(self, event: Any) -> float:
        """The engine's clock, in µs, at a timed ``event`` that has passed."""
        raise NotImplementedError

    def _span_ns(self, start: Any, end: Any) -> tuple[int, int]:
        """A :data:`Span`'s start and end in the engine's clock, in ns."""
        raise NotImplementedError

    def _end(self, last: Any) -> Any:
        """The event that ends an op whose last command's event is ``last`` (None: nothing to wait for)."""
        return last

    def _driver_error(self, exc: BaseException) -> BaseException:
        """The error an op fails with when its submission raised ``exc`` (by default ``exc`` itself)."""
        return exc

    def _on_thread(self) -> None:
        """Run first on each of the engine's threads (to make a driver context current, say)."""

    # ---- submission -------------------------------------------------------------------------------

    def _enqueue(self, cmds: list[Command], op: Op) -> None:
        self._submit(cmds, op)

    def _submit(self, cmds: list[Command], op: Op) -> None:
        """Enqueue the op's commands in order, then hand the op to the completion thread."""
        steps: list[Step] = []
        spans: list[Span] = []
        wait_for: list[Any] = []
        last: Any = None
        error: BaseException | None = None
        i = -1
        try:
            if op.inputs:
                check_deps(op, settle=False)  # an input that already failed: nothing is enqueued
            for i, cmd in enumerate(cmds):  # noqa: B007 (after a failure, i says where it stopped)
                kind = cmd[0]
                if kind == WAIT:
                    self._wait(cmd[1], cmd[2], wait_for, steps)
                    continue
                if kind in (SIGNAL, TIMESTAMP):
                    last = self._marker(kind == TIMESTAMP, wait_for)
                    steps.append((*cmd, last))
                else:
                    last, span = self._command(cmd, wait_for)
                    if span is not None:
                        spans.append(span)
                wait_for = []
            if wait_for:  # waits with no command after them: the op ends when they pass
                last = self._marker(False, wait_for)
        except BaseException as exc:  # the op fails; the signals it was to set are set when its queue gets there
            if isinstance(exc, CopyFault):  # a staged copy met a file-backed page that is gone
                error = fault_error(op.name, cmds[i][1], self.signal.name, exc.side)
            else:
                error = self._driver_error(exc)
            self._fail(op, error)
            steps.extend((SIGNAL, c[1], c[2], None) for c in cmds[i + 1 :] if c[0] == SIGNAL)
        self._submitted(op, steps, self._end(last), spans, error)

    def _wait(self, signal: TimelineSignal, value: int, wait_for: list[Any], steps: list[Step]) -> None:
        """Order what follows after ``signal`` reaches ``value``; ``steps`` are the op's steps so far."""
        if signal.value >= value:
            return
        other = _engines.get(id(signal))
        event = None
        if other is not None and type(other) is type(self):  # an engine of this kind: one of its events
            event = other._event_of(value)
        if event is not None:
            self._order_after(event, wait_for)  # on the device, no host wait
        elif signal.value < value:
            self._wait_on_host(signal, value, wait_for, steps)

    def _event_of(self, value: int) -> Any:
        """The event that ends this engine's op ``value`` (None if there is none, or it is done)."""
        return self._events.get(value)

    def _wait_on_host(self, signal: TimelineSignal, value: int, wait_for: list[Any], steps: list[Step]) -> None:
        """A wait on a signal no engine of this kind sets: what follows waits on a host event that the completion
        thread sets once the signal passes (or when the wait times out, failing the op)."""
        event = self._host_event()
        steps.append((WAIT, signal, value, event))
        wait_for.append(event)

    def _submitted(self, op: Op, steps: list[Step], end: Any, spans: list[Span], error: BaseException | None) -> None:
        """Hand the submitted op to the completion thread."""
        if end is not None:
            self._events[op.value] = end
        self._completions.put((op, steps, end, spans, error))

    # ---- completion -------------------------------------------------------------------------------

    def _complete_loop(self) -> None:
        self._on_thread()
        while (item := self._completions.get()) is not None:
            self._finish(*item)

    def _finish(
        self, op: Op | None, steps: list[Step], end: Any, spans: list[Span], error: BaseException | None
    ) -> None:
        """Do the op's steps in order, wait for the event that ends it, complete it. An op already done costs one
        wait that returns at once, so a run of finished ops completes without sleeping."""
        for step in steps:
            if step[0] == WAIT:
                if error is None:
                    try:
                        step[1].wait(step[2])  # times out after the signal's timeout
                    except BaseException as exc:
                        error = exc
                self._set_host_event(step[3])  # what waits on it runs either way
                continue
            event = step[-1]
            if event is not None:
                error = error or self._wait_event(event)
            if step[0] == SIGNAL:
                step[1].set(step[2])
            elif error is None:
                step[1].append(self._clock_us(event))
        if op is None:  # the signals of an op whose submission waits on the host for another signal
            return
        if end is not None:
            error = error or self._wait_event(end)
        if error is None and op.inputs:
            try:
                check_deps(op)  # a producer on another queue failed after this op was enqueued
            except BaseException as exc:
                error = exc
        if error is None and recorder.enabled:
            for name, start, stop in spans:
                self.ranges.add(name, *self._span_ns(start, stop), op.id)
        self._events.pop(op.value, None)
        self._complete(op, error)

    def close(self) -> None:
        """Stop accepting work; wait until what was submitted has completed (unless called from its threads)."""
        super().close()
        if threading.current_thread() not in self._threads:
            for t in self._threads:
                t.join()

    def _stop(self) -> None:
        self._completions.put(None)


class ThreadedDriverEngine(DriverEngine):
    """A :class:`DriverEngine` that enqueues on a submission thread of its own, so that a wait on a signal no
    engine of its kind sets blocks that thread (the driver has no host-set events to wait on instead)."""

    def __init__(self, device: str, kind: str, timeout: float) -> None:
        super().__init__(device, kind, timeout)
        self._submissions: queues.SimpleQueue[tuple[list[Command], Op] | None] = queues.SimpleQueue()
        self._recorded = 0  # the last op value whose end event is recorded
        self._cond = threading.Condition()

    def _start(self) -> None:
        self._threads.append(threading.Thread(target=self._submit_loop, name=f"{self.signal.name} submit", daemon=True))
        super()._start()

    def _enqueue(self, cmds: list[Command], op: Op) -> None:
        self._submissions.put((cmds, op))

    def _submit_loop(self) -> None:
        self._on_thread()
        while (item := self._submissions.get()) is not None:
            self._submit(*item)
        self._completions.put(None)

    def _event_of(self, value: int) -> Any:
        """The end event of this engine's op ``value`` once recorded (None if already done)."""
        with self._cond:
            self._cond.wait_for(lambda: self._recorded >= value or self.signal.value >= value)
        return self._events.get(value)

    def _wait_on_host(self, signal: TimelineSignal, value: int, wait_for: list[Any], steps: list[Step]) -> None:
        """Wait for the signal on the submission thread (it times out after the signal's timeout)."""
        if steps:  # what this op signalled so far may be what the wait needs (graph replays): set it first
            self._completions.put((None, list(steps), None, [], None))
            steps.clear()
        signal.wait(value)

    def _submitted(self, op: Op, steps: list[Step], end: Any, spans: list[Span], error: BaseException | None) -> None:
        with self._cond:
            if end is not None:
                self._events[op.value] = end
            self._recorded = op.value
            self._cond.notify_all()
        self._completions.put((op, steps, end, spans, error))

    def _stop(self) -> None:
        self._submissions.put(None)


def launch_dims(name: str, what: str, dims: Sequence[int]) -> tuple[int, ...]:
    """``dims`` (a kernel's grid or block, global or local size) as a tuple, checked to be 1 to 3 positive ints."""
    if not (1 <= len(dims) <= 3 and all(type(d) is int and d > 0 for d in dims)):
        raise ValueError(f"{name}: {what} must be 1 to 3 positive ints, got {dims!r}")
    return tuple(dims)


def _enqueued(dst: int, src: int, nbytes: int) -> None:
    raise DeviceError("copies on this device are enqueued by its engines; copy_fn is not called")


class DriverDevice(BaseDevice):
    """A device whose engines are :class:`DriverEngine` s: they enqueue its copies (to, from and between its
    memory and host addresses) on the driver's queues themselves."""

    copies_host = True
    copy_fn = staticmethod(_enqueued)


class StagingPool:
    """A ring of ``count`` pinned host buffers of ``chunk`` bytes for copies from and to pageable memory.

    A copy moves ``chunk`` bytes per DMA through the next buffer of the ring. Before a buffer is used
    again, the completion ``event`` recorded after its last DMA is waited for (and, for a copy out, its
    bytes are copied on to their destination), so ``count`` chunks are in flight. ``alloc(n)`` gives a
    pinned host address (and what keeps it alive), ``record()`` an event after the work enqueued so far,
    ``wait(event)`` blocks until it has passed. The host side of each chunk is copied with
    :func:`~aruntime.engine.host_copy`: a page of a file-backed mapping that is gone raises
    :class:`~aruntime.engine.CopyFault` (a copy out then delivers none of its chunks still in flight).
    """

    def __init__(
        self,
        count: int,
        chunk: int,
        alloc: Callable[[int], tuple[int, object]],
        record: Callable[[], object],
        wait: Callable[[object], None],
    ) -> None:
        self.chunk = chunk
        self.record = record
        self.wait = wait
        self._slots = [alloc(chunk) for _ in range(count)]
        self._pending: list[tuple[object, int, int] | None] = [None] * count  # (event, copy-out dest, bytes)
        self._next = 0

    def _take(self) -> int:
        i = self._next
        self._next = (i + 1) % len(self._slots)
        self._settle(i)
        return i

    def _settle(self, i: int, deliver: bool = True) -> None:
        pending = self._pending[i]
        if pending is not None:
            event, dest, nbytes = pending
            self.wait(event)
            self._pending[i] = None
            if dest and deliver:
                host_copy(dest, self._slots[i][0], nbytes)

    def copy_in(self, dst: int, src: int, nbytes: int, dma: Callable[[int, int, int], object]) -> None:
        """Copy ``nbytes`` from host address ``src`` to device address ``dst`` with ``dma(dst, pinned, n)``."""
        for off in range(0, nbytes, self.chunk):
            n = min(self.chunk, nbytes - off)
            i = self._take()
            pinned = self._slots[i][0]
            host_copy(pinned, src + off, n)
            dma(dst + off, pinned, n)
            self._pending[i] = (self.record(), 0, n)

    def copy_out(self, dst: int, src: int, nbytes: int, dma: Callable[[int, int, int], object]) -> None:
        """Copy ``nbytes`` from device address ``src`` to host address ``dst``; returns once all are in ``dst``."""
        try:
            for off in range(0, nbytes, self.chunk):
                n = min(self.chunk, nbytes - off)
                i = self._take()
                dma(self._slots[i][0], src + off, n)
                self._pending[i] = (self.record(), dst + off, n)
            for k in range(len(self._slots)):  # the last chunks, oldest first
                self._settle((self._next + k) % len(self._slots))
        except CopyFault:  # its chunks still in flight are not delivered: the op fails, its memory may go
            for k in range(len(self._slots)):
                self._settle(k, deliver=False)
            raise
