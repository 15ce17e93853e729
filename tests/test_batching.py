"""Dynamic batching: concurrent requests served by batched calls, priorities, errors, cancellation, closing."""

from __future__ import annotations

import array
import re
from collections.abc import Sequence

import anyio
import pytest

from aruntime import Device, dtypes
from aruntime.batching import Batcher
from tests.kernels import SCALE

pytestmark = pytest.mark.anyio


class Recorder:
    """A batch function that doubles its items and records every batch it was given."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate: anyio.Event | None = None  # when set, each batch waits for it

    async def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        if self.gate is not None:
            await self.gate.wait()
        return [2 * i for i in items]


async def _burst(batcher: Batcher[int, int], items: Sequence[int]) -> dict[int, int]:
    """Call ``batcher`` from one task per item, all released at once; item -> result."""
    results: dict[int, int] = {}
    gate = anyio.Event()

    async def one(item: int) -> None:
        await gate.wait()
        results[item] = await batcher(item)

    async with anyio.create_task_group() as tg:
        for item in items:
            tg.start_soon(one, item)
        await anyio.wait_all_tasks_blocked()
        gate.set()
    return results


async def test_a_burst_of_requests_runs_in_batches_of_at_most_max_batch() -> None:
    run = Recorder()
    async with Batcher(run, max_batch=32) as batcher:
        results = await _burst(batcher, range(100))
    assert results == {i: 2 * i for i in range(100)}
    assert [len(b) for b in run.batches] == [32, 32, 32, 4]  # all 100 were in before the first batch ran
    assert sorted(i for b in run.batches for i in b) == list(range(100))


async def test_requests_that_come_while_a_batch_runs_form_the_next_batch() -> None:
    run = Recorder()
    run.gate = anyio.Event()
    results: dict[int, int] = {}

    async def one(item: int) -> None:
        results[item] = await batcher(item)

    async with Batcher(run) as batcher, anyio.create_task_group() as tg:
        tg.start_soon(one, 0)
        await anyio.wait_all_tasks_blocked()  # batch [0] is running, held by the gate
        for item in (1, 2, 3):
            tg.start_soon(one, item)
        await anyio.wait_all_tasks_blocked()
        assert run.batches == [[0]] and not results
        run.gate.set()
    assert [sorted(b) for b in run.batches] == [[0], [1, 2, 3]]  # (trio starts tasks in any order)
    assert results == {0: 0, 1: 2, 2: 4, 3: 6}


async def test_a_failing_batch_fails_its_callers_only() -> None:
    async def run(items: list[int]) -> list[int]:
        if 13 in items:
            raise ArithmeticError("unlucky batch")
        return items

    async with Batcher(run) as batcher:
        errors: list[BaseException] = []

        async def one(item: int) -> None:
            try:
                await batcher(item)
            except ArithmeticError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for item in (13, *range(50)):
                tg.start_soon(one, item)
        assert len(errors) == 51 and all("unlucky batch" in str(e) for e in errors)
        frames, tb = 0, errors[0].__traceback__
        while tb is not None:
            frames, tb = frames + 1, tb.tb_next
        assert frames < 10  # the last caller's frames and run's, not every caller's
        assert await batcher(70) == 70  # the batcher goes on


async def test_a_batch_function_must_return_one_result_per_item() -> None:
    async def run(items: list[int]) -> list[int]:
        return items[:-1]

    async def run_and_clear(items: list[int]) -> list[int]:
        items.clear()
        return []

    for bad in (run, run_and_clear):
        async with Batcher(bad) as batcher:
            with pytest.raises(ValueError, match="run returned 0 results for a batch of 1 items"):
                await batcher(1)


async def test_a_cancelled_caller_stops_waiting_and_the_others_get_their_results() -> None:
    run = Recorder()
    run.gate = anyio.Event()
    results: dict[int, int] = {}

    async def one(item: int) -> None:
        results[item] = await batcher(item)

    scope = anyio.CancelScope()

    async def cancelled() -> None:
        with scope:
            await batcher(2)

    async with Batcher(run) as batcher, anyio.create_task_group() as tg:
        tg.start_soon(one, 0)
        await anyio.wait_all_tasks_blocked()  # batch [0] runs, held by the gate
        tg.start_soon(one, 1)
        tg.start_soon(cancelled)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        run.gate.set()
    assert results == {0: 0, 1: 2}
    assert [sorted(b) for b in run.batches] == [[0], [1, 2]]  # the cancelled caller's item still ran with its batch


async def test_leaving_the_context_runs_what_was_handed_in_then_refuses_new_items() -> None:
    run = Recorder()
    run.gate = anyio.Event()
    results: dict[int, int] = {}

    async def one(item: int) -> None:
        results[item] = await batcher(item)

    async def release_once_all_wait() -> None:
        await anyio.wait_all_tasks_blocked()  # the batcher's exit included
        assert run.gate is not None
        run.gate.set()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, Batcher(run) as batcher:
            tg.start_soon(one, 0)
            await anyio.wait_all_tasks_blocked()  # batch [0] runs, held by the gate
            for item in (1, 2):
                tg.start_soon(one, item)
            await anyio.wait_all_tasks_blocked()  # items 1 and 2 wait for the next batch
            tg.start_soon(release_once_all_wait)
    assert results == {0: 0, 1: 2, 2: 4}
    assert [sorted(b) for b in run.batches] == [[0], [1, 2]]
    with pytest.raises(RuntimeError, match="not open"):
        await batcher(5)
    async with batcher:  # it can be opened again
        assert await batcher(6) == 12


async def _record_error(batcher: Batcher[int, int], item: int, errors: list[RuntimeError]) -> None:
    """Call ``batcher`` with ``item``, from outside the batcher's block, expecting a RuntimeError."""
    try:
        await batcher(item)
    except RuntimeError as exc:
        errors.append(exc)


