"""Ops, command queues and the engine interface.

An :class:`Engine` owns a :class:`TimelineSignal`. Each submission is one
:class:`CommandQueue` (a list of wait, signal, timestamp, exec and copy
commands) plus the :class:`Op` handle that tracks it; the engine runs
submissions in order and then sets its signal to the op's value, which wakes
every thread and task waiting on that op. The native engine
(:mod:`aruntime.engine.native.engine`) runs the commands in C; the Python
:class:`~aruntime.engine.thread.ThreadEngine` is its fallback; a backend with
hardware queues subclasses :class:`Engine` and maps the same commands onto them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Collection, Generator, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from aruntime.engine import native
from aruntime.engine.kernel import _NATIVE_COPIES
from aruntime.engine.metrics import summary
from aruntime.engine.signal import TimelineSignal, wait_registered
from aruntime.errors import (
    DeadlineExceeded,
    DependencyError,
    DeviceError,
    FileTruncated,
    OpError,
    OpSkipped,
    SignalTimeout,
)
from aruntime.events import RangeLog, op_ids, recorder
from aruntime.helpers import checkpoint, getenv
from aruntime.memory.hazards import in_submission

HELD = 1 << 62
"""The ``value`` of an op that is held: bound for an engine, not yet handed to it."""
ABANDONED = 1 << 63
"""What the cell of an op pending in the native core reads once the core found its engine stopped."""
_later_lock = threading.Lock()
_log = logging.getLogger("aruntime")

WAIT, SIGNAL, TIMESTAMP, EXEC, COPY = range(5)  # the engine relies on this order: control commands first
Command = tuple[Any, ...]
Later = list[tuple[bool, Callable[[], None], object]] | tuple[()]
"""What waits for a held op: ``(on_dispatch, callback, where)`` each; the empty tuple while nothing does."""
CopyFn = Callable[[int, int, int], object]


SKIP, DEADLINE, SHARED = range(3)
"""The words of an op's gate (``array("q")``, shared by the ops of one request): skip it if not started (non-zero),
skip it if not started by this ``time.monotonic_ns()`` (0: no deadline), and whether work outside the request
reads what its ops write (then they are never skipped)."""


HIGH = -1
"""The high priority of a device's queues (see :func:`check_priority`); 0 is the normal one."""


def check_priority(priority: object, what: str) -> int:
    """``priority`` if it is a priority a device's queues take: 0 (normal, the default) or :data:`HIGH` (-1: its
    ops overtake queued normal ones, as a CUDA stream of lower priority number does); else a ``ValueError``
    naming ``what`` and the value."""
    if isinstance(priority, bool) or not isinstance(priority, int) or priority not in (0, HIGH):
        raise ValueError(f"{what}: priority must be 0 (normal) or -1 (high), got {priority!r}")
    return priority


def new_gate(deadline_ns: int = 0) -> array[int]:
    """A gate for the ops of one request (see :data:`SKIP`)."""
    return array("q", [0, deadline_ns, 0])


def check_gate(gate: object) -> array[int]:
    """``gate`` if it is one (what :func:`new_gate` makes: the queues read and write its three words), else a
    TypeError."""
    if not (isinstance(gate, array) and gate.typecode == "q" and len(gate) == 3):
        raise TypeError(f"a window's gate must be a writable array('q') of 3 words (ops.new_gate), got {gate!r}")
    return gate


def protect(producers: Iterable[Op], gate: array[int] | None) -> None:
    """An op of ``gate`` (None: of no request) reads what ``producers`` write: the request of each producer from
    another one is never skipped from now on, unless it was told to skip already (then the reader fails,
    naming the skipped op)."""
    for producer in producers:
        other = producer.gate
        if other is not None and other is not gate and not other[SKIP]:
            other[SHARED] = 1


def skip_error(op: Op, deadline: bool) -> OpSkipped:
    """The error of ``op``, skipped by its engine before it started (its gate said so, or its ``deadline``
    passed). A skipped op counts as observed: nobody was left to read it."""
    op.observed = True
    if deadline:
        return DeadlineExceeded(f"{op.name} was skipped: its request's deadline passed before it started")
    return OpSkipped(f"{op.name} was skipped: its request was cancelled before it started")


