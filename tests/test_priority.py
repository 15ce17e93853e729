"""Queue priorities: high-priority ops overtake queued normal ones, and never reorder ops that touch the same memory."""

from __future__ import annotations

import array
import ctypes

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aruntime import Device, Program, dtypes
from aruntime.device import BaseDevice
from aruntime.engine import NativeEngine, ThreadEngine
from aruntime.errors import DeviceError
from aruntime.scheduler import Scheduler
from tests.kernels import ADD_ONE, SPINS, closed_gate, gate_output, gate_started
from tests.test_scheduler_property import EXAMPLES, Case, check_through_scheduler, programs

pytestmark = pytest.mark.anyio

DEVICES = ("CPU:4", "CPU:5", "CPU:6", "CPU:7")  # devices of their own: their high-priority queues stay open

TICKET = r"""
#include <stdint.h>
/* out[0] = the next ticket of the counter at address `counter`: the order in which kernels started. */
void kernel(int32_t *out, int64_t counter) {
  out[0] = __atomic_fetch_add((int32_t *)(intptr_t)counter, 1, __ATOMIC_SEQ_CST);
}
"""


@st.composite
def prioritized(draw: st.DrawFn) -> tuple[Case, list[int], bool]:
    """A random program (see :func:`programs`), a priority per op, and whether ops go through a scheduler."""
    case = draw(programs())
    ops = case[2]
    priorities = draw(st.lists(st.sampled_from([0, -1]), min_size=len(ops), max_size=len(ops)))
    return case, priorities, draw(st.booleans())


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(drawn=prioritized())
async def test_priorities_never_reorder_ops_on_the_same_memory(drawn: tuple[Case, list[int], bool]) -> None:
    """Random programs with a random priority per op, straight to the devices or through a scheduler: every
    copy-out and the final bytes equal the sequential reference."""
    case, priorities, scheduled = drawn
    await check_through_scheduler(DEVICES, case, [not scheduled] * len(case[2]), priorities)


async def _tickets(dev: BaseDevice) -> tuple[Program, ctypes.c_int32]:
    return await dev.compile(TICKET, outs=(0,)), ctypes.c_int32(0)


async def test_high_priority_op_runs_past_a_busy_normal_queue() -> None:
    """A gate holds the normal compute queue with normal ops queued behind it: a high-priority kernel on other
    memory runs and is done while they still wait."""
    dev = Device["CPU:4"]
    gate, flag = await closed_gate(dev)
    add = await dev.compile(ADD_ONE)
    out = await gate_output(dev)
    bufs = [await dev.allocate(8) for _ in range(4)]
    for buf in bufs:
        await dev.copyin(buf, bytes(8))
    with anyio.fail_after(20):
        held = dev.launch(gate, out, vals=(flag.handle, SPINS))
        await gate_started(out)
        normal = [dev.launch(add, buf, vals=(8,)) for buf in bufs[:3]]
        await dev.launch(add, bufs[3], vals=(8,), priority=-1)
        assert not held.done() and not any(op.done() for op in normal)
        await dev.copyin(flag, array.array("i", [1]))
        for op in (held, *normal):
            await op
    assert [bytes(await dev.copyout(buf)) for buf in bufs] == [bytes([1] * 8)] * 4
    assert dev.metrics()["compute_high"]["done"] >= 1
    for buf in (flag, out, *bufs):
        await dev.free(buf)


async def test_queued_high_priority_ops_overtake_queued_normal_ones() -> None:
    """Both queues are held by gates, each with ops queued behind: once the normal gate opens, its queue lets
    the high one go first (its ops start only after the high ops but the last one have run)."""
    dev = Device["CPU:5"]
    gate, flag = await closed_gate(dev)
    high_gate = await dev.allocate(1, dtypes.int32)  # the high queue's gate flag
    await dev.copyin(high_gate, array.array("i", [0]))
    ticket, counter = await _tickets(dev)
    outs = [await gate_output(dev) for _ in range(8)]
    with anyio.fail_after(20):
        normal_gate = dev.launch(gate, outs[0], vals=(flag.handle, SPINS))
        await gate_started(outs[0])
        normal = [dev.launch(ticket, out, vals=(ctypes.addressof(counter),)) for out in outs[2:5]]
        high_gated = dev.launch(gate, outs[1], vals=(high_gate.handle, SPINS), priority=-1)
        await gate_started(outs[1])
        high = [dev.launch(ticket, out, vals=(ctypes.addressof(counter),), priority=-1) for out in outs[5:8]]
        await dev.copyin(flag, array.array("i", [1]))
        await normal_gate
        await anyio.sleep(0.05)  # room for a wrong order to show: the normal queue must wait all along
        assert not any(op.done() for op in normal)
        await dev.copyin(high_gate, array.array("i", [1]))
        for op in (high_gated, *high, *normal):
            await op
    tickets = [array.array("i", bytes(await dev.copyout(out)))[0] for out in outs[2:8]]
    normal_t, high_t = tickets[:3], tickets[3:]
    assert max(high_t[:2]) < min(normal_t)  # the last high op may run alongside the first normal one
    for buf in (flag, high_gate, *outs):
        await dev.free(buf)


