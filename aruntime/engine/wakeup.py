"""Waking tasks on their event loop: one loop wake per batch, and one deadline timer per loop.

Each event loop (asyncio, uvloop or trio) that awaits ops has one :class:`Waker`. With the native engine,
the waker owns the loop's notifier (:meth:`Waker.native`, see :mod:`aruntime.engine.native.notify`): native
code writes its file descriptor and the loop resumes the waiting tasks itself. With the Python engine (and
for callbacks that must wake a task from any thread), a thread calls :meth:`Waker.post` with the
:class:`Waiter` of a waiting task: the first post after a drain schedules one call on the loop through its
thread-safe entry point, later posts only append to the pending batch, and the drain wakes every task in it.
A post on the loop's own thread (a callback its notifier runs as it drains) resumes the waiter at once.

Each waker also times out its waiters: their deadlines are kept in one heap,
with one timer armed for the earliest, so a wait costs a heap push rather than
a timer (asyncio) or a cancel scope (trio) of its own. Entries of waiters that
were woken or cancelled first are dropped lazily.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from aruntime.engine.native.notify import Notified, close_later

_log = logging.getLogger("aruntime")


class Waiter:
    """A suspended task: an asyncio future or a trio task, cleared once it is resumed or gives up waiting."""

    __slots__ = ("args", "deadline", "task", "timeout_error")

    def __init__(
        self, task: Any, deadline: float, timeout_error: Callable[..., BaseException], args: tuple[Any, ...] = ()
    ) -> None:
        self.task = task
        self.deadline = deadline
        self.timeout_error = timeout_error  # called with ``args`` at the deadline: no closure made per wait
        self.args = args

    def __lt__(self, other: Waiter) -> bool:
        return self.deadline < other.deadline


class Waker:
    """Collects wake-ups from any thread and delivers them on one event loop in batches."""

    __slots__ = (
        "__weakref__",
        "_call_soon",
        "_compact_at",
        "_deadlines",
        "_lock",
        "_pending",
        "_scheduled",
        "notified",
    )

    def __init__(self, call_soon_threadsafe: Callable[[Callable[[], None]], object]) -> None:
        self._call_soon = call_soon_threadsafe
        self._pending: deque[Waiter] = deque()
        self._scheduled = False
        self._lock = threading.Lock()
        self._deadlines: list[Waiter] = []
        self._compact_at = 64
        self.notified: Notified | None = None

    def native(self) -> Notified:
        """This loop's notifier for native signals (see :mod:`aruntime.engine.native.notify`), made on first use."""
        notified = self.notified
        if notified is None or notified.closed:
            notified = self.notified = self._start_notified()
        return notified

    def _start_notified(self) -> Notified:  # pragma: no cover - overridden
        raise NotImplementedError

    def _resume_waiter(self, waiter: Waiter) -> None:
        task = waiter.task
        if task is not None:
            waiter.task = None
            self._resume(task, None)

    def post(self, waiter: Waiter) -> None:
        """Queue ``waiter`` to be woken on this waker's loop (thread-safe, never blocks on the loop)."""
        self._pending.append(waiter)
        if not self._scheduled:
            self.schedule()

    def schedule(self) -> None:
        """Make sure a drain of the pending waiters is scheduled on the loop."""
        if self._scheduled or not self._pending:
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
        while pending:
            waiter = pending.popleft()
            task = waiter.task
            if task is not None:
                waiter.task = None
                self._resume(task, None)

    def track(self, waiter: Waiter) -> None:
        """Time ``waiter`` out at its deadline unless it is woken first (call on the loop's thread)."""
        heap = self._deadlines
        if len(heap) >= self._compact_at:
            heap[:] = [w for w in heap if w.task is not None]
            heapq.heapify(heap)
            self._compact_at = max(64, 2 * len(heap))
        heapq.heappush(heap, waiter)
        if heap[0] is waiter:
            self._arm(waiter.deadline)

    def _expire(self, now: float) -> None:
        """Time out the waiters whose deadline is past, then arm the timer for the next deadline."""
        heap = self._deadlines
        while heap and (heap[0].task is None or heap[0].deadline <= now):
            waiter = heapq.heappop(heap)
            task = waiter.task
            if task is not None:
                waiter.task = None
                self._resume(task, waiter.timeout_error(*waiter.args))
        if heap:
            self._arm(heap[0].deadline)

    def _resume(self, task: Any, error: BaseException | None) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _arm(self, deadline: float) -> None:  # pragma: no cover - overridden
        """Make sure :meth:`_expire` runs on the loop by ``deadline``."""
        raise NotImplementedError


