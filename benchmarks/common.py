"""The harness every benchmark module shares: run settings, the result record and its goals, timing
(interleaved repeats, bursts, streams of ops), the baselines (memmove, a bare worker thread that wakes
the loop) and the copy-in -> kernel -> copy-out pipeline that several devices are measured on.

A benchmark module ``benchmarks/bench_<topic>.py`` exports ``BENCHMARKS``, a list
of async callables taking no arguments. Each returns a list of result dicts made
with :func:`result`. The runner calls each once per event loop (asyncio, uvloop,
trio), with :data:`settings` telling it the loop and whether to use small sizes;
a benchmark decorated with :func:`loop_independent` runs only once. A module is
its workloads: what it measures it measures with the helpers here.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import functools
import gc
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from aruntime import Buffer, Device, Op, Program, dtypes
from aruntime.device import BaseDevice
from aruntime.errors import DeviceError
from aruntime.events import RangeEvent, recorder
from aruntime.scheduler import Scheduler

Result = dict[str, Any]
Benchmark = Callable[[], Awaitable[list[Result]]]

REQUIRED_KEYS = ("name", "value", "unit", "baseline", "ratio", "goal", "loop")
"""The keys every result has (``pass`` too: whether the goal is met, or None when it has no goal)."""


@dataclass
class Settings:
    """The current run: ``quick`` asks for small sizes and few repeats (a smoke test, not a measurement)."""

    quick: bool = False
    loop: str = "asyncio"


settings = Settings()


def loop_independent(fn: Benchmark) -> Benchmark:
    """Mark the benchmark ``fn`` to run once rather than once per event loop."""
    fn.loop_independent = True  # type: ignore[attr-defined]
    return fn


def is_loop_independent(fn: Benchmark) -> bool:
    """Whether ``fn`` was marked with :func:`loop_independent`."""
    return bool(getattr(fn, "loop_independent", False))


def result(
    name: str,
    value: float,
    unit: str,
    baseline: float,
    ratio: float,
    goal: str,
    passed: bool | None,
    **extra: Any,
) -> Result:
    """One measured figure: ``value`` against ``baseline`` measured in the same run, and its goal."""
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "ratio": ratio,
        "goal": goal,
        "pass": passed,
        "loop": settings.loop,
        **extra,
    }


def ratio_goal(ratio: float, op: str, limit: float) -> tuple[str, bool]:
    """A row's goal on its ratio, ``"ratio <= 1.5"`` say, and whether ``ratio`` meets it (``op``: ``<=`` or ``>=``)."""
    return f"ratio {op} {limit}", ratio <= limit if op == "<=" else ratio >= limit


def open_devices(bench: str, *names: str) -> list[BaseDevice] | None:
    """The devices ``names``; None (and why, on stderr) when one does not open here: ``bench`` gets no rows."""
    try:
        return [Device[name] for name in names]
    except DeviceError as exc:
        print(f"{bench}: skipped, {exc}", file=sys.stderr)
        return None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


def address(obj: Any) -> int:
    """The address of a writable buffer-protocol object's memory (the caller keeps ``obj`` alive)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(obj))


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    """Seconds that ``await fn()`` takes, after a full garbage collection."""
    gc.collect()
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def interleaved(
    ours: Callable[[], Awaitable[object]], base: Callable[[], Awaitable[object]], repeats: int
) -> tuple[float, float]:
    """Median seconds of ``ours`` and of ``base``, run alternately ``repeats`` times each (after one warm-up)."""
    await ours()
    await base()
    seconds = await alternated({"ours": ours, "base": base}, repeats)
    return statistics.median(seconds["ours"]), statistics.median(seconds["base"])


async def alternated(
    variants: Mapping[str, Callable[[], Awaitable[object]]], repeats: int, after: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Seconds of each variant, timed in turn ``repeats`` times (no warm-up), ``after()`` once per round: every
    variant is sampled across the same stretch of time."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            seconds[name].append(await timed(fn))
        if after is not None:
            after()
    return seconds


async def stream(submit: Callable[[], Op], count: int) -> None:
    """Submit ``count`` ops, then await each: a stream of ops in flight."""
    ops = [submit() for _ in range(count)]
    for op in ops:
        await op


async def one_at_a_time(submit: Callable[[], Op], count: int) -> None:
    """Submit and await ``count`` ops, one after the other."""
    for _ in range(count):
        await submit()


async def memmoves(dst: int, src: int, size: int, count: int) -> None:
    """The copies' baseline: ``count`` plain memmoves of ``size`` bytes."""
    for _ in range(count):
        ctypes.memmove(dst, src, size)


