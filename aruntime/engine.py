"""Ops, command queues and the engines that execute them.

An :class:`Engine` owns a :class:`TimelineSignal`. Each submission is one
:class:`CommandQueue` (a list of wait, signal, timestamp, exec and copy
commands) plus the :class:`Op` handle that tracks it; the engine runs
submissions in order and then sets its signal to the op's value, which wakes
every thread and task waiting on that op. :class:`ThreadEngine` executes the
commands on a Python worker thread; a backend with hardware queues subclasses
:class:`Engine` and maps the same commands onto them.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from time import perf_counter_ns
from typing import Any

from aruntime.errors import DependencyError, DeviceError, OpError, SignalTimeout
from aruntime.events import now_us, op_ids, recorder
from aruntime.signal import TimelineSignal, wait_registered
from aruntime.wakeup import Waker, deferral, flush

HELD = 1 << 62
"""The ``value`` of an op that is held: bound for an engine, not yet handed to it."""
_later_lock = threading.Lock()

WAIT, SIGNAL, TIMESTAMP, EXEC, COPY = range(5)  # the engine relies on this order: control commands first
Command = tuple[Any, ...]
CopyFn = Callable[[int, int, int], object]


class CommandQueue:
    """A chainable list of commands, submitted to an engine as one unit."""

    __slots__ = ("cmds",)

    def __init__(self) -> None:
        self.cmds: list[Command] = []

    def wait(self, signal: TimelineSignal, value: int) -> CommandQueue:
        """Block the engine until ``signal`` reaches ``value``."""
        self.cmds.append((WAIT, signal, value))
        return self

    def signal(self, signal: TimelineSignal, value: int) -> CommandQueue:
        """Set ``signal`` to ``value``."""
        self.cmds.append((SIGNAL, signal, value))
        return self

    def timestamp(self, sink: list[float]) -> CommandQueue:
        """Append the engine's clock (host µs) to ``sink`` when this command runs."""
        self.cmds.append((TIMESTAMP, sink))
        return self

    def exec(self, name: str, fn: Callable[..., object], args: Sequence[Any] = ()) -> CommandQueue:
        """Run the program ``fn(*args)``."""
        self.cmds.append((EXEC, name, fn, tuple(args)))
        return self

    def copy(self, name: str, fn: CopyFn, dst: int, src: int, nbytes: int) -> CommandQueue:
        """Copy ``nbytes`` with ``fn(dst, src, n)``; the engine may split it into chunks."""
        self.cmds.append((COPY, name, fn, dst, src, nbytes))
        return self


