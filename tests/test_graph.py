"""Graph capture and replay."""

from __future__ import annotations

import array

import anyio
import pytest

from aruntime import Buffer, BufferUsageError, DependencyError, Device, DeviceError, OpError, Program, dtypes
from aruntime.events import GraphEvent, recorder
from aruntime.graph import Graph, Param
from aruntime.scheduler import Scheduler
from tests.kernels import SCALE, Failing

pytestmark = pytest.mark.anyio

N = 512


def floats(value: float) -> array.array[float]:
    return array.array("f", [value] * N)


def values(data: bytes | bytearray) -> set[float]:
    return set(array.array("f", bytes(data)))


def scale_graph(prog: Program, y: Buffer, x: Buffer, scale: float | Param) -> Graph:
    """copy-in "x" -> y = x * scale -> copy-out "y"."""
    graph = Graph()
    graph.copyin(x, "x")
    graph.launch(prog, y, x, vals=(N, scale))
    graph.copyout(y, "y")
    return graph


async def test_replay_with_new_inputs_params_and_buffers() -> None:
    dev = Device["CPU"]
    prog = await dev.compile(SCALE, outs=(0,))
    x, y = await dev.allocate(N, dtypes.float32), await dev.allocate(N, dtypes.float32)
    graph = scale_graph(prog, y, x, Param("scale"))
    for k in range(4):
        result = await graph.replay(x=floats(k), scale=2.0)
        assert values(result["y"]) == {2.0 * k}
    x2, y2 = await dev.allocate(N, dtypes.float32), await dev.allocate(N, dtypes.float32)
    into = bytearray(N * 4)
    result = await graph.replay({x: x2, y: y2}, x=floats(5), scale=-1.0, y=into)
    assert result["y"] is into and values(into) == {-5.0}
    assert values(await dev.copyout(y2)) == {-5.0}
    result = await graph.replay(x=floats(6), scale=1.0)  # the captured buffers again, after the stand-ins
    assert values(result["y"]) == {6.0} and values(await dev.copyout(y)) == {6.0}
    assert values(await dev.copyout(y2)) == {-5.0}
    await dev.free(y2)
    with pytest.raises(BufferUsageError, match="was freed"):
        graph.replay({y: y2}, x=floats(7), scale=1.0)


async def test_many_replays_in_flight_keep_their_order() -> None:
    dev = Device["CPU:1"]
    prog = await dev.compile(SCALE, outs=(0,))
    x, y = await dev.allocate(N, dtypes.float32), await dev.allocate(N, dtypes.float32)
    graph = scale_graph(prog, y, x, 1.0)
    runs = [graph.replay(x=floats(k)) for k in range(40)]  # all submitted before any is awaited
    for k, run in enumerate(runs):
        assert values((await run)["y"]) == {float(k)}


async def test_replays_after_the_first_put_their_own_memory_and_progress_into_prepared_commands() -> None:
    # after its first replay each engine's part is prepared once (on the native engine: its ring records packed)
    # and every replay puts in its own host memory and progress values: copies on the copy queues here, so that
    # the parts wait for one another on the graph's progress signals
    a, b = Device["CPU:2"], Device["CPU:3"]
    pa, pb = await a.compile(SCALE, outs=(0,)), await b.compile(SCALE, outs=(0,))
    xa, ya = await a.allocate(N, dtypes.float32), await a.allocate(N, dtypes.float32)
    xb, yb = await b.allocate(N, dtypes.float32), await b.allocate(N, dtypes.float32)
    inline_before = a.inline_copy_max
    a.inline_copy_max = b.inline_copy_max = 0
    try:
        graph = Graph()
        graph.copyin(xa, "x")
        graph.launch(pa, ya, xa, vals=(N, 2.0))
        graph.transfer(xb, ya)
        graph.launch(pb, yb, xb, vals=(N, Param("scale")))
        graph.copyout(yb, "y")
        kinds = [floats, lambda k: bytes(floats(k)), lambda k: memoryview(bytearray(floats(k)))]
        given = {k: bytearray(N * 4) for k in range(0, 60, 3)}  # some replays name their destination
        runs = [
            graph.replay(x=kinds[k % 3](k), scale=float(k % 5), **({"y": given[k]} if k in given else {}))
            for k in range(60)
        ]
        assert len({op.engine for op in runs[0].ops}) == 4
        for k, run in enumerate(runs):
            result = await run
            assert values(result["y"]) == {2.0 * k * (k % 5)}
            assert k not in given or result["y"] is given[k]
        with pytest.raises(BufferUsageError, match="graph input 'x' has 8 bytes"):
            graph.replay(x=b"12345678", scale=1.0)
        with pytest.raises(BufferUsageError, match="graph output 'y' has 4 bytes"):
            graph.replay(x=floats(1), scale=1.0, y=bytearray(4))
        assert values((await graph.replay(x=floats(7), scale=3.0))["y"]) == {42.0}
    finally:
        a.inline_copy_max = b.inline_copy_max = inline_before


