"""At interpreter exit: wait for the work in flight on every open device, and say what was dropped or failed."""

from __future__ import annotations

import atexit
import warnings

from aruntime.device.base import BaseDevice
from aruntime.device.registry import Device
from aruntime.engine import first_failure
from aruntime.errors import SignalTimeout


def _unfinished(dev: BaseDevice) -> str:
    """What is still in flight on ``dev``'s queues, for a message (empty if nothing is): per queue, how many ops
    were submitted and not done and how many are held, and the names of the first ones its engine can name."""
    parts = []
    for engine in dev.engines:
        running = max(0, engine.last - engine.signal.value)
        held = sorted(op.name for op in tuple(engine.held))
        if running or held:
            named = [op.name for op in engine._unfinished()] + held
            names = f" ({', '.join(named[:5])}{', ...' if len(named) > 5 else ''})" if named else ""
            parts.append(f"{engine.signal.name}: {running} op(s) submitted and {len(held)} held{names}")
    return "; ".join(parts)


EXIT_NOTICE = 1.0
"""Seconds the wait at interpreter exit lasts before it says what it waits for (see :func:`finish_at_exit`)."""


def _settle_at_exit(dev: BaseDevice) -> None:
    """Wait for ``dev``'s work in flight (each wait bounded by its timeout), saying what is waited for, in a
    warning, once the wait has lasted :data:`EXIT_NOTICE` seconds."""
    try:
        dev.settle_blocking(min(EXIT_NOTICE, dev.timeout))
    except SignalTimeout:
        if dev.timeout <= EXIT_NOTICE:
            raise
        unfinished = _unfinished(dev)
        if unfinished:
            warnings.warn(
                f"aruntime at exit: waiting up to {dev.timeout:g} s for the work in flight on {dev.name}: "
                f"{unfinished} (Ctrl-C stops waiting and drops it)",
                RuntimeWarning,
                stacklevel=1,
            )
        dev.settle_blocking()


def finish_at_exit() -> None:
    """At interpreter exit: wait for the work in flight on every open device (each wait bounded by the
    device's timeout, and said in a warning when it lasts more than :data:`EXIT_NOTICE` seconds), warn naming
    what did not finish (it is dropped) and the failures nobody awaited, and write file-backed devices'
    mappings back to their files (``msync``). A :class:`KeyboardInterrupt` (Ctrl-C) stops the waiting: what
    is still in flight on every device is dropped, and named. Registered with :mod:`atexit` on import."""
    interrupted = False
    for dev in Device.devices():
        dropped = "interrupted by Ctrl-C" if interrupted else None
        if not interrupted:
            try:
                _settle_at_exit(dev)
            except KeyboardInterrupt:
                interrupted, dropped = True, "interrupted by Ctrl-C"
            except Exception as exc:
                dropped = f"{type(exc).__name__}: {exc}"
        unfinished = _unfinished(dev) if dropped is not None else ""
        if unfinished:
            warnings.warn(
                f"aruntime at exit: work in flight on {dev.name} did not finish and is dropped: {unfinished} "
                f"({dropped})",
                RuntimeWarning,
                stacklevel=1,
            )
        failed = [op for engine in dev.engines for op in engine.take_failures()]
        if failed:
            error = first_failure(failed, "failed on it")
            warnings.warn(
                f"aruntime at exit: {len(failed)} op(s) on {dev.name} failed and nobody awaited them; the first: "
                f"{error}",
                RuntimeWarning,
                stacklevel=1,
            )
        if dev.file_backed:
            flush = getattr(dev.allocator, "flush", None)
            if flush is not None:
                flush()


atexit.register(finish_at_exit)