class Op:
    """The awaitable handle of one submission.

    ``await op`` (or ``op.wait()`` from a thread) returns the op's result once
    the engine has run it, or raises the error it failed with. Cancelling the
    awaiting task stops only the waiting: the op still runs.

    An op may be *held*: bound for an engine but not yet handed to it, until
    the ops it depends on allow it (see :meth:`BaseDevice.copyin`'s ``hold``).
    Its ``value`` is then :data:`HELD`.

    What an engine uses: ``cmds`` (the commands to run, until done), ``deps``
    (ops it is ordered after), ``inputs`` (ops whose output it consumes; see
    :func:`check_deps`), ``value`` (the engine signal
    value that marks it done), ``engine``, and ``error`` (set when it fails).
    """

    __slots__ = (
        "cmds",
        "deps",
        "engine",
        "error",
        "id",
        "inputs",
        "keep",
        "later",
        "name",
        "observed",
        "result",
        "value",
    )

    def __init__(self, name: str, deps: Sequence[Op] = (), keep: Any = None, result: Any = None) -> None:
        self.name = name
        self.deps = deps
        self.inputs: Sequence[Op] = ()
        self.keep = keep
        self.result = result
        self.error: BaseException | None = None
        self.observed = False
        self.engine: Engine | None = None
        self.cmds: list[Command] | None = None  # held from submission until the op has run
        self.value = 0
        self.later: list[tuple[bool, Callable[[], None]]] | None = None  # while held: (on_dispatch, callback)
        self.id = next(op_ids)

    def __repr__(self) -> str:
        state = "failed" if self.error is not None else "done" if self.done() else "pending"
        return f"<Op #{self.id} {self.name} {state}>"

    @property
    def dispatched(self) -> bool:
        """Whether the op has been handed to its engine (it is not held)."""
        return self.engine is not None and self.value != HELD

    def hold(self, engine: Engine) -> None:
        """Bind the op to ``engine`` without handing it over yet (see :meth:`Engine.push`)."""
        self.engine = engine
        self.value = HELD
        self.later = []
        engine.held.add(self)

    def abandon(self, engine: Engine, error: BaseException) -> None:
        """Fail an op that can no longer be handed to ``engine`` (it was closed while the op was held): the op
        counts as done, with ``error``, and whatever waited for its dispatch or its end runs now."""
        with _later_lock:
            later, self.later = self.later or [], None
            self.error = error
            self.engine = engine
            self.value = 0  # done: every timeline is at 0 or beyond
        engine.held.discard(self)
        engine._note_failure(self)
        for _, callback in later:
            callback()

    def _when(self, on_dispatch: bool, callback: Callable[[], None]) -> None:
        if self.value == HELD:
            with _later_lock:
                if self.value == HELD:
                    assert self.later is not None
                    self.later.append((on_dispatch, callback))
                    return
        if on_dispatch:
            callback()
        else:
            self._submitted().signal.on_reach(self.value, callback)

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on whichever thread finishes the op) once it is done; now if it is."""
        self._when(False, callback)

    def when_dispatched(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the op has been handed to its engine; now if it has."""
        self._when(True, callback)

    async def settled(self) -> None:
        """Wait until the op is done, whatever its outcome (cancelling the wait leaves the op alone)."""
        engine = self._submitted()
        if self.value == HELD:
            limit = engine.signal.timeout
            await wait_registered(self.when_done, limit, lambda: self._held_timeout(limit))
        elif engine.signal.value < self.value:
            await engine.signal.wait_async(self.value)

    def _held_timeout(self, limit: float) -> SignalTimeout:
        state = "still held (not handed to its engine)" if self.value == HELD else "not done"
        return SignalTimeout(f"{self.name} on {self._submitted().signal.name}: {state} after {limit:g} s")

    def done(self) -> bool:
        """Whether the engine has finished with this op (successfully or not)."""
        engine = self.engine
        return engine is not None and engine.signal.value >= self.value

    def _outcome(self) -> Any:
        if self.error is not None:
            self.observed = True
            raise self.error
        return self.result

    def __await__(self) -> Generator[Any, None, Any]:
        signal = self._submitted().signal
        if signal.value < self.value:
            if self.value == HELD:
                yield from self.settled().__await__()
            else:  # what settled() does, without two coroutine frames per await
                yield from signal.wait_async(self.value).__await__()
        return self._outcome()

    def wait(self, timeout: float | None = None) -> Any:
        """Block the calling thread until the op is done; return its result or raise its error."""
        self.wait_done(timeout)
        return self._outcome()

    def wait_done(self, timeout: float | None = None) -> None:
        """Block the calling thread until the op is done, whatever its outcome."""
        signal = self._submitted().signal
        if self.value != HELD:
            signal.wait(self.value, timeout)
            return
        finished = threading.Event()
        self.when_done(finished.set)
        limit = signal.timeout if timeout is None else timeout
        if not finished.wait(limit):
            raise self._held_timeout(limit)

    def _submitted(self) -> Engine:
        if self.engine is None:
            raise RuntimeError(f"{self.name}: this op was never submitted")
        return self.engine