def gate_error(op: Op) -> OpSkipped | None:
    """Whether ``op``'s gate says to skip it now (the error it then fails with), else None (an engine asks just
    before the op's first copy or kernel)."""
    gate = op.gate
    if gate is None or gate[SHARED]:
        return None
    if gate[DEADLINE] and time.monotonic_ns() >= gate[DEADLINE]:
        return skip_error(op, True)
    return skip_error(op, False) if gate[SKIP] else None


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


class Prepared(list[Command]):
    """Commands made once and submitted many times with a few of them changed (a graph's part of a replay):
    :meth:`fresh` copies them, :meth:`put` replaces one. An engine may keep its own form of them alongside (the
    native engine: their packed ring records, see :meth:`Engine.prepare`)."""

    __slots__ = ()

    def fresh(self) -> Prepared:
        """A copy to change and submit."""
        return Prepared(self)

    def put(self, index: int, cmd: Command) -> None:
        """Replace command ``index`` with ``cmd``, a command of the same kind (and, for a kernel or a copy, of the
        same function)."""
        self[index] = cmd

    def after(self, waits: list[Command]) -> Prepared:
        """These commands with the wait commands ``waits`` first."""
        return Prepared(waits + self)


class Op:
    """The awaitable handle of one submission.

    ``await op`` (or ``op.wait()`` from a thread) returns the op's result once
    the engine has run it, or raises the error it failed with. Cancelling the
    awaiting task stops only the waiting: the op still runs. Awaiting is a
    checkpoint even when the op is done (it checks for cancellation and lets
    other tasks run); an awaiter cancelled there has not observed the op's
    failure, which ``synchronize()`` or the scheduler's exit then raises.

    An op may be *held*: bound for an engine but not yet handed to it, until
    the ops it depends on allow it (see :meth:`BaseDevice.copyin`'s ``hold``).
    Its ``value`` is then :data:`HELD`. A held op is *pending in the native core*
    when it has a ``cell``: the core hands it to its queue itself, from the
    thread that meets its last dependency, and writes its value at ``cell[at]``; Python
    takes that value when it next looks at the op (:meth:`_resolve`).

    What an engine uses: ``cmds`` (the commands to run, until done), ``deps``
    (ops it is ordered after; a native engine drops them once it has the op's
    waits in its ring), ``inputs`` (ops whose output it consumes; see
    :func:`check_deps`), ``value`` (the engine signal
    value that marks it done), ``engine``, ``error`` (set when it fails), and
    ``gate`` (see :func:`skip_error`).
    """

    __slots__ = (
        "_pend",
        "_value",
        "at",
        "cell",
        "cmds",
        "deps",
        "engine",
        "error",
        "gate",
        "id",
        "inputs",
        "keep",
        "later",
        "name",
        "observed",
        "result",
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
        self.cmds: Sequence[Command] | None = None  # held from submission until the op has run
        self._value = 0
        self.later: Later | None = None  # held: (on_dispatch, callback, where); () until something waits
        self.cell: array[int] | None = None  # pending in the native core: the array where it writes the op's value,
        self.at = 0  # at this index (ops share an array: no tracked object per op)
        self._pend = 0  # pending in the native core: its record there
        self.gate: array[int] | None = None  # submitted in a request: see skip_error
        self.id = next(op_ids)

    def __repr__(self) -> str:
        state = "failed" if self.error is not None else "done" if self.done() else "pending"
        return f"<Op #{self.id} {self.name} {state}>"

    @property
    def value(self) -> int:
        """The value its engine's signal reaches when it is done (:data:`HELD` while it is held); set by its
        engine only."""
        return self._value

    @property
    def pend(self) -> int:
        """Pending in the native core: its record there (0 otherwise); set by its engine only."""
        return self._pend

    @property
    def dispatched(self) -> bool:
        """Whether the op has been handed to its engine (it is not held)."""
        return self.engine is not None and (self._value != HELD or (self.cell is not None and self._resolve()))

    def _resolve(self) -> bool:
        """For an op pending in the native core: whether the core has handed it to its queue; if so, take its
        value (or abandon it, if its engine had stopped) and run what waited for its dispatch."""
        assert self.cell is not None and self.engine is not None
        value = self.cell[self.at]
        if not value:
            return False
        engine = self.engine
        if value == ABANDONED:
            return self.abandon(engine, DeviceError(f"{self.name}: {engine.signal.name} is closed"), resolving=True)
        with _later_lock:
            if self._value != HELD:  # another thread took it
                return True
            if self.later and in_submission():  # what waits for it runs outside submissions
                return False
            self._value = value
            later, self.later = self.later, None
        engine.held.discard(self)
        _run_later(engine, self, later or ())
        return True

    def resolve_when_handed_on(self) -> None:
        """For an op pending in the native core: once the core hands it on, take its value and run what waits in
        ``later`` (added while it was held, before it was pended), which nothing else would look at."""
        engine = self._submitted()
        if self.later:
            engine.when_handed_on(self, self._look_again)

    def _look_again(self) -> None:
        self._resolve()

    def hold(self, engine: Engine) -> None:
        """Bind the op to ``engine`` without handing it over yet (see :meth:`Engine.push`); what already waits
        for it (it was held before) keeps waiting."""
        self.engine = engine
        self._value = HELD
        if self.later is None:
            self.later = ()  # a list once something waits for it: no tracked object per op until then
        engine.held.add(self)

    def drop_unsubmitted(self, engine: Engine, error: BaseException) -> None:
        """Fail a held op whose submission raised ``error`` (already raised to its submitter) before it was handed
        to ``engine`` or pended in its core: what found it meanwhile (another thread's op on the same buffer, a
        window) sees it done with that failure instead of waiting for it forever."""
        if self._value == HELD and self.cell is None:
            self.observed = True
            self.abandon(engine, error)

    def abandon(self, engine: Engine, error: BaseException, resolving: bool = False) -> bool:
        """Fail an op that can no longer be handed to ``engine`` (it was closed while the op was held): the op
        counts as done, with ``error``, and whatever waited for its dispatch or its end runs now. Once: an op
        another thread has abandoned or taken is left as it is. ``resolving`` (:meth:`_resolve`): nothing is done,
        and False returned, where something waits and this thread is submitting (see :func:`in_submission`)."""
        with _later_lock:
            if self._value != HELD:
                return True
            if resolving and self.later and in_submission():
                return False
            later, self.later = self.later or (), None
            engine._fail(self, error)  # an OpError naming the op and queue, ``error`` its cause
            self.engine = engine
            self._value = 0  # done: every timeline is at 0 or beyond
        engine.held.discard(self)
        engine._note_failure(self)
        _run_later(engine, self, [(True, callback, None) for _, callback, _ in later])  # done: each one now
        return True

    def _when(self, on_dispatch: bool, callback: Callable[[], None]) -> None:
        engine = self._submitted()
        signal = engine.signal
        if self._value == HELD and self.cell is not None and not self._resolve():
            # pending in the native core: look again once the core hands it on (it tells this thread's loop)
            engine.when_handed_on(self, lambda: self._when(on_dispatch, callback))
            return
        if self._value == HELD:
            added = pended = False
            with _later_lock:
                if self._value == HELD:
                    later = self.later
                    assert later is not None
                    item = (on_dispatch, callback, None if on_dispatch else signal.here())
                    if isinstance(later, list):
                        later.append(item)
                    else:
                        self.later = [item]
                    added, pended = True, self.cell is not None  # pended meanwhile: see resolve_when_handed_on
            if pended:
                self.resolve_when_handed_on()
            if added:
                return
        if on_dispatch:
            callback()
        else:
            signal.on_reach(self._value, callback)

    def _frontier(self) -> Op | None:
        """For an op pending in the native core: an op it waits for, directly or through other pending ops, that
        has been handed to its queue and is not done (the core moves on once it is); None if there is none."""
        todo, seen = [self], {id(self)}
        while todo:
            op = todo.pop()
            if op.value != HELD or (op.cell is not None and op._resolve()):
                if op is not self and not op.done():
                    return op
                continue
            for dep in op.deps:
                if id(dep) not in seen:
                    seen.add(id(dep))
                    todo.append(dep)
        return None

    def _handed_on(self) -> None:
        """Once nothing this op waits for is left unfinished, the core has handed it on, or is doing so on the
        thread that met its last dependency: take its value (waiting at most the queue's timeout for it)."""
        engine = self._submitted()
        deadline = time.monotonic() + engine.signal.timeout
        while not self._resolve():
            if time.monotonic() > deadline:
                self.abandon(engine, DeviceError(f"{self.name}: not handed to its queue by the native core"))
                return
            time.sleep(0)

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the op is done (now if it is): where its signal's ``on_reach`` runs callbacks
        registered by the calling thread."""
        self._when(False, callback)

    def when_dispatched(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the op has been handed to its engine; now if it has."""
        self._when(True, callback)

    async def settled(self) -> None:
        """Wait until the op is done, whatever its outcome (cancelling the wait leaves the op alone); a
        checkpoint even when it is done."""
        engine = self._submitted()
        if self._value == HELD:
            limit = engine.signal.timeout
            await wait_registered(self.when_done, limit, lambda: self._held_timeout(limit))
        else:
            await engine.signal.wait_async(self._value)

    def _held_timeout(self, limit: float) -> SignalTimeout:
        state = "still held (not handed to its engine)" if self._value == HELD else "not done"
        return SignalTimeout(f"{self.name} on {self._submitted().signal.name}: {state} after {limit:g} s")

    def done(self) -> bool:
        """Whether the engine has finished with this op (successfully or not); if so, ``error`` is up to date.

        An engine that learns of failures after its signal has advanced (the native engine) sets them in
        :meth:`Engine.retire`: a done op that it has not retired yet (its ``cmds`` are still held) is retired
        here, so that a done op's ``error`` is never read before it is known.
        """
        engine = self.engine
        if engine is None:
            return False
        if self._value == HELD and (self.cell is None or not self._resolve()):
            return False
        if engine.signal.value < self._value:
            return False
        if self.cmds is not None or engine.failures[0] != engine.failures_seen:
            engine.retire()
        return True

    def refresh(self) -> None:
        """Once the op is done, bring what its engine learns afterwards up to date: its error, its timestamps,
        the memory it kept alive (see :meth:`Engine.retire`)."""
        engine = self.engine
        if engine is not None and (self.cmds is not None or engine.failures[0] != engine.failures_seen):
            engine.retire()

    def _outcome(self) -> Any:
        self.refresh()
        engine = self.engine
        if engine is not None:
            engine.signal.catch_up()
        if self.error is not None:
            self.observed = True
            raise self.error
        return self.result

    def __await__(self) -> Generator[Any, None, Any]:
        signal = self._submitted().signal
        if self._value == HELD and self.cell is not None:
            self._resolve()  # handed to its queue by the core already: wait for its value, as for any op
        if signal.value < self._value:
            if self._value == HELD:
                yield from self.settled().__await__()
            else:  # what settled() does, without two coroutine frames per await
                yield from signal.wait_async(self._value).__await__()
        else:  # done: still a checkpoint; an awaiter cancelled here leaves a failure unobserved
            yield from checkpoint()
        return self._outcome()

    def wait(self, timeout: float | None = None) -> Any:
        """Block the calling thread until the op is done; return its result or raise its error."""
        self.wait_done(timeout)
        return self._outcome()

    def wait_done(self, timeout: float | None = None) -> None:
        """Block the calling thread until the op is done, whatever its outcome."""
        signal = self._submitted().signal
        if self._value == HELD and self.cell is not None:
            limit = signal.timeout if timeout is None else timeout
            deadline = time.monotonic() + limit
            while not self._resolve():
                front = self._frontier()
                if front is None:
                    self._handed_on()
                    continue
                try:
                    front.wait_done(max(0.0, deadline - time.monotonic()))
                except SignalTimeout:
                    raise self._held_timeout(limit) from None
        if self._value != HELD:
            signal.wait(self._value, timeout)
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
    An engine that learns of failures after its signal has advanced counts them
    in ``failures[0]`` and sets the ops' errors in :meth:`retire` (which readers
    call when that count differs from ``failures_seen``).
    """

    failures: Sequence[int] = (0,)
    failures_seen = 0
    last = 0
    """The value of the op handed over last."""
    assigns_values = False
    """Whether :meth:`_enqueue` sets the op's value itself (else :meth:`push` numbers ops in order)."""
    pends = False
    """Whether :meth:`pend` takes ops that wait for others in the engine itself (the native engine)."""
    thread_id = 0
    """The native id of the thread that runs this engine's commands (see :meth:`pin`)."""
    reads_gates = False
    """Whether this engine skips an op whose gate says so before it starts (see :func:`skip_error`); one that does
    not runs every op it was given."""
    skipped = 0
    """Ops this engine skipped because their gate said so."""
    fast: Any = None
    """The native submission path of this engine's eager ops (the module :mod:`aruntime.engine.native.submit`
    builds), or None where every op takes the Python path."""

    def __init__(self, device: str, kind: str, timeout: float) -> None:
        self.device = device
        self.keeps_metrics: bool = getenv("METRICS", 1, minimum=0, maximum=1) == 1  # a bad value: nothing made yet
        """Whether the engine times its ops for :meth:`metrics` (``ARUNTIME_METRICS=0``: counts only)."""
        self.kind = kind
        """``compute`` or ``copy``, with ``_high`` for a device's high-priority queue of that kind."""
        self.is_copy = kind.startswith("copy")
        self.priority = HIGH if kind.endswith("_high") else 0
        """0, or :data:`HIGH` for a high-priority queue (see :meth:`yield_to`)."""
        self.signal = TimelineSignal(f"{device} {kind} queue", timeout)
        self.ranges = recorder.add_log(self._range_log())
        self.held: set[Op] = set()  # ops bound for this engine, not yet handed to it
        self.failed: list[Op] = []
        self.closed = False
        self.crashed: DeviceError | None = None
        self._lock: AbstractContextManager[bool] = threading.Lock()  # submissions
        self._failed_lock = threading.Lock()
        self._mark = (time.monotonic_ns(), 0)  # (when, busy ns) at the last metrics() call

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.signal.name}>"

    def prepare(self, cmds: list[Command]) -> Prepared:
        """``cmds`` made ready to be submitted many times (see :class:`Prepared`)."""
        return Prepared(cmds)

    def submit(self, cq: CommandQueue, op: Op) -> Op:
        """Hand ``cq`` to the engine; ``op`` completes when it has run. Never blocks."""
        return self.push(cq.cmds, op)

    def push(self, cmds: list[Command], op: Op) -> Op:
        """:meth:`submit` for a plain list of commands, which the engine then owns."""
        with self._lock:
            self.check_open(op.name)
            if not self.assigns_values:
                self.last = op._value = self.last + 1
            op.engine = self
            op.cmds = cmds
            self._enqueue(cmds, op)
        handed_over(self, op)
        return op

    def pend(self, cmds: list[Command], op: Op, blockers: Sequence[tuple[bool, Op]]) -> None:
        """Hand ``op`` to the engine once its ``blockers`` allow, each ``(on_dispatch, dependency)``: once the
        dependency has been handed to this engine, or else once it is done; only engines that :attr:`pends`."""
        raise NotImplementedError(f"{self.signal.name} cannot take pending ops")

    def when_handed_on(self, op: Op, callback: Callable[[], None]) -> None:
        """Call ``callback`` once ``op``, pending in this engine's core (see :meth:`pend`), is handed to its queue:
        on the calling thread's loop, as :meth:`TimelineSignal.on_reach` runs callbacks. Only engines that
        :attr:`pends` have such ops."""
        raise NotImplementedError(f"{self.signal.name} pends no op")

    def yield_to(self, high: Engine) -> None:
        """From now on, before taking its next op, let ``high`` (the high-priority queue of this queue's kind on
        the same device) run first while it has work it can run: ops on its queue not taken yet while it is not
        blocked in a wait for another queue (an op that waits for this queue must not stall it). An op running
        is never interrupted. An engine whose hardware orders its queues by priority itself (a CUDA stream
        priority), or that cannot (a CL queue), keeps this default: nothing."""

    def pin(self, cpus: Collection[int]) -> None:
        """Run this engine's commands on ``cpus`` only (Linux; ``os.sched_getaffinity(0)`` of the process
        to let it run anywhere again). An ``OSError`` names a CPU the process may not use; a closed engine, or
        one whose commands run on no thread of its own (a driver's queue), is a :class:`DeviceError`."""
        if not self.thread_id:
            raise DeviceError(f"{self.signal.name} runs its commands on no thread of its own: nothing to pin")
        self.check_open(f"pin {self.signal.name}")  # its thread has ended: its id may name another thread
        os.sched_setaffinity(self.thread_id, cpus)

    def counters(self) -> tuple[int, int, Sequence[int], Sequence[int]]:
        """What :meth:`metrics` reads: the value of the op the engine took last, the nanoseconds spent running
        ops (the one running so far included), and the histograms (see :mod:`aruntime.engine.metrics`) of queue
        and run times. An engine that keeps none (the CL and CUDA driver queues) reports its signal's value, 0
        and empty histograms."""
        return self.signal.value, 0, (), ()

    def metrics(self) -> dict[str, Any]:
        """This queue's live metrics, as plain data: ``submitted`` ops (handed to the queue, or held for it),
        ``queued`` (not taken yet, held ones included), ``running`` (taken, not done: 0 or 1), ``done`` (run),
        ``skipped`` (see :func:`skip_error`), ``busy_s`` (seconds spent running ops), ``busy_share`` (the share
        of the time since the previous call, or since the queue started, spent running ops), and the
        ``queue_time`` and ``run_time`` histograms' ``count`` and ``p50_us``, ``p90_us``, ``p99_us``.
        ``done + skipped + running + queued == submitted``; a failed op counts as done."""
        skipped = self.skipped
        value = self.signal.value
        started, busy, queued_hist, run_hist = self.counters()
        last = self.last
        held = sum(1 for op in list(self.held) if op.cell is None or not op.cell[op.at])  # not yet handed on
        now = time.monotonic_ns()
        mark, mark_busy = self._mark
        self._mark = (now, busy)
        return {
            "submitted": last + held,
            "queued": last - started + held,
            "running": started - value,
            "done": value - skipped,
            "skipped": skipped,
            "busy_s": busy / 1e9,
            "busy_share": min(max((busy - mark_busy) / (now - mark), 0.0), 1.0) if now > mark else 0.0,
            "queue_time": summary(queued_hist),
            "run_time": summary(run_hist),
        }

    def _range_log(self) -> RangeLog:
        """The log this engine records its ranges in (see :mod:`aruntime.events`)."""
        return RangeLog(self.device, self.is_copy)

    def retire(self) -> None:
        """Bring the errors of finished ops up to date (see the class docstring); nothing to do by default."""

    def failure_logged(self, op: Op) -> bool:
        """Whether this engine has logged ``op``'s failure before marking it done (see :func:`check_deps`);
        an engine that sets errors before its signal advances never has."""
        return False

    def check_open(self, what: str) -> None:
        """Raise :class:`DeviceError` (naming ``what``) if the engine is closed or has crashed."""
        if self.closed:
            if self.crashed is not None:
                raise DeviceError(f"{what}: {self.crashed}") from self.crashed.__cause__
            raise DeviceError(f"{what}: {self.signal.name} is closed")

    def crash(self, error: BaseException) -> None:
        """The code that runs commands failed unexpectedly: refuse new work and fail every op not yet done with a
        :class:`DeviceError` naming the queue and ``error`` (from any thread)."""
        crashed = DeviceError(f"{self.signal.name} crashed: {error!r}; its unfinished ops failed, it takes no work")
        crashed.__cause__ = error
        with self._lock:
            self.closed = True
            self.crashed = crashed
            last = self.last
        _log.error("%s", crashed)
        for op in self._unfinished():
            self._fail(op, crashed)
            self._note_failure(op)
        if self.signal.value < last:
            self.signal.set(last)

    def _unfinished(self) -> list[Op]:
        """The ops handed to this engine and not done (for :meth:`crash`)."""
        return []

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
        with self._failed_lock:
            self.failed.append(op)
            if len(self.failed) > 256:  # a server that awaits its ops but never synchronizes: keep the unseen
                self.failed = [f for f in self.failed if not f.observed]

    def take_failures(self) -> list[Op]:
        """The failed ops nobody awaited since the last call (and forget them)."""
        self.retire()
        with self._failed_lock:
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


