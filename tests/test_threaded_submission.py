"""Ops submitted from several OS threads at once onto the same buffers, eagerly and through one shared
``Scheduler``, on both submission paths (C and Python).

An op is bound to its queue, held, before another thread can find it in a buffer's hazard log or in a window, and
one op's accesses are recorded all at once: every op runs, in an order each thread's own submissions keep, and no
thread's submission fails because of another's. A long chain of held ops handed on together runs its callbacks
one after another, not nested.
"""

from __future__ import annotations

import array
import threading
from collections.abc import Callable

import anyio
import pytest

from aruntime import BaseDevice, Device, Op, Scheduler, dtypes, transfer
from tests.kernels import INC, on_path

pytestmark = pytest.mark.anyio

PATHS = ("c", "python")
_INDEX = {"c": 230, "python": 232}  # CPU:230 (and :231) submit in C, CPU:232 (and :233) in Python
THREADS = 4
N = 256  # int32 elements per buffer


def _devices(path: str) -> tuple[BaseDevice, BaseDevice]:
    first = _INDEX[path]
    return on_path(Device[f"CPU:{first}"], path), on_path(Device[f"CPU:{first + 1}"], path)


async def _in_threads(work: Callable[[int], None]) -> list[BaseException]:
    """Run ``work(k)`` on THREADS threads started together; the errors they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def run(k: int) -> None:
        start.wait()
        try:
            work(k)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        await anyio.to_thread.run_sync(t.join)
    return errors


@pytest.mark.parametrize("path", PATHS)
async def test_kernels_and_transfers_from_several_threads_on_one_buffer_all_run(path: str) -> None:
    """Each thread adds one to a buffer with a kernel, then transfers it to another device, over and over: every
    op runs, the buffer holds every thread's increments, and no submission fails."""
    dev, other = _devices(path)
    prog = await dev.compile(INC, outs=(0,))
    buf = await dev.allocate(N, dtypes.int32)
    dst = await other.allocate(N, dtypes.int32)
    await dev.copyin(buf, bytes(4 * N))
    rounds = 800
    ops: list[Op] = []

    def work(k: int) -> None:
        for _ in range(rounds):
            ops.append(dev.launch(prog, buf, vals=(N,)))
            ops.append(transfer(dst, buf))

    errors = await _in_threads(work)
    try:
        assert errors == []
        with anyio.fail_after(60):
            for op in ops:
                await op
        assert set(array.array("i", await dev.copyout(buf))) == {THREADS * rounds}
        assert len(ops) == 2 * THREADS * rounds
    finally:
        await dev.synchronize()
        await dev.free(buf)
        await other.free(dst)


@pytest.mark.parametrize("path", PATHS)
async def test_a_scheduler_shared_by_several_threads_admits_every_op(path: str) -> None:
    """Threads submit through one Scheduler with a window smaller than what they submit: the window keeps
    admitting ops as room frees, and every op runs."""
    dev, _ = _devices(path)
    prog = await dev.compile(INC, outs=(0,))
    bufs = [await dev.allocate(N, dtypes.int32) for _ in range(THREADS)]
    shared = await dev.allocate(N, dtypes.int32)
    for b in (*bufs, shared):
        await dev.copyin(b, bytes(4 * N))
    rounds = 500
    try:
        with anyio.fail_after(60):
            async with Scheduler(window=4, queue=1 << 20) as sched:

                def work(k: int) -> None:
                    for i in range(rounds):
                        sched.launch(prog, bufs[k] if i % 2 else shared, vals=(N,))

                errors = await _in_threads(work)
                await sched.drain()
        assert errors == []
        for b in bufs:
            assert set(array.array("i", await dev.copyout(b))) == {rounds // 2}
        assert set(array.array("i", await dev.copyout(shared))) == {THREADS * (rounds - rounds // 2)}
    finally:
        await dev.synchronize()
        for b in (*bufs, shared):
            await dev.free(b)