class Engine:
    """Runs submissions in order and advances its timeline signal after each one.

    Subclasses implement :meth:`_enqueue` to hand ``(cmds, op)`` to whatever
    executes them; whatever executes them calls :meth:`_complete` afterwards.
    """

    def __init__(self, device: str, kind: str, timeout: float) -> None:
        self.device = device
        self.kind = kind
        self.is_copy = kind == "copy"
        self.signal = TimelineSignal(f"{device} {kind} queue", timeout)
        self.ranges = recorder.range_log(device, self.is_copy)
        self.last = 0
        self.held: set[Op] = set()  # ops bound for this engine, not yet handed to it
        self.failed: list[Op] = []
        self.closed = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.signal.name}>"

    def submit(self, cq: CommandQueue, op: Op) -> Op:
        """Hand ``cq`` to the engine; ``op`` completes when it has run. Never blocks."""
        return self.push(cq.cmds, op)

    def push(self, cmds: list[Command], op: Op) -> Op:
        """:meth:`submit` for a plain list of commands, which the engine then owns."""
        with self._lock:
            self.check_open(op.name)
            self.last = op.value = self.last + 1
            op.engine = self
            op.cmds = cmds
            self._enqueue(cmds, op)
        if op.later is not None:  # it was held: run what waited for its dispatch, pass on what waits for the end
            self.held.discard(op)
            with _later_lock:
                later, op.later = op.later, None
            for on_dispatch, callback in later:
                if on_dispatch:
                    callback()
                else:
                    self.signal.on_reach(op.value, callback)
        return op

    def check_open(self, what: str) -> None:
        """Raise :class:`DeviceError` (naming ``what``) if the engine is closed."""
        if self.closed:
            raise DeviceError(f"{what}: {self.signal.name} is closed")

    def _enqueue(self, cmds: list[Command], op: Op) -> None:
        raise NotImplementedError

    def _fail(self, op: Op, error: BaseException) -> None:
        """Record ``error`` (wrapped in an :class:`OpError` naming the op and queue) as the op's, if it has none."""
        if op.error is None:
            if not isinstance(error, OpError):
                wrapped = OpError(f"{op.name} failed on {self.signal.name}: {error!r}")
                wrapped.__cause__ = error
                error = wrapped
            op.error = error

    def _complete(self, op: Op, error: BaseException | None) -> None:
        if error is not None:
            self._fail(op, error)
            self._note_failure(op)
        op.keep = op.cmds = None
        op.deps = op.inputs = ()
        self.signal.set(op.value)

    def _note_failure(self, op: Op) -> None:
        with self._lock:
            self.failed.append(op)
            if len(self.failed) > 256:  # a server that awaits its ops but never synchronizes: keep the unseen
                self.failed = [f for f in self.failed if not f.observed]

    def take_failures(self) -> list[Op]:
        """The failed ops nobody awaited since the last call (and forget them)."""
        with self._lock:
            failed, self.failed = self.failed, []
        return [op for op in failed if not op.observed]

    def close(self) -> None:
        """Stop accepting work (a later submission raises :class:`DeviceError`); what was submitted still runs."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._stop()

    def _stop(self) -> None:
        """Called once, under the engine's lock, when it closes: let whatever executes finish and end."""


def check_deps(op: Op) -> None:
    """Raise :class:`DependencyError` if an op whose output ``op`` consumes failed (engines call it before running)."""
    for dep in op.inputs:
        error = dep.error
        if error is not None:
            first = error.first if isinstance(error, DependencyError) else dep.name
            raise DependencyError(f"{op.name} was not run: it depends on {first}, which failed", first)


def first_failure(failed: Sequence[Op], others: str) -> BaseException:
    """The error to raise for ``failed`` ops (each with an error): the first root cause, that is the first
    error that is not a :class:`DependencyError`, else the first error. Marks every op observed; when there
    are several, notes how many more ``others`` (e.g. "failed in this scheduler")."""
    roots = [op for op in failed if not isinstance(op.error, DependencyError)]
    error = (roots or failed)[0].error
    assert error is not None
    for op in failed:
        op.observed = True
    if len(failed) > 1 and sys.version_info >= (3, 11):
        error.add_note(f"{len(failed) - 1} more op(s) {others}")
    return error


SHORT_COPY = 1 << 20
"""Copies up to this size count as short: an engine may run one before it wakes the loops of tasks
awaiting ops it completed earlier (see :class:`ThreadEngine`)."""
DEFER_NS = 200_000
"""How long an engine may go on with short commands before it wakes the loops it deferred."""


