"""Recording: profile() regions, host ranges, graph replays, and ARUNTIME_PROFILE=1 at exit."""

from __future__ import annotations

import array
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aruntime import Buffer, Device, Op, OpError, dtypes, host_range, profile
from aruntime.engine import CommandQueue
from aruntime.events import DependencyEvent, DeviceEvent, GraphEvent, HostRangeEvent, RangeEvent, recorder
from aruntime.graph import Graph
from aruntime.profile.model import parse_trace
from tests.kernels import SCALE

pytestmark = pytest.mark.anyio

N = 256
ROOT = Path(__file__).resolve().parent.parent


def floats(value: float) -> array.array[float]:
    return array.array("f", [value] * N)


def ranges(events: list[object], device: str | None = None) -> list[RangeEvent]:
    return [e for e in events if isinstance(e, RangeEvent) and (device is None or e.device == device)]


async def test_a_region_records_its_ops_dependencies_and_clock_offsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = Device["CPU:5"]
    monkeypatch.setattr(dev, "inline_copy_max", 0)  # every copy on the copy queue, so the hazards cross queues
    prog = await dev.compile(SCALE, outs=(0,))
    x, y = await dev.allocate(N, dtypes.float32), await dev.allocate(N, dtypes.float32)
    await dev.copyin(x, floats(0.0))  # before the region: not in it
    assert not recorder.enabled
    async with profile() as prof:
        assert recorder.enabled
        a = dev.copyin(x, floats(3.0))
        b = dev.launch(prog, y, x, vals=(N, 2.0))
        c = dev.copyout(y)
    assert not recorder.enabled
    assert set(array.array("f", bytes(await c))) == {6.0}
    got = ranges(prof.events, "CPU:5")
    assert [(r.name, r.is_copy, r.op) for r in got] == [
        (f"copyin {N * 4} B", True, a.id),
        ("kernel", False, b.id),
        (f"copyout {N * 4} B", True, c.id),
    ]
    assert all(r.start <= r.end for r in got)
    assert got[0].end <= got[1].start and got[1].end <= got[2].start  # the hazards ordered them
    deps = {(d.src, d.dst) for d in prof.events if isinstance(d, DependencyEvent)}
    assert deps <= {(a.id, b.id), (b.id, c.id)}  # a wait (and its arrow) only where the earlier op was still running
    (dev_event,) = [e for e in prof.events if isinstance(e, DeviceEvent)]
    assert dev_event.device == "CPU:5"
    assert abs(dev_event.comp_offset) < 1_000.0 and abs(dev_event.copy_offset) < 1_000.0

    path = prof.save(tmp_path / "region.json")
    trace = json.loads(path.read_text())
    tl = parse_trace(trace)
    assert [t.label for t in tl.tracks] == ["CPU:5 · compute", "CPU:5 · copy"]
    assert len(tl.slices) == 3 and len(tl.arrows) == len(deps)  # one arrow per recorded wait
    summary = prof.summary()
    assert [d["device"] for d in summary["devices"]] == ["CPU:5"]
    assert summary["devices"][0]["waits"]["total"] == len(deps)


async def test_regions_nest_and_leave_no_events_behind() -> None:
    dev = Device["NULL"]
    prog = await dev.compile("void kernel(void) {}")
    mark = len(recorder.events)
    async with profile() as outer:
        first = dev.launch(prog)
        await first  # a region holds what *ran* while it was open; let this one finish outside the inner one
        async with profile() as inner:
            second = dev.launch(prog)
        third = dev.launch(prog)
    assert [r.op for r in ranges(inner.events)] == [second.id]
    assert [r.op for r in ranges(outer.events)] == [first.id, second.id, third.id]
    assert [e.device for e in outer.events if isinstance(e, DeviceEvent)] == ["NULL"]
    assert not recorder.enabled
    assert len(recorder.events) == mark  # nobody else records: the regions' events were handed over, not kept
    await dev.launch(prog)
    assert len(recorder.events) == mark


def test_a_plain_with_region_waits_for_the_work_it_submitted() -> None:
    dev = Device["NULL"]
    buf = Buffer("NULL", 64, preallocate=True)
    with profile() as prof:
        ops = [dev.copyin(buf, bytes(64)) for _ in range(20)]
    assert all(op.done() for op in ops)
    assert [r.op for r in ranges(prof.events)] == [op.id for op in ops]
    assert not recorder.enabled


async def test_a_region_keeps_its_events_when_the_block_raises() -> None:
    dev = Device["NULL"]
    prog = await dev.compile("void kernel(void) {}")
    with pytest.raises(KeyError):
        async with profile() as prof:
            op = dev.launch(prog)
            raise KeyError("boom")
    assert [r.op for r in ranges(prof.events)] == [op.id]
    assert not recorder.enabled


async def test_waiting_in_a_region_does_not_take_a_devices_failures() -> None:
    dev = Device["CPU:5"]

    def explode() -> None:
        raise RuntimeError("kernel exploded")

    async with profile() as prof:
        failing = dev.compute.submit(CommandQueue().exec("bad", explode), Op("bad op"))
    assert failing.done() and failing.error is not None
    assert [r.name for r in ranges(prof.events)] == []  # it never finished: no range
    with pytest.raises(OpError, match="kernel exploded"):
        await dev.synchronize()  # still reported to the program


def test_host_range_names_must_be_str() -> None:
    with pytest.raises(TypeError, match="host_range: name must be a str, got int"):
        host_range(5)  # type: ignore[arg-type]


