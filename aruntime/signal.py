"""Timeline signals: thread-safe monotonic counters that threads and tasks wait on."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from functools import partial

from aruntime.errors import SignalTimeout
from aruntime.wakeup import Waiter, asyncio_waker, trio_waker

_log = logging.getLogger("aruntime")


class TimelineSignal:
    """A monotonic counter. ``wait``/``wait_async`` pass once ``value >= target``.

    ``name`` says whose signal it is (device and queue), so a timed-out wait can
    name it. The engine that owns the signal advances it with :meth:`set`;
    callbacks registered with :meth:`on_reach` run on the thread that advances
    it (or at once, if the value was already reached).
    """

    __slots__ = ("_blocked", "_callbacks", "_cond", "_lock", "name", "timeout", "value")

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        self.value = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._callbacks: dict[int, list[Callable[[], None]]] = {}
        self._blocked = 0

    def __repr__(self) -> str:
        return f"<TimelineSignal {self.name} value={self.value}>"

    def set(self, value: int) -> None:
        """Advance the counter to ``value`` and wake everything waiting for it."""
        with self._lock:
            old = self.value
            if value <= old:
                raise ValueError(f"{self.name}: timeline must increase (at {old}, asked to set {value})")
            self.value = value
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

    def on_reach(self, value: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the counter reaches ``value`` (now, if it already has)."""
        with self._lock:
            if self.value < value:
                self._callbacks.setdefault(value, []).append(callback)
                return
        callback()

    def _timeout_error(self, value: int, timeout: float) -> SignalTimeout:
        return SignalTimeout(
            f"{self.name}: wait for value >= {value} did not pass within {timeout:g} s (signal value is {self.value})"
        )

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
        """Suspend the current task (asyncio or trio) until ``value`` is reached, without polling."""
        if self.value >= value:
            return
        limit = self.timeout if timeout is None else timeout
        await wait_registered(partial(self.on_reach, value), limit, partial(self._timeout_error, value, limit))


async def wait_registered(
    register: Callable[[Callable[[], None]], None], limit: float, error: Callable[[], BaseException]
) -> None:
    """Suspend the current task until the callback given to ``register`` is called (from any thread).

    Raises ``error()`` after ``limit`` seconds. The loop is woken once per batch
    of such callbacks (see :mod:`aruntime.wakeup`); asyncio and trio alike.
    """
    loop = asyncio._get_running_loop()
    if loop is None:
        await _wait_trio(register, limit, error)
        return
    fut: asyncio.Future[None] = loop.create_future()
    waiter = Waiter(fut, loop.time() + limit, error)
    waker = asyncio_waker(loop)
    register(partial(waker.post, waiter))
    waker.track(waiter)
    try:
        await fut
    finally:
        waiter.task = None  # woken, timed out or cancelled: the waker has nothing left to do


async def _wait_trio(
    register: Callable[[Callable[[], None]], None], limit: float, error: Callable[[], BaseException]
) -> None:
    import trio

    waiter = Waiter(trio.lowlevel.current_task(), trio.current_time() + limit, error)
    waker = trio_waker()
    register(partial(waker.post, waiter))
    waker.track(waiter)

    def abort(_: object) -> trio.lowlevel.Abort:
        waiter.task = None
        return trio.lowlevel.Abort.SUCCEEDED

    await trio.lowlevel.wait_task_rescheduled(abort)
