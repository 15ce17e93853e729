"""Export recorded events as a Chrome Trace Event file (opens in Perfetto UI and chrome://tracing).

The file is a JSON object ``{"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}``:

* one process per device (plus one named ``host`` when host ranges were
  recorded), named and ordered with ``"ph": "M"`` metadata events;
* in each device process a ``compute`` and a ``copy`` track (a thread, named
  with metadata); ranges that overlap on one queue (several hardware queues,
  or a graph entry over an eager op) spill onto extra tracks ``compute 2``, ...;
* one complete event (``"ph": "X"``, ``ts`` and ``dur`` in µs) per range, on
  the host clock (each device's clock offsets applied), relative to the
  earliest event (``otherData.t0_us`` keeps the absolute host time);
* one flow arrow per recorded dependency: an ``"s"`` event inside the source
  range and an ``"f"`` event with ``"bp": "e"`` inside the range that waited,
  sharing an ``id``.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aruntime.events import DependencyEvent, DeviceEvent, Event, GraphEvent, HostRangeEvent, RangeEvent

HOST = "host"
COMPUTE = "compute"
COPY = "copy"
HOST_PID = 1
FORMAT_VERSION = 1


@dataclass
class _Slice:
    process: str  # device name, or HOST
    queue: str  # COMPUTE, COPY or HOST
    name: str
    start: float  # host µs
    end: float
    cat: str
    args: dict[str, Any] = field(default_factory=dict)
    tid: int = 0


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key that orders ``CPU, CPU:1, CPU:2, CPU:10`` numerically."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)


def pack_lanes(spans: list[tuple[float, float]]) -> list[int]:
    """Assign each ``(start, end)`` span a lane so that spans in one lane are disjoint or nested.

    Trace viewers require the complete events of one thread to nest properly;
    partially overlapping spans go to different lanes. Returns the lane of each
    span, in input order; lane 0 is used first.
    """
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1]))
    lanes: list[list[float]] = []  # per lane, the ends of the spans still open (a stack)
    result = [0] * len(spans)
    for i in order:
        start, end = spans[i]
        for lane, stack in enumerate(lanes):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                result[i] = lane
                break
        else:
            result[i] = len(lanes)
            lanes.append([end])
    return result


def _track_name(queue: str, lane: int) -> str:
    return queue if lane == 0 else f"{queue} {lane + 1}"


def build_trace(events: Iterable[Event], other: dict[str, Any] | None = None) -> dict[str, Any]:
    """Turn recorded events into a Chrome Trace Event JSON object (see the module docstring).

    ``other`` is merged into ``otherData``. Dependencies whose ops recorded no
    range (e.g. they ran before the profiled region) are left out and counted
    in ``otherData.dropped_dependencies``.
    """
    offsets: dict[str, tuple[float, float]] = {}
    ranges: list[RangeEvent] = []
    hosts: list[HostRangeEvent] = []
    deps: list[DependencyEvent] = []
    graphs: list[GraphEvent] = []
    for ev in events:
        if isinstance(ev, RangeEvent):
            ranges.append(ev)
        elif isinstance(ev, DependencyEvent):
            deps.append(ev)
        elif isinstance(ev, HostRangeEvent):
            hosts.append(ev)
        elif isinstance(ev, DeviceEvent):
            offsets[ev.device] = (ev.comp_offset, ev.copy_offset)
        elif isinstance(ev, GraphEvent):
            graphs.append(ev)

    def shift(device: str, is_copy: bool) -> float:
        comp, copy = offsets.get(device, (0.0, 0.0))
        return copy if is_copy else comp

    slices: list[_Slice] = []
    arrows: list[tuple[int, int, str]] = []

    # Graph replays first: one slice per timed entry, arrows for the entries' dependencies.
    graph_slices: dict[tuple[str, str], list[int]] = {}
    for g_index, g in enumerate(graphs, 1):
        at: dict[int, int] = {}
        for i, entry in enumerate(g.entries):
            start, end = g.starts[i], g.ends[i]
            if (start == 0.0 and end == 0.0) or end < start:
                continue  # this entry never ran (its replay failed before it)
            off = shift(entry.device, entry.is_copy)
            queue = COPY if entry.is_copy else COMPUTE
            at[i] = len(slices)
            graph_slices.setdefault((entry.device, queue), []).append(len(slices))
            args = {"graph": g_index, "entry": i}
            slices.append(_Slice(entry.device, queue, entry.name, start + off, end + off, f"{queue},graph", args))
        for i, entry_deps in enumerate(g.deps):
            for j in entry_deps:
                if i in at and j in at and j != i:
                    arrows.append((at[j], at[i], "graph dependency"))
    for indices in graph_slices.values():
        indices.sort(key=lambda k: slices[k].start)
    graph_starts = {key: [slices[k].start for k in indices] for key, indices in graph_slices.items()}

    def graph_entry_of(device: str, queue: str, name: str, start: float, end: float) -> int | None:
        """The graph entry slice that timed this same command (the engine records it as a range too)."""
        indices = graph_slices.get((device, queue))
        if not indices:
            return None
        last = bisect.bisect_right(graph_starts[(device, queue)], start) - 1
        for k in range(last, max(last - 16, -1), -1):  # one queue runs one entry at a time: look only nearby
            g = slices[indices[k]]
            if g.end >= end and g.name == name:
                return indices[k]
        return None

    first_of_op: dict[int, int] = {}
    last_of_op: dict[int, int] = {}
    for r in ranges:
        off = shift(r.device, r.is_copy)
        queue = COPY if r.is_copy else COMPUTE
        start, end = r.start + off, r.end + off
        index = graph_entry_of(r.device, queue, r.name, start, end) if graph_slices else None
        if index is None:
            index = len(slices)
            slices.append(_Slice(r.device, queue, r.name, start, end, queue, {"op": r.op} if r.op else {}))
        if r.op:
            first = first_of_op.get(r.op)
            if first is None or slices[first].start > slices[index].start:
                first_of_op[r.op] = index
            last = last_of_op.get(r.op)
            if last is None or slices[last].end < slices[index].end:
                last_of_op[r.op] = index
    for h in hosts:
        slices.append(_Slice(HOST, HOST, h.name, h.start, h.end, HOST))

    dropped = 0
    seen: set[tuple[int, int]] = set()
    for d in deps:
        src, dst = last_of_op.get(d.src), first_of_op.get(d.dst)
        if src is None or dst is None or src == dst:
            dropped += 1
            continue
        if (src, dst) not in seen:
            seen.add((src, dst))
            arrows.append((src, dst, "dependency"))

    devices = sorted({s.process for s in slices if s.process != HOST} | set(offsets), key=natural_key)
    t0 = min((s.start for s in slices), default=0.0)

    pids = {device: HOST_PID + 1 + i for i, device in enumerate(devices)}
    meta: list[dict[str, Any]] = []

    def name_process(pid: int, name: str, order: int) -> None:
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": order}})

    def name_thread(pid: int, tid: int, name: str) -> None:
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})

    host_slices = [s for s in slices if s.process == HOST]
    if host_slices:
        name_process(HOST_PID, HOST, 0)
        lanes = pack_lanes([(s.start, s.end) for s in host_slices])
        for s, lane in zip(host_slices, lanes, strict=True):
            s.tid = lane + 1
        for lane in range(max(lanes) + 1):
            name_thread(HOST_PID, lane + 1, _track_name(HOST, lane))
    for order, device in enumerate(devices, 1):
        pid = pids[device]
        name_process(pid, device, order)
        tid = 1
        for queue in (COMPUTE, COPY):
            mine = [s for s in slices if s.process == device and s.queue == queue]
            lanes = pack_lanes([(s.start, s.end) for s in mine])
            for s, lane in zip(mine, lanes, strict=True):
                s.tid = tid + lane
            for lane in range(max(lanes, default=0) + 1):
                name_thread(pid, tid + lane, _track_name(queue, lane))
            tid += max(lanes, default=0) + 1

    def pid_of(s: _Slice) -> int:
        return HOST_PID if s.process == HOST else pids[s.process]

    out: list[dict[str, Any]] = meta
    for s in sorted(slices, key=lambda s: (pid_of(s), s.tid, s.start)):
        complete: dict[str, Any] = {
            "name": s.name,
            "cat": s.cat,
            "ph": "X",
            "ts": round(s.start - t0, 3),
            "dur": round(max(s.end - s.start, 0.0), 3),
            "pid": pid_of(s),
            "tid": s.tid,
        }
        if s.args:
            complete["args"] = s.args
        out.append(complete)
    for flow_id, (src, dst, name) in enumerate(arrows, 1):
        a, b = slices[src], slices[dst]
        # a point strictly inside each slice, so "enclosing slice" binding is unambiguous
        out.append(
            {
                "name": name,
                "cat": "dependency",
                "ph": "s",
                "id": flow_id,
                "ts": round((a.start + a.end) / 2 - t0, 3),
                "pid": pid_of(a),
                "tid": a.tid,
            }
        )
        out.append(
            {
                "name": name,
                "cat": "dependency",
                "ph": "f",
                "bp": "e",
                "id": flow_id,
                "ts": round((b.start + b.end) / 2 - t0, 3),
                "pid": pid_of(b),
                "tid": b.tid,
            }
        )
    other_data: dict[str, Any] = {
        "producer": "aruntime",
        "format_version": FORMAT_VERSION,
        "t0_us": t0,
        "clock_offsets_us": {d: {COMPUTE: c, COPY: p} for d, (c, p) in offsets.items()},
        "dropped_dependencies": dropped,
    }
    if other:
        other_data.update(other)
    return {"traceEvents": out, "displayTimeUnit": "ns", "otherData": other_data}


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` atomically: a temporary file in the same directory, then ``os.replace``.

    Readers see the old file or the complete new one, never a partial write;
    on any error the temporary file is removed and the target is untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    try:
        mode = target.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


def dumps(trace: dict[str, Any]) -> str:
    """Serialize a trace compactly (NaN and infinity are errors: viewers reject them)."""
    return json.dumps(trace, separators=(",", ":"), allow_nan=False)


def write_trace(trace: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Serialize ``trace`` and write it atomically to ``path``; returns the path."""
    return atomic_write(path, dumps(trace))


def save_events(events: Iterable[Event], path: str | os.PathLike[str], other: dict[str, Any] | None = None) -> Path:
    """Export ``events`` as a Chrome trace and write it atomically to ``path``."""
    return write_trace(build_trace(events, other), path)


def load_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a Chrome Trace Event file (object form, or the bare array form); a ValueError names the file."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a JSON trace ({exc})") from None
    if isinstance(data, list):
        return {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (expected an object with a traceEvents list)")
    return data
