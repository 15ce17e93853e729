"""Profile event records (plain data) and the process-wide recorder they go to."""

from __future__ import annotations

import itertools
import threading
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple


def now_us() -> float:
    """The host clock, in microseconds, that every range is expressed in."""
    return time.perf_counter_ns() / 1000.0


@dataclass(frozen=True)
class DeviceEvent:
    """A device and the offsets (µs) mapping its compute and copy clocks to the host clock."""

    device: str
    comp_offset: float = 0.0
    copy_offset: float = 0.0


class RangeEvent(NamedTuple):
    """One timed command: ``start``/``end`` in host µs; ``op`` identifies it for dependency arrows.

    A named tuple rather than a dataclass: engines create one per command while profiling.
    """

    device: str
    name: str
    start: float
    end: float
    is_copy: bool
    op: int = 0


@dataclass(frozen=True)
class HostRangeEvent:
    """A named block of host code, timed in host µs."""

    name: str
    start: float
    end: float


class DependencyEvent(NamedTuple):
    """Op ``dst`` waited for op ``src`` on another queue (a hazard the runtime resolved)."""

    src: int
    dst: int


@dataclass(frozen=True)
class GraphEntry:
    """One op of a captured graph."""

    device: str
    name: str
    is_copy: bool


@dataclass(frozen=True)
class GraphEvent:
    """A graph replay: its entries, each entry's dependencies (indices), and per-entry start/end µs."""

    entries: tuple[GraphEntry, ...]
    deps: tuple[tuple[int, ...], ...]
    starts: tuple[float, ...]
    ends: tuple[float, ...]


Event = DeviceEvent | RangeEvent | HostRangeEvent | DependencyEvent | GraphEvent


class RangeLog:
    """One engine's recorded ranges, kept in columns so that recording allocates no object per command."""

    __slots__ = ("device", "ends", "is_copy", "names", "ops", "starts")

    def __init__(self, device: str, is_copy: bool) -> None:
        self.device = device
        self.is_copy = is_copy
        self.names: list[str] = []
        self.starts = array("q")
        self.ends = array("q")
        self.ops = array("q")

    def add(self, name: str, start_ns: int, end_ns: int, op: int) -> None:
        """Record one command (the engine's thread only); times from ``time.perf_counter_ns``."""
        self.ends.append(end_ns)
        self.starts.append(start_ns)
        self.names.append(name)
        self.ops.append(op)

    def drain(self) -> list[RangeEvent]:
        """Take the ranges recorded so far as events (safe while the engine keeps recording)."""
        n = len(self.ops)  # the column the engine fills last
        if not n:
            return []
        names, starts, ends, ops = self.names[:n], self.starts[:n], self.ends[:n], self.ops[:n]
        del self.names[:n], self.starts[:n], self.ends[:n], self.ops[:n]
        device, is_copy = self.device, self.is_copy
        return [
            RangeEvent(device, name, start / 1000.0, end / 1000.0, is_copy, op)
            for name, start, end, op in zip(names, starts, ends, ops, strict=True)
        ]


class Recorder:
    """Where events go while ``enabled``: engines record ranges in their :class:`RangeLog`, everything
    else goes through :meth:`add`."""

    __slots__ = ("_events", "_lock", "_logs", "enabled")  # slots: the native submission path reads `enabled`

    def __init__(self) -> None:
        self.enabled = False
        self._events: list[Event] = []
        self._logs: list[RangeLog] = []
        self._lock = threading.Lock()

    def add_log(self, log: RangeLog) -> RangeLog:
        """Register one engine's range log (returned), drained into :attr:`events` when they are read."""
        with self._lock:
            self._logs.append(log)
        return log

    def add(self, events: Iterable[Event]) -> None:
        """Record ``events`` (anything but an engine's ranges, which its log keeps until :attr:`events` is read)."""
        added = list(events)
        with self._lock:
            self._events.extend(added)

    @property
    def events(self) -> list[Event]:
        """Every event recorded so far; the engines' ranges join it, in start order, as it is read."""
        with self._lock:
            drained = [event for log in self._logs for event in log.drain()]
            drained.sort(key=lambda event: event.start)
            self._events.extend(drained)
            return self._events


recorder = Recorder()
op_ids = itertools.count(1)
