"""``aruntime profile summary`` and the ``view`` command's page (without a browser)."""

from __future__ import annotations

import json
import re
import webbrowser
from pathlib import Path
from typing import Any

import pytest

from aruntime.cli import main
from aruntime.events import DependencyEvent, DeviceEvent, Event, HostRangeEvent, RangeEvent
from aruntime.profile import viewer
from aruntime.profile.summary import format_time, intersect, summarize, union
from aruntime.profile.trace import build_trace, save_events

# On CPU: kernels [0, 10] and [20, 30], copies [5, 15] and [18, 19]: busy [0, 15], [18, 19], [20, 30].
EVENTS: list[Event] = [
    DeviceEvent("CPU"),
    RangeEvent("CPU", "matmul", 1000.0, 1010.0, False, 1),
    RangeEvent("CPU", "relu", 1020.0, 1030.0, False, 2),
    RangeEvent("CPU", "copyin 4 KiB", 1005.0, 1015.0, True, 3),
    RangeEvent("CPU", "copyin 4 KiB", 1018.0, 1019.0, True, 4),
    RangeEvent("CPU:1", "matmul", 1000.0, 1040.0, False, 5),
    RangeEvent("CPU:1", "matmul", 1040.0, 1060.0, False, 6),
    DependencyEvent(3, 2),
    DependencyEvent(1, 6),
    HostRangeEvent("host work", 900.0, 1100.0),
]


def test_interval_helpers() -> None:
    assert union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert intersect([(0, 4), (5, 6)], [(3, 5.5)]) == [(3, 4), (5, 5.5)]
    assert [format_time(x) for x in (0.25, 12.5, 3200.0, 1.5e6)] == ["250 ns", "12.500 µs", "3.200 ms", "1.500 s"]


def test_busy_overlap_idle_and_top_lists_per_device() -> None:
    result = summarize(build_trace(EVENTS))
    assert result["ranges"] == 7 and result["dependencies"] == 2
    cpu, cpu1 = result["devices"]
    assert cpu["device"] == "CPU" and cpu1["device"] == "CPU:1"
    assert cpu["span_us"] == 30.0
    assert cpu["compute_busy_us"] == 20.0 and cpu["compute_busy_pct"] == pytest.approx(66.67)
    assert cpu["copy_busy_us"] == 11.0 and cpu["copy_busy_pct"] == pytest.approx(36.67)
    assert cpu["overlap_us"] == 5.0 and cpu["overlap_pct"] == pytest.approx(16.67)
    assert cpu["copy_hidden_pct"] == pytest.approx(45.45)
    assert cpu["idle"]["count"] == 2 and cpu["idle"]["total_us"] == 4.0
    assert cpu["idle"]["largest"][0] == {"start_us": 115.0, "end_us": 118.0, "dur_us": 3.0}  # trace time starts at 900
    assert cpu["waits"] == {"total": 1, "by_kind": {"copy->compute": 1}}
    assert [k["name"] for k in cpu["top_kernels"]] == ["matmul", "relu"]
    assert cpu["top_copies"] == [
        {"name": "copyin 4 KiB", "count": 2, "total_us": 11.0, "mean_us": 5.5, "pct": pytest.approx(36.67)}
    ]
    assert cpu1["compute_busy_pct"] == 100.0 and cpu1["copy_busy_pct"] == 0.0 and cpu1["idle"]["count"] == 0
    assert cpu1["waits"] == {"total": 1, "by_kind": {"CPU compute->compute": 1}}
    assert cpu1["top_kernels"] == [{"name": "matmul", "count": 2, "total_us": 60.0, "mean_us": 30.0, "pct": 100.0}]


def test_summary_command_prints_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_events(EVENTS, tmp_path / "t.json")
    assert main(["profile", "summary", str(path)]) == 0
    text = capsys.readouterr().out
    assert "CPU: 4 ranges over 30.000 µs" in text
    assert re.search(r"compute 66\.7 %\s+copy 36\.7 %\s+overlap 16\.7 %", text)
    assert "idle gaps    2, 4.000 µs total" in text
    assert "matmul" in text and "copyin 4 KiB" in text and "CPU:1:" in text
    assert main(["profile", "summary", str(path), "--json", "--top", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["device"] for d in data["devices"]] == ["CPU", "CPU:1"]
    assert len(data["devices"][0]["top_kernels"]) == 1


def test_commands_report_unreadable_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "summary", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["profile", "view", "--no-open", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "missing.json" in err and f"aruntime profile view: {tmp_path / 'bad.json'}: not a JSON trace" in err


def test_view_writes_a_self_contained_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[Any] = []
    monkeypatch.setattr(webbrowser, "open", lambda *a, **k: opened.append(a) or True)
    path = save_events([*EVENTS, HostRangeEvent("</script><b>&", 950.0, 960.0)], tmp_path / "t.json")
    assert main(["profile", "view", "--no-open", str(path)]) == 0
    page = tmp_path / "t.html"
    assert capsys.readouterr().out.strip() == f"wrote {page}"
    assert opened == []
    html = page.read_text()
    for external in ("http://", "https://", "//cdn", "<script src", "<link", "@import", "url("):
        assert external not in html
    assert html.count("</script>") == 2  # the data island and the code; the range name is escaped
    data = json.loads(re.search(r'<script id="trace-data" type="application/json">(.*?)</script>', html, re.S)[1])  # type: ignore[index]
    assert len(data["s"]) == 8 and len(data["a"]) == 4
    assert "</script><b>&" in data["names"]
    assert [t["label"] for t in data["tracks"]] == [  # CPU:1 copied nothing: no empty copy row
        "host · host",
        "CPU · compute",
        "CPU · copy",
        "CPU:1 · compute",
    ]
    # of the 200 µs span, CPU computes 20, copies 11, both 5; "4 KiB" is not a byte count as the runtime writes it
    strip = data["summary"]
    assert strip["copy_bytes"] == 0 and strip["devices"][0] == ["CPU", 10.0, 5.5, 2.5]
    assert strip["busy_queues"] == pytest.approx((20 + 11 + 60) / 200, abs=1e-3)
    out = tmp_path / "elsewhere" / "page.html"
    assert main(["profile", "view", "--no-open", "-o", str(out), str(path)]) == 0
    assert out.exists() and out.read_text() == html


def test_view_opens_a_browser_only_where_one_can_show(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    opened: list[str] = []
    monkeypatch.setattr(webbrowser, "open", lambda url, *a, **k: opened.append(url) or True)
    page = tmp_path / "p.html"
    page.write_text("x")
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("DISPLAY", ":0")
    assert not viewer.can_open_browser() and not viewer.open_in_browser(page)
    monkeypatch.delenv("CI")
    monkeypatch.setattr(viewer.sys, "platform", "linux")
    monkeypatch.delenv("DISPLAY")
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    assert not viewer.open_in_browser(page)
    assert opened == []
    monkeypatch.setenv("DISPLAY", ":0")
    assert viewer.open_in_browser(page)
    assert opened == [page.resolve().as_uri()]