async def copy_bandwidth(
    dev: BaseDevice, size: int, count: int, repeats: int, host_addressed: bool
) -> dict[str, tuple[float, float]]:
    """GB/s of ``count`` copy-ins and of ``count`` copy-outs of ``size`` bytes in flight on ``dev``, each against
    as many memmoves of that size (to or from the buffer itself when ``dev``'s memory is ``host_addressed``, else
    to or from host scratch memory), interleaved: ``{"copyin": (ours, memmove), "copyout": (...)}``."""
    host_in, host_out, scratch = bytearray(b"\x5a") * size, bytearray(size), bytearray(size)
    buf = await dev.allocate(size)
    at_in, at_out = address(host_in), address(host_out)
    at_dev = buf.handle if host_addressed else address(scratch)
    cases = {
        "copyin": (functools.partial(dev.copyin, buf, host_in), (at_dev, at_in)),
        "copyout": (functools.partial(dev.copyout, buf, host_out), (at_out, at_dev)),
    }
    figures: dict[str, tuple[float, float]] = {}
    for direction, (submit, (dst, src)) in cases.items():
        ours_s, base_s = await interleaved(
            functools.partial(stream, submit, count), functools.partial(memmoves, dst, src, size, count), repeats
        )
        figures[direction] = (size * count / ours_s / 1e9, size * count / base_s / 1e9)
    await dev.free(buf)
    return figures


async def burst(tasks: int, handle: Callable[[int], Awaitable[object]]) -> tuple[float, list[float]]:
    """Start ``tasks`` tasks blocked on one gate, open it; seconds until all are done, and each one's latency."""
    gate, all_ready = anyio.Event(), anyio.Event()
    latencies = [0.0] * tasks
    ready = 0

    async def one(i: int) -> None:
        nonlocal ready
        ready += 1
        if ready == tasks:
            all_ready.set()
        await gate.wait()
        start = time.perf_counter()
        await handle(i)
        latencies[i] = time.perf_counter() - start

    async with anyio.create_task_group() as tg:
        for i in range(tasks):
            tg.start_soon(one, i)
        await all_ready.wait()
        begin = time.perf_counter()
        gate.set()
    return time.perf_counter() - begin, latencies


# ---- the bare wake: a worker thread that wakes the loop --------------------------------------------------------------


class _TrioFuture:
    """The least a trio task needs to await a value set from another thread."""

    __slots__ = ("done", "task")

    def __init__(self) -> None:
        self.done = False
        self.task: Any = None

    def set_result(self, _: None) -> None:
        import trio

        self.done = True
        if self.task is not None:
            trio.lowlevel.reschedule(self.task)

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    async def _wait(self) -> None:
        if not self.done:
            import trio

            self.task = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)


def _resolve(batch: list[Any]) -> None:
    for fut in batch:
        fut.set_result(None)


