"""The offline timeline page, loaded in a real headless Chromium.

Chromium (Debian's ``chromium`` package; ``.ci/run`` installs it) must be on
PATH. Without it these tests fail under CI (``CI`` set) and skip elsewhere.
"""

from __future__ import annotations

import array
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import anyio
import pytest

from aruntime import Device, dtypes, host_range, profile
from aruntime.events import DependencyEvent, DeviceEvent, Event, RangeEvent
from aruntime.profile.model import parse_trace
from aruntime.profile.trace import load_trace, save_events
from aruntime.profile.viewer import write_html
from tests.kernels import SCALE

BROWSERS = ("chromium", "chromium-browser")
N = 64 * 1024


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def chromium() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    message = "chromium is not installed (apt-get install chromium); the viewer's browser tests need it"
    if _in_ci():
        pytest.fail(message)
    pytest.skip(message)


def run_chromium(browser: str, profile_dir: Path, *args: str) -> str:
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile_dir}",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def page_state(dom: str) -> tuple[str, dict[str, str]]:
    """The page's title and its ``<body data-*>`` attributes, from ``--dump-dom`` output."""
    title = re.search(r"<title>(.*?)</title>", dom, re.S)
    body = re.search(r"<body([^>]*)>", dom)
    assert title and body, dom[:500]
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', body[1]))
    return title[1], attrs


