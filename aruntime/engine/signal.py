"""Timeline signals: thread-safe monotonic counters that threads and tasks wait on.

``TimelineSignal(name, timeout)`` makes the kind the process runs on: a
:class:`~aruntime.engine.native.signal.NativeSignal` (its value in native memory, set by native engine threads
without the GIL, awaited through each loop's notifier) where the native core is in use, else a
:class:`PySignal` (a Python counter whose callbacks run on the thread that sets it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from functools import partial

from aruntime.engine import native
from aruntime.engine.wakeup import Waiter, asyncio_waker, trio_waker
from aruntime.errors import SignalTimeout
from aruntime.helpers import checkpoint

_log = logging.getLogger("aruntime")

_native_type: type[TimelineSignal] | None = None


def use_native_signal(kind: type[TimelineSignal]) -> None:
    """Make ``kind`` the signal ``TimelineSignal(name, timeout)`` makes where the native core is in use
    (:mod:`aruntime.engine.native.signal` registers its :class:`NativeSignal` when it is imported, so that this
    module, which it builds on, never imports it)."""
    global _native_type
    _native_type = kind


class TimelineSignal:
    """A monotonic counter. ``wait``/``wait_async`` pass once ``value >= target``.

    ``name`` says whose signal it is (device and queue), so a timed-out wait can
    name it. The engine that owns the signal advances it with :meth:`set`;
    callbacks registered with :meth:`on_reach` run once the value is reached
    (at once, if it already was), on the thread :meth:`here` names.
    """

    __slots__ = ("name", "timeout")
    name: str
    timeout: float

    def __new__(cls, name: str, timeout: float) -> TimelineSignal:
        if cls is TimelineSignal:
            if native.lib() is None:
                cls = PySignal
            elif _native_type is None:
                raise RuntimeError("no native signal type is registered (importing aruntime.engine registers it)")
            else:
                cls = _native_type
        return object.__new__(cls)

    @property
    def value(self) -> int:
        """The counter's current value."""
        raise NotImplementedError

    def set(self, value: int) -> None:
        """Advance the counter to ``value`` and wake everything waiting for it."""
        raise NotImplementedError

    def catch_up(self) -> None:
        """Run, now, the callbacks of values already reached that the calling thread's loop has not run yet (so a
        task that sees an op done also sees what was registered to happen then, e.g. a deferred free)."""

    def here(self) -> object:
        """Where a callback registered from the calling thread runs; pass it to :meth:`on_reach` to register one
        later, from elsewhere, that runs there too."""
        return None

    def on_reach(self, value: int, callback: Callable[[], None], where: object = None) -> None:
        """Call ``callback`` once the counter reaches ``value`` (now, if it already has), where ``where`` says
        (from :meth:`here`; None: where :meth:`here` says now)."""
        raise NotImplementedError

    def wait(self, value: int, timeout: float | None = None) -> None:
        """Block this thread until ``value`` is reached; raise :class:`SignalTimeout` after ``timeout``."""
        raise NotImplementedError

    async def wait_async(self, value: int, timeout: float | None = None) -> None:
        """Suspend the current task (asyncio or trio) until ``value`` is reached, without polling; a checkpoint
        (cancellable, letting other tasks run) even when it already is."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<TimelineSignal {self.name} value={self.value}>"

    def _timeout_error(self, value: int, timeout: float) -> SignalTimeout:
        return SignalTimeout(
            f"{self.name}: wait for value >= {value} did not pass within {timeout:g} s (signal value is {self.value})"
        )


class PySignal(TimelineSignal):
    """A signal of the Python engine: a counter under a lock; callbacks run on the thread that advances it."""

    __slots__ = ("_blocked", "_callbacks", "_cond", "_lock", "_value")

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        self._value = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._callbacks: dict[int, list[Callable[[], None]]] = {}
        self._blocked = 0

    @property
    def value(self) -> int:
        """The counter's current value."""
        return self._value

    def set(self, value: int) -> None:
        """Advance the counter to ``value`` and wake everything waiting for it."""
        with self._lock:
            old = self._value
            if value <= old:
                raise ValueError(f"{self.name}: timeline must increase (at {old}, asked to set {value})")
            self._value = value
            if self._blocked:
                self._cond.notify_all()
            callbacks = self._callbacks
            if not callbacks:
                return
            fired = [callbacks.pop(v) for v in range(old + 1, value + 1) if v in callbacks]
        for group in fired:
            for callback in group:
                try:
                    callback()
                except Exception:  # one failing callback must not skip the others or stop the engine that sets
                    _log.exception("%s: a callback for value %d failed", self.name, value)

    def on_reach(self, value: int, callback: Callable[[], None], where: object = None) -> None:
        """Call ``callback`` once the counter reaches ``value``: on the thread that advances it, or now."""
        with self._lock:
            if self.value < value:
                self._callbacks.setdefault(value, []).append(callback)
                return
        callback()

    def wait(self, value: int, timeout: float | None = None) -> None:
        """Block this thread until ``value`` is reached; raise :class:`SignalTimeout` after ``timeout``."""
        if self.value >= value:
            return
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            self._blocked += 1
            try:
                while self.value < value:
                    left = deadline - time.monotonic()
                    if left <= 0 or (not self._cond.wait(left) and self.value < value):
                        raise self._timeout_error(value, limit)
            finally:
                self._blocked -= 1

    async def wait_async(self, value: int, timeout: float | None = None) -> None:
        """Suspend the current task (asyncio or trio) until ``value`` is reached, without polling; a wait that
        is cancelled or times out takes its callback back. A checkpoint even when ``value`` is reached."""
        if self.value >= value:
            await checkpoint()
            return
        limit = self.timeout if timeout is None else timeout
        await wait_registered(
            partial(self.on_reach, value), limit, partial(self._timeout_error, value, limit), partial(self._drop, value)
        )

    def _drop(self, value: int, callback: Callable[[], None]) -> None:
        """Take back ``callback``, registered for ``value``, if it has not run."""
        with self._lock:
            group = self._callbacks.get(value)
            if group is None:  # it ran
                return
            with contextlib.suppress(ValueError):  # it ran, and others were registered for the value since
                group.remove(callback)
            if not group:
                del self._callbacks[value]