async def test_an_error_in_the_body_cancels_the_batch_and_fails_its_callers() -> None:
    run = Recorder()
    run.gate = anyio.Event()  # never set
    errors: list[RuntimeError] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as callers:
            with pytest.raises(ZeroDivisionError):
                async with Batcher(run) as batcher:
                    callers.start_soon(_record_error, batcher, 1, errors)
                    await anyio.wait_all_tasks_blocked()  # item 1 runs, held by the gate
                    raise ZeroDivisionError("the body failed")
    assert [str(e) for e in errors] == ["the batcher was closed while this item ran"]


async def test_a_batcher_whose_runner_was_cancelled_refuses_new_items_instead_of_hanging() -> None:
    with anyio.fail_after(10), anyio.CancelScope() as outer:
        async with Batcher(Recorder()) as batcher:
            outer.cancel()  # the runner, in the batcher's task group, ends at once
            with anyio.CancelScope(shield=True), anyio.fail_after(10):  # (the outer limit cannot reach in here)
                await anyio.wait_all_tasks_blocked()
                with pytest.raises(RuntimeError, match="not open"):
                    await batcher(1)


async def test_a_batch_function_stopped_by_a_base_exception_fails_its_callers_with_the_cause() -> None:
    class Abort(BaseException):
        pass

    async def run(items: list[int]) -> list[int]:
        raise Abort("stop")

    errors: list[RuntimeError] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as callers:
            with pytest.raises(BaseException) as info:  # the batcher's task group reports what stopped its runner
                async with Batcher(run) as batcher:
                    callers.start_soon(_record_error, batcher, 1, errors)
                    await anyio.sleep_forever()
            assert [type(e) for e in getattr(info.value, "exceptions", ())] == [Abort]
    assert [str(e) for e in errors] == ["run was stopped: Abort('stop')"]
    assert isinstance(errors[0].__cause__, Abort)


async def test_callers_outside_a_cancelled_batcher_get_an_error_instead_of_hanging() -> None:
    run = Recorder()
    run.gate = anyio.Event()  # never set: the batch runs until the batcher is cancelled
    errors: list[RuntimeError] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as callers:
            with anyio.CancelScope() as scope:
                async with Batcher(run) as batcher:
                    callers.start_soon(_record_error, batcher, 0, errors)
                    await anyio.wait_all_tasks_blocked()  # item 0 runs, held by the gate
                    callers.start_soon(_record_error, batcher, 1, errors)
                    await anyio.wait_all_tasks_blocked()  # item 1 waits for the next batch
                    scope.cancel()
                    await anyio.sleep_forever()
    assert sorted(str(e) for e in errors) == [
        "the batcher was closed before this item ran",
        "the batcher was closed while this item ran",
    ]


