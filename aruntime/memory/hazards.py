"""Read/write hazard tracking over byte ranges of a root buffer."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from aruntime.engine import Engine, Op


class _Lock(AbstractContextManager[bool], Protocol):
    def acquire(self) -> bool: ...

    def release(self) -> None: ...


_here = threading.local()  # .held: how many SubmissionLocks this thread holds


class SubmissionLock:
    """A lock that ops are submitted under, where the C submission path's own ``Lock`` is not built (or not yet):
    :func:`in_submission` counts the ones the calling thread holds. Taken and let go of on one thread."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        """Take the lock, waiting while another thread holds it; True."""
        self._lock.acquire()
        _here.held = getattr(_here, "held", 0) + 1
        return True

    def release(self) -> None:
        """Let go of the lock (a RuntimeError if it is not held)."""
        self._lock.release()
        _here.held -= 1

    def locked(self) -> bool:
        """Whether the lock is held."""
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


_logs_lock: _Lock = SubmissionLock()
"""What every op's accesses are recorded under (see :func:`logs_held`); the C submission path's own lock once
it is built (:func:`use_lock`)."""
_native_held: Callable[[], bool] | None = None  # the C module's held_here(), once it is used


@contextmanager
def logs_held() -> Iterator[None]:
    """Hold the lock under which an op records its accesses, all of them at once (and takes its place in a
    scheduler's window). Two ops on the same buffers then find each other in one order: recorded piecemeal, from
    two threads, each could find the other on a different buffer and wait for it, a cycle that never ends."""
    while True:
        lock = _logs_lock
        lock.acquire()
        if lock is _logs_lock:
            break
        lock.release()  # replaced meanwhile: take the one in use
    try:
        yield
    finally:
        lock.release()


def in_submission() -> bool:
    """Whether the calling thread is submitting: holds :func:`logs_held`'s lock, or an engine's or a scheduler's
    (a :class:`SubmissionLock`, or the C submission path's ``Lock``). What waits for a held op's hand-on does not
    run there (it may submit, and take those locks again): an op the native core has handed on is then taken by
    whoever looks at it next, or by the core's hand-on callback."""
    return getattr(_here, "held", 0) > 0 or (_native_held is not None and _native_held())


def use_lock(lock: _Lock, held_here: Callable[[], bool]) -> None:
    """From now on record accesses under ``lock`` (the C submission path's own, which it takes without a call);
    ``held_here()`` says whether the calling thread holds any lock of that path."""
    global _logs_lock, _native_held
    with _logs_lock:
        _native_held = held_here
        _logs_lock = lock


class AccessLog:
    """The in-flight accesses to one root buffer: (start, end, is_write, op).

    A new access conflicts with an in-flight one when their byte ranges overlap
    and at least one of them writes (read-after-write, write-after-read,
    write-after-write): it must be ordered after it. The log stays short:
    entries of finished ops are dropped, and so is every entry that a newer
    access both covers and is ordered after (a write after anything it
    conflicts with; a read after a read already handed to the same engine,
    which runs in order), since waiting for the newer access then implies the
    older one is done.

    A write that *failed* stays in the log, finished or not, until a newer
    write covers it: the bytes it should have written are not valid, so an op
    that reads them is given the failed op as an *input*, and fails with a
    :class:`~aruntime.errors.DependencyError` naming it. An op that writes them
    (a copy-in, a transfer, a kernel's output: a kernel's ``outs`` count as
    overwritten) does not inherit the failure, and makes them valid again.
    """

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[tuple[int, int, bool, Op]] = []

    def access(
        self,
        start: int,
        end: int,
        write: bool,
        consumes: bool,
        op: Op,
        engine: Engine,
        deps: list[Op],
        inputs: list[Op],
    ) -> None:
        """Record that ``op``, bound for ``engine``, accesses [start, end), holding :func:`logs_held`'s lock.

        Adds the ops it must be ordered after to ``deps``, and, when it
        ``consumes`` the bytes (reads them), the ops that write them to ``inputs``.
        """
        live = []
        for entry in self.entries:
            s, e, w, other = entry
            if other.done():
                if not w or other.error is None:
                    continue  # finished and valid: nothing to order after or to inherit
                if consumes and s < end and start < e and other not in inputs:  # a failed write
                    inputs.append(other)
            else:
                overlap = s < end and start < e
                if (write or w) and overlap and other not in deps and other is not op:
                    deps.append(other)
                if consumes and w and overlap and other not in inputs and other is not op:
                    inputs.append(other)
            if not (start <= s and e <= end and (write or (not w and other.engine is engine and other.dispatched))):
                live.append(entry)
        live.append((start, end, write, op))
        self.entries = live

    def conflicts_on(self, engine: Engine, start: int, end: int, write: bool) -> bool:
        """Whether an access to [start, end) would have to wait for an in-flight op of ``engine``."""
        for s, e, w, other in self.entries:
            if other.engine is engine and (write or w) and s < end and start < e and not other.done():
                return True
        return False

    def pending(self) -> list[Op]:
        """The ops still in flight on this buffer."""
        if not self.entries:
            return []
        with logs_held():
            self.entries = entries = [e for e in self.entries if _matters(e[2], e[3])]
        return [e[3] for e in entries if not e[3].done()]


def _matters(write: bool, op: Op) -> bool:
    """Whether an access stays in the log: its op is in flight, or it is a write that failed."""
    return not op.done() or (write and op.error is not None)