def handed_over(engine: Engine, op: Op) -> None:
    """Once ``op`` (held until now, or never) has been handed to ``engine``: run what waited for its dispatch,
    pass on what waits for its end (outside the engine's lock: a callback may submit). The C submission path
    calls it too."""
    if op.later is not None:
        engine.held.discard(op)
        with _later_lock:
            later, op.later = op.later, None
        _run_later(engine, op, later)


_handing_over = threading.local()
"""Per thread, the hand-overs (engine, op, later) waiting for the one :func:`_run_later` runs on it now."""


def _run_later(engine: Engine, op: Op, later: Later) -> None:
    """Once ``op`` has been handed to ``engine``: run what waited for that, pass on what waits for its end.

    A callback often hands on the next held op, whose own waiters then run: on a chain of ops held one behind
    the other (ops submitted from several threads onto one buffer) that would nest one call per op. Called
    while it runs on this thread, it queues the hand-over instead, which the outer call runs next. Every
    callback runs, also after one raised; the first error is raised at the end."""
    queued: deque[tuple[Engine, Op, Later]] | None = getattr(_handing_over, "queued", None)
    if queued is not None:
        queued.append((engine, op, later))
        return
    queued = _handing_over.queued = deque(((engine, op, later),))
    error: BaseException | None = None
    try:
        while queued:
            engine, op, later = queued.popleft()
            for on_dispatch, callback, where in later:
                try:
                    if on_dispatch:
                        callback()
                    else:
                        engine.signal.on_reach(op.value, callback, where)
                except BaseException as exc:  # the others still run: what waits on them must not wait forever
                    error = error or exc
    finally:
        _handing_over.queued = None
    if error is not None:
        raise error