class BareWorker:
    """A thread that takes futures from a queue and resolves them with one loop wake-up per batch.

    Created inside the running loop (asyncio, uvloop or trio); :meth:`close` stops the thread.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            import trio

            self._call_soon: Callable[..., object] = trio.lowlevel.current_trio_token().run_sync_soon
            self.future: Callable[[], Any] = _TrioFuture
        else:
            self._call_soon = loop.call_soon_threadsafe
            self.future = loop.create_future
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def submit(self) -> Any:
        """A new future that the worker resolves."""
        fut = self.future()
        self._queue.put(fut)
        return fut

    def _run(self) -> None:
        get, get_nowait, empty = self._queue.get, self._queue.get_nowait, self._queue.empty
        while (item := get()) is not None:
            batch = [item]
            while not empty():
                batch.append(get_nowait())
            if batch[-1] is None:
                self._call_soon(_resolve, batch[:-1])
                return
            self._call_soon(_resolve, batch)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


@contextlib.contextmanager
def threads_on_one_cpu() -> Iterator[None]:
    """Pin every thread of this process to one CPU for the duration (Linux; elsewhere nothing is pinned).

    A wake-up across CPUs costs far more than one on the same CPU (on a VM, an
    inter-processor interrupt), and the scheduler places each worker thread on
    its own; pinned, both sides of a comparison get the same placement.
    """
    tasks = Path("/proc/self/task")
    if not hasattr(os, "sched_setaffinity") or not tasks.is_dir():
        yield
        return
    allowed = os.sched_getaffinity(0)
    for tid in tasks.iterdir():
        with contextlib.suppress(OSError):  # a thread may end meanwhile
            os.sched_setaffinity(int(tid.name), {min(allowed)})
    try:
        yield
    finally:
        for tid in tasks.iterdir():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid.name), allowed)


async def launch_vs_bare_wake(dev: BaseDevice, prog: Program, n: int, repeats: int) -> tuple[float, float]:
    """Median µs of one awaited ``dev.launch(prog)`` and of one bare worker wake, ``n`` in a row, on this loop."""
    worker = BareWorker()

    async def ours() -> None:
        for _ in range(n):
            await dev.launch(prog)

    async def base() -> None:
        for _ in range(n):
            await worker.submit()

    try:
        ours_s, base_s = await interleaved(ours, base, repeats)
    finally:
        worker.close()
    return ours_s / n * 1e6, base_s / n * 1e6


# ---- the copy-in -> kernel -> copy-out pipeline --------------------------------------------------------------------

SLOTS = 2
"""Device buffers per device that the batches rotate through (double buffering)."""


async def exec_seconds(dev: BaseDevice, submit: Callable[[], Op], repeats: int) -> float:
    """Median seconds the engine itself spends running the op ``submit()`` makes, from the engine's own ranges."""
    was_enabled, mark = recorder.enabled, len(recorder.events)
    recorder.enabled = True
    try:
        for _ in range(repeats):
            await submit()
    finally:
        recorder.enabled = was_enabled
    ranges = [e for e in recorder.events[mark:] if isinstance(e, RangeEvent) and e.device == dev.name]
    if not was_enabled:
        del recorder.events[mark:]
    return statistics.median((e.end - e.start) / 1e6 for e in ranges)


async def calibrate(
    dev: BaseDevice, prog: Program, x: Buffer, y: Buffer, src: Any, repeats: int, block: int
) -> tuple[int, float]:
    """The ``work`` that makes one launch of ``prog(y, x, vals=(n, work))`` (a kernel whose time grows about
    linearly with ``work``, in steps of ``block``) run as long as one copy-in of ``src``; and that copy's time."""
    n = x.size
    copy_s = await exec_seconds(dev, lambda: dev.copyin(x, src), repeats)

    async def kernel_s(work: int) -> float:
        return await exec_seconds(dev, lambda: dev.launch(prog, y, x, vals=(n, work)), repeats)

    base = await kernel_s(0)
    if base >= copy_s:  # the kernel's own memory traffic already takes as long as the copy
        return 0, copy_s
    work = 8 * block
    for _ in range(4):  # secant steps on the (nearly linear) time of `work`
        took = await kernel_s(work)
        if took <= base:  # too little work to measure: double it
            work *= 2
            continue
        if abs(took - copy_s) <= 0.05 * copy_s:
            break
        work = max(1, round(work * (copy_s - base) / (took - base)))
    return work, copy_s


