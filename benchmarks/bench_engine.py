"""Engine benchmarks: op round trip, NULL-device op throughput, copy bandwidth, compile times.

Every figure is compared with a baseline measured in the same run:

* ``roundtrip``: ``await dev.launch(empty kernel)`` on CPU against a bare worker
  thread that wakes one future on the same loop (time per round trip).
* ``null_ops``: 100k NULL-device launches submitted, then each awaited, against
  a bare worker that takes futures from a queue and wakes the loop once per
  batch to resolve them (ops per second).
* ``launch_cost``: the event loop thread's CPU time to submit one eager launch whose input a copy-in on the
  copy queue is still writing (one cross-queue dependency), against a launch with no dependency (µs per op,
  ``time.thread_time`` around each launch, less what the two calls themselves add, measured in the same run
  and reported as ``timer_us``; goal <= 1.5 µs).
* ``copies``: ``copyin``/``copyout`` of 1, 64 and 256 MiB against one plain
  ``ctypes.memmove`` of the same size (GB/s). Small copies are timed as a
  stream of copies in flight, big ones one at a time.
* ``compile``: a warm-cache compile in a fresh process, where the persistent
  cache (not an in-process memo) is what makes it warm, against a cold one; and
  8 different kernels compiled at once against one after another.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

import anyio
import anyio.lowlevel

from aruntime import Device
from benchmarks.common import (
    BareWorker,
    Benchmark,
    Result,
    address,
    copy_bandwidth,
    interleaved,
    launch_vs_bare_wake,
    loop_independent,
    memmoves,
    one_at_a_time,
    ratio_goal,
    result,
    settings,
    threads_on_one_cpu,
)

ROOT = Path(__file__).resolve().parent.parent
EMPTY_KERNEL = "void kernel(void) {}"


# ---- 1. round trip -------------------------------------------------------------------------------------


async def roundtrip() -> list[Result]:
    """Awaited launch of an empty CPU kernel against a bare worker thread waking a future on the same loop.

    Measured twice: with threads unpinned, as users run it, and with every thread of the process on one CPU
    (see :func:`benchmarks.common.threads_on_one_cpu`), where a wake-up costs least.
    """
    n, repeats = (50, 3) if settings.quick else (400, 9)
    dev = Device["CPU"]
    prog = await dev.compile(EMPTY_KERNEL)
    rows = []
    for name, placement in (("roundtrip", contextlib.nullcontext()), ("roundtrip_pinned", threads_on_one_cpu())):
        with placement:
            value, baseline = await launch_vs_bare_wake(dev, prog, n, repeats)
        ratio = value / baseline
        rows.append(result(name, value, "us", baseline, ratio, *ratio_goal(ratio, "<=", 1.0)))
    return rows


# ---- 2. NULL-device op throughput ----------------------------------------------------------------------


async def null_ops() -> list[Result]:
    """100k NULL launches submitted, then awaited, against a bare worker that wakes the loop once per batch."""
    n, repeats = (5_000, 1) if settings.quick else (100_000, 5)
    dev = Device["NULL"]
    prog = await dev.compile(EMPTY_KERNEL)
    worker = BareWorker()

    async def ours() -> None:
        ops = [dev.launch(prog) for _ in range(n)]
        for op in ops:
            await op

    async def base() -> None:
        futs = [worker.submit() for _ in range(n)]
        for fut in futs:
            await fut

    try:
        ours_s, base_s = await interleaved(ours, base, repeats)
    finally:
        worker.close()
    value, baseline = n / ours_s, n / base_s
    ratio = value / baseline
    need = 600_000 if settings.loop == "uvloop" else 0
    goal = "ratio >= 0.5" + (f" and >= {need} ops/s" if need else "")
    return [result("null_ops", value, "ops/s", baseline, ratio, goal, ratio >= 0.5 and value >= need, ops=n)]


READ_ONE = r"""
#include <stdint.h>
void kernel(uint8_t *out, const uint8_t *x) { out[0] = x[0]; }
"""


async def launch_cost() -> list[Result]:
    """Loop-thread CPU per eager launch with one cross-queue dependency, against one with none."""
    n, repeats = (200, 1) if settings.quick else (5_000, 5)
    dev = Device["CPU"]
    prog = await dev.compile(READ_ONE, outs=(0,))
    size = (64 << 10) + 1  # small beside a core's cache: the copies do not slow the loop's thread
    data = bytes(size)
    inline, dev.inline_copy_max = dev.inline_copy_max, 0  # every copy-in on the copy queue
    xs = [await dev.allocate(size) for _ in range(64)]  # in turn: each is long done with when it comes again
    out = await dev.allocate(1)

    async def measure(dependent: bool) -> float:
        cpu = 0.0
        for i in range(n):
            x = xs[i % len(xs)]
            if dependent:
                dev.copyin(x, data)  # in flight on the copy queue when the launch is submitted
            start = time.thread_time()
            dev.launch(prog, out, x)
            cpu += time.thread_time() - start
        await dev.synchronize()
        return cpu / n * 1e6

    def timer() -> float:
        """What an interval timed by two ``time.thread_time()`` calls holds with nothing between them (µs): a
        system call on some VMs, 0.3-0.7 µs here."""
        cpu = 0.0
        for _ in range(n):
            start = time.thread_time()
            cpu += time.thread_time() - start
        return cpu / n * 1e6

    try:
        await measure(True)
        with_dep = [await measure(True) for _ in range(repeats)]
        without = [await measure(False) for _ in range(repeats)]
        timed = statistics.median(timer() for _ in range(repeats))
    finally:
        dev.inline_copy_max = inline
        for x in xs:
            await dev.free(x)
        await dev.free(out)
    value, baseline = statistics.median(with_dep) - timed, statistics.median(without) - timed
    return [
        result("launch_cost", value, "us", baseline, value / baseline, "<= 1.5 us", value <= 1.5, ops=n, timer_us=timed)
    ]


# ---- 3. copies -----------------------------------------------------------------------------------------


async def copies() -> list[Result]:
    """copyin/copyout GB/s against plain memmove of the same size, per size; and one 1 MiB copy awaited at a time."""
    sizes = (1 << 20, 8 << 20) if settings.quick else (1 << 20, 64 << 20, 256 << 20)
    stream = 32 << 20  # copies smaller than this are timed as a stream of them, all in flight
    dev = Device["CPU"]
    rows: list[Result] = []
    for size in sizes:
        count = max(1, stream // size)
        repeats = 3 if settings.quick else max(5, min(15, (1 << 30) // (size * count)))
        goal = 0.9 if size <= 1 << 20 else 0.95
        figures = await copy_bandwidth(dev, size, count, repeats, host_addressed=True)
        for direction, (value, baseline) in figures.items():
            ratio = value / baseline
            name = f"{direction}_{size >> 20}MiB"
            rows.append(result(name, value, "GB/s", baseline, ratio, *ratio_goal(ratio, ">=", goal), in_flight=count))
        if size == 1 << 20:  # the serving pattern: each copy awaited before the next is submitted
            host_in = bytearray(b"\x5a") * size
            buf = await dev.allocate(size)
            ours_s, base_s = await interleaved(
                partial(one_at_a_time, partial(dev.copyin, buf, host_in), count),
                partial(memmoves, buf.handle, address(host_in), size, count),
                repeats,
            )
            value, baseline = size * count / ours_s / 1e9, size * count / base_s / 1e9
            ratio = value / baseline
            rows.append(result("copyin_1MiB_awaited", value, "GB/s", baseline, ratio, *ratio_goal(ratio, ">=", 0.7)))
            await dev.free(buf)
    return rows


async def starvation() -> list[Result]:
    """A task floods a CPU device with small copies (no window) for 2 s: how many the device completes meanwhile,
    against the rate at which it completes the same copies when nothing floods it; and the flood's memory."""
    seconds, batch = (0.3, 50) if settings.quick else (2.0, 200)
    dev = Device["CPU:1"]
    size = 4096
    buf = await dev.allocate(size)
    src = bytes(size)
    engine = dev.copy
    count = 2_000 if settings.quick else 20_000
    start = time.perf_counter()
    for _ in range(count):
        last = dev.copyin(buf, src)
    await last
    unloaded = count / (time.perf_counter() - start)  # submitted as fast as the loop can, then awaited
    await dev.synchronize()
    rss0 = _rss()
    first = engine.signal.value
    held_most = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(batch):
            dev.copyin(buf, src)
        held_most = max(held_most, engine.last - engine.signal.value)
        await anyio.lowlevel.checkpoint()
    elapsed = time.perf_counter() - start
    completed = engine.signal.value - first
    rss = _rss() - rss0
    await dev.synchronize()
    rate = completed / elapsed
    ratio = rate / unloaded
    return [
        result(
            "starvation",
            rate,
            "ops/s",
            unloaded,
            ratio,
            *ratio_goal(ratio, ">=", 0.5),
            submitted=engine.last - first,
            held_most=held_most,
            rss_growth_mb=round(rss / 2**20, 1),
            bytes_per_held_op=round(rss / held_most) if held_most else None,
        )
    ]


