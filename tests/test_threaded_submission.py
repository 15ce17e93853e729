"""Ops submitted from several OS threads at once onto the same buffers, eagerly and through one shared
``Scheduler``, on both submission paths (C and Python).

An op is bound to its queue, held, before another thread can find it in a buffer's hazard log or in a window, and
one op's accesses are recorded all at once: every op runs, in an order each thread's own submissions keep, and no
thread's submission fails because of another's. A long chain of held ops handed on together runs its callbacks
one after another, not nested, and never inside another thread's submission.
"""

from __future__ import annotations

import array
import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from aruntime import BaseDevice, Device, Op, Scheduler, dtypes, transfer
from aruntime.engine import dispatch
from tests.kernels import ACCUMULATE, INC, SPINS, closed_gate, on_path

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


@pytest.mark.parametrize("path", PATHS)
async def test_a_callback_that_submits_never_runs_inside_another_submission(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A held op X, found by kernel B before X was pended in the native core, has B's dispatch waiting on it; B has
    a ``when_dispatched`` callback that launches. The core hands X on while the callback thread is busy, and
    another thread's launch D then finds X handed on in a hazard log, inside its own submission (under the logs'
    or its engine's lock). D's submission must not run B's callback there (the callback's launch would wait for
    the lock its own thread holds): D returns, and the callback's launch runs once the callback thread is free.

    X is paused between being held and being pended, where any thread may be preempted, so that B finds it held."""
    dev, other = _devices(path)
    big = 2 << 20  # bytes: over inline_copy_max, each transfer goes on a copy queue
    gate, flag = await closed_gate(other)
    accumulate = await dev.compile(ACCUMULATE, outs=(0,))
    inc = await dev.compile(INC, outs=(0,))
    gated = await other.allocate(big // 4, dtypes.int32)  # the gate writes it; P copies it
    await other.copyin(gated, bytes(big))
    a, a2, e = [await dev.allocate(big // 4, dtypes.int32) for _ in range(3)]
    small = await dev.allocate(N, dtypes.int32)
    await dev.copyin(small, bytes(4 * N))
    x_paused, x_go, callbacks_free = threading.Event(), threading.Event(), threading.Event()
    box: dict[str, Op] = {}
    real_pend = dispatch._pend

    def pend(*args: object) -> None:
        if "P" in box and args[2] is not box["P"] and not x_paused.is_set():
            x_paused.set()
            assert x_go.wait(10)
        real_pend(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(dispatch, "_pend", pend)
    made: list[Op] = []
    ops: list[Op] = []
    try:
        with anyio.fail_after(60):
            async with Scheduler() as sched:

                def scenario() -> None:  # a thread outside any loop: callbacks go to the callback thread
                    g = other.launch(gate, gated, vals=(flag.handle, SPINS))
                    g.when_done(lambda: callbacks_free.wait(20))  # keeps the callback thread busy once G is done
                    p = box["P"] = sched.transfer(a, gated)  # pended in the core: waits for G
                    ops.extend((g, p))
                    t = threading.Thread(target=lambda: box.setdefault("X", transfer(a2, a)))
                    t.start()
                    assert x_paused.wait(10)
                    b = dev.launch(accumulate, e, a2, vals=(big,))  # finds X held, not yet pended
                    b.when_dispatched(lambda: made.append(dev.launch(inc, small, vals=(N,))))
                    x_go.set()
                    t.join(10)
                    x = box["X"]
                    ops.extend((x, b))
                    assert x.cell is not None and x.later  # pended in the core, B waiting for its hand-on
                    ctypes.c_int32.from_address(flag.handle).value = 1  # open the gate
                    deadline = time.monotonic() + 10
                    while not x.cell[x.at]:  # the core hands X on once P is done
                        assert time.monotonic() < deadline
                        time.sleep(0.001)
                    d = threading.Thread(target=lambda: ops.append(dev.launch(inc, a2, vals=(big // 4,))), daemon=True)
                    d.start()  # D: finds X handed on in a2's hazard log
                    d.join(10)
                    assert not d.is_alive(), "D's launch never returned: a callback ran inside its submission"
                    callbacks_free.set()

                await anyio.to_thread.run_sync(scenario)
                await sched.drain()
            for op in ops:
                await op
            while not made:  # the callback thread runs B's callback  # noqa: ASYNC110
                await anyio.sleep(0.001)
            await made[0]
        assert set(array.array("i", await dev.copyout(small))) == {1}
    finally:
        x_go.set()
        callbacks_free.set()
        await dev.synchronize()
        await other.synchronize()
        await other.free(gated)
        for buf in (a, a2, e, small):
            await dev.free(buf)


@pytest.mark.parametrize("look", ["launch", "when_done"])
async def test_an_op_found_while_it_is_handed_to_the_core_is_waited_for(
    look: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X, a transfer that waits in the native core for a gated op, is paused on its way into the core (its pend
    made, its cell not yet published: a point where any thread may be preempted). Another thread then finds X in
    a hazard log and launches on another queue after it, or asks to be told when it is done: X is seen as held,
    waited for off the core, and everything runs once the gate opens (a cell seen before its pend crashed here)."""
    dev, other = _devices("python")  # the Python path runs Python between the pend and its cell
    big = 2 << 20
    gate, flag = await closed_gate(other)
    accumulate = await dev.compile(ACCUMULATE, outs=(0,))
    gated = await other.allocate(big // 4, dtypes.int32)
    await other.copyin(gated, bytes(big))
    a, a2, e = [await dev.allocate(big // 4, dtypes.int32) for _ in range(3)]
    x_paused, x_go = threading.Event(), threading.Event()
    mover: list[int] = []
    real_hold = Op.hold

    def hold(op: Op, engine: Any) -> None:
        if threading.get_ident() in mover and op.pend and op.cell is None and not x_paused.is_set():
            x_paused.set()
            assert x_go.wait(10)
        real_hold(op, engine)

    monkeypatch.setattr(Op, "hold", hold)
    ops: list[Op] = []
    told = threading.Event()
    try:
        with anyio.fail_after(60):
            async with Scheduler() as sched:

                def scenario() -> None:
                    ops.append(other.launch(gate, gated, vals=(flag.handle, SPINS)))
                    ops.append(sched.transfer(a, gated))  # pended in the core: waits for the gate

                    def move() -> None:
                        mover.append(threading.get_ident())
                        ops.append(transfer(a2, a))  # X: waits for the transfer, pended in the core

                    t = threading.Thread(target=move)
                    t.start()
                    assert x_paused.wait(10)
                    try:
                        if look == "launch":
                            ops.append(dev.launch(accumulate, e, a2, vals=(big,)))  # another queue, after X
                        else:
                            a2.log.entries[-1][3].when_done(told.set)
                    finally:
                        x_go.set()
                        t.join(10)
                    ctypes.c_int32.from_address(flag.handle).value = 1  # open the gate

                await anyio.to_thread.run_sync(scenario)
                await sched.drain()
            for op in ops:
                await op
            if look == "when_done":
                await anyio.to_thread.run_sync(told.wait, 10)
                assert told.is_set()
    finally:
        x_go.set()
        ctypes.c_int32.from_address(flag.handle).value = 1
        await dev.synchronize()
        await other.synchronize()
        await other.free(gated)
        for buf in (a, a2, e):
            await dev.free(buf)
