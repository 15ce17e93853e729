"""The SIM device: its ops take at least their modelled time, compute the right bytes, skip them in timing-only
mode, refuse bad model values, and keep the scheduler's hazard property at 64 devices.

Timing is checked only from below (profile ranges and the monotonic clock): a loaded machine makes ops late,
never early.
"""

from __future__ import annotations

import array
import math
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings

import aruntime
from aruntime import BaseDevice, Device, dtypes
from aruntime.backends.sim import BANDWIDTH, KERNEL, LATENCY, SimDevice, SimModel, SimProgram
from aruntime.events import RangeEvent
from aruntime.graph import Graph, Param
from aruntime.profile import profile
from aruntime.scheduler import Scheduler
from tests.bench_rows import quick_rows
from tests.kernels import ADD_ONE, SCALE
from tests.test_scheduler_property import EXAMPLES, Case, check_through_scheduler, programs

pytestmark = pytest.mark.anyio

SLOW = SimModel(latency=3e-3, bandwidth=1e9, kernel=4e-3)
"""A model whose times stand far above the machine's own costs."""
US = 1e6
SLACK_US = 0.01  # ranges are whole ns turned into µs floats


@pytest.fixture
def sim() -> Iterator[SimDevice]:
    """A SIM device of the slow model, given back with the model it had."""
    dev = Device["SIM:40"]
    assert isinstance(dev, SimDevice)
    before = dev.model
    dev.model = SLOW
    yield dev
    dev.model = before


def ranges_of(events: list[object], dev: BaseDevice) -> list[RangeEvent]:
    return [e for e in events if isinstance(e, RangeEvent) and e.device == dev.name]


def test_the_defaults_resemble_a_pcie_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LATENCY", "BANDWIDTH", "KERNEL", "TIMING_ONLY"):
        monkeypatch.delenv(f"ARUNTIME_SIM_{var}", raising=False)
    model = SimModel.from_env()
    assert model == SimModel() == SimModel(LATENCY, BANDWIDTH, KERNEL, False)
    assert (LATENCY, BANDWIDTH, KERNEL) == (10e-6, 25e9, 10e-6)
    assert model.copy_time(25_000_000) == pytest.approx(10e-6 + 1e-3)


def test_the_environment_sets_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARUNTIME_SIM_LATENCY", "2e-6")
    monkeypatch.setenv("ARUNTIME_SIM_BANDWIDTH", "1e9")
    monkeypatch.setenv("ARUNTIME_SIM_KERNEL", "0.5")
    monkeypatch.setenv("ARUNTIME_SIM_TIMING_ONLY", "1")
    assert SimModel.from_env() == SimModel(latency=2e-6, bandwidth=1e9, kernel=0.5, timing_only=True)
    dev = SimDevice("SIM:41")  # a device made by hand reads the environment too
    assert dev.model.timing_only and dev.engine_kind in ("native", "python")
    dev.close()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"latency": -1e-6}, "latency"),
        ({"latency": math.inf}, "latency"),
        ({"kernel": math.nan}, "kernel"),
        ({"kernel": "1"}, "kernel"),
        ({"bandwidth": 0}, "bandwidth"),
        ({"bandwidth": -5.0}, "bandwidth"),
        ({"bandwidth": True}, "bandwidth"),
        ({"timing_only": 1}, "timing_only"),
    ],
)
def test_bad_model_values_are_refused_by_name(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SimModel(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("var", "raw"), [("LATENCY", "fast"), ("BANDWIDTH", "0"), ("KERNEL", "-1"), ("TIMING_ONLY", "2")]
)
def test_bad_environment_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, raw: str) -> None:
    monkeypatch.setenv(f"ARUNTIME_SIM_{var}", raw)
    with pytest.raises(ValueError, match=f"ARUNTIME_SIM_{var}"):
        SimModel.from_env()