@pytest.mark.parametrize("hold", [False, True])
async def test_high_priority_op_waits_for_a_queued_normal_op_it_depends_on(hold: bool) -> None:
    """A high-priority kernel on memory a queued normal kernel writes waits for it, with more high work queued
    behind it (the normal queue goes on while the high one waits), and sees its result. Held (``hold``), it
    waits off its queue, and the independent high op behind it runs at once."""
    dev = Device["CPU:6"]
    gate, flag = await closed_gate(dev)
    add = await dev.compile(ADD_ONE)
    out = await gate_output(dev)
    shared, other = await dev.allocate(8), await dev.allocate(8)
    await dev.copyin(shared, bytes(8))
    await dev.copyin(other, bytes(8))
    with anyio.fail_after(20):
        held = dev.launch(gate, out, vals=(flag.handle, SPINS))
        await gate_started(out)
        first = dev.launch(add, shared, vals=(8,))
        second = dev.launch(add, shared, vals=(8,), priority=-1, hold=hold)
        more = dev.launch(add, other, vals=(8,), priority=-1)
        read = dev.copyout(shared, priority=-1)
        if hold:
            await more
        assert not held.done() and not first.done() and not second.done()
        await dev.copyin(flag, array.array("i", [1]))
        for op in (held, first, second, more):
            await op
        assert bytes(await read) == bytes([2] * 8)
    assert bytes(await dev.copyout(other)) == bytes([1] * 8)
    for buf in (flag, out, shared, other):
        await dev.free(buf)


async def test_bad_priorities_are_refused_and_lose_nothing() -> None:
    dev = Device["CPU:6"]
    add = await dev.compile(ADD_ONE)
    buf = await dev.allocate(8)
    await dev.copyin(buf, bytes(8))
    for bad in (1, -2, True, 0.0, None, "high"):
        with pytest.raises(ValueError, match=f"priority must be 0 .normal. or -1 .high., got {bad!r}"):
            dev.launch(add, buf, vals=(8,), priority=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="priority must be"):
            dev.copyin(buf, bytes([9] * 8), priority=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="priority must be"):
            dev.copyout(buf, priority=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="Scheduler: priority must be"):
            Scheduler(priority=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="queue kind must be"):
        dev.queue("kernels", -1)
    async with Scheduler() as sched:
        with pytest.raises(ValueError, match="priority must be"):
            sched.copyin(buf, bytes(8), priority=2)
    assert bytes(await dev.copyout(buf)) == bytes(8)  # nothing ran, nothing is left waiting
    await dev.synchronize()
    await dev.free(buf)


async def test_scheduler_priority_is_its_ops_default() -> None:
    dev = Device["CPU:7"]
    buf = await dev.allocate(8)
    async with Scheduler(priority=-1) as sched:
        sched.copyin(buf, bytes(range(8)))
        assert bytes(await sched.copyout(buf, priority=0)) == bytes(range(8))
    metrics = dev.metrics()
    assert metrics["copy_high"]["done"] >= 1 and metrics["copy"]["done"] >= 1
    await dev.free(buf)


async def test_closing_a_device_stops_its_high_priority_queues() -> None:
    dev = Device["CPU:8"]
    add = await dev.compile(ADD_ONE)
    buf = await dev.allocate(8)
    dev.copyin(buf, bytes(8), priority=-1)
    dev.launch(add, buf, vals=(8,))
    read = dev.copyout(buf, priority=-1)
    assert {e.kind for e in dev.engines} >= {"compute", "copy", "copy_high"}
    engines = dev.engines
    await dev.free(buf)
    await dev.aclose()
    assert bytes(await read) == bytes([1] * 8)
    for engine in engines:
        assert engine.closed
        if isinstance(engine, ThreadEngine):
            assert not engine._thread.is_alive()
        else:
            assert isinstance(engine, NativeEngine) and engine._joined
    with pytest.raises(DeviceError, match="CPU:8 is closed"):  # a high-priority queue is not opened any more
        dev.queue("compute", -1)
