"""The Chrome trace export, reading traces back, atomic writes and clock alignment."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest

from aruntime import Device
from aruntime.engine import clock as align
from aruntime.events import (
    DependencyEvent,
    DeviceEvent,
    Event,
    GraphEntry,
    GraphEvent,
    HostRangeEvent,
    RangeEvent,
)
from aruntime.profile.model import parse_trace
from aruntime.profile.trace import atomic_write, build_trace, load_trace, pack_lanes, save_events, write_trace


def by_ph(trace: dict[str, Any], ph: str) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def meta(trace: dict[str, Any]) -> dict[tuple[str, int, int], Any]:
    out: dict[tuple[str, int, int], Any] = {}
    for e in by_ph(trace, "M"):
        out[(e["name"], e["pid"], e["tid"])] = e["args"]
    return out


def names(trace: dict[str, Any]) -> tuple[dict[str, int], dict[tuple[int, int], str]]:
    """process name -> pid, and (pid, tid) -> thread name."""
    processes = {args["name"]: pid for (n, pid, _), args in meta(trace).items() if n == "process_name"}
    threads = {(pid, tid): args["name"] for (n, pid, tid), args in meta(trace).items() if n == "thread_name"}
    return processes, threads


def enclosing(trace: dict[str, Any], ev: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        x
        for x in by_ph(trace, "X")
        if x["pid"] == ev["pid"] and x["tid"] == ev["tid"] and x["ts"] <= ev["ts"] <= x["ts"] + x["dur"]
    ]


EVENTS: list[Event] = [
    DeviceEvent("CPU", comp_offset=10.0, copy_offset=-5.0),
    DeviceEvent("CPU:1"),
    RangeEvent("CPU", "copyin 64 B", 1000.0, 1020.0, True, 1),
    RangeEvent("CPU", "kernel", 1020.0, 1050.0, False, 2),
    RangeEvent("CPU", "copyout 64 B", 1070.0, 1080.0, True, 3),
    RangeEvent("CPU:1", "kernel", 1100.0, 1110.0, False, 4),
    DependencyEvent(1, 2),
    DependencyEvent(2, 3),
    DependencyEvent(2, 3),  # recorded twice: one arrow
    DependencyEvent(99, 3),  # its source recorded no range: dropped
    HostRangeEvent("prepare", 990.0, 1100.0),
]


def test_processes_tracks_and_metadata() -> None:
    trace = build_trace(EVENTS)
    assert trace["displayTimeUnit"] == "ns"
    processes, threads = names(trace)
    assert set(processes) == {"host", "CPU", "CPU:1"}
    m = meta(trace)
    order = sorted(processes, key=lambda p: m[("process_sort_index", processes[p], 0)]["sort_index"])
    assert order == ["host", "CPU", "CPU:1"]
    for device in ("CPU", "CPU:1"):
        pid = processes[device]
        assert sorted(name for (p, _), name in threads.items() if p == pid) == ["compute", "copy"]
        for (p, tid), _ in threads.items():
            if p == pid:
                assert ("thread_sort_index", pid, tid) in m
    assert [name for (p, _), name in threads.items() if p == processes["host"]] == ["host"]
    # every event is well formed for trace viewers
    for e in trace["traceEvents"]:
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["ph"] in "MXsf"
    json.loads(json.dumps(trace, allow_nan=False))


def test_complete_events_are_on_the_host_clock_relative_to_the_first() -> None:
    trace = build_trace(EVENTS)
    processes, threads = names(trace)
    xs = {(x["name"], x["pid"]): x for x in by_ph(trace, "X")}
    t0 = 990.0  # the host range starts first; CPU copy is shifted by -5 µs, compute by +10 µs
    assert trace["otherData"]["t0_us"] == t0
    copyin = xs[("copyin 64 B", processes["CPU"])]
    assert copyin["ts"] == pytest.approx(1000.0 - 5.0 - t0) and copyin["dur"] == pytest.approx(20.0)
    assert threads[(copyin["pid"], copyin["tid"])] == "copy" and copyin["cat"] == "copy"
    kernel = xs[("kernel", processes["CPU"])]
    assert kernel["ts"] == pytest.approx(1020.0 + 10.0 - t0) and kernel["dur"] == pytest.approx(30.0)
    assert threads[(kernel["pid"], kernel["tid"])] == "compute" and kernel["args"] == {"op": 2}
    other = xs[("kernel", processes["CPU:1"])]
    assert other["ts"] == pytest.approx(1100.0 - t0)
    host = xs[("prepare", processes["host"])]
    assert host["ts"] == 0.0 and host["dur"] == pytest.approx(110.0) and host["cat"] == "host"
    assert len(xs) == 5
    assert trace["otherData"]["clock_offsets_us"]["CPU"] == {"compute": 10.0, "copy": -5.0}


def test_flow_arrows_bind_to_the_ranges_of_the_dependent_ops() -> None:
    trace = build_trace(EVENTS)
    starts, finishes = by_ph(trace, "s"), by_ph(trace, "f")
    assert len(starts) == len(finishes) == 2
    assert sorted(e["id"] for e in starts) == sorted(e["id"] for e in finishes)
    assert len({e["id"] for e in starts}) == 2
    pairs = []
    for s in starts:
        (f,) = [f for f in finishes if f["id"] == s["id"]]
        assert f["bp"] == "e"
        (src,) = enclosing(trace, s)
        (dst,) = enclosing(trace, f)
        pairs.append((src["name"], dst["name"]))
    assert sorted(pairs) == [("copyin 64 B", "kernel"), ("kernel", "copyout 64 B")]
    assert trace["otherData"]["dropped_dependencies"] == 1


def test_overlapping_ranges_of_one_queue_spill_onto_extra_tracks() -> None:
    assert pack_lanes([(0, 10), (2, 5), (3, 12), (11, 20), (12, 13), (12, 30)]) == [0, 0, 1, 0, 0, 1]
    events: list[Event] = [
        HostRangeEvent("outer", 0.0, 100.0),
        HostRangeEvent("inner", 10.0, 20.0),  # nested: same track
        HostRangeEvent("straddles", 50.0, 150.0),  # partial overlap: another track
        RangeEvent("CPU", "a", 0.0, 10.0, False, 1),
        RangeEvent("CPU", "b", 5.0, 15.0, False, 2),
    ]
    trace = build_trace(events)
    processes, threads = names(trace)
    x = {e["name"]: e for e in by_ph(trace, "X")}
    assert x["outer"]["tid"] == x["inner"]["tid"] != x["straddles"]["tid"]
    assert threads[(processes["host"], x["straddles"]["tid"])] == "host 2"
    assert threads[(processes["CPU"], x["a"]["tid"])] == "compute"
    assert threads[(processes["CPU"], x["b"]["tid"])] == "compute 2"
    assert threads[(processes["CPU"], x["b"]["tid"] + 1)] == "copy"


def test_graph_replays_are_ranges_with_dependency_arrows() -> None:
    entries = (
        GraphEntry("CPU", "copyin 8 B", True),
        GraphEntry("CPU", "kernel", False),
        GraphEntry("CPU:1", "kernel", False),
        GraphEntry("CPU", "copyout 8 B", True),
        GraphEntry("CPU", "never ran", False),
    )
    graph = GraphEvent(
        entries,
        ((), (0,), (0,), (1, 2), (3,)),
        (100.0, 110.0, 112.0, 140.0, 0.0),
        (108.0, 130.0, 125.0, 150.0, 0.0),
    )
    # the engines also record each graph command as a plain range: drawn once, as the graph entry
    duplicates = [
        RangeEvent("CPU", "copyin 8 B", 101.0, 107.0, True, 7),
        RangeEvent("CPU", "kernel", 111.0, 129.0, False, 8),
        RangeEvent("CPU", "eager kernel", 131.0, 135.0, False, 9),
    ]
    trace = build_trace([graph, *duplicates])
    xs = by_ph(trace, "X")
    graph_slices = [x for x in xs if "graph" in x["cat"].split(",")]
    assert sorted(x["name"] for x in graph_slices) == ["copyin 8 B", "copyout 8 B", "kernel", "kernel"]
    assert [x["name"] for x in xs if x not in graph_slices] == ["eager kernel"]
    assert {x["args"]["entry"] for x in graph_slices} == {0, 1, 2, 3}
    arrows = set()
    for s in by_ph(trace, "s"):
        (f,) = [f for f in by_ph(trace, "f") if f["id"] == s["id"]]
        (src,) = [x for x in enclosing(trace, s) if x in graph_slices]
        (dst,) = [x for x in enclosing(trace, f) if x in graph_slices]
        arrows.add((src["args"]["entry"], dst["args"]["entry"]))
    assert arrows == {(0, 1), (0, 2), (1, 3), (2, 3)}


def test_parse_trace_reads_back_tracks_slices_and_arrows() -> None:
    tl = parse_trace(build_trace(EVENTS))
    labels = [t.label for t in tl.tracks]
    assert labels == ["host · host", "CPU · compute", "CPU · copy", "CPU:1 · compute", "CPU:1 · copy"]
    assert [t.kind for t in tl.tracks] == ["host", "compute", "copy", "compute", "copy"]
    assert len(tl.slices) == 5
    named = {(tl.tracks[tl.slices[a].track].label, tl.slices[a].name, tl.slices[b].name) for a, b in tl.arrows}
    assert named == {("CPU · copy", "copyin 64 B", "kernel"), ("CPU · compute", "kernel", "copyout 64 B")}


def test_parse_trace_accepts_begin_end_pairs_and_the_array_form() -> None:
    events = [
        {"ph": "B", "name": "outer", "pid": 1, "tid": 1, "ts": 0},
        {"ph": "B", "name": "inner", "pid": 1, "tid": 1, "ts": 2},
        {"ph": "E", "pid": 1, "tid": 1, "ts": 4},
        {"ph": "E", "pid": 1, "tid": 1, "ts": 10},
        {"ph": "X", "name": "later", "pid": 1, "tid": 2, "ts": 20, "dur": 5},
        {"ph": "s", "id": 7, "cat": "c", "pid": 1, "tid": 1, "ts": 3},
        {"ph": "f", "id": 7, "cat": "c", "pid": 1, "tid": 2, "ts": 15},  # no bp: binds to the next slice
    ]
    tl = parse_trace(events)
    got = {(s.name, s.start, s.dur) for s in tl.slices}
    assert got == {("outer", 0.0, 10.0), ("inner", 2.0, 2.0), ("later", 20.0, 5.0)}
    ((a, b),) = tl.arrows
    assert (tl.slices[a].name, tl.slices[b].name) == ("inner", "later")


def test_atomic_write_replaces_whole_files_and_leaves_nothing_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trace.json"
    save_events(EVENTS, path)
    first = path.read_text()
    assert load_trace(path)["traceEvents"]
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]

    def crash(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)  # dies after part of the data went to the temp file
    with pytest.raises(OSError, match="disk full"):
        save_events([*EVENTS, HostRangeEvent("more", 0.0, 1.0)], path)
    monkeypatch.undo()
    assert path.read_text() == first
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]

    with pytest.raises(ValueError):  # a NaN cannot be written: nothing is
        write_trace({"traceEvents": [{"ph": "X", "ts": math.nan}]}, tmp_path / "nan.json")
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]

    atomic_write(tmp_path / "sub" / "new.txt", "x")
    assert (tmp_path / "sub" / "new.txt").read_text() == "x"


def test_load_trace_rejects_what_is_not_a_trace(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a Chrome trace"):
        load_trace(bad)
    bare = tmp_path / "bare.json"
    bare.write_text('[{"ph": "X", "name": "a", "ts": 0, "dur": 1, "pid": 1, "tid": 1}]')
    assert load_trace(bare)["traceEvents"][0]["name"] == "a"


# ---- clock alignment -----------------------------------------------------------------------------------


def test_offset_is_recovered_from_paired_samples_of_a_skewed_clock() -> None:
    rng = random.Random(7)
    true_offset = 123_456.75  # host = device + offset
    samples = []
    host = 1_000.0
    for _ in range(9):
        before = host
        stamp_at = before + rng.uniform(1.0, 40.0)  # asymmetric latencies
        after = stamp_at + rng.uniform(1.0, 40.0)
        samples.append((before, stamp_at - true_offset, after))
        host = after + 100.0
    # one sample delayed by a context switch hardly moves the median
    samples.append((host, host + 5_000.0 - true_offset, host + 5_001.0))
    estimate = align.offset_from_samples(samples)
    assert abs(estimate - true_offset) <= 20.0
    for before, stamp, after in samples[:-1]:
        assert before - stamp - 1e-6 <= estimate <= after - stamp + 1e-6  # agrees with every good sample


def test_estimate_offset_takes_the_median_of_its_samples() -> None:
    calls = iter([(0.0, 100.0, 10.0), (20.0, 118.0, 30.0), (40.0, 141.0, 50.0)])
    assert align.estimate_offset(lambda: next(calls), 3) == pytest.approx(-95.0)
    with pytest.raises(ValueError):
        align.offset_from_samples([])
    with pytest.raises(ValueError):
        align.estimate_offset(lambda: (0.0, 0.0, 0.0), 0)
    with pytest.raises(ValueError, match="backwards"):
        align.offset_from_samples([(5.0, 0.0, 4.0)])


def test_cpu_engines_have_an_offset_of_about_zero() -> None:
    dev = Device["CPU:6"]
    dev.synchronize_blocking()
    for engine in (dev.compute, dev.copy):
        before, stamp, after = align.engine_sample(engine)
        assert before <= stamp <= after  # the CPU engines stamp with the host clock itself
        assert abs(align.engine_offset(engine)) < 1_000.0
    event = dev.finalize_profile()
    assert event.device == "CPU:6"
    assert abs(event.comp_offset) < 1_000.0 and abs(event.copy_offset) < 1_000.0
