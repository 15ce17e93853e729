"""``aruntime profile view``: a self-contained HTML timeline of a Chrome trace.

The page is one file: the template ``timeline.html`` (inline CSS and script,
no network access at all) with the trace's ranges embedded as compact JSON
columns and a summary strip (bytes copied, queues busy at once, busy and
overlap per device). It draws a row per device queue on a canvas, colours
ranges by kind, shows names on hover, draws the dependency arrows of the
clicked (or hovered) range, or all of them on demand, a time axis, and zooms
and pans with the wheel, the mouse and the keyboard.
"""

from __future__ import annotations

import json
import os
import re
import sys
import webbrowser
from importlib import resources
from pathlib import Path
from typing import Any

from aruntime.profile.model import Timeline, parse_trace, slice_kind
from aruntime.profile.summary import summarize
from aruntime.profile.trace import atomic_write, load_trace

PLACEHOLDER = "__ARUNTIME_TRACE_DATA__"
KINDS = ("compute", "copy", "host", "other", "graph compute", "graph copy")


def template() -> str:
    """The HTML template shipped inside the package."""
    return resources.files("aruntime.profile").joinpath("timeline.html").read_text(encoding="utf-8")


def viewer_data(timeline: Timeline, title: str = "aruntime timeline") -> dict[str, Any]:
    """The columns the page draws from: times relative to the first range, names interned; tracks that hold
    no range (a DISK device's compute queue) are left out."""
    t0 = timeline.start
    used = sorted({s.track for s in timeline.slices})
    row_of = {t: i for i, t in enumerate(used)}
    names: dict[str, int] = {}
    kind_ix = {k: i for i, k in enumerate(KINDS)}
    starts: list[float] = []
    durs: list[float] = []
    track_ix: list[int] = []
    name_ix: list[int] = []
    kind_col: list[int] = []
    depth: list[int] = []
    open_ends: list[float] = []
    current = -1
    for s in timeline.slices:  # sorted by track, then start (outer ranges first)
        if s.track != current:
            current = s.track
            open_ends.clear()
        while open_ends and open_ends[-1] <= s.start:
            open_ends.pop()
        depth.append(min(len(open_ends), 255))
        open_ends.append(s.end)
        kind = slice_kind(s, timeline.tracks[s.track])
        if "graph" in s.categories and kind in ("compute", "copy"):
            kind = f"graph {kind}"
        starts.append(round(s.start - t0, 3))
        durs.append(round(s.dur, 3))
        track_ix.append(row_of[s.track])
        name_ix.append(names.setdefault(s.name, len(names)))
        kind_col.append(kind_ix.get(kind, kind_ix["other"]))
    return {
        "title": title,
        "tracks": [
            {"process": t.process, "thread": t.thread, "kind": t.kind, "label": t.label}
            for t in map(timeline.tracks.__getitem__, used)
        ],
        "kinds": list(KINDS),
        "names": list(names),
        "s": starts,
        "d": durs,
        "t": track_ix,
        "n": name_ix,
        "k": kind_col,
        "z": depth,
        "a": [i for pair in timeline.arrows for i in pair],
        "span": round(timeline.end - t0, 3),
        "summary": summary_strip(timeline),
    }


COPY_BYTES = re.compile(r"\b(\d+) B\b")
"""How a copy range names its size: ``copyin 4096 B``, ``transfer 1048576 B DISK:...->CPU``."""


def summary_strip(timeline: Timeline) -> dict[str, Any]:
    """The page's summary strip: bytes the copies moved, queues busy at once on average, and per device the
    share of the whole span its compute queue, its copy queue, and both at once were busy (percent)."""
    span = timeline.end - timeline.start
    devices = summarize(timeline, top=0)["devices"]
    copied = 0
    for s in timeline.slices:
        found = COPY_BYTES.search(s.name) if slice_kind(s, timeline.tracks[s.track]) == "copy" else None
        copied += int(found[1]) if found else 0
    busy = sum(d["compute_busy_us"] + d["copy_busy_us"] for d in devices)
    pct = 100 / span if span > 0 else 0.0
    return {
        "copy_bytes": copied,
        "busy_queues": round(busy / span, 3) if span > 0 else 0.0,
        "devices": [
            [
                d["device"],
                round(d["compute_busy_us"] * pct, 1),
                round(d["copy_busy_us"] * pct, 1),
                round(d["overlap_us"] * pct, 1),
            ]
            for d in devices
        ],
    }


def _embed(data: dict[str, Any]) -> str:
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    # inside <script> only "</" (and "<!--") could end or confuse the element: escape every <, > and &
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_html(trace: dict[str, Any] | Timeline, title: str = "aruntime timeline") -> str:
    """The complete viewer page for ``trace`` (a Chrome trace object or a parsed timeline)."""
    timeline = trace if isinstance(trace, Timeline) else parse_trace(trace)
    page = template()
    if page.count(PLACEHOLDER) != 1:
        raise RuntimeError("timeline.html template is damaged: expected exactly one data placeholder")
    return page.replace(PLACEHOLDER, _embed(viewer_data(timeline, title)))


def default_output(trace_path: str | os.PathLike[str]) -> Path:
    """Where ``view`` writes the page by default: next to the trace, ``.html`` instead of ``.json``."""
    path = Path(trace_path)
    return path.with_suffix(".html") if path.suffix.lower() == ".json" else path.with_name(path.name + ".html")


def write_html(
    trace_path: str | os.PathLike[str], output: str | os.PathLike[str] | None = None, title: str | None = None
) -> Path:
    """Read the trace at ``trace_path`` and write its viewer page (atomically); returns the page's path."""
    trace = load_trace(trace_path)
    out = Path(output) if output is not None else default_output(trace_path)
    return atomic_write(out, render_html(trace, title or f"aruntime timeline · {Path(trace_path).name}"))


def can_open_browser() -> bool:
    """Whether opening a browser makes sense here: not under CI, and (on Linux/BSD) only with a display."""
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    if sys.platform.startswith(("linux", "freebsd", "openbsd", "netbsd")):
        return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return True


def open_in_browser(path: str | os.PathLike[str]) -> bool:
    """Open the page in a browser when :func:`can_open_browser`; returns whether one was started."""
    if not can_open_browser():
        return False
    try:
        return webbrowser.open(Path(path).resolve().as_uri())
    except webbrowser.Error:
        return False
