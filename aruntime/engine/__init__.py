"""The engine layer: timeline signals, command queues, the engines that run them, and handing ops to them.

Each device queue runs on an engine: the native engine (:mod:`aruntime.engine.native`: a C command processor
per queue, signals in native memory, loops woken through a file descriptor) where the native core builds, else
the Python :class:`ThreadEngine`. ``ARUNTIME_ENGINE=native|python`` forces one; :func:`engine_name` says which
is in use. :func:`dispatch_when_ready` hands an op to its engine once the ops it depends on allow it;
:mod:`~aruntime.engine.clock` maps an engine's timestamps onto the host clock. The rest of the runtime reaches
engines only through :class:`Engine`, :func:`make_engine` and the names below.
"""

from __future__ import annotations

from aruntime.engine import native
from aruntime.engine.clock import Sample, engine_offset, estimate_offset
from aruntime.engine.dispatch import Window, dispatch_when_ready, gate_of
from aruntime.engine.kernel import Entry, KernelError
from aruntime.engine.native.engine import NativeEngine
from aruntime.engine.ops import (
    COPY,
    EXEC,
    HELD,
    SIGNAL,
    TIMESTAMP,
    WAIT,
    Command,
    CommandQueue,
    CopyFault,
    CopyFn,
    Engine,
    Op,
    Prepared,
    check_deps,
    fault_error,
    first_failure,
    host_copy,
)
from aruntime.engine.signal import TimelineSignal, wait_registered
from aruntime.engine.thread import ThreadEngine
from aruntime.helpers import getenv

engine_name = native.engine_name


def make_engine(device: str, kind: str, timeout: float, chunk: int, shared: bool = False) -> Engine:
    """A new engine for ``device``'s ``kind`` queue ("compute" or "copy"): native where the core is in use,
    run by the shared workers where ``shared`` and :func:`workers_shared` say so (see :class:`NativeEngine`)."""
    shared = workers_shared() and shared  # a bad setting is refused whatever the engine
    if native.lib() is not None:
        return NativeEngine(device, kind, timeout, chunk=chunk, shared=shared)
    return ThreadEngine(device, kind, timeout, chunk=chunk)


def workers_shared() -> bool:
    """``ARUNTIME_WORKERS``: ``shared`` (the default: the native queues of CPU and NULL devices run on one worker
    thread per CPU the process may use, serving them in the order they get work) or ``queue`` (a worker thread
    per queue). Another value is a ``ValueError`` naming the variable."""
    setting = getenv("WORKERS", "shared").strip().lower()
    if setting not in ("shared", "queue"):
        raise ValueError(f"environment variable ARUNTIME_WORKERS={setting!r}: expected 'shared' or 'queue'")
    return setting == "shared"


__all__ = [
    "COPY",
    "EXEC",
    "HELD",
    "SIGNAL",
    "TIMESTAMP",
    "WAIT",
    "Command",
    "CommandQueue",
    "CopyFault",
    "CopyFn",
    "Engine",
    "Entry",
    "KernelError",
    "NativeEngine",
    "Op",
    "Prepared",
    "Sample",
    "ThreadEngine",
    "TimelineSignal",
    "Window",
    "check_deps",
    "dispatch_when_ready",
    "engine_name",
    "engine_offset",
    "estimate_offset",
    "fault_error",
    "first_failure",
    "gate_of",
    "host_copy",
    "make_engine",
    "wait_registered",
    "workers_shared",
]