def test_host_ranges_record_names_and_times_even_when_the_block_raises() -> None:
    @host_range()
    def helper(x: int) -> int:
        return x + 1

    @host_range("named helper")
    def failing() -> None:
        raise ValueError("no")

    with profile() as prof, host_range("outer"):
        assert helper(1) == 2
        with pytest.raises(RuntimeError), host_range("raises"):
            raise RuntimeError("boom")
        with pytest.raises(ValueError):
            failing()
    hosts = [e for e in prof.events if isinstance(e, HostRangeEvent)]
    assert [h.name for h in hosts] == [
        "test_host_ranges_record_names_and_times_even_when_the_block_raises.<locals>.helper",
        "raises",
        "named helper",
        "outer",
    ]
    outer = hosts[-1]
    assert all(outer.start <= h.start <= h.end <= outer.end for h in hosts)
    assert helper.__name__ == "helper"
    mark = len(recorder.events)
    with host_range("not profiling"):
        pass
    helper(2)
    assert len(recorder.events) == mark


async def test_host_range_decorates_async_functions() -> None:
    @host_range("step")
    async def step(x: int) -> int:
        if x < 0:
            raise ValueError(x)
        return x * 2

    async with profile() as prof:
        assert await step(4) == 8
        with pytest.raises(ValueError):
            await step(-1)
    hosts = [e for e in prof.events if isinstance(e, HostRangeEvent)]
    assert [h.name for h in hosts] == ["step", "step"]
    assert all(h.start <= h.end for h in hosts)


async def test_graph_replays_are_recorded_and_drawn_once() -> None:
    dev = Device["CPU:5"]
    prog = await dev.compile(SCALE, outs=(0,))
    x, y = await dev.allocate(N, dtypes.float32), await dev.allocate(N, dtypes.float32)
    graph = Graph()
    graph.copyin(x, "x")
    graph.launch(prog, y, x, vals=(N, 2.0))
    graph.copyout(y, "y")
    async with profile() as prof:
        result = await graph.replay(x=floats(1.0))
    assert set(array.array("f", bytes(result["y"]))) == {2.0}
    (event,) = [e for e in prof.events if isinstance(e, GraphEvent)]
    assert [e.name for e in event.entries] == [f"copyin {N * 4} B", "kernel", f"copyout {N * 4} B"]
    trace = prof.trace()
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(x["name"] for x in xs) == sorted(e.name for e in event.entries)
    assert all("graph" in x["cat"] for x in xs)
    assert len(parse_trace(trace).arrows) == 2


def run_script(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full, cwd=cwd, capture_output=True, text=True, timeout=120
    )


SCRIPT = """
    import anyio
    from aruntime import Device, Op, host_range
    from aruntime.engine import CommandQueue

    def explode():
        raise RuntimeError("nobody awaits this")

    async def main():
        dev = Device["NULL"]
        prog = await dev.compile("void kernel(void) {}")
        with host_range("submit"):
            ops = [dev.launch(prog) for _ in range(10)]
        for op in ops:
            await op
        Device["CPU:1"]  # opened, idle
        dev.copy.submit(CommandQueue().exec("bad", explode), Op("bad"))  # fails; nobody awaits it

    anyio.run(main)
"""


def test_profile_env_writes_the_trace_at_exit(tmp_path: Path) -> None:
    target = tmp_path / "out" / "run.json"
    proc = run_script(SCRIPT, {"ARUNTIME_PROFILE": "1", "ARUNTIME_PROFILE_PATH": str(target)}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {target}" in proc.stderr
    assert "aruntime profile view" in proc.stderr
    assert "NULL: OpError" in proc.stderr  # the unobserved failure is reported, the trace still written
    trace = json.loads(target.read_text())
    tl = parse_trace(trace)
    labels = {t.label for t in tl.tracks}
    assert {"host · host", "NULL · compute", "NULL · copy", "CPU:1 · compute", "CPU:1 · copy"} <= labels
    names = [s.name for s in tl.slices]
    assert names.count("kernel") == 10 and "submit" in names
    assert set(trace["otherData"]["clock_offsets_us"]) == {"NULL", "CPU:1"}
    assert [p.name for p in target.parent.iterdir()] == ["run.json"]


def test_profile_env_unset_records_nothing(tmp_path: Path) -> None:
    proc = run_script(
        SCRIPT + "\n    from aruntime.events import recorder\n    print(recorder.enabled)\n",
        {"ARUNTIME_PROFILE": "0", "ARUNTIME_PROFILE_PATH": str(tmp_path / "no.json")},
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    assert not (tmp_path / "no.json").exists()


def test_profile_env_writes_nothing_for_a_process_that_did_nothing(tmp_path: Path) -> None:
    target = tmp_path / "idle.json"
    proc = run_script("import aruntime\n", {"ARUNTIME_PROFILE": "1", "ARUNTIME_PROFILE_PATH": str(target)}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not target.exists() and "aruntime profile" not in proc.stderr


async def test_a_region_without_sync_neither_waits_nor_aligns_clocks() -> None:
    dev = Device["NULL"]
    prog = await dev.compile("void kernel(void) {}")
    async with profile(sync=False) as prof:
        op = dev.launch(prog)
        await op
    assert [r.op for r in ranges(prof.events)] == [op.id]
    assert not [e for e in prof.events if isinstance(e, DeviceEvent)]
    assert not recorder.enabled
