"""Waking tasks from engine threads: one loop wake per batch of completions.

An engine thread that completes work calls :meth:`Waker.post` with the token of
each waiting task. The first post after a drain schedules one call on the
task's event loop through the loop's thread-safe entry point; later posts only
append to the pending batch. The drain then wakes every task in the batch.
Works for asyncio (including uvloop) and trio; each loop has its own waker, so
a task may await from any loop or thread.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any


class Waker:
    """Collects wake-ups from any thread and delivers them on one event loop in batches."""

    __slots__ = ("__weakref__", "_call_soon", "_lock", "_pending", "_scheduled")

    def __init__(self, call_soon_threadsafe: Callable[[Callable[[], None]], object]) -> None:
        self._call_soon = call_soon_threadsafe
        self._pending: deque[Any] = deque()
        self._scheduled = False
        self._lock = threading.Lock()

    def post(self, token: Any) -> None:
        """Queue ``token`` to be woken on this waker's loop (thread-safe, never blocks on the loop)."""
        self._pending.append(token)
        if self._scheduled:
            return
        with self._lock:
            if self._scheduled:  # another thread may have set it meanwhile
                return  # type: ignore[unreachable]
            self._scheduled = True
        try:
            self._call_soon(self._drain)
        except RuntimeError:  # the loop is closed: nobody is left to wake
            self._scheduled = False

    def _drain(self) -> None:
        self._scheduled = False
        pending = self._pending
        wake = self._wake
        while pending:
            wake(pending.popleft())

    def _wake(self, token: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class AsyncioWaker(Waker):
    """Wakes asyncio futures."""

    __slots__ = ()

    def _wake(self, token: asyncio.Future[None]) -> None:
        if not token.done():
            token.set_result(None)


class TrioWaiter:
    """A suspended trio task; ``live`` is cleared once it is woken or aborted."""

    __slots__ = ("live", "task")

    def __init__(self, task: Any) -> None:
        self.task = task
        self.live = True


class TrioWaker(Waker):
    """Reschedules suspended trio tasks."""

    __slots__ = ()

    def _wake(self, token: TrioWaiter) -> None:
        if token.live:
            token.live = False
            import trio

            trio.lowlevel.reschedule(token.task)


_asyncio_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioWaker] = weakref.WeakKeyDictionary()
_trio_waker: Any = None


def asyncio_waker(loop: asyncio.AbstractEventLoop) -> AsyncioWaker:
    """The waker of a running asyncio loop (created on first use)."""
    waker = _asyncio_wakers.get(loop)
    if waker is None:
        waker = _asyncio_wakers[loop] = AsyncioWaker(loop.call_soon_threadsafe)
    return waker


def trio_waker() -> TrioWaker:
    """The waker of the running trio run (created on first use)."""
    global _trio_waker
    import trio

    if _trio_waker is None:
        _trio_waker = trio.lowlevel.RunVar("aruntime_waker")
    waker: TrioWaker | None = _trio_waker.get(None)
    if waker is None:
        waker = TrioWaker(trio.lowlevel.current_trio_token().run_sync_soon)
        _trio_waker.set(waker)
    return waker