def check_deps(op: Op, settle: bool = True) -> None:
    """Raise :class:`DependencyError` if an op whose output ``op`` consumes failed.

    Engines call it before they run ``op`` or deliver its result. An input not yet done counts as failed if
    its engine has already logged its failure (:meth:`Engine.failure_logged`: the native core logs it before
    the input's value is published, and may hand ``op`` on in between). With ``settle`` (on a completion
    thread) an input not yet done is waited for, so that its failure is known: a driver may have run ``op``
    after the input's commands before the input's own engine completed it. Without it (on the submitting
    thread, which never blocks, and on engine threads, whose waits already ordered ``op`` after what it reads)
    the other inputs not yet done are left alone.
    """
    for dep in op.inputs:
        if dep.error is None and not dep.done():  # an error, once set, is final
            engine = dep.engine
            if engine is not None and engine.failure_logged(dep):
                raise DependencyError(f"{op.name} was not run: it depends on {dep.name}, which failed", dep.name)
            if not settle:
                continue
            dep.wait_done()
            dep.done()  # brings its error up to date
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


class CopyFault(Exception):
    """A :func:`host_copy` met a file-backed page that is gone (its file was truncated under the mapping): ``side``
    1 in its source, 2 in its destination. The code that knows the op turns it into :func:`fault_error`."""

    def __init__(self, side: int) -> None:
        super().__init__(side)
        self.side = side