class ThreadEngine(Engine):
    """An engine whose commands run on one Python worker thread.

    ``chunk`` bounds the bytes of one copy call, so a big copy is a series of
    short calls (each releases the GIL) rather than one long one.

    When the worker completes an op whose awaiting task's loop is asleep, it
    does not wake that loop at once if more work is queued: it wakes it when it
    runs out of queued work, before a command that may take long (a kernel, a
    copy of more than :data:`SHORT_COPY` bytes, a wait that blocks), and before
    any command once :data:`DEFER_NS` has passed. Waking a sleeping loop is a
    system call that costs about as much as a 1 MiB copy; a stream of copies
    awaited in turn would otherwise pay it for each. Only completions are
    deferred: a loop woken by a command itself (a kernel setting a signal) is
    woken at once.
    """

    def __init__(self, device: str, kind: str, timeout: float, chunk: int = 8 << 20) -> None:
        super().__init__(device, kind, timeout)
        self.chunk = chunk
        self._ops: deque[Op | None] = deque()
        self._idle = False  # the worker is (about to be) asleep on the pipe and must be woken
        self._deferred: list[Waker] = []  # (worker only) wakers whose loops its completions have not woken yet
        self._flush_by = 0  # perf_counter_ns() deadline for them, 0 until the worker next checks
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name=self.signal.name, daemon=True)
        self._thread.start()

    def _enqueue(self, cmds: list[Command], op: Op | None) -> None:
        self._ops.append(op)
        if self._idle:
            self._idle = False
            os.write(self._wake_w, b"\0")  # the system call runs without the GIL

    def close(self) -> None:
        """Stop accepting work; wait until what was submitted has run (unless called from this engine's thread)."""
        super().close()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _stop(self) -> None:
        self._enqueue([], None)

    def _next(self) -> Op | None:
        ops = self._ops
        if self._deferred:
            self._flush_if(not ops)
        while not ops:
            self._idle = True
            if ops:  # appended after the check above: no wake-up is coming for it
                self._idle = False
                break
            os.read(self._wake_r, 4096)  # sleeps without the GIL; extra bytes only cost a spare loop turn
        return ops.popleft()

    def _flush_if(self, long: bool) -> None:
        """Wake the deferred loops if what comes next may take ``long``, or the deferral's time is up."""
        if not long:
            now = perf_counter_ns()
            if not self._flush_by:
                self._flush_by = now + DEFER_NS
            if now <= self._flush_by:
                return
        self._flush_by = 0
        flush(self._deferred)

    def _run(self) -> None:
        get = self._next
        execute = self._execute
        complete = self._complete
        deferred, local = self._deferred, deferral
        try:
            while (op := get()) is not None:
                try:
                    execute(op)
                except BaseException as exc:  # the op's awaiter (or synchronize) receives it
                    error: BaseException | None = exc
                else:
                    error = None
                local.wakers = deferred
                try:
                    complete(op, error)
                finally:
                    local.wakers = None
        finally:
            self._flush_if(True)
            os.close(self._wake_r)  # nothing writes after the end: only a sleeping worker is ever woken
            os.close(self._wake_w)

    def _execute(self, op: Op) -> None:
        assert op.cmds is not None
        checked = not op.inputs
        cmds = op.cmds
        deferred = self._deferred
        for i, cmd in enumerate(cmds):
            try:
                kind = cmd[0]
                if deferred:  # a kernel, a long copy or a blocking wait may take long
                    blocks = kind == WAIT and cmd[1].value < cmd[2]
                    self._flush_if(kind == EXEC or (kind == COPY and cmd[5] > SHORT_COPY) or blocks)
                if kind < EXEC:
                    if kind == WAIT:
                        cmd[1].wait(cmd[2])
                        checked = not op.inputs  # a producer on the queue waited for may have failed: check again
                    elif kind == SIGNAL:
                        cmd[1].set(cmd[2])
                    else:
                        cmd[1].append(now_us())
                    continue
                if not checked:
                    check_deps(op)
                    checked = True
                recording = recorder.enabled
                start = perf_counter_ns() if recording else 0
                if kind == EXEC:
                    cmd[2](*cmd[3])
                else:
                    self._copy(cmd[2], cmd[3], cmd[4], cmd[5])
                if recording:  # RangeLog.add, inlined: this runs once per command
                    ranges = self.ranges
                    ranges.ends.append(perf_counter_ns())
                    ranges.starts.append(start)
                    ranges.names.append(cmd[1])
                    ranges.ops.append(op.id)
            except BaseException as exc:
                # the rest of this queue is skipped, but its signals are still set: engines waiting on them
                # (e.g. other queues of a graph replay) go on, and their dependency checks, which find this
                # op's error already in place, fail their ops instead
                self._fail(op, exc)
                for rest in cmds[i + 1 :]:
                    if rest[0] == SIGNAL:
                        rest[1].set(rest[2])
                raise

    def _copy(self, fn: CopyFn, dst: int, src: int, nbytes: int) -> None:
        step = self.chunk
        if nbytes <= step:
            fn(dst, src, nbytes)
        else:
            for off in range(0, nbytes, step):
                fn(dst + off, src + off, min(step, nbytes - off))