async def test_a_bad_model_or_cost_is_refused(sim: SimDevice) -> None:
    with pytest.raises(TypeError, match="SimModel"):
        sim.model = {"latency": 1.0}  # type: ignore[assignment]
    prog = await sim.compile(ADD_ONE)
    assert isinstance(prog, SimProgram)
    for bad in (-1.0, math.inf, math.nan, "2"):
        with pytest.raises(ValueError, match="cost of kernel"):
            prog.cost = bad  # type: ignore[assignment]
    assert prog.cost is None
    buf = await sim.allocate(8)
    prog.cost = lambda n: -n
    before = sim.compute.last
    with pytest.raises(ValueError, match=r"cost of kernel for vals \(8,\)"):
        sim.launch(prog, buf, vals=(8,))
    assert sim.compute.last == before  # refused before anything was enqueued
    await sim.free(buf)


async def test_copies_take_at_least_latency_plus_bytes_over_bandwidth(sim: SimDevice) -> None:
    n = 3_000_000  # 3 ms at 1 GB/s, on top of the 3 ms latency
    data = bytes(range(256)) * (n // 256) + bytes(n % 256)
    buf = await sim.allocate(n)
    start = time.monotonic()
    async with profile() as prof:
        await sim.copyin(buf, data)
        out = await sim.copyout(buf)
    assert time.monotonic() - start >= 2 * SLOW.copy_time(n)
    assert bytes(out) == data
    copies = ranges_of(prof.events, sim)
    assert [(r.name, r.is_copy) for r in copies] == [(f"copyin {n} B", True), (f"copyout {n} B", True)]
    for r in copies:
        assert r.end - r.start >= SLOW.copy_time(n) * US - SLACK_US
    await sim.free(buf)


async def test_kernels_take_their_declared_time_and_compute(sim: SimDevice) -> None:
    n = 1000
    x, y = await sim.allocate(n, dtypes.float32), await sim.allocate(n, dtypes.float32)
    await sim.copyin(x, array.array("f", range(n)))
    scale = await sim.compile(SCALE, outs=(0,))
    assert isinstance(scale, SimProgram)
    async with profile() as prof:
        await sim.launch(scale, y, x, vals=(n, 2.0))  # the model's kernel time
        scale.cost = 6e-3
        await sim.launch(scale, y, x, vals=(n, 3.0))
        scale.cost = lambda count, s: s * 1e-3  # a function of the launch's values
        start = time.monotonic()
        await sim.launch(scale, y, x, vals=(n, 5.0))
        assert time.monotonic() - start >= 5e-3
    assert list(array.array("f", bytes(await sim.copyout(y)))) == [i * 5.0 for i in range(n)]
    kernels = [r for r in ranges_of(prof.events, sim) if not r.is_copy]
    assert [r.name for r in kernels] == ["kernel"] * 3
    for r, seconds in zip(kernels, (SLOW.kernel, 6e-3, 5e-3), strict=True):
        assert r.end - r.start >= seconds * US - SLACK_US
    assert scale.time((n, 7.0)) == pytest.approx(7e-3)
    await sim.free(x)
    await sim.free(y)


async def test_transfers_with_host_devices_run_on_the_sim_copy_queue_both_ways(sim: SimDevice) -> None:
    cpu = Device["CPU"]
    n = 100_000
    data = bytes((i * 7) % 251 for i in range(n))
    a, b, back = await cpu.allocate(n), await sim.allocate(n), await cpu.allocate(n)
    await cpu.copyin(a, data)
    async with profile() as prof:
        await aruntime.transfer(b, a)
        await aruntime.transfer(back, b)
    assert bytes(await cpu.copyout(back)) == data
    moves = ranges_of(prof.events, sim)
    assert [(r.name.split(" ")[0], r.is_copy) for r in moves] == [("transfer", True)] * 2
    for r in moves:
        assert r.end - r.start >= SLOW.copy_time(n) * US - SLACK_US
    for buf in (a, back):
        await cpu.free(buf)
    await sim.free(b)


async def test_timing_only_moves_no_bytes_and_runs_no_kernels_but_takes_the_time(sim: SimDevice) -> None:
    buf = await sim.allocate(64)
    await sim.copyin(buf, b"a" * 64)
    add_one = await sim.compile(ADD_ONE)
    sim.model = SimModel(latency=SLOW.latency, kernel=SLOW.kernel, timing_only=True)
    start = time.monotonic()
    await sim.copyin(buf, b"z" * 64)  # skipped
    await sim.launch(add_one, buf, vals=(64,))  # not run
    into = bytearray(b"?" * 64)
    assert await sim.copyout(buf, into) is into and into == b"?" * 64  # nothing copied out
    assert time.monotonic() - start >= 2 * SLOW.latency + SLOW.kernel
    sim.model = SLOW
    assert bytes(await sim.copyout(buf)) == b"a" * 64  # the bytes from before timing-only mode
    await sim.free(buf)


async def test_a_graph_replays_with_modelled_times(sim: SimDevice) -> None:
    n = 256
    x, y = await sim.allocate(n, dtypes.float32), await sim.allocate(n, dtypes.float32)
    scale = await sim.compile(SCALE, outs=(0,))
    assert isinstance(scale, SimProgram)
    scale.cost = lambda count, s: 1e-3 * s
    graph = Graph()
    graph.copyin(x, "x")
    graph.launch(scale, y, x, vals=(n, Param("s")))
    graph.copyout(y, "y")
    start = time.monotonic()
    result = await graph.replay(x=array.array("f", [1.0] * n), s=4.0)
    assert time.monotonic() - start >= 2 * SLOW.copy_time(4 * n) + 4e-3
    assert set(array.array("f", bytes(result["y"]))) == {4.0}
    await sim.free(x)
    await sim.free(y)


async def test_the_scheduler_overlaps_sim_devices_and_each_op_takes_its_time() -> None:
    devs = [Device[f"SIM:{i}"] for i in (42, 43)]
    for dev in devs:
        assert isinstance(dev, SimDevice)
        dev.model = SimModel(kernel=2e-3)
    progs = [await dev.compile(ADD_ONE) for dev in devs]
    bufs = [await dev.allocate(16) for dev in devs]
    for dev, buf in zip(devs, bufs, strict=True):
        await dev.copyin(buf, bytes(16))
    async with profile() as prof, Scheduler() as sched:
        for _ in range(3):
            for prog, buf in zip(progs, bufs, strict=True):
                sched.launch(prog, buf, vals=(16,))
        outs = [sched.copyout(buf) for buf in bufs]
    assert [bytes(await out) for out in outs] == [bytes([3] * 16)] * 2
    for dev in devs:
        kernels = [r for r in ranges_of(prof.events, dev) if r.name == "kernel"]
        assert len(kernels) == 3 and all(r.end - r.start >= 2e-3 * US - SLACK_US for r in kernels)
    for dev, buf in zip(devs, bufs, strict=True):
        await dev.free(buf)
        dev.model = SimModel()


SIM_DEVICES = tuple(f"SIM:{i}" for i in range(64))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=programs(devices=(64, 64), bufs=24, length=40))
async def test_random_programs_on_64_sim_devices_match_the_sequential_reference(case: Case) -> None:
    await check_through_scheduler(SIM_DEVICES, case)


def test_the_many_device_benchmark_runs_in_quick_mode() -> None:
    """benchmarks/bench_sim.py end to end, small: only the shape of its rows (timing goals live in it)."""
    rows = quick_rows("sim_scale")
    assert {row["loop"] for row in rows} == {"asyncio", "uvloop", "trio"}
    names = [row["name"] for row in rows if row["loop"] == "trio"]
    assert names == ["sim_makespan_1", "sim_makespan_8", "sim_loop_cost_8_vs_1"]
    assert all(row["pass"] is None for row in rows)  # quick mode measures nothing