def host_copy(dst: int, src: int, nbytes: int) -> None:
    """``memmove`` between host addresses, as the native core copies: guarded (:func:`native.copier
    <aruntime.engine.native.copier>`), so a page of a file-backed mapping that is gone raises :class:`CopyFault`
    instead of killing the process. Where there is no core (no C compiler) it is a plain ``memmove``."""
    copy = native.copier()
    if copy is None:
        ctypes.memmove(dst, src, nbytes)
    elif side := copy(dst, src, nbytes):
        raise CopyFault(side)


def fault_error(op: str, command: str | None, queue: str, side: int) -> FileTruncated:
    """The error of ``op``, whose copy ``command`` (None: the op's own) on ``queue`` met a file-backed page that is
    gone (``side``: see :class:`CopyFault`)."""
    what = op if command is None or command in op else f"{op} ({command})"
    end = {1: "source", 2: "destination"}.get(side, "memory")
    return FileTruncated(
        f"{what} failed on {queue}: its {end} reaches past the end of the file it maps, which was truncated (or "
        "shrank) under the buffer; the copy stopped there (the destination may hold part of the bytes)"
    )


def run_copy(fn: CopyFn, dst: int, src: int, nbytes: int, step: int) -> None:
    """Copy with ``fn(dst, src, n)`` in calls of at most ``step`` bytes (each returns to the caller's thread). A
    function the native engines run as a ``memmove`` (:func:`~aruntime.engine.kernel.register_native`) runs as
    :func:`host_copy`: a page of a file-backed mapping that is gone raises :class:`CopyFault`."""
    if id(fn) in _NATIVE_COPIES:
        fn = host_copy
    if nbytes <= step:
        fn(dst, src, nbytes)
    else:
        for off in range(0, nbytes, step):
            fn(dst + off, src + off, min(step, nbytes - off))