async def wait_registered(
    register: Callable[[Callable[[], None]], None],
    limit: float,
    error: Callable[[], BaseException],
    unregister: Callable[[Callable[[], None]], None] | None = None,
) -> None:
    """Suspend the current task until the callback given to ``register`` is called (from any thread).

    Raises ``error()`` after ``limit`` seconds. The loop is woken once per batch
    of such callbacks (see :mod:`aruntime.engine.wakeup`); asyncio and trio alike.
    If the wait is cancelled or times out first, the callback is given to ``unregister``.
    """
    loop = asyncio._get_running_loop()
    if loop is None:
        await _wait_trio(register, limit, error, unregister)
        return
    fut: asyncio.Future[None] = loop.create_future()
    waiter = Waiter(fut, loop.time() + limit, error)
    waker = asyncio_waker(loop)
    callback = partial(waker.post, waiter)
    register(callback)
    if fut.done():  # called back at once, on this thread: still a checkpoint
        await checkpoint()
        return
    waker.track(waiter)
    woken = False
    try:
        await fut
        woken = True
    finally:
        waiter.task = None  # woken, timed out or cancelled: the waker has nothing left to do
        if not woken and unregister is not None:
            unregister(callback)


async def _wait_trio(
    register: Callable[[Callable[[], None]], None],
    limit: float,
    error: Callable[[], BaseException],
    unregister: Callable[[Callable[[], None]], None] | None,
) -> None:
    import trio

    waiter = Waiter(trio.lowlevel.current_task(), trio.current_time() + limit, error)
    waker = trio_waker()
    callback = partial(waker.post, waiter)
    register(callback)
    waker.track(waiter)

    def abort(_: object) -> trio.lowlevel.Abort:
        waiter.task = None
        return trio.lowlevel.Abort.SUCCEEDED

    woken = False
    try:
        await trio.lowlevel.wait_task_rescheduled(abort)
        woken = True
    finally:
        if not woken and unregister is not None:
            unregister(callback)