class AsyncioWaker(Waker):
    """Wakes asyncio futures; one ``call_at`` timer watches the deadlines.

    It holds its loop only weakly, so a finished loop and its waker are freed.
    """

    __slots__ = ("_loop", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        super().__init__(self._call_soon_threadsafe)
        self._timer: asyncio.TimerHandle | None = None

    def post(self, waiter: Waiter) -> None:
        """See :meth:`Waker.post`; on the thread running the loop (a callback run by its notifier's drain) the
        waiter's future is resolved at once, with no trip through the loop's thread-safe entry point."""
        loop = self._loop()
        if loop is not None and asyncio._get_running_loop() is loop:
            self._resume_waiter(waiter)
        else:
            super().post(waiter)

    def _call_soon_threadsafe(self, fn: Callable[[], None]) -> None:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("the event loop is gone")
        loop.call_soon_threadsafe(fn)

    def _start_notified(self) -> Notified:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("the event loop is gone")
        ref = self._loop

        def alive() -> bool:
            live = ref()
            return live is not None and not live.is_closed()

        notified = Notified(self._resume_waiter, alive)
        loop.add_reader(notified.fd, notified.drain)
        weakref.finalize(loop, close_later, notified)  # a finalizer: closed on the callback thread
        return notified

    def _resume(self, fut: asyncio.Future[None], error: BaseException | None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    def _arm(self, deadline: float) -> None:
        timer = self._timer
        if timer is not None:
            if timer.when() <= deadline:
                return
            timer.cancel()
        loop = self._loop()
        if loop is not None:
            self._timer = loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        loop = self._loop()
        if loop is not None:
            self._expire(loop.time())


class TrioWaker(Waker):
    """Reschedules suspended trio tasks; one system task sleeps until the earliest deadline."""

    __slots__ = ("_token", "_watch")

    def __init__(self, token: Any) -> None:
        super().__init__(token.run_sync_soon)
        self._token = token  # its run's (see trio_waker)
        self._watch: Any = None  # the cancel scope the watchdog task sleeps in

    def post(self, waiter: Waiter) -> None:
        """See :meth:`Waker.post`; inside its own run, by another task than the waiter's (the notifier's, as it
        drains), the waiter's task is rescheduled at once, with no trip through the run's thread-safe entry point.
        A task posting its own waiter (a callback run as it registers it) has not suspended yet: queued."""
        import trio

        try:
            here = trio.lowlevel.current_trio_token() is self._token
        except RuntimeError:  # outside any trio run
            here = False
        if here:
            try:
                running = trio.lowlevel.current_task()
            except RuntimeError:  # not in a task: the waiter's is suspended (or gone)
                running = None
            if running is not waiter.task:
                self._resume_waiter(waiter)
                return
        super().post(waiter)

    def _resume(self, task: Any, error: BaseException | None) -> None:
        import outcome
        import trio

        trio.lowlevel.reschedule(task, outcome.Value(None) if error is None else outcome.Error(error))

    def _arm(self, deadline: float) -> None:
        import trio

        if self._watch is None:
            self._watch = trio.CancelScope()
            trio.lowlevel.spawn_system_task(self._watchdog, name="aruntime wait timeouts")
        elif deadline < self._watch.deadline:
            self._watch.deadline = deadline

    def _start_notified(self) -> Notified:
        import trio

        ended = [False]
        notified = Notified(self._resume_waiter, lambda: not ended[0])

        async def watch() -> None:
            try:
                while True:
                    await trio.lowlevel.wait_readable(notified.fd)
                    notified.drain()
            finally:
                ended[0] = True
                notified.close()

        trio.lowlevel.spawn_system_task(watch, name="aruntime notifier")
        return notified

    async def _watchdog(self) -> None:
        import trio

        while True:
            self._expire(trio.current_time())
            heap = self._deadlines
            self._watch = trio.CancelScope(deadline=heap[0].deadline if heap else math.inf)
            with self._watch:
                await trio.sleep_forever()


_asyncio_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioWaker] = weakref.WeakKeyDictionary()
_trio_waker: Any = None


_last_asyncio: tuple[weakref.ref[asyncio.AbstractEventLoop], AsyncioWaker] | None = None


def asyncio_waker(loop: asyncio.AbstractEventLoop) -> AsyncioWaker:
    """The waker of a running asyncio loop (created on first use)."""
    global _last_asyncio
    last = _last_asyncio  # one read: another thread may replace it meanwhile
    if last is not None and last[0]() is loop:
        return last[1]
    waker = _asyncio_wakers.get(loop)
    if waker is None:
        waker = _asyncio_wakers[loop] = AsyncioWaker(loop)
    _last_asyncio = (weakref.ref(loop), waker)
    return waker


def trio_waker() -> TrioWaker:
    """The waker of the running trio run (created on first use)."""
    global _trio_waker
    import trio

    if _trio_waker is None:
        _trio_waker = trio.lowlevel.RunVar("aruntime_waker")
    waker: TrioWaker | None = _trio_waker.get(None)
    if waker is None:
        waker = TrioWaker(trio.lowlevel.current_trio_token())
        _trio_waker.set(waker)
    return waker
