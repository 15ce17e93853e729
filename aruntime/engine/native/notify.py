"""Notifiers: how native signals wake event loops and run callbacks, without any Python on engine threads.

Each event loop that waits on native signals owns one :class:`Notified`: a file descriptor (an eventfd, or a
pipe where there is none) registered in the native core. Waiting for ``signal >= v`` puts the waiter in the
notified's heap for that signal and *arms* the signal for the least value waited for (one native call, only
when that least value goes down). Native code writes the descriptor when an armed value is reached, at most
once until the loop acknowledges; the loop, woken by the descriptor (``add_reader`` on asyncio and uvloop,
``wait_readable`` in a trio system task), reads the signals and resumes every waiter whose value was reached.

Callbacks (:meth:`NativeSignal.on_reach`) go the same way: they run on the loop that registered them, or on
the process's callback thread (a Python thread blocked reading its own notifier) when registered outside any
loop. A loop that ends hands its pending callbacks to the callback thread, so none is lost. The callback thread
starts with the first native signal, before any loop can wait: a loop that is collected has its notifier closed
there (:func:`close_later`), since a finalizer may run under any lock, the callback thread's own included.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import sys
import threading
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aruntime.engine import native
from aruntime.errors import DeviceError

if TYPE_CHECKING:
    from aruntime.engine.native.signal import NativeSignal

_log = logging.getLogger("aruntime")
_seq = itertools.count()
_live: weakref.WeakSet[Notified] = weakref.WeakSet()
_closing: deque[Notified] = deque()  # notifieds of consumers that were collected, for the callback thread to close
Item = Any  # a Waiter (resumed by the owner) or a callable


class Notified:
    """The waits and callbacks of one consumer (an event loop or the callback thread) on native signals.

    ``resume(waiter)`` resumes a task on the consumer's loop; ``alive()`` says whether the consumer can still
    run anything. :meth:`add` may be called from any thread; :meth:`drain` only on the consumer's own.
    """

    def __init__(self, resume: Callable[[Any], None] | None, alive: Callable[[], bool]) -> None:
        lib = native.lib()
        assert lib is not None
        _reclaim()  # loops that closed since the last one was made give their descriptors back now
        self._lib = lib
        self._resume = resume
        self.alive = alive
        if hasattr(os, "eventfd"):
            self.fd = self._wfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            is_eventfd = 1
        else:  # pragma: no cover - platforms without eventfd
            self.fd, self._wfd = os.pipe()
            os.set_blocking(self.fd, False)
            is_eventfd = 0
        slot = lib.ar_notifier_new(self._wfd, is_eventfd)
        if slot < 0:
            self._close_fds()
            raise DeviceError("too many event loops are waiting on aruntime signals at once (64 at most)")
        self.slot = slot
        self._lock = threading.Lock()
        self._waits: dict[NativeSignal, list[tuple[int, int, Item]]] = {}
        self._armed: dict[NativeSignal, int] = {}
        self._gone: dict[NativeSignal, int] = {}  # waiters that gave up, per signal, since its heap was last swept
        # ops pending in the core that something here waits for, by their cell's address (see add_handed_on)
        self._handed: dict[int, list[tuple[Sequence[int], int, int, Callable[[], None]]]] = {}
        self._handed_now: list[int] = []  # of those, the addresses of ops handed on before they were asked about
        self._notes = array("Q", bytes(8 * 256))  # where the core's notes of ops handed on are read into
        self.callbacks = 0
        """How many callbacks (not waiters) are registered here and not run yet."""
        self.closed = False
        _live.add(self)

    def add(self, sig: NativeSignal, value: int, item: Item) -> None:
        """Run ``item`` (resume it, or call it) on this consumer once ``sig`` reaches ``value``."""
        with self._lock:
            if self.closed:
                moved = True
            else:
                moved = False
                heap = self._waits.get(sig)
                if heap is None:
                    heap = self._waits[sig] = []
                heapq.heappush(heap, (value, next(_seq), item))
                if callable(item):
                    self.callbacks += 1
                    sig.callbacks += 1
                armed = self._armed.get(sig)
                if armed is None or value < armed or armed <= sig.value:  # none, too late, or fired already
                    self._armed[sig] = value
                    if self._lib.ar_sig_arm(sig.ptr, self.slot, value):
                        self._lib.ar_notify(self.slot)  # reached meanwhile: the consumer finds it when it drains
        if moved and callable(item):
            callback_thread().add(sig, value, item)

    def add_handed_on(
        self, cells: Sequence[int], at: int, pend: int, address: int, callback: Callable[[], None]
    ) -> None:
        """Call ``callback`` on this consumer once the native core hands on the op pending in it as ``pend``
        (its value then written to ``cells[at]``, the word at ``address``): the core writes this consumer's
        descriptor then, so that what waits for the op costs one wake-up."""
        with self._lock:
            if not self.closed:
                self._handed.setdefault(address, []).append((cells, at, pend, callback))
                self.callbacks += 1
                if self._lib.ar_pend_notify(pend, address, self.slot):  # handed on meanwhile: found when it drains
                    self._handed_now.append(address)
                    self._lib.ar_notify(self.slot)
                return
        callback_thread().add_handed_on(cells, at, pend, address, callback)

    def _take_handed(self, ready: list[tuple[NativeSignal | None, Item]]) -> None:
        """Move the callbacks of the ops the core noted as handed on into ``ready`` (under the lock)."""
        notes = self._notes
        addresses = self._handed_now
        self._handed_now = []
        while taken := self._lib.ar_notifier_handed(self.slot, notes.buffer_info()[0], len(notes)):
            addresses.extend(notes[:taken])
        if 0 in addresses:  # a note was lost (no memory in the core): look at every op asked about
            addresses = [a for a, entries in self._handed.items() if entries[0][0][entries[0][1]]]
        for address in addresses:
            entries = self._handed.pop(address, None)
            if entries is None:
                continue
            for _, _, _, callback in entries:
                self.callbacks -= 1
                ready.append((None, callback))

    def forget(self, sig: NativeSignal) -> None:
        """A waiter added for ``sig`` gave up (cancelled or timed out, its ``task`` cleared): once such waiters
        may be half of ``sig``'s heap, drop them, so that a wait cancelled over and over costs no memory.

        What is armed stays armed (native code cannot be told to forget it): while it has not fired, an empty
        heap stays too, so that :meth:`drain` arms the next value when it fires.
        """
        with self._lock:
            heap = self._waits.get(sig)
            if not heap:
                return
            gone = self._gone[sig] = self._gone.get(sig, 0) + 1
            if 2 * gone < len(heap):
                return
            del self._gone[sig]
            heap[:] = [entry for entry in heap if callable(entry[2]) or entry[2].task is not None]
            heapq.heapify(heap)
            if not heap and self._armed.get(sig, 0) <= sig.value:  # nothing armed that is still to fire
                del self._waits[sig]
                self._armed.pop(sig, None)

    def drain(self) -> None:
        """Resume or call whatever was reached (on the consumer's thread, when its descriptor is readable)."""
        with contextlib.suppress(BlockingIOError, InterruptedError):
            os.read(self.fd, 8)
        self._lib.ar_notifier_ack(self.slot)
        while True:
            ready: list[tuple[NativeSignal | None, Item]] = []
            again = False
            with self._lock:
                if self._handed:
                    self._take_handed(ready)
                for sig, heap in list(self._waits.items()):
                    reached = sig.value
                    if self._armed.get(sig, reached + 1) <= reached:
                        del self._armed[sig]  # fired (or about to be): native code disarmed it
                    elif not heap or heap[0][0] > reached:  # empty: its waiters gave up (see forget)
                        continue
                    while heap and heap[0][0] <= reached:
                        item = heapq.heappop(heap)[2]
                        if callable(item):
                            self.callbacks -= 1
                            sig.callbacks -= 1
                        ready.append((sig, item))
                    if not heap:
                        del self._waits[sig]
                        self._armed.pop(sig, None)
                        self._gone.pop(sig, None)
                    elif sig not in self._armed:
                        self._armed[sig] = heap[0][0]
                        if self._lib.ar_sig_arm(sig.ptr, self.slot, heap[0][0]):
                            again = True
            retired: set[int] = set()
            for reached_sig, item in ready:
                retire = None if reached_sig is None else reached_sig.retire
                if retire is not None and id(reached_sig) not in retired:
                    retired.add(id(reached_sig))
                    retire()
                self._run(reached_sig, item)
            if not again:
                return
            self._lib.ar_notifier_ack(self.slot)

    def run_due(self, sig: NativeSignal) -> None:
        """Resume or call, now, what waits here for values of ``sig`` already reached (on the consumer's thread)."""
        ready: list[Item] = []
        with self._lock:
            heap = self._waits.get(sig)
            reached = sig.value
            while heap and heap[0][0] <= reached:
                item = heapq.heappop(heap)[2]
                if callable(item):
                    self.callbacks -= 1
                    sig.callbacks -= 1
                ready.append(item)
            if heap is not None and not heap and self._armed.get(sig, 0) <= reached:
                del self._waits[sig]
                self._armed.pop(sig, None)
                self._gone.pop(sig, None)
            elif heap and self._armed.get(sig, reached + 1) <= reached:
                self._armed[sig] = heap[0][0]  # what was armed fired (natively): arm the next value
                if self._lib.ar_sig_arm(sig.ptr, self.slot, heap[0][0]):
                    self._lib.ar_notify(self.slot)
        if ready and sig.retire is not None:
            sig.retire()
        for item in ready:
            self._run(sig, item)

    def _run(self, sig: NativeSignal | None, item: Item) -> None:
        if callable(item):
            try:
                item()
            except Exception:  # one failing callback must not skip the others
                if sig is None:
                    _log.exception("a callback for an op handed on by the native core failed")
                else:
                    _log.exception("%s: a callback for value %d failed", sig.name, sig.value)
        elif self._resume is not None:
            self._resume(item)

    def close(self) -> None:
        """Stop being notified; pending callbacks move to the callback thread, pending waiters are dropped."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            waits, self._waits = self._waits, {}
            handed, self._handed = self._handed, {}
            self._armed = {}
            self._gone = {}
            self.callbacks = 0
        self._lib.ar_notifier_free(self.slot)
        self._close_fds()
        if sys.is_finalizing():  # the process is ending: no thread is left to run them, none may start
            return
        for sig, heap in waits.items():
            for value, _, item in heap:
                if callable(item):
                    sig.callbacks -= 1
                    callback_thread().add(sig, value, item)
        for address, entries in handed.items():  # the core may still write this slot's descriptor once: harmless
            for cells, at, pend, callback in entries:
                callback_thread().add_handed_on(cells, at, pend, address, callback)

    def _close_fds(self) -> None:
        os.close(self.fd)
        if self._wfd != self.fd:
            os.close(self._wfd)

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            close_later(self)


def close_later(notified: Notified) -> None:
    """Have the callback thread close ``notified``, soon: what finalizers call (a collected loop's, the notified's
    own), since one may run under any lock, :meth:`Notified.close` takes two. Takes no lock (appending to a
    deque is atomic; the wake-up is a native call)."""
    _closing.append(notified)
    callbacks = _callbacks
    if callbacks is not None:
        callbacks.notified._lib.ar_notify(callbacks.notified.slot)


def _reclaim() -> None:
    """Close the notifieds of consumers that are gone (an asyncio loop that was closed)."""
    for notified in list(_live):
        if not notified.alive():
            notified.close()


class _CallbackThread:
    """Runs callbacks registered outside any event loop: a Python thread that sleeps reading its notifier."""

    def __init__(self) -> None:
        self.notified = Notified(None, lambda: True)
        self._thread = threading.Thread(target=self._run, name="aruntime callbacks", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import select

        notified = self.notified
        while True:
            select.select([notified.fd], [], [])  # sleeps without the GIL
            notified.drain()
            while _closing:  # after the drain acknowledged the wake-ups: a later close_later wakes it again
                try:
                    _closing.popleft().close()  # only this thread takes from it
                except Exception:  # this thread must go on
                    _log.exception("aruntime: closing the notifier of a collected event loop failed")


_callbacks: _CallbackThread | None = None
_callbacks_lock = threading.Lock()


def callback_thread() -> Notified:
    """The notified of the callback thread (started on first use)."""
    global _callbacks
    if _callbacks is None:
        with _callbacks_lock:
            if _callbacks is None:
                _callbacks = _CallbackThread()
    return _callbacks.notified


def started_callback_thread() -> Notified | None:
    """The callback thread's notified, or None if it was never started."""
    return None if _callbacks is None else _callbacks.notified
