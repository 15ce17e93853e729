"""``aruntime profile summary``: per device, how busy each queue was and how much they overlapped.

All percentages are of the device's *span*: from its first range's start to
its last range's end. ``overlap`` is the time both the compute and the copy
queue were busy; ``copy_hidden_pct`` is that overlap as a share of the copy
time (100 % means every copy ran behind a kernel). Idle gaps are the stretches
inside the span where neither queue was busy. ``waits`` counts the recorded
cross-queue dependencies that ended on the device: they are why a queue
waited instead of overlapping.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from aruntime.profile.model import COMPUTE, COPY, HOST, Slice, Timeline, parse_trace, slice_kind

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge intervals into a sorted list of disjoint ones."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def measure(intervals: Sequence[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(end - start for start, end in intervals)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The intersection of two sorted lists of disjoint intervals."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def gaps(busy: Sequence[Interval]) -> list[Interval]:
    """The holes between consecutive disjoint intervals."""
    return [(busy[k][1], busy[k + 1][0]) for k in range(len(busy) - 1) if busy[k + 1][0] > busy[k][1]]


def _pct(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 2) if whole > 0 else 0.0


def _top(slices: list[Slice], span: float, top: int) -> list[dict[str, Any]]:
    totals: dict[str, float] = defaultdict(float)
    counts: Counter[str] = Counter()
    for s in slices:
        totals[s.name] += s.dur
        counts[s.name] += 1
    ranked = sorted(totals, key=lambda n: (-totals[n], n))[:top]
    return [
        {
            "name": name,
            "count": counts[name],
            "total_us": round(totals[name], 3),
            "mean_us": round(totals[name] / counts[name], 3),
            "pct": _pct(totals[name], span),
        }
        for name in ranked
    ]


def summarize(trace: dict[str, Any] | Timeline, top: int = 5, gaps_listed: int = 5) -> dict[str, Any]:
    """Summarize a Chrome trace (or a parsed :class:`Timeline`) per device; the ``--json`` output."""
    tl = trace if isinstance(trace, Timeline) else parse_trace(trace)
    by_process: dict[Any, list[int]] = {}
    for i, track in enumerate(tl.tracks):
        by_process.setdefault(track.pid, []).append(i)
    kinds = [slice_kind(s, tl.tracks[s.track]) for s in tl.slices]
    slices_of: dict[Any, list[int]] = defaultdict(list)
    for i, s in enumerate(tl.slices):
        slices_of[tl.tracks[s.track].pid].append(i)

    devices: list[dict[str, Any]] = []
    for pid, track_ids in by_process.items():
        track_kinds = {tl.tracks[t].kind for t in track_ids}
        mine = slices_of.get(pid, [])
        if HOST in track_kinds or not ({COMPUTE, COPY} & track_kinds or any(kinds[i] in (COMPUTE, COPY) for i in mine)):
            continue
        compute = [tl.slices[i] for i in mine if kinds[i] == COMPUTE]
        copies = [tl.slices[i] for i in mine if kinds[i] == COPY]
        every = [tl.slices[i] for i in mine]
        span_start = min((s.start for s in every), default=0.0)
        span_end = max((s.end for s in every), default=0.0)
        span = span_end - span_start
        comp_busy = union((s.start, s.end) for s in compute)
        copy_busy = union((s.start, s.end) for s in copies)
        both = intersect(comp_busy, copy_busy)
        any_busy = union((s.start, s.end) for s in every)
        holes = sorted(gaps(any_busy), key=lambda g: (g[0] - g[1], g[0]))
        waits: Counter[str] = Counter()
        mine_set = set(mine)
        for src, dst in tl.arrows:
            if dst in mine_set:
                src_dev = tl.tracks[tl.slices[src].track].process
                where = "" if src_dev == tl.tracks[tl.slices[dst].track].process else f"{src_dev} "
                waits[f"{where}{kinds[src]}->{kinds[dst]}"] += 1
        copy_time = measure(copy_busy)
        devices.append(
            {
                "device": tl.tracks[track_ids[0]].process,
                "ranges": len(every),
                "span_us": round(span, 3),
                "start_us": round(span_start, 3),
                "compute_busy_us": round(measure(comp_busy), 3),
                "copy_busy_us": round(copy_time, 3),
                "overlap_us": round(measure(both), 3),
                "compute_busy_pct": _pct(measure(comp_busy), span),
                "copy_busy_pct": _pct(copy_time, span),
                "overlap_pct": _pct(measure(both), span),
                "copy_hidden_pct": _pct(measure(both), copy_time),
                "idle": {
                    "count": len(holes),
                    "total_us": round(measure(holes), 3),
                    "pct": _pct(measure(holes), span),
                    "largest": [
                        {"start_us": round(a, 3), "end_us": round(b, 3), "dur_us": round(b - a, 3)}
                        for a, b in holes[:gaps_listed]
                    ],
                },
                "waits": {"total": sum(waits.values()), "by_kind": dict(sorted(waits.items()))},
                "top_kernels": _top(compute, span, top),
                "top_copies": _top(copies, span, top),
            }
        )
    return {
        "span_us": round(tl.end - tl.start, 3),
        "ranges": len(tl.slices),
        "dependencies": len(tl.arrows),
        "devices": devices,
    }


def format_time(us: float) -> str:
    """A duration in µs as text with a fitting unit: ``850 ns``, ``12.500 µs``, ``3.200 ms``, ``1.500 s``."""
    a = abs(us)
    if a < 1.0:
        return f"{us * 1000:.0f} ns"
    if a < 1000.0:
        return f"{us:.3f} µs"
    if a < 1_000_000.0:
        return f"{us / 1000:.3f} ms"
    return f"{us / 1_000_000:.3f} s"


def _table(title: str, rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return [f"  {title:<13}none"]
    lines = [f"  {title:<13}{'total':>12}  {'share':>7}  {'count':>7}  {'mean':>12}  name"]
    for r in rows:
        lines.append(
            f"  {'':<13}{format_time(r['total_us']):>12}  {r['pct']:>6.1f}%  {r['count']:>7}  "
            f"{format_time(r['mean_us']):>12}  {r['name']}"
        )
    return lines


def format_summary(summary: dict[str, Any], source: str = "") -> str:
    """The human-readable form of :func:`summarize`'s result."""
    head = f"profile summary{f' of {source}' if source else ''}: "
    head += f"{summary['ranges']} ranges, {summary['dependencies']} dependencies, "
    head += f"span {format_time(summary['span_us'])}"
    lines = [head]
    if not summary["devices"]:
        lines.append("no device ranges in this trace")
    for d in summary["devices"]:
        lines.append("")
        lines.append(f"{d['device']}: {d['ranges']} ranges over {format_time(d['span_us'])}")
        lines.append(
            f"  {'busy':<13}compute {d['compute_busy_pct']:.1f} %   copy {d['copy_busy_pct']:.1f} %   "
            f"overlap {d['overlap_pct']:.1f} %  ({d['copy_hidden_pct']:.1f} % of copy time ran behind compute)"
        )
        idle = d["idle"]
        gap_line = f"  {'idle gaps':<13}{idle['count']}, {format_time(idle['total_us'])} total ({idle['pct']:.1f} %)"
        if idle["largest"]:
            g = idle["largest"][0]
            gap_line += f"; largest {format_time(g['dur_us'])} at +{format_time(g['start_us'])}"
        lines.append(gap_line)
        waits = d["waits"]
        if waits["total"]:
            kinds = ", ".join(f"{k} {v}" for k, v in waits["by_kind"].items())
            lines.append(f"  {'waits':<13}{waits['total']} cross-queue dependencies ({kinds})")
        else:
            lines.append(f"  {'waits':<13}none recorded")
        lines.extend(_table("top kernels", d["top_kernels"]))
        lines.extend(_table("top copies", d["top_copies"]))
    return "\n".join(lines)
