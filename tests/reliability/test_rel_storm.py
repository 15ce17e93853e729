"""A cancellation storm: many tasks doing random allocate / copy-in / launch / transfer / copy-out sequences
across two CPU devices, directly and through a Scheduler, cancelled at random points (deadlines and whole
task groups), their buffers freed or dropped in reference cycles mid-flight, with garbage collections (and the
finalizers they run) starting every few allocations. Afterwards every device works, bytes in use are back at
their baseline, cached bytes are within the cap, no task hung (a global deadline) and every result that came
back is right."""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import pytest

from aruntime import BaseDevice, Buffer, Device, Program, transfer
from aruntime.scheduler import Scheduler
from tests.kernels import ADD_ONE

CAP = 256 << 10  # a small cache cap, so that the storm evicts
SIZES = (16, 256, 4096, 1 << 16)


@dataclass
class Tally:
    tasks: int = 0  # started in a task group
    finished: int = 0  # ran to the end with the right bytes; the others were cancelled
    ops: int = 0  # ops submitted

    def __str__(self) -> str:
        cancelled = self.tasks - self.finished
        return f"storm: {self.tasks} tasks, {self.finished} finished right, {cancelled} cancelled, {self.ops} ops"


async def one_task(
    rng: random.Random, devs: list[BaseDevice], progs: dict[str, Program], sched: Scheduler | None, t: Tally
) -> None:
    dev, other = rng.sample(devs, 2)
    n = rng.choice(SIZES)
    data = rng.randbytes(n)
    bufs: list[Buffer] = []
    finished = False
    try:
        with anyio.move_on_after(rng.uniform(0, 0.02) if rng.random() < 0.5 else 30):
            buf = await dev.allocate(n)
            bufs.append(buf)
            if sched is None:
                await dev.copyin(buf, data)
                await dev.launch(progs[dev.name], buf, vals=(n,))
            else:
                sched.copyin(buf, data)
                sched.launch(progs[dev.name], buf, vals=(n,))
                await sched.room()  # backpressure: waits (and may be cancelled) while the window is full
            t.ops += 2
            if rng.random() < 0.3:
                await anyio.lowlevel.checkpoint()
            if rng.random() < 0.5:
                dst = await other.allocate(n)
                bufs.append(dst)
                if sched is None:
                    await transfer(dst, buf)
                else:
                    sched.transfer(dst, buf)  # the copy-out below waits for it
                t.ops += 1
                buf = dst
            op = buf.owner.copyout(buf) if sched is None else sched.copyout(buf)
            got = await op
            t.ops += 1
            assert bytes(got) == bytes((b + 1) & 0xFF for b in data)
            finished = True
    finally:
        if rng.random() < 0.2:  # dropped in a reference cycle: a garbage collection frees them, maybe mid-flight
            cycle: list[object] = [*bufs]
            cycle.append(cycle)
        else:
            for b in bufs:
                if b.is_allocated():
                    b.deallocate()  # released once its ops finish, whether or not this task was cancelled
    t.finished += finished


async def group(rng: random.Random, devs: list[BaseDevice], progs: dict[str, Program], size: int, t: Tally) -> None:
    """``size`` tasks in one task group, through one Scheduler or directly; the whole group may be cancelled."""
    through = rng.random() < 0.5
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            if rng.random() < 0.3:
                delay = rng.uniform(0, 0.01)

                async def cancel_later() -> None:
                    await anyio.sleep(delay)
                    scope.cancel()

                tg.start_soon(cancel_later)
            if through:
                async with Scheduler(window=rng.choice((4, 64))) as sched, anyio.create_task_group() as inner:
                    for _ in range(size):
                        t.tasks += 1
                        inner.start_soon(one_task, random.Random(rng.random()), devs, progs, sched, t)
            else:
                for _ in range(size):
                    t.tasks += 1
                    tg.start_soon(one_task, random.Random(rng.random()), devs, progs, None, t)


async def storm(tasks: int, seed: int) -> Tally:
    devs = [Device["CPU:71"], Device["CPU:72"]]
    for dev in devs:
        dev.allocator.cache_limit = CAP  # type: ignore[attr-defined]
    progs = {dev.name: await dev.compile(ADD_ONE) for dev in devs}
    baseline = {dev.name: dev.allocator.in_use for dev in devs}
    rng = random.Random(seed)
    t = Tally()
    thresholds = gc.get_threshold()
    gc.set_threshold(50, 5, 5)  # a collection every few allocations: under whatever lock is held then
    try:
        with anyio.fail_after(max(60, tasks / 50)):  # no task may hang
            left = tasks
            while left:
                size = min(left, rng.randint(1, 40))
                await group(rng, devs, progs, size, t)
                left -= size
            for dev in devs:
                await dev.synchronize()  # nothing failed that nobody saw (and the failed ops let go of their buffers)
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()  # the buffers dropped in cycles
    for dev in devs:
        stats = dev.memory_stats()
        assert stats["in_use"] == baseline[dev.name], (dev.name, stats)
        assert stats["cached"] <= CAP, (dev.name, stats)
        buf = await dev.allocate(64)  # every device still works
        await dev.copyin(buf, bytes(range(64)))
        await dev.launch(progs[dev.name], buf, vals=(64,))
        assert bytes(await dev.copyout(buf)) == bytes(range(1, 65))
        await dev.free(buf)
        await dev.synchronize()  # and nothing failed that nobody saw
    assert t.tasks == tasks
    return t


@pytest.mark.anyio
async def test_a_quick_cancellation_storm() -> None:
    t = await storm(300, seed=13)
    print(t)
    assert 0 < t.finished < t.tasks


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_long_cancellation_storm() -> None:
    t = await storm(10_000, seed=1313)
    print(t)
    assert 0 < t.finished < t.tasks
