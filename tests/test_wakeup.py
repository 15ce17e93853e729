"""Loop wake-ups from engine threads: a run of short copies wakes a loop once; long commands never wait for it."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator

import anyio
import pytest

from aruntime import engine as engine_module
from aruntime.engine import SHORT_COPY, CommandQueue, Op, ThreadEngine
from aruntime.signal import TimelineSignal
from aruntime.wakeup import Waiter, Waker, asyncio_waker, deferral, flush, trio_waker

pytestmark = pytest.mark.anyio


@pytest.fixture
def engine() -> Iterator[ThreadEngine]:
    eng = ThreadEngine("TEST", "copy", timeout=10)
    yield eng
    eng.close()


def _running_waker() -> Waker:
    loop = asyncio._get_running_loop()
    return asyncio_waker(loop) if loop is not None else trio_waker()


def _count_wakes(waker: Waker) -> list[int]:
    """Make ``waker`` count the loop wake-ups it schedules; the count is the returned list's length."""
    calls: list[int] = []
    call_soon: Callable[[Callable[[], None]], object] = waker._call_soon

    def counting(fn: Callable[[], None]) -> object:
        calls.append(1)
        return call_soon(fn)

    waker._call_soon = counting
    return calls


async def test_a_run_of_short_copies_wakes_the_loop_once(engine: ThreadEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "DEFER_NS", 10**12)  # only running out of work flushes
    gate = TimelineSignal("test gate", timeout=10)
    wakes = _count_wakes(_running_waker())
    seen: list[int] = []  # the wake-ups scheduled so far, as each copy starts

    def copy(dst: int, src: int, nbytes: int) -> None:
        seen.append(len(wakes))

    engine.submit(CommandQueue().wait(gate, 1), Op("gate"))
    ops = [engine.submit(CommandQueue().copy("short", copy, 0, 0, SHORT_COPY), Op(f"copy {i}")) for i in range(32)]
    done: list[int] = []

    async def wait_for(i: int) -> None:
        await ops[i]
        done.append(i)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for i in range(len(ops)):
                tg.start_soon(wait_for, i)
            await anyio.wait_all_tasks_blocked()
            gate.set(1)
    assert sorted(done) == list(range(32))
    assert seen == [0] * 32  # no wake-up while more copies were queued
    assert len(wakes) == 1  # one when the queue ran dry, for all 32 waiters


@pytest.mark.parametrize("blocker", ["kernel", "blocking wait", "long copy", "time limit"])
async def test_a_deferred_wake_up_is_sent_before_the_engine_may_be_busy_for_long(
    engine: ThreadEngine, blocker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task awaiting a short copy is woken while the next op blocks: the engine flushed before that."""
    clock = [1]  # the engine's clock: only the "time limit" case moves it, from inside the next op
    monkeypatch.setattr(engine_module, "perf_counter_ns", lambda: clock[0])
    gate, other = TimelineSignal("test gate", timeout=10), TimelineSignal("test other", timeout=10)
    release = threading.Event()

    def blocking_copy(dst: int, src: int, nbytes: int) -> None:
        release.wait(10)

    def later(dst: int, src: int, nbytes: int) -> None:
        clock[0] += engine_module.DEFER_NS + 1

    engine.submit(CommandQueue().wait(gate, 1), Op("gate"))
    short = engine.submit(CommandQueue().copy("short", lambda d, s, n: None, 0, 0, 8), Op("short"))
    cq = CommandQueue()
    if blocker == "kernel":
        cq.exec("kernel", release.wait, (10,))
    elif blocker == "blocking wait":
        cq.wait(other, 1)
    elif blocker == "long copy":
        cq.copy("long", blocking_copy, 0, 0, SHORT_COPY + 1)
    else:  # short copies in one op (as in a graph replay), the time limit passing between them
        cq.copy("short", later, 0, 0, 8).copy("short", blocking_copy, 0, 0, 8)
    long = engine.submit(cq, Op(blocker))
    woken = anyio.Event()

    async def wait_short() -> None:
        await short
        woken.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_short)
            await anyio.wait_all_tasks_blocked()
            gate.set(1)
            await woken.wait()
            assert not long.done()
            release.set()
            other.set(1)
        await long


async def test_a_kernel_that_sets_a_signal_wakes_its_waiter_at_once(engine: ThreadEngine) -> None:
    """Only completions are deferred: a task woken by a running kernel runs while the kernel still does."""
    gate, user = TimelineSignal("test gate", timeout=10), TimelineSignal("test user", timeout=10)
    answered = threading.Event()
    seen: list[bool] = []

    def kernel() -> None:
        user.set(1)
        seen.append(answered.wait(10))  # the task answers only once woken

    async def answer() -> None:
        await user.wait_async(1)
        answered.set()

    engine.submit(CommandQueue().wait(gate, 1), Op("gate"))
    op = engine.submit(CommandQueue().exec("kernel", kernel), Op("kernel"))
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(answer)
            await anyio.wait_all_tasks_blocked()
            gate.set(1)
        await op
    assert seen == [True]


def test_a_failing_loop_wake_up_is_logged_and_the_others_still_happen(caplog: pytest.LogCaptureFixture) -> None:
    woken: list[Callable[[], None]] = []

    def broken(fn: Callable[[], None]) -> None:
        raise ValueError("no loop here")

    wakers = [Waker(woken.append), Waker(broken), Waker(woken.append)]
    deferred: list[Waker] = []
    deferral.wakers = deferred
    try:
        for waker in wakers:
            waker.post(Waiter(object(), 0.0, RuntimeError))
    finally:
        deferral.wakers = None
    assert deferred == wakers and not woken  # collected, not woken yet
    with caplog.at_level(logging.ERROR, logger="aruntime"):
        flush(deferred)
    assert len(woken) == 2 and not deferred
    assert "waking an event loop failed" in caplog.text
