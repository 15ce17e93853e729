"""Dynamic batching: many concurrent single-item requests served by one call per batch.

A server of tiny kernels pays the runtime's per-op cost (a few µs of Python
per op, and a wake-up per awaited result) once per request. A
:class:`Batcher` gathers the items that concurrent tasks hand it while the
previous batch runs, and runs them with one call of a batch function (which
would copy them in as one buffer, launch one kernel over all of them and copy
the results out), so that cost is paid once per batch. A call may ask for high
priority: its item goes into a batch of high-priority items, which runs before
any batch of normal ones that is waiting, and ``run`` can pass the priority on
to its device ops.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Generic, Protocol, TypeVar

import anyio
import anyio.abc

from aruntime.engine.ops import HIGH, check_priority
from aruntime.helpers import checkpoint

T = TypeVar("T")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class PriorityRun(Protocol[T, R_co]):
    """A batch function that takes the batch's priority: ``run(items, priority=p)`` (see :class:`Batcher`)."""

    def __call__(self, items: list[T], /, *, priority: int) -> Awaitable[Sequence[R_co]]: ...


class _Batch(Generic[T, R]):
    __slots__ = ("done", "error", "items", "results", "traceback")

    def __init__(self) -> None:
        self.items: list[T] = []
        self.done = anyio.Event()
        self.results: Sequence[R] = ()
        self.error: BaseException | None = None
        self.traceback: TracebackType | None = None  # the error's own, restored for each caller that raises it

    def fail(self, error: BaseException) -> None:
        self.error, self.traceback = error, error.__traceback__


