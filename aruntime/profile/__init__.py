"""Profiling: record what the device queues did, export it as a Chrome trace, view and summarize it.

* ``ARUNTIME_PROFILE=1`` in the environment records everything; at exit every opened
  device is synchronized and asked for its clock offsets, and the trace is
  written to ``ARUNTIME_PROFILE_PATH`` (default: ``aruntime-profile-<pid>.json`` in the
  temp dir); the path is printed.
* :func:`profile` records one region: ``async with profile() as prof: ...``
  (or a plain ``with``), then ``prof.save("trace.json")``.
* :class:`host_range` times a block of host code (context manager or decorator).
* ``aruntime profile view trace.json`` writes an offline HTML timeline;
  ``aruntime profile summary trace.json`` prints busy/overlap figures.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import multiprocessing
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

from aruntime.events import (
    DependencyEvent,
    DeviceEvent,
    Event,
    GraphEntry,
    GraphEvent,
    HostRangeEvent,
    RangeEvent,
    now_us,
    recorder,
)
from aruntime.helpers import check_seconds, checkpoint, getenv
from aruntime.profile.trace import build_trace, load_trace, save_events, write_trace

if TYPE_CHECKING:
    from aruntime.device import BaseDevice

__all__ = [
    "DependencyEvent",
    "DeviceEvent",
    "Event",
    "GraphEntry",
    "GraphEvent",
    "HostRangeEvent",
    "Profile",
    "RangeEvent",
    "build_trace",
    "default_path",
    "host_range",
    "install_atexit",
    "load_trace",
    "profile",
    "save_events",
    "write_profile",
    "write_trace",
]

F = TypeVar("F", bound=Callable[..., Any])

_state_lock = threading.Lock()
_active = 0  # profile() regions currently open
_outer_enabled = False  # whether recording was on (by someone else) when the first open region began
_outer_start = 0  # len(recorder.events) when the first open region began
_env_enabled = False  # ARUNTIME_PROFILE=1 turned recording on for the whole process
_atexit_installed = False


# ---- host ranges ------------------------------------------------------------------------------------


class host_range:
    """Time a block of host code as a named range (recorded only while profiling is on).

    As a context manager::

        with host_range("prepare batch"):
            ...

    or as a decorator of a plain or an ``async`` function (``name`` defaults to
    the function's qualified name)::

        @host_range()
        async def step(): ...

    The range is recorded even when the block raises. A decorated function
    times each call separately, also when calls run concurrently; one
    ``host_range`` object used with ``with`` may nest within one task, but
    concurrent tasks should each create their own.
    """

    __slots__ = ("_starts", "name")

    def __init__(self, name: str | None = None) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"host_range: name must be a str, got {type(name).__name__}")
        self.name = name
        self._starts: list[float] = []

    def __enter__(self) -> host_range:
        self._starts.append(now_us())
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        start = self._starts.pop()
        if recorder.enabled:
            recorder.add((HostRangeEvent(self.name or "host range", start, now_us()),))

    def __call__(self, fn: F) -> F:
        """Decorate ``fn`` so each call is recorded as a host range."""
        name = self.name or getattr(fn, "__qualname__", None) or repr(fn)
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                start = now_us()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    if recorder.enabled:
                        recorder.add((HostRangeEvent(name, start, now_us()),))

            return cast(F, async_wrapper)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = now_us()
            try:
                return fn(*args, **kwargs)
            finally:
                if recorder.enabled:
                    recorder.add((HostRangeEvent(name, start, now_us()),))

        return cast(F, wrapper)


# ---- finishing: synchronize devices and align clocks ------------------------------------------------


def _opened_devices() -> list[BaseDevice]:
    from aruntime.device import Device

    return list(Device.devices())


def _drain(dev: BaseDevice, timeout: float | None) -> None:
    """Wait for everything submitted to ``dev`` so far, without taking its unobserved failures."""
    dev.settle_blocking(timeout)


def _finalize(devices: Iterable[BaseDevice], warn: Callable[[str], None] | None = None) -> list[DeviceEvent]:
    """Ask each device for its clock offsets; a device that cannot answer gets zero offsets (and a warning)."""
    out: list[DeviceEvent] = []
    for dev in devices:
        try:
            out.append(dev.finalize_profile())
        except Exception as exc:
            if warn is not None:
                warn(f"{dev.name}: clock alignment failed ({exc!r}); its ranges use offset 0")
            out.append(DeviceEvent(dev.name))
    return out


def _devices_in(events: Iterable[Event]) -> set[str]:
    names: set[str] = set()
    for ev in events:
        if isinstance(ev, RangeEvent):
            names.add(ev.device)
        elif isinstance(ev, GraphEvent):
            names.update(e.device for e in ev.entries)
    return names


# ---- profile regions --------------------------------------------------------------------------------


class Profile:
    """One profiled region; use it through :func:`profile`.

    After the region, :attr:`events` holds what was recorded in it (ranges,
    dependencies, host ranges, graph replays) followed by a :class:`DeviceEvent`
    with the clock offsets of every device that ran something.
    """

    def __init__(self, sync: bool = True, timeout: float | None = None) -> None:
        self.sync = sync
        self.timeout = None if timeout is None else check_seconds("profile timeout", timeout)
        self.events: list[Event] = []
        self._start = 0
        self._open = False

    # entering and leaving

    def _begin(self) -> None:
        global _active, _outer_enabled, _outer_start
        if self._open:
            raise RuntimeError("this profile region is already open")
        with _state_lock:
            if _active == 0:
                _outer_enabled = recorder.enabled
                _outer_start = len(recorder.events)
            self._start = len(recorder.events)
            _active += 1
            recorder.enabled = True
        self._open = True

    def _end(self, device_events: list[DeviceEvent]) -> None:
        global _active
        with _state_lock:
            captured = recorder.events[self._start :]
            _active -= 1
            if _active == 0 and not (_outer_enabled or _env_enabled):
                recorder.enabled = False
                # nobody else is recording: drop what the regions added, so repeated regions don't accumulate
                del recorder.events[_outer_start:]
        self._open = False
        self.events = [*captured, *device_events]

    def _devices_to_finalize(self) -> list[BaseDevice]:
        used = _devices_in(recorder.events[self._start :])
        return [d for d in _opened_devices() if d.name in used]

    def __enter__(self) -> Profile:
        self._begin()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._open:
            raise RuntimeError("this profile region is not open (it was never entered, or it was left already)")
        device_events: list[DeviceEvent] = []
        try:
            if self.sync:
                for dev in _opened_devices():
                    _drain(dev, self.timeout)
                # the clock samples also run after any completion callbacks (e.g. graph events) of that work
                device_events = _finalize(self._devices_to_finalize())
        except Exception:
            if exc is None:  # don't let a finishing error hide the region's own exception
                raise
        finally:
            self._end(device_events)

    async def __aenter__(self) -> Profile:
        await checkpoint()
        self._begin()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        import anyio

        # waiting for the devices blocks: do it on a worker thread, never on the event loop; shielded (the wait is
        # bounded), so that a cancelled task still ends the region, and a checkpoint after it
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.__exit__, exc_type, exc, tb)
        await checkpoint()

    # results

    def trace(self) -> dict[str, Any]:
        """The region as a Chrome Trace Event JSON object."""
        return build_trace(self.events)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the region's Chrome trace to ``path`` (atomically); returns the path."""
        return write_trace(self.trace(), path)

    def summary(self, top: int = 5) -> dict[str, Any]:
        """Per-device busy, overlap and idle figures and the top kernels and copies (see ``summary.py``)."""
        from aruntime.profile.summary import summarize

        return summarize(self.trace(), top)


def profile(sync: bool = True, timeout: float | None = None) -> Profile:
    """Record one region, as ``async with profile() as prof:`` or ``with profile() as prof:``.

    The region holds what *ran* while it was open (an op submitted just before
    and run inside counts). On leaving it (with ``sync``, the default) it waits
    until every opened device has run the work submitted so far, so that
    work's ranges are in :attr:`Profile.events`, then asks each device that ran
    something for its clock offsets (``sync=False`` neither waits nor aligns
    clocks: offsets are taken as zero). The ``async with`` form waits without
    blocking the event loop; the plain ``with`` form blocks the calling thread
    (``timeout`` bounds each wait). Waiting never takes a device's failed ops:
    ``synchronize`` still raises them. If the block raises, the region still
    ends and keeps its events; so does a cancelled ``async with`` (its exit
    still waits, each wait bounded, then raises the cancellation). Entering
    and leaving the ``async with`` form are checkpoints. Regions nest; when
    nobody else records, leaving the outermost one turns recording off and
    drops its records from the global recorder.
    """
    return Profile(sync, timeout)


# ---- ARUNTIME_PROFILE=1 -----------------------------------------------------------------------------


def _env_flag() -> bool:
    raw = getenv("PROFILE", "").strip()
    try:
        return int(raw) > 0
    except ValueError:
        return raw.lower() in ("true", "yes", "on")


def default_path() -> Path:
    """Where ``ARUNTIME_PROFILE=1`` writes the trace: ``ARUNTIME_PROFILE_PATH``, else
    ``aruntime-profile-<pid>.json`` in the temp dir."""
    configured = getenv("PROFILE_PATH", "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path(tempfile.gettempdir()) / f"aruntime-profile-{os.getpid()}.json"


def write_profile(path: str | os.PathLike[str] | None = None, quiet: bool = False) -> Path:
    """Synchronize every opened device, collect their clock offsets and write all recorded events.

    This is what ``ARUNTIME_PROFILE=1`` runs at exit. Failures of ops nobody awaited
    are reported on stderr (the trace is still written).
    """
    target = Path(path) if path is not None else default_path()

    def warn(message: str) -> None:
        if not quiet:
            print(f"aruntime profile: {message}", file=sys.stderr)

    devices = _opened_devices()
    for dev in devices:
        try:
            dev.synchronize_blocking()
        except Exception as exc:
            warn(f"{dev.name}: {type(exc).__name__}: {exc}")
    events = [*recorder.events, *_finalize(devices, warn)]
    written = save_events(events, target)
    if not quiet:
        print(
            f"aruntime profile: wrote {written} ({len(events)} events); view it with: aruntime profile view {written}",
            file=sys.stderr,
        )
    return written


def _at_exit() -> None:
    try:
        if not recorder.events and not _opened_devices():
            return  # e.g. a worker process that never used aruntime: nothing to write
        path = default_path()
        if getenv("PROFILE_PATH", "").strip() and multiprocessing.parent_process() is not None:
            path = path.with_name(f"{path.stem}-{os.getpid()}{path.suffix}")  # don't overwrite the parent's trace
        write_profile(path)
    except Exception as exc:  # never turn a finished program into a crash at exit
        print(f"aruntime profile: could not write the profile: {type(exc).__name__}: {exc}", file=sys.stderr)


def install_atexit() -> bool:
    """With ``ARUNTIME_PROFILE=1`` (any positive integer) set: start recording and write the trace at exit.

    Called once when ``aruntime`` is imported; calling it again does nothing.
    Returns whether profiling is on for the whole process.
    """
    global _env_enabled, _atexit_installed
    if not _env_flag():
        return _env_enabled
    with _state_lock:
        _env_enabled = True
        recorder.enabled = True
        if not _atexit_installed:
            _atexit_installed = True
            atexit.register(_at_exit)
    return True