def _rss() -> int:
    """This process's resident memory in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


# ---- 4. compile ----------------------------------------------------------------------------------------


def _kernels(tag: str, count: int) -> list[str]:
    """``count`` different small kernels; ``tag`` makes them differ from any compiled before."""
    return [
        f"/* {tag} {i} */\n#include <stdint.h>\n"
        f"void kernel(float *o, const float *x, int64_t n) {{ for (int64_t j = 0; j < n; j++) o[j] = x[j] * {i + 2}; }}"
        for i in range(count)
    ]


def _compile_child(sources: list[str]) -> list[float]:
    """In a fresh process: compile each source once on CPU and return the seconds each took."""

    async def main() -> list[float]:
        dev = Device["CPU"]
        times = []
        for src in sources:
            start = time.perf_counter()
            await dev.compile(src)
            times.append(time.perf_counter() - start)
        return times

    times: list[float] = anyio.run(main)
    return times


async def _in_fresh_process(sources: list[str], env: dict[str, str]) -> list[float]:
    code = "import json, sys; from benchmarks.bench_engine import _compile_child; "
    code += "print(json.dumps(_compile_child(json.load(sys.stdin))))"
    proc = await anyio.run_process(
        [sys.executable, "-c", code], input=json.dumps(sources).encode(), env=env, cwd=ROOT, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"compile child failed:\n{proc.stderr.decode(errors='replace')}")
    times: list[float] = json.loads(proc.stdout)
    return times


@loop_independent
async def compile_warm() -> list[Result]:
    """A warm-cache compile, in a fresh process, against a cold compile.

    One process compiles ``n`` new kernels into an empty cache (the cold times).
    A second, fresh process compiles them again with ``ARUNTIME_ASSERT_COMPILE=1``, so any
    miss fails: each compile there is a persistent-cache hit seen for the first
    time in that process, so no in-process memo can answer it. The first compile
    of that process also pays the one-time costs (the compiler key, the cache
    connection) and is reported separately; the goal is on the median of the rest.
    """
    n = 4 if settings.quick else 12
    sources = _kernels(uuid.uuid4().hex, n)
    with tempfile.TemporaryDirectory(prefix="aruntime-bench-") as tmp:
        env = {**os.environ, "ARUNTIME_CACHEDB": os.path.join(tmp, "cache.db"), "PYTHONPATH": str(ROOT)}
        for var in ("ARUNTIME_DISABLE_COMPILER_CACHE", "ARUNTIME_CACHELEVEL", "ARUNTIME_ASSERT_COMPILE"):
            env.pop(var, None)
        cold = await _in_fresh_process(sources, env)
        warm = await _in_fresh_process(sources, {**env, "ARUNTIME_ASSERT_COMPILE": "1"})
    cold_ms = statistics.median(cold) * 1e3
    warm_ms = statistics.median(warm[1:]) * 1e3
    first_ms = warm[0] * 1e3
    return [
        result("compile_warm", warm_ms, "ms", cold_ms, warm_ms / cold_ms, "<= 1 ms", warm_ms <= 1.0, kernels=n - 1),
        result("compile_warm_first", first_ms, "ms", cold_ms, first_ms / cold_ms, "none (one-time costs)", None),
    ]


@loop_independent
async def compile_parallel() -> list[Result]:
    """8 different kernels compiled at once against the same number compiled one after another (cold)."""
    n, repeats = 8, (1 if settings.quick else 3)
    dev = Device["CPU"]
    serial_s: list[float] = []
    parallel_s: list[float] = []
    saved = {var: os.environ.pop(var, None) for var in ("ARUNTIME_CACHEDB", "ARUNTIME_ASSERT_COMPILE")}
    try:
        with tempfile.TemporaryDirectory(prefix="aruntime-bench-") as tmp:
            os.environ["ARUNTIME_CACHEDB"] = os.path.join(tmp, "cache.db")
            await dev.compile(EMPTY_KERNEL)  # warm up the compiler key and the worker threads
            for _ in range(repeats):
                start = time.perf_counter()
                for src in _kernels(uuid.uuid4().hex, n):
                    await dev.compile(src)
                serial_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for src in _kernels(uuid.uuid4().hex, n):
                        tg.start_soon(dev.compile, src)
                parallel_s.append(time.perf_counter() - start)
    finally:
        for var, value in saved.items():
            os.environ.pop(var, None)
            if value is not None:
                os.environ[var] = value
    serial, parallel = statistics.median(serial_s), statistics.median(parallel_s)
    speedup = serial / parallel
    return [
        result(
            "compile_parallel",
            parallel * 1e3,
            "ms",
            serial * 1e3,
            speedup,
            "speedup >= 1.6",
            speedup >= 1.6,
            cpus=os.cpu_count(),
        )
    ]


BENCHMARKS: list[Benchmark] = [roundtrip, null_ops, launch_cost, copies, starvation, compile_warm, compile_parallel]
