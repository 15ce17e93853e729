"""Dynamic batching: concurrent requests served by batched calls, errors, cancellation, closing."""

from __future__ import annotations

import array
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
