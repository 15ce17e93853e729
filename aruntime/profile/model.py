"""Read a Chrome Trace Event JSON object back into tracks, slices and arrows.

The viewer and the summary both work from this model, so they accept any
Chrome trace (complete ``X`` events, ``B``/``E`` pairs, ``s``/``t``/``f``
flows, ``M`` metadata), not only the ones aruntime writes.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

COMPUTE, COPY, HOST, OTHER = "compute", "copy", "host", "other"
_PHASE_ORDER = {"s": 0, "t": 1, "f": 2}


class Slice(NamedTuple):
    """One range: its track (index into :attr:`Timeline.tracks`), start and duration in µs, name, category."""

    track: int
    start: float
    dur: float
    name: str
    cat: str

    @property
    def end(self) -> float:
        """Where the range ends (µs)."""
        return self.start + self.dur

    @property
    def categories(self) -> frozenset[str]:
        """The comma-separated categories of ``cat``."""
        return frozenset(c.strip() for c in self.cat.split(",") if c.strip())


@dataclass
class Track:
    """A row of the timeline: one thread of one process in the trace (a device queue or the host)."""

    pid: Any
    tid: Any
    process: str
    thread: str
    kind: str = OTHER
    process_order: float = 0.0
    thread_order: float = 0.0

    @property
    def label(self) -> str:
        """``process · thread``, e.g. ``CPU:1 · copy``."""
        return f"{self.process} · {self.thread}"


@dataclass
class Timeline:
    """Tracks (sorted for display), slices (sorted by track, then start) and arrows (slice index pairs)."""

    tracks: list[Track] = field(default_factory=list)
    slices: list[Slice] = field(default_factory=list)
    arrows: list[tuple[int, int]] = field(default_factory=list)

    @property
    def start(self) -> float:
        """The earliest slice start (0 when empty)."""
        return min((s.start for s in self.slices), default=0.0)

    @property
    def end(self) -> float:
        """The latest slice end (0 when empty)."""
        return max((s.end for s in self.slices), default=0.0)


def slice_kind(s: Slice, track: Track) -> str:
    """How a slice is classified (and coloured): ``compute``, ``copy``, ``host`` or ``other``."""
    cats = s.categories
    for kind in (COPY, COMPUTE, HOST):
        if kind in cats:
            return kind
    return track.kind


def _kind_of_thread(name: str) -> str:
    low = name.lower()
    for kind in (COMPUTE, COPY, HOST):
        if low.startswith(kind):
            return kind
    return OTHER


def _num(value: Any, default: float = 0.0) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def parse_trace(trace: dict[str, Any] | list[Any]) -> Timeline:
    """Build a :class:`Timeline` from a Chrome trace object (or its bare event list)."""
    events: Iterable[Any] = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    process_names: dict[Any, str] = {}
    process_order: dict[Any, float] = {}
    thread_names: dict[tuple[Any, Any], str] = {}
    thread_order: dict[tuple[Any, Any], float] = {}
    raw: list[tuple[tuple[Any, Any], float, float, str, str]] = []
    open_slices: dict[tuple[Any, Any], list[tuple[float, str, str]]] = {}
    flows: dict[tuple[Any, str], list[tuple[str, tuple[Any, Any], float, bool]]] = {}
    for ev in events:
        if not isinstance(ev, dict):
            continue
        ph = ev.get("ph")
        key = (ev.get("pid", 0), ev.get("tid", 0))
        if ph == "X":
            raw.append((key, _num(ev.get("ts")), max(_num(ev.get("dur")), 0.0), str(ev.get("name", "")), _cat(ev)))
        elif ph == "B":
            open_slices.setdefault(key, []).append((_num(ev.get("ts")), str(ev.get("name", "")), _cat(ev)))
        elif ph == "E":
            stack = open_slices.get(key)
            if stack:
                ts, name, cat = stack.pop()
                raw.append((key, ts, max(_num(ev.get("ts")) - ts, 0.0), name, cat))
        elif ph in ("s", "t", "f"):
            flow_key = (ev.get("id", ev.get("bind_id")), str(ev.get("cat", "")))
            enclosing = ph != "f" or ev.get("bp") == "e"
            flows.setdefault(flow_key, []).append((ph, key, _num(ev.get("ts")), enclosing))
        elif ph == "M":
            args = ev.get("args") or {}
            meta = ev.get("name")
            if meta == "process_name":
                process_names[key[0]] = str(args.get("name", key[0]))
            elif meta == "process_sort_index":
                process_order[key[0]] = _num(args.get("sort_index"))
            elif meta == "thread_name":
                thread_names[key] = str(args.get("name", key[1]))
            elif meta == "thread_sort_index":
                thread_order[key] = _num(args.get("sort_index"))

    keys = set(thread_names) | {r[0] for r in raw}
    kinds_seen: dict[tuple[Any, Any], set[str]] = {}
    for key, _, _, _, cat in raw:
        kinds_seen.setdefault(key, set()).update(c.strip() for c in cat.split(","))
    tracks: list[Track] = []
    for key in keys:
        pid, tid = key
        thread = thread_names.get(key, f"thread {tid}")
        kind = _kind_of_thread(thread)
        if kind == OTHER:
            found = [k for k in (COMPUTE, COPY, HOST) if k in kinds_seen.get(key, set())]
            kind = found[0] if len(found) == 1 else OTHER
        tracks.append(
            Track(
                pid,
                tid,
                process_names.get(pid, f"process {pid}"),
                thread,
                kind,
                process_order.get(pid, _num(pid, 0.0)),
                thread_order.get(key, _num(tid, 0.0)),
            )
        )
    tracks.sort(key=lambda t: (t.process_order, str(t.pid), t.thread_order, str(t.tid)))
    index = {(t.pid, t.tid): i for i, t in enumerate(tracks)}
    slices = sorted(
        (Slice(index[key], ts, dur, name, cat) for key, ts, dur, name, cat in raw),
        key=lambda s: (s.track, s.start, -s.dur),
    )
    timeline = Timeline(tracks, slices, [])
    timeline.arrows = _resolve_flows(timeline, index, flows)
    return timeline


def _cat(ev: dict[str, Any]) -> str:
    cat = ev.get("cat", "")
    return cat if isinstance(cat, str) else ""


def _resolve_flows(
    timeline: Timeline,
    index: dict[tuple[Any, Any], int],
    flows: dict[tuple[Any, str], list[tuple[str, tuple[Any, Any], float, bool]]],
) -> list[tuple[int, int]]:
    """Bind each flow step to a slice (the enclosing one, or for ``f`` without ``bp: e`` the next one)."""
    bounds: dict[int, tuple[int, int]] = {}
    for i, s in enumerate(timeline.slices):
        lo, _ = bounds.get(s.track, (i, i))
        bounds[s.track] = (lo, i + 1)
    starts = [s.start for s in timeline.slices]
    # running maximum of slice ends within each track, to stop the backwards search early
    max_end: list[float] = []
    for i, s in enumerate(timeline.slices):
        prev = max_end[i - 1] if i and timeline.slices[i - 1].track == s.track else float("-inf")
        max_end.append(max(prev, s.end))

    def bind(key: tuple[Any, Any], ts: float, enclosing: bool) -> int | None:
        track = index.get(key)
        if track is None or track not in bounds:
            return None
        lo, hi = bounds[track]
        if not enclosing:
            k = bisect.bisect_left(starts, ts, lo, hi)
            return k if k < hi else None
        j = bisect.bisect_right(starts, ts, lo, hi) - 1
        while j >= lo and max_end[j] >= ts:
            if timeline.slices[j].end >= ts:
                return j
            j -= 1
        return None

    arrows: list[tuple[int, int]] = []
    for steps in flows.values():
        steps.sort(key=lambda step: (_PHASE_ORDER[step[0]], step[2]))
        bound = [bind(key, ts, enclosing) for _, key, ts, enclosing in steps]
        points = [b for b in bound if b is not None]
        for a, b in itertools.pairwise(points):
            if a != b:
                arrows.append((a, b))
    return arrows