class Batcher(Generic[T, R]):
    """An async context manager that serves ``await batcher(item)`` from many tasks with batched calls
    of ``run``.

    ``run(items)`` gets the items of one batch (at most ``max_batch``, in the
    order they came) and returns one result per item, in the same order; each
    caller gets its item's result, or the exception ``run`` raised. One batch
    runs at a time: the items that come while it runs form the next one, so a
    lone request is run at once and a burst is run in few calls.

    Each call has a priority (see :meth:`__call__`): 0, normal (the default),
    or -1, high. Items of one priority are batched together, and of the
    batches waiting to run, a high-priority one always runs before any
    normal one; a running batch is never interrupted, and while high-priority
    batches keep coming, normal ones wait. If ``run`` declares a keyword
    parameter ``priority`` (``async def run(items, *, priority)``), each
    batch is run as ``run(items, priority=p)``, so that ``run`` can give its
    device ops the batch's priority (``dev.launch(..., priority=priority)``);
    else as ``run(items)``. A ``run`` that cannot be called either way is a
    :class:`TypeError`.

    A caller that is cancelled stops waiting; its item still runs with its
    batch. Leaving the context runs what was handed in. If its body raises or it is
    cancelled, the batch that runs is cancelled, and every caller still
    waiting gets a :class:`RuntimeError` (so does one that calls a batcher
    that is closed). A batcher serves the tasks of the event loop it was
    opened in; ``run`` must not call it. Entering, leaving and each call
    are checkpoints.
    """

    def __init__(
        self, run: Callable[[list[T]], Awaitable[Sequence[R]]] | PriorityRun[T, R], max_batch: int = 1024
    ) -> None:
        if not callable(run):
            raise TypeError(f"run must be an async function of a list of items, got {run!r}")
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        self.run = run
        """The batch function."""
        self.max_batch = max_batch
        """The most items of one batch."""
        self.takes_priority = _takes_priority(run)
        """Whether ``run`` is called as ``run(items, priority=p)`` (it declares ``priority``), else ``run(items)``."""
        self._call: Callable[..., Awaitable[Sequence[R]]] = run
        self._high: deque[_Batch[T, R]] = deque()  # high-priority batches waiting to run; the last may take items
        self._normal: deque[_Batch[T, R]] = deque()  # the same at priority 0
        self._wake: anyio.Event | None = None  # set when the runner, idle, is needed
        self._open = False
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Batcher[T, R]:
        await checkpoint()
        if self._tg is not None:
            raise RuntimeError("this batcher is already open")
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._open = True
        self._tg.start_soon(self._runner)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        self._open = False  # no new items; the runner ends once what was handed in has run
        self._poke()
        try:
            if exc_type is None or issubclass(exc_type, anyio.get_cancelled_exc_class()):
                suppress = await self._tg.__aexit__(exc_type, exc, tb)
                if exc_type is None:
                    await checkpoint()  # a task group's exit is not one once its tasks have returned
                return suppress
            self._tg.cancel_scope.cancel()  # the body failed: stop the runner, and let the error through as it is
            await self._tg.__aexit__(None, None, None)
            return None
        finally:
            self._tg = None

    async def __call__(self, item: T, priority: int = 0) -> R:
        """Hand ``item`` to the next batch of ``priority`` and return its result once the batch has run.

        ``priority``: 0 (normal, the default) or -1 (high: its batch runs before any waiting batch of normal
        items, see :class:`Batcher`); another value is a ``ValueError``, raised before the item is taken.
        """
        if type(priority) is not int or priority != 0:  # the default path: nothing more to check
            check_priority(priority, "Batcher")
        if not self._open:
            raise RuntimeError("the batcher is not open: use `async with Batcher(run) as batcher:`")
        ready = self._high if priority == HIGH else self._normal
        if not ready or len(ready[-1].items) >= self.max_batch:
            ready.append(_Batch())
            self._poke()
        batch = ready[-1]
        index = len(batch.items)
        batch.items.append(item)
        await batch.done.wait()
        if batch.error is not None:
            raise batch.error.with_traceback(batch.traceback)  # each caller's frames, not all of them
        return batch.results[index]

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()
            self._wake = None

    async def _runner(self) -> None:
        high, normal = self._high, self._normal
        try:
            while True:
                if not high and not normal:
                    if not self._open:
                        return
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
                await checkpoint()  # tasks already woken add their items first
                if high:  # items that come meanwhile start a new batch
                    await self._run(high.popleft(), HIGH)
                else:
                    await self._run(normal.popleft(), 0)
        finally:  # done, cancelled or interrupted: nobody will run what is left, or take new items
            self._open = False
            for ready in (high, normal):
                for batch in ready:
                    batch.fail(RuntimeError("the batcher was closed before this item ran"))
                    batch.done.set()
                ready.clear()

    async def _run(self, batch: _Batch[T, R], priority: int) -> None:
        count = len(batch.items)
        try:
            if self.takes_priority:
                results = await self._call(batch.items, priority=priority)
            else:
                results = await self._call(batch.items)
            if len(results) != count:
                raise ValueError(f"run returned {len(results)} results for a batch of {count} items")
        except Exception as exc:
            batch.fail(exc)
        except BaseException as exc:
            closed = isinstance(exc, anyio.get_cancelled_exc_class())
            why = "the batcher was closed while this item ran" if closed else f"run was stopped: {exc!r}"
            error = RuntimeError(why)
            error.__cause__ = exc
            batch.fail(error)
            raise
        else:
            batch.results = results
        finally:
            batch.done.set()


def _takes_priority(run: Callable[..., object]) -> bool:
    """Whether ``run`` declares a keyword parameter ``priority`` (then it is called with one); a ``TypeError`` if it
    cannot be called with a list of items (and that keyword). A callable whose signature cannot be read is called
    without it."""
    try:
        signature = inspect.signature(run)
    except (TypeError, ValueError):  # a builtin without a signature, say: nothing to check
        return False
    param = signature.parameters.get("priority")
    takes = param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
    try:
        if takes:
            signature.bind([], priority=0)
        else:
            signature.bind([])
    except TypeError as exc:
        how = "run(items, priority=p)" if takes else "run(items)"
        raise TypeError(
            f"run must be an async function of a list of items, with an optional keyword parameter priority:"
            f" {run!r} cannot be called as {how} ({exc})"
        ) from None
    return takes