class PriorityRecorder:
    """A batch function that declares ``priority``: doubles its items and records each batch with its priority."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[int]]] = []
        self.gate: anyio.Event | None = None  # when set, each batch waits for it

    async def __call__(self, items: list[int], *, priority: int) -> list[int]:
        self.batches.append((priority, list(items)))
        if self.gate is not None:
            await self.gate.wait()
        return [2 * i for i in items]


async def _queue_behind_a_running_batch(
    batcher: Batcher[int, int], gate: anyio.Event, calls: Sequence[tuple[int, int]]
) -> dict[int, int]:
    """Run item 0 (normal) and hold it in ``run`` until ``gate``; meanwhile make each call of ``calls``
    (``(item, priority)``, one group after the other as given, each group in waiting before the next comes), then
    release the gate; item -> result."""
    results: dict[int, int] = {}

    async def one(item: int, priority: int) -> None:
        results[item] = await batcher(item, priority=priority)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, 0, 0)
        await anyio.wait_all_tasks_blocked()  # batch [0] runs, held by the gate
        for item, priority in calls:
            tg.start_soon(one, item, priority)
            await anyio.wait_all_tasks_blocked()  # each item is in its batch before the next comes
        gate.set()
    return results


async def test_high_priority_batches_overtake_waiting_normal_ones() -> None:
    run = Recorder()
    run.gate = anyio.Event()
    calls = [(1, 0), (2, 0), (3, 0), (10, -1), (11, -1), (12, -1), (4, 0)]
    async with Batcher(run, max_batch=2) as batcher:
        results = await _queue_behind_a_running_batch(batcher, run.gate, calls)
    assert results == {i: 2 * i for i in (0, 1, 2, 3, 4, 10, 11, 12)}
    # the running batch finished; then every high batch, then the normal ones, each priority in arrival order
    assert run.batches == [[0], [10, 11], [12], [1, 2], [3, 4]]


async def test_a_high_priority_item_that_comes_while_a_high_batch_runs_still_goes_before_normal_ones() -> None:
    run = PriorityRecorder()
    gates = [anyio.Event(), anyio.Event()]
    order: list[int] = []

    async def one(item: int, priority: int) -> None:
        await batcher(item, priority=priority)
        order.append(item)

    async with Batcher(run) as batcher, anyio.create_task_group() as tg:
        run.gate = gates[0]
        tg.start_soon(one, 10, -1)
        await anyio.wait_all_tasks_blocked()  # high batch [10] runs, held by the first gate
        tg.start_soon(one, 1, 0)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(one, 11, -1)
        await anyio.wait_all_tasks_blocked()
        run.gate = None
        gates[0].set()
    assert run.batches == [(-1, [10]), (-1, [11]), (0, [1])]
    assert order == [10, 11, 1]


async def test_run_that_declares_priority_is_given_its_batchs_priority() -> None:
    async def positional(items: list[int], priority: int = 0) -> list[int]:  # not keyword-only: also taken
        seen.append((priority, list(items)))
        return items

    seen: list[tuple[int, list[int]]] = []
    run = PriorityRecorder()
    run.gate = anyio.Event()
    async with Batcher(run) as batcher:
        assert batcher.takes_priority
        await _queue_behind_a_running_batch(batcher, run.gate, [(1, 0), (10, -1)])
        run.gate = None
        assert await batcher(5) == 10  # the default priority is 0
    assert run.batches == [(0, [0]), (-1, [10]), (0, [1]), (0, [5])]
    async with Batcher(positional) as other:
        assert await other(3, priority=-1) == 3 and await other(4) == 4
    assert seen == [(-1, [3]), (0, [4])]


async def test_run_without_priority_is_called_with_the_items_only_whatever_the_priority() -> None:
    async def options(items: list[int], **options: int) -> list[int]:  # **options does not declare priority
        assert not options
        return items

    run = Recorder()
    async with Batcher(run) as batcher, Batcher(options) as other:
        assert not batcher.takes_priority and not other.takes_priority
        assert await batcher(1, priority=-1) == 2 and await batcher(2) == 4
        assert await other(3, priority=-1) == 3
    assert run.batches == [[1], [2]]


async def test_a_bad_priority_is_refused_before_the_item_is_taken() -> None:
    run = Recorder()
    async with Batcher(run) as batcher:
        for bad in (1, -2, True, "high", None, -1.0):
            message = f"Batcher: priority must be 0 (normal) or -1 (high), got {bad!r}"
            with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
                await batcher(7, priority=bad)  # type: ignore[arg-type]
        assert await batcher(2) == 4
    assert run.batches == [[2]]  # nothing of the refused calls was queued
    with pytest.raises(ValueError, match="priority must be"):
        await batcher(1, priority=5)  # refused as such by a closed batcher too


async def test_a_run_that_cannot_be_called_with_its_items_is_refused() -> None:
    async def nothing() -> list[int]:
        return []

    async def extra(items: list[int], *, priority: int, more: int) -> list[int]:
        return items

    async def positional_only(items: list[int], priority: int, /) -> list[int]:
        return items

    for bad, how in ((nothing, "run(items)"), (extra, "run(items, priority=p)"), (positional_only, "run(items)")):
        with pytest.raises(TypeError, match=rf"run must be an async function .* cannot be called as {re.escape(how)}"):
            Batcher(bad)  # type: ignore[arg-type]


async def test_a_batch_run_at_its_priority_on_a_device() -> None:
    """``run`` passes its batch's priority on to its ops: high-priority requests use the device's high queues."""
    dev = Device["CPU"]
    prog = await dev.compile(SCALE, outs=(0,))
    width = 4
    queues: list[tuple[int, int]] = []  # (batch priority, priority of the queue its launch went to)

    async def scale(requests: list[array.array[float]], *, priority: int) -> list[array.array[float]]:
        n = len(requests) * width
        async with dev.buffer(n, dtypes.float32) as x, dev.buffer(n, dtypes.float32) as y:
            packed = array.array("f")
            for request in requests:
                packed.extend(request)
            dev.copyin(x, packed, priority=priority)
            launch = dev.launch(prog, y, x, vals=(n, 3.0), priority=priority)
            queues.append((priority, launch.engine.priority))
            out = array.array("f", await dev.copyout(y, priority=priority))
        return [out[i * width : (i + 1) * width] for i in range(len(requests))]

    results: dict[int, list[float]] = {}
    async with Batcher(scale, max_batch=16) as batcher:

        async def one(i: int) -> None:
            results[i] = list(await batcher(array.array("f", [float(i)] * width), priority=-1 if i % 2 else 0))

        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i)
    assert results == {i: [3.0 * i] * width for i in range(64)}
    assert {p for p, _ in queues} == {0, -1} and all(p == q for p, q in queues)
    assert dev.metrics()["compute_high"]["done"] >= 1


async def test_bad_arguments_and_misuse_are_refused() -> None:
    with pytest.raises(ValueError, match="max_batch must be a positive int, got 0"):
        Batcher(Recorder(), max_batch=0)
    with pytest.raises(TypeError, match="run must be an async function"):
        Batcher(42)  # type: ignore[arg-type]
    batcher = Batcher(Recorder())
    with pytest.raises(RuntimeError, match="not open"):
        await batcher(1)
    async with batcher:
        with pytest.raises(RuntimeError, match="already open"):
            await batcher.__aenter__()


async def test_requests_batched_into_one_kernel_launch_on_a_device() -> None:
    """The serving pattern: each request is 8 floats; a batch is one copy-in, one launch and one copy-out."""
    dev = Device["CPU"]
    prog = await dev.compile(SCALE, outs=(0,))
    width = 8
    launches: list[int] = []

    async def scale(requests: list[array.array[float]]) -> list[array.array[float]]:
        n = len(requests) * width
        x, y = await dev.allocate(n, dtypes.float32), await dev.allocate(n, dtypes.float32)
        try:
            packed = array.array("f")
            for request in requests:
                packed.extend(request)
            dev.copyin(x, packed)
            dev.launch(prog, y, x, vals=(n, 3.0))
            launches.append(len(requests))
            out = array.array("f", await dev.copyout(y))
        finally:
            x.deallocate()
            y.deallocate()
        return [out[i * width : (i + 1) * width] for i in range(len(requests))]

    results: dict[int, list[float]] = {}

    async with Batcher(scale, max_batch=64) as batcher:

        async def one(i: int) -> None:
            results[i] = list(await batcher(array.array("f", [float(i)] * width)))

        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(one, i)
    assert results == {i: [3.0 * i] * width for i in range(200)}
    assert sum(launches) == 200 and max(launches) <= 64 and len(launches) < 200
