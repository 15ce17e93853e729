"""A wait that gives up does not stay registered: polling a long wait (``with anyio.move_on_after(0)``, or with a
timeout) thousands of times leaves a bounded number of registrations on the signal, on both kinds of signal and
every loop, and a task that kept waiting is still woken."""

from __future__ import annotations

import anyio
import pytest

from aruntime.engine import native
from aruntime.engine.signal import PySignal, TimelineSignal
from aruntime.errors import SignalTimeout

POLLS = 10_000


def registered(sig: TimelineSignal) -> int:
    """How many waits and callbacks are registered on ``sig`` (from the calling loop, for a native signal)."""
    if isinstance(sig, PySignal):
        return sum(len(group) for group in sig._callbacks.values())
    return len(sig.here()._waits.get(sig, ()))  # type: ignore[attr-defined]  # a NativeSignal's notified


def make(kind: str) -> TimelineSignal:
    if kind == "python":
        return PySignal("polled", 30)
    if native.lib() is None:
        pytest.skip("the native core is not available here")
    from aruntime.engine.native.signal import NativeSignal

    return NativeSignal("polled", 30)


async def give_up(sig: TimelineSignal, how: str) -> None:
    if how == "cancelled":
        with anyio.move_on_after(0):
            await sig.wait_async(1)
    else:
        with pytest.raises(SignalTimeout):
            await sig.wait_async(1, timeout=0)


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["cancelled", "timed out"])
@pytest.mark.parametrize("kind", ["python", "native"])
async def test_waits_that_give_up_leave_a_bounded_number_of_registrations(kind: str, how: str) -> None:
    sig = make(kind)
    woken = anyio.Event()

    async def stays() -> None:
        await sig.wait_async(1)
        woken.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stays)
        await anyio.wait_all_tasks_blocked()
        for _ in range(POLLS if how == "cancelled" else POLLS // 10):
            await give_up(sig, how)
        assert registered(sig) <= 2  # the task that stays, and at most one that gave up and is not dropped yet
        sig.set(1)
        with anyio.fail_after(10):
            await woken.wait()
    assert registered(sig) == 0
