"""Profile event records (plain data) and the process-wide recorder they go to."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
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


@dataclass
class Recorder:
    """Where engines append events while ``enabled`` (list appends are thread-safe)."""

    enabled: bool = False
    events: list[Event] = field(default_factory=list)


recorder = Recorder()
op_ids = itertools.count(1)