async def test_graph_across_devices_with_transfer_and_scheduler() -> None:
    a, b = Device["CPU"], Device["CPU:1"]
    pa, pb = await a.compile(SCALE, outs=(0,)), await b.compile(SCALE, outs=(0,))
    xa, ya = await a.allocate(N, dtypes.float32), await a.allocate(N, dtypes.float32)
    xb, yb = await b.allocate(N, dtypes.float32), await b.allocate(N, dtypes.float32)
    graph = Graph()
    graph.copyin(xa, "x")
    graph.launch(pa, ya, xa, vals=(N, 2.0))
    graph.transfer(xb, ya)
    graph.launch(pb, yb, xb, vals=(N, 3.0))
    graph.copyout(yb, "y")
    graph.copyout(ya, "mid")
    async with Scheduler() as sched:
        runs = [sched.replay(graph, x=floats(k)) for k in range(10)]
    for k, run in enumerate(runs):
        result = await run
        assert values(result["y"]) == {6.0 * k} and values(result["mid"]) == {2.0 * k}


async def test_replay_errors_name_what_is_wrong() -> None:
    dev = Device["CPU:2"]
    prog = await dev.compile(SCALE, outs=(0,))
    x, y = await dev.allocate(N, dtypes.float32), await dev.allocate(N, dtypes.float32)
    graph = Graph()
    with pytest.raises(ValueError, match="no entries"):
        graph.replay()
    graph.copyin(x, "x")
    graph.launch(prog, y, x, vals=(N, Param("scale")))
    with pytest.raises(ValueError, match="missing inputs: scale"):
        graph.replay(x=floats(1))
    with pytest.raises(ValueError, match="unknown inputs: z"):
        graph.replay(x=floats(1), scale=1.0, z=1)
    other = await dev.allocate(N, dtypes.float32)
    with pytest.raises(BufferUsageError, match="not a buffer of this graph"):
        graph.replay({other: x}, x=floats(1), scale=1.0)
    with pytest.raises(ValueError, match="graph copyin: a replay input or output needs a non-empty str name"):
        graph.copyin(x, "buffers")  # the name replay() takes its buffer map by
    with pytest.raises(ValueError, match="Param: a replay input or output needs a non-empty str name"):
        Param(3)  # type: ignore[arg-type]
    with pytest.raises(BufferUsageError, match="graph copyout: expected a Buffer, got bytearray"):
        graph.copyout(bytearray(4), "y")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="buffers must map captured buffers to others, got list"):
        graph.replay([x], x=floats(1), scale=1.0)  # type: ignore[arg-type]
    with pytest.raises(BufferUsageError, match="can only be replaced by a Buffer, got bytes"):
        graph.replay({x: b"1234"}, x=floats(1), scale=1.0)  # type: ignore[dict-item]
    small = await dev.allocate(N // 2, dtypes.float32)
    with pytest.raises(BufferUsageError, match="cannot stand in"):
        graph.replay({x: small}, x=floats(1), scale=1.0)
    with pytest.raises(BufferUsageError, match="graph input 'x' has 4 bytes"):
        graph.replay(x=b"1234", scale=1.0)
    with pytest.raises(TypeError, match="input 'scale' of kernel: scalar 1 must be int or float, got str"):
        graph.replay(x=floats(1), scale="2")
    with pytest.raises(TypeError, match="scalar 1 must be int or float, got list"):
        graph.launch(prog, y, x, vals=(N, [2.0]))  # type: ignore[list-item]
    with pytest.raises(DeviceError, match="graph launch: expected a Program, got str"):
        graph.launch("kernel", y, x)  # type: ignore[arg-type]
    result = await graph.replay(x=floats(3), scale=2.0)  # nothing of the failed replays was left behind
    assert values(await dev.copyout(y)) == {6.0} and result == {}


async def test_replay_records_a_graph_event() -> None:
    dev = Device["CPU:3"]
    prog = await dev.compile(SCALE, outs=(0,))
    x, y = await dev.allocate(N, dtypes.float32), await dev.allocate(N, dtypes.float32)
    graph = scale_graph(prog, y, x, 1.0)
    recorder.enabled = True
    try:
        mark = len(recorder.events)
        await graph.replay(x=floats(1))
        await dev.synchronize()
    finally:
        recorder.enabled = False
    events = [e for e in recorder.events[mark:] if isinstance(e, GraphEvent)]
    assert len(events) == 1
    event = events[0]
    assert [e.name for e in event.entries] == ["copyin 2048 B", "kernel", "copyout 2048 B"]
    assert event.deps == ((), (0,), (1,))
    assert all(s <= e for s, e in zip(event.starts, event.ends, strict=True))
    assert event.ends[0] <= event.starts[1] and event.ends[1] <= event.starts[2]


async def test_replay_runs_independent_entries_of_an_engine_before_waiting_ones() -> None:
    dev = Device["CPU:2"]
    prog = await dev.compile(SCALE, outs=(0,))
    xs = [await dev.allocate(N, dtypes.float32) for _ in range(3)]
    ys = [await dev.allocate(N, dtypes.float32) for _ in range(3)]
    graph = Graph()
    for k in range(3):
        graph.copyin(xs[k], f"x{k}")
        graph.launch(prog, ys[k], xs[k], vals=(N, float(k + 1)))
        graph.copyout(ys[k], f"y{k}")
    recorder.enabled = True
    try:
        mark = len(recorder.events)
        result = await graph.replay(**{f"x{k}": floats(10.0) for k in range(3)})
        await dev.synchronize()
    finally:
        recorder.enabled = False
    assert [values(result[f"y{k}"]) for k in range(3)] == [{10.0}, {20.0}, {30.0}]
    (event,) = [e for e in recorder.events[mark:] if isinstance(e, GraphEvent)]
    copyins, copyouts = event.starts[0::3], event.starts[2::3]
    assert max(copyins) < min(copyouts)  # the copy queue does not hold copy-in 1 behind copy-out 0
    assert event.deps == ((), (0,), (1,), (), (3,), (4,), (), (6,), (7,))


async def test_failing_entry_fails_the_replay_without_stalling_other_queues() -> None:
    dev = Device["CPU:2"]
    prog = await dev.compile(SCALE, outs=(0,))
    x, y = await dev.allocate(N, dtypes.float32), await dev.allocate(N, dtypes.float32)
    graph = Graph()
    graph.copyin(x, "x")
    graph.launch(Failing(dev, "broken", b""), y, x, outs=(0,))
    graph.copyout(y, "y")  # waits on the copy queue for the failed kernel's progress signal
    with anyio.fail_after(10), pytest.raises(OpError, match="kernel blew up"):
        await graph.replay(x=floats(1))
    good = scale_graph(prog, y, x, 2.0)
    assert values((await good.replay(x=floats(3)))["y"]) == {6.0}
    await dev.synchronize()


STATUS = r"""
#include <stdint.h>
int kernel(int32_t *out) { out[0] = 1; return 7; }
"""


async def test_a_replay_awaited_after_its_failed_part_is_done_raises_the_failure() -> None:
    """The part's engine has finished it but not yet learnt of its failure (the native core logs it; Python
    reads the log when it retires the op): awaiting the replay then still raises it, never returns its results."""
    dev = Device["CPU:2"]
    prog = await dev.compile(STATUS, outs=(0,))
    out = await dev.allocate(4, dtypes.int32)
    graph = Graph()
    graph.launch(prog, out, outs=(0,))
    for _ in range(20):
        run = graph.replay()
        (part,) = run.ops
        engine = part.engine
        assert engine is not None
        with anyio.fail_after(10):
            # polled: waiting through the signal would retire the part (what this test must not do)
            while engine.signal.value < part.value:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        with pytest.raises(OpError, match="returned status 7"):
            await run
    await dev.free(out)


async def test_a_failed_part_of_a_replay_fails_the_parts_that_consume_its_output() -> None:
    dev = Device["CPU:3"]
    prog = await dev.compile(SCALE, outs=(0,))
    x, y = await dev.allocate(N, dtypes.float32), await dev.allocate(N, dtypes.float32)
    inline_before, dev.inline_copy_max = dev.inline_copy_max, 0  # copies on the copy queue, the kernel on the
    # compute queue: two parts per replay

    def broken_copy(dst: int, src: int, nbytes: int) -> None:
        raise OSError("copy engine fault")

    try:
        graph = scale_graph(prog, y, x, 2.0)
        dev.copy_fn = broken_copy  # type: ignore[method-assign]
        run = graph.replay(x=floats(1))
        del dev.copy_fn
        assert {op.engine for op in run.ops} == {dev.copy, dev.compute}
        with anyio.fail_after(10), pytest.raises(OpError, match="copy engine fault"):
            await run  # the root failure, not the dependent one
        (kernel_part,) = [op for op in run.ops if op.engine is dev.compute]
        assert isinstance(kernel_part.error, DependencyError)  # it never ran on the bytes the copy-in missed
        with pytest.raises(DependencyError, match="depends on Graph #"):
            await dev.copyout(y)  # what the failed part should have written is not valid
        assert values((await graph.replay(x=floats(3)))["y"]) == {6.0}  # a good replay makes it valid again
    finally:
        dev.inline_copy_max = inline_before