def png_rows(path: Path) -> list[list[tuple[int, int, int]]]:
    """The RGB pixels, row by row, of an 8-bit RGB/RGBA, non-interlaced PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    height = channels = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, chunk = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            assert depth == 8 and color in (2, 6) and interlace == 0
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    prev = bytearray(stride)
    rows = []
    for y in range(height):
        filt = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if filt == 1:
                line[i] = (line[i] + a) & 0xFF
            elif filt == 2:
                line[i] = (line[i] + b) & 0xFF
            elif filt == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif filt == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append([(line[x], line[x + 1], line[x + 2]) for x in range(0, stride, channels)])
        prev = line
    return rows


BACKGROUND = {(0xFA, 0xFA, 0xFA), (0xF3, 0xF3, 0xF3), (0xE4, 0xE4, 0xE4), (0xFF, 0xFF, 0xFF), (0xCC, 0xCC, 0xCC)}
"""The lane backgrounds (alternating rows), the grid lines, the label column and the process separators."""
COMPUTE, COPY, HOST = (0x4E, 0x79, 0xA7), (0xF2, 0x8E, 0x2B), (0x59, 0xA1, 0x4F)


async def pipeline(path: Path) -> None:
    """copyin -> launch -> copyout of 4 batches over two CPU devices, double-buffered, profiled."""
    devs = [Device["CPU:7"], Device["CPU:8"]]
    progs = [await d.compile(SCALE, outs=(0,)) for d in devs]
    bufs = [
        [(await d.allocate(N, dtypes.float32), await d.allocate(N, dtypes.float32)) for _ in range(2)] for d in devs
    ]
    async with profile() as prof:
        outs = []
        with host_range("submit"):
            for b in range(4):
                d = b % 2
                x, y = bufs[d][b // 2]
                devs[d].copyin(x, array.array("f", [float(b)]) * N)
                devs[d].launch(progs[d], y, x, vals=(N, 2.0))
                outs.append(devs[d].copyout(y))
        for op in outs:
            await op
    prof.save(path)


def test_the_timeline_draws_a_real_trace(chromium: str, tmp_path: Path) -> None:
    trace_path = tmp_path / "pipeline.json"
    anyio.run(pipeline, trace_path)
    tl = parse_trace(load_trace(trace_path))
    arrows = len(tl.arrows)  # a wait (and its arrow) only where the op waited for was still running: at most 2 a batch
    assert len(tl.slices) == 13 and 0 < arrows <= 8  # 12 device ranges + 1 host range
    page = write_html(trace_path)
    assert page == tmp_path / "pipeline.html"

    dom = run_chromium(chromium, tmp_path / "profile-a", "--dump-dom", page.as_uri())
    title, state = page_state(dom)
    assert title == "drawn:13"
    assert state["ready"] == "1" and state["ranges"] == "13" and state["drawn"] == "13"
    assert state["tracks"] == "5" and state["dependencies"] == str(arrows)
    assert state["arrows"] == "0" and state["selected"] == "-1"  # no arrows until a range is picked
    assert 'id="all-deps"' in dom and "queues busy at once" in dom and "CPU:7</b> compute" in dom

    _, state = page_state(run_chromium(chromium, tmp_path / "profile-c", "--dump-dom", page.as_uri() + "#arrows"))
    assert state["arrows"] == str(arrows)  # on demand: every one in view
    src = tl.arrows[0][0]
    wanted = sum(src in pair for pair in tl.arrows)  # arrows into and out of the range that arrow starts at
    _, state = page_state(run_chromium(chromium, tmp_path / "profile-d", "--dump-dom", f"{page.as_uri()}#select={src}"))
    assert state["selected"] == str(src) and state["arrows"] == str(wanted) and 0 < wanted < arrows + 1

    shot = tmp_path / "timeline.png"
    run_chromium(chromium, tmp_path / "profile-b", f"--screenshot={shot}", "--window-size=1400,800", page.as_uri())
    _, state = page_state(
        run_chromium(chromium, tmp_path / "profile-e", "--window-size=1400,800", "--dump-dom", page.as_uri())
    )
    rows = png_rows(shot)
    assert (len(rows[0]), len(rows)) == (1400, 800)
    label_w, row_h, top = int(state["label-w"]), int(state["row-h"]), int(state["lanes-top"])
    assert row_h > 26  # five lanes in an 800 px window: the rows grow to fill the page
    assert top + 5 * row_h > 0.6 * 800  # the lanes reach down the page, no empty lower part
    for lane in range(5):  # every lane has bars drawn in it
        band = rows[top + lane * row_h + 4 : top + (lane + 1) * row_h - 4]
        drawn = sum(px not in BACKGROUND for line in band for px in line[label_w + 2 :])
        colours = {px for line in band for px in line[label_w + 2 :]}
        assert drawn > 200, (lane, drawn)
        assert colours & {COMPUTE, COPY, HOST}, lane
    assert {px for line in rows[top:] for px in line} >= {COMPUTE, COPY, HOST}
    labels = {px for line in rows[top : top + 5 * row_h] for px in line[8:label_w]}
    assert len(labels - BACKGROUND) > 3  # lane labels are written


def big_trace(path: Path, count: int) -> Path:
    rng = random.Random(3)
    events: list[Event] = [DeviceEvent("CPU", 0.5, -0.25), DeviceEvent("CPU:1")]
    ends: dict[tuple[str, bool], float] = {}
    for op in range(1, count + 1):
        device, is_copy = ("CPU", "CPU:1")[op % 2], op % 3 == 0
        start = ends.get((device, is_copy), 0.0) + rng.uniform(0.2, 3.0)
        ends[(device, is_copy)] = end = start + rng.uniform(0.5, 15.0)
        name = f"copyin {1 << (op % 7 + 10)} B" if is_copy else f"kernel_{op % 13}"
        events.append(RangeEvent(device, name, start, end, is_copy, op))
        if op % 4 == 0:
            events.append(DependencyEvent(op - 3, op))
    return save_events(events, path)


def test_a_100k_range_trace_loads_and_pans_without_freezing(
    chromium: str, tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    count = 100_000
    start = time.perf_counter()
    page = write_html(big_trace(tmp_path / "big.json", count))
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    dom = run_chromium(chromium, tmp_path / "profile", "--dump-dom", page.as_uri() + "#selftest")
    browser_s = time.perf_counter() - start
    title, state = page_state(dom)
    assert title == f"drawn:{count}"
    assert state["ready"] == "1" and state["ranges"] == str(count) and state["first-drawn"] == str(count)
    assert int(state["pan-frames"]) == 60 and state["hover-hit"]
    load_ms, pan_max, pan_avg = float(state["load-ms"]), float(state["pan-ms-max"]), float(state["pan-ms-avg"])
    report = (
        f"100k ranges: trace+page built in {build_s:.2f} s; page parse+first draw {load_ms:.0f} ms "
        f"({float(state['since-navigation-ms']):.0f} ms since navigation), redraw while panning avg {pan_avg:.1f} ms, "
        f"max {pan_max:.1f} ms; whole headless browser run {browser_s:.1f} s"
    )
    print(report, file=sys.stderr)
    record_property("viewer_100k", report)
    assert load_ms < 5_000  # opens in seconds, not minutes
    assert pan_max < 500  # no redraw freezes the page