@dataclass
class Pipeline:
    """Copy-in -> ``progs[d](y, x, vals)`` -> copy-out, ``batches`` batches: batch ``b`` on device ``b % len(devs)``,
    in slot ``(b // len(devs)) % SLOTS`` of its ``xs``/``ys``, from ``srcs[d]`` into ``dsts[d][slot]``."""

    devs: Sequence[BaseDevice]
    progs: Sequence[Program]
    xs: Sequence[Sequence[Buffer]]
    ys: Sequence[Sequence[Buffer]]
    srcs: Sequence[Any]
    dsts: Sequence[Sequence[Any]]
    vals: tuple[int, ...]
    batches: int
    op_s: list[float] = field(default_factory=list)
    """Each op's seconds, submitted and awaited, in the last :meth:`one_by_one` pass."""

    @classmethod
    async def make(
        cls, devs: Sequence[BaseDevice], progs: Sequence[Program], n: int, vals: tuple[int, ...], batches: int
    ) -> Pipeline:
        """``SLOTS`` buffers of ``n`` float32 per device for ``xs`` and ``ys``, ``srcs`` of ``0 .. n-1``, zeroed
        ``dsts``."""
        xs = [[await d.allocate(n, dtypes.float32) for _ in range(SLOTS)] for d in devs]
        ys = [[await d.allocate(n, dtypes.float32) for _ in range(SLOTS)] for d in devs]
        srcs = [array.array("f", range(n)) for _ in devs]
        dsts = [[bytearray(n * 4) for _ in range(SLOTS)] for _ in devs]
        return cls(devs, progs, xs, ys, srcs, dsts, vals, batches)

    def where(self, b: int) -> tuple[int, int]:
        """The device and the buffer slot of batch ``b``: batches alternate between the devices."""
        return b % len(self.devs), (b // len(self.devs)) % SLOTS

    @functools.cached_property
    def plan(self) -> list[tuple[BaseDevice, bool, Callable[[], Op]]]:
        """Every op in batch order: its device, whether it copies, and what submits it (made on first use, with
        the :attr:`vals` of then)."""
        ops: list[tuple[BaseDevice, bool, Callable[[], Op]]] = []
        for b in range(self.batches):
            d, s = self.where(b)
            dev, x, y = self.devs[d], self.xs[d][s], self.ys[d][s]
            ops.append((dev, True, functools.partial(dev.copyin, x, self.srcs[d])))
            ops.append((dev, False, functools.partial(dev.launch, self.progs[d], y, x, vals=self.vals)))
            ops.append((dev, True, functools.partial(dev.copyout, y, self.dsts[d][s])))
        return ops

    async def one_by_one(self) -> None:
        """Every op submitted and awaited before the next, each one's time in :attr:`op_s`."""
        plan = self.plan
        self.op_s = [0.0] * len(plan)
        clock = time.perf_counter
        for i, (_, _, submit) in enumerate(plan):
            start = clock()
            await submit()
            self.op_s[i] = clock() - start

    def busiest_queue_s(self) -> float:
        """The largest sum of :attr:`op_s` on one queue (a device's copy or compute queue)."""
        queues: dict[tuple[str, bool], float] = {}
        for (dev, is_copy, _), took in zip(self.plan, self.op_s, strict=True):
            queues[dev.name, is_copy] = queues.get((dev.name, is_copy), 0.0) + took
        return max(queues.values())

    async def double_buffered(self, window: int) -> None:
        """The batches through one Scheduler of ``window``, double-buffered: a device's next batch is copied in and
        launched before its previous batch is copied out, so that the copy-out (which waits for the previous
        kernel) does not hold the next copy-in back."""
        lag = len(self.devs)
        async with Scheduler(window=window) as sched:
            for b in range(self.batches + lag):
                if b < self.batches:
                    d, s = self.where(b)
                    sched.copyin(self.xs[d][s], self.srcs[d])
                    sched.launch(self.progs[d], self.ys[d][s], self.xs[d][s], vals=self.vals)
                if b >= lag:
                    d, s = self.where(b - lag)
                    sched.copyout(self.ys[d][s], self.dsts[d][s])
                await sched.room()  # backpressure: at most the window in flight

    async def in_order(self, window: int) -> None:
        """The ops of :meth:`plan`, in that order, through one Scheduler of ``window``."""
        async with Scheduler(window=window) as sched:
            for _, _, submit in self.plan:
                part = submit
                assert isinstance(part, functools.partial)
                await getattr(sched, part.func.__name__)(*part.args, **part.keywords)

    async def checked(self, run: Callable[[], Awaitable[object]], expected: Callable[[Sequence[float]], bytes]) -> None:
        """``run()`` once on zeroed destinations (a warm-up), then check that each one starts with
        ``expected(first two source elements)``."""
        for slots in self.dsts:
            for dst in slots:
                dst[:] = bytes(len(dst))
        await run()
        want = [expected(src[:2]) for src in self.srcs]
        assert all(dst[:8] == want[d] for d, slots in enumerate(self.dsts) for dst in slots), "wrong result"
