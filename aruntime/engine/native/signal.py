"""Timeline signals in native memory: set by native engine threads, read by Python without a lock."""

from __future__ import annotations

import asyncio
import ctypes
import sys
import time
from collections.abc import Callable

from aruntime.engine import native
from aruntime.engine.native import notify
from aruntime.engine.native.notify import Notified, callback_thread
from aruntime.engine.signal import TimelineSignal, use_native_signal
from aruntime.engine.wakeup import Waiter, Waker, asyncio_waker, trio_waker
from aruntime.helpers import checkpoint

SLICE = 0.05
"""The longest a blocking :meth:`NativeSignal.wait` stays in native code before it checks for signals (seconds)."""


def _loop_waker() -> Waker | None:
    """The waker of the event loop running on the calling thread (asyncio or trio), or None outside any loop."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return asyncio_waker(loop)
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            return None
        return trio_waker()
    return None


def _existing_notified() -> Notified | None:
    """The notified that holds callbacks registered from the calling thread, if it has been made yet: the running
    event loop's, else (outside any loop) the callback thread's."""
    waker = _loop_waker()
    return notify.started_callback_thread() if waker is None else waker.notified


def current_notified() -> Notified:
    """The notified of the running event loop (asyncio or trio), else the callback thread's."""
    waker = _loop_waker()
    return callback_thread() if waker is None else waker.native()


class NativeSignal(TimelineSignal):
    """A signal whose 64-bit value lives in native memory (``ptr``); see :mod:`aruntime.engine.native.notify`.

    ``retire``, when set (by the engine that owns the signal), runs on a consumer's thread before it resumes
    waiters or runs callbacks of this signal, so that what they observe (an op's error, its timestamps) is
    up to date.
    """

    __slots__ = ("__weakref__", "_lib", "_v", "callbacks", "ptr", "retire")

    def __init__(self, name: str, timeout: float) -> None:
        lib = native.lib()
        assert lib is not None
        self._lib = lib
        self.name = name
        self.timeout = timeout
        ptr = lib.ar_sig_new(0)
        if not ptr:
            raise MemoryError(f"{name}: no memory for a signal")
        self.ptr: int = ptr
        self._v = memoryview((ctypes.c_uint64 * 1).from_address(ptr)).cast("B").cast("Q")
        callback_thread()  # running before a loop waits on a signal (see notify.close_later)
        self.retire: Callable[[], None] | None = None
        self.callbacks = 0
        """Callbacks registered on this signal, on any notified, not run yet (a hint: it spares the lookup of the
        calling loop's notified in :meth:`catch_up` when there are none)."""

    def __del__(self) -> None:
        ptr = getattr(self, "ptr", 0)
        if ptr and not sys.is_finalizing():  # at exit a worker may still wait on it: the process frees it
            self.ptr = 0
            self._v.release()
            self._lib.ar_sig_free(ptr)

    @property
    def value(self) -> int:
        """The counter's current value (read from native memory)."""
        return self._v[0]

    def set(self, value: int) -> None:
        """Advance the counter to ``value``: wakes blocked threads and the loops armed for it."""
        if not isinstance(value, int) or not 0 <= value < 1 << 64:
            raise ValueError(f"{self.name}: a signal value is a non-negative 64-bit int, got {value!r}")
        if self._lib.ar_sig_set(self.ptr, value):
            raise ValueError(f"{self.name}: timeline must increase (at {self.value}, asked to set {value})")

    def catch_up(self) -> None:
        """Run the due callbacks the calling thread's loop holds for this signal (see the base class)."""
        if not self.callbacks:
            return
        notified = _existing_notified()
        if notified is not None and notified.callbacks:
            notified.run_due(self)

    def here(self) -> Notified:
        """The notified a callback registered from the calling thread runs on."""
        return current_notified()

    def on_reach(self, value: int, callback: Callable[[], None], where: object = None) -> None:
        """Call ``callback`` once the value reaches ``value``: on ``where`` (a notified from :meth:`here`), else on
        the calling thread's loop, or the callback thread outside any loop; now if it already has. While the
        interpreter finalizes, a callback for a value not reached is dropped (the process frees what it held)."""
        if self._v[0] >= value:
            retire = self.retire
            if retire is not None:
                retire()
            callback()
            return
        if sys.is_finalizing():  # the process is ending: nothing could run it (and no thread may start now)
            return
        target = where if isinstance(where, Notified) else current_notified()
        target.add(self, value, callback)

    def wait(self, value: int, timeout: float | None = None) -> None:
        """Block this thread (the GIL released) until ``value`` is reached; raise :class:`SignalTimeout`.

        It blocks in slices of :data:`SLICE` seconds, so that the main thread runs signal handlers between them
        (Ctrl-C raises :class:`KeyboardInterrupt` in it, as it does in any Python wait).
        """
        if self._v[0] >= value:
            return
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while self._lib.ar_sig_wait(self.ptr, value, int(min(SLICE, max(0.0, deadline - time.monotonic())) * 1e9)):
            if time.monotonic() >= deadline:
                raise self._timeout_error(value, limit)
        retire = self.retire
        if retire is not None:
            retire()

    async def wait_async(self, value: int, timeout: float | None = None) -> None:
        """Suspend the current task until ``value`` is reached: woken through the loop's notifier. A wait that
        is cancelled or times out leaves nothing registered behind (see :meth:`Notified.forget`). A checkpoint
        even when ``value`` is reached."""
        if self._v[0] >= value:
            self.catch_up()
            await checkpoint()
            return
        limit = self.timeout if timeout is None else timeout
        loop = asyncio._get_running_loop()
        if loop is not None:
            fut: asyncio.Future[None] = loop.create_future()
            waker = asyncio_waker(loop)
            waiter = Waiter(fut, loop.time() + limit, type(self)._timeout_error, (self, value, limit))
            notified = waker.native()
            notified.add(self, value, waiter)
            waker.track(waiter)
            woken = False
            try:
                await fut
                woken = True
            finally:
                waiter.task = None
                if not woken:
                    notified.forget(self)
            return
        import trio

        twaker = trio_waker()
        task = trio.lowlevel.current_task()
        waiter = Waiter(task, trio.current_time() + limit, type(self)._timeout_error, (self, value, limit))
        tnotified = twaker.native()
        tnotified.add(self, value, waiter)
        twaker.track(waiter)

        def abort(_: object) -> trio.lowlevel.Abort:
            waiter.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        woken = False
        try:
            await trio.lowlevel.wait_task_rescheduled(abort)
            woken = True
        finally:
            if not woken:
                tnotified.forget(self)


use_native_signal(NativeSignal)
