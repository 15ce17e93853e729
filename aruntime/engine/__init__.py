"""Timeline signals, command queues and the engines that run them.

Each device queue runs on an engine: the native engine (:mod:`aruntime.engine.native`: a C command processor
per queue, signals in native memory, loops woken through a file descriptor) where the native core builds, else
the Python :class:`ThreadEngine`. ``ARUNTIME_ENGINE=native|python`` forces one; :func:`engine_name` says which
is in use. The rest of the runtime reaches engines only through :class:`Engine` and :func:`make_engine`.
"""

from __future__ import annotations

from aruntime.engine import native
from aruntime.engine.kernel import Entry, KernelError
from aruntime.engine.ops import (
    COPY,
    EXEC,
    HELD,
    SIGNAL,
    TIMESTAMP,
    WAIT,
    Command,
    CommandQueue,
    CopyFn,
    Engine,
    Op,
    check_deps,
    first_failure,
)
from aruntime.engine.signal import TimelineSignal, wait_registered
from aruntime.engine.thread import ThreadEngine

engine_name = native.engine_name


def make_engine(device: str, kind: str, timeout: float, chunk: int) -> Engine:
    """A new engine for ``device``'s ``kind`` queue ("compute" or "copy"): native where the core is in use."""
    if native.lib() is not None:
        from aruntime.engine.native.engine import NativeEngine

        return NativeEngine(device, kind, timeout, chunk=chunk)
    return ThreadEngine(device, kind, timeout, chunk=chunk)


__all__ = [
    "COPY",
    "EXEC",
    "HELD",
    "SIGNAL",
    "TIMESTAMP",
    "WAIT",
    "Command",
    "CommandQueue",
    "CopyFn",
    "Engine",
    "Entry",
    "KernelError",
    "Op",
    "ThreadEngine",
    "TimelineSignal",
    "check_deps",
    "engine_name",
    "first_failure",
    "make_engine",
    "wait_registered",
]
