"""The engine and scheduler figures on the CL device (OpenCL through PoCL here), rows named ``cl_*``.

* ``cl_roundtrip``: ``await dev.launch(empty kernel)`` on CL against a bare worker thread that
  wakes one future on the same loop (the CPU row's baseline, see ``bench_engine.roundtrip``); the
  driver's own round trip (enqueue a marker, ``clWaitForEvents`` on a thread) is reported with it.
* ``cl_copies``: ``copyin``/``copyout`` of 1 and 64 MiB against one ``ctypes.memmove`` of the
  same size (GB/s); 1 MiB copies are timed as a stream of copies in flight.
* ``cl_pipeline``: copy-in -> kernel -> copy-out batches over CL and CL:1 through a
  :class:`Scheduler` against the same ops awaited one by one; the kernel is calibrated to run as
  long as one copy of the batch (as in ``bench_scheduler.scheduler_pipeline``).

A machine where CL does not open gets no rows (the reason goes to stderr).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

from benchmarks.bench_scheduler import BLOCK, WINDOW, _expected
from benchmarks.common import (
    Benchmark,
    Pipeline,
    Result,
    alternated,
    calibrate,
    copy_bandwidth,
    exec_seconds,
    launch_vs_bare_wake,
    open_devices,
    ratio_goal,
    result,
    settings,
    threads_on_one_cpu,
)

os.environ.setdefault("POCL_DEVICES", "pthread pthread")  # two PoCL devices for the pipeline

EMPTY = "__kernel void empty(void) {}"
PASSES = r"""
#define BLOCK 2048
/* bench_scheduler's PASSES kernel in OpenCL C, as one work item: y = x after `work` multiply-adds per block. */
__kernel void passes(__global float *y, __global const float *x, long n, long work) {
  float t[BLOCK];
  for (long b = 0; b < n; b += BLOCK) {
    long m = n - b < BLOCK ? n - b : BLOCK;
    for (long i = 0; i < m; i++) t[i] = x[b + i];
    for (long w = work; w > 0; w -= BLOCK) {
      long k = w < BLOCK ? w : BLOCK;
      for (long i = 0; i < k; i++) t[i] = t[i] * 0.5f + 1.0f;
    }
    for (long i = 0; i < m; i++) y[b + i] = t[i];
  }
}
"""


def _driver_roundtrip(dev: Any, count: int) -> float:
    """Seconds per marker enqueued on a fresh queue and waited for with clWaitForEvents, on a thread."""
    import pyopencl as cl

    from aruntime.backends.cl import wait_event

    queue = cl.CommandQueue(dev.context, dev.cl_device)
    took: list[float] = []

    def run() -> None:
        start = time.perf_counter()
        for _ in range(count):
            wait_event(cl.enqueue_marker(queue))
        took.append(time.perf_counter() - start)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return took[0] / count


async def cl_roundtrip() -> list[Result]:
    """Awaited empty CL kernel against a bare worker thread waking a future (all threads on one CPU)."""
    devs = open_devices("bench_cl", "CL")
    if devs is None:
        return []
    dev = devs[0]
    n, repeats = (50, 3) if settings.quick else (400, 9)
    prog = await dev.compile(EMPTY, "empty")
    with threads_on_one_cpu():
        value, baseline = await launch_vs_bare_wake(dev, prog, n, repeats)
        driver_us = _driver_roundtrip(dev, n) * 1e6
    ratio = value / baseline
    return [result("cl_roundtrip", value, "us", baseline, ratio, *ratio_goal(ratio, "<=", 1.5), driver_us=driver_us)]


async def cl_copies() -> list[Result]:
    """CL copyin/copyout GB/s against plain memmove of the same size."""
    devs = open_devices("bench_cl", "CL")
    if devs is None:
        return []
    dev = devs[0]
    sizes = (1 << 20, 8 << 20) if settings.quick else (1 << 20, 64 << 20)
    rows: list[Result] = []
    for size in sizes:
        count = max(1, (32 << 20) // size)
        repeats = 3 if settings.quick else 7
        figures = await copy_bandwidth(dev, size, count, repeats, host_addressed=False)
        for direction, (value, baseline) in figures.items():
            ratio = value / baseline
            name = f"cl_{direction}_{size >> 20}MiB"
            rows.append(result(name, value, "GB/s", baseline, ratio, *ratio_goal(ratio, ">=", 0.85), in_flight=count))
    return rows


async def cl_pipeline() -> list[Result]:
    """Copy-in -> kernel -> copy-out batches over CL and CL:1: through a Scheduler against one by one."""
    devs = open_devices("bench_cl", "CL", "CL:1")
    if devs is None:
        return []
    quick = settings.quick
    nbytes = (256 << 10) if quick else (2 << 20)
    batches, repeats = (6, 1) if quick else (32, 5)
    n = nbytes // 4
    progs = [await d.compile(PASSES, "passes", outs=(0,)) for d in devs]
    line = await Pipeline.make(devs, progs, n, (n, 0), batches)
    x, y = line.xs[0][0], line.ys[0][0]
    work, copy_s = await calibrate(devs[0], progs[0], x, y, line.srcs[0], 3 if quick else 9, BLOCK)
    line.vals = (n, work)
    kernel_s = await exec_seconds(devs[0], lambda: devs[0].launch(progs[0], y, x, vals=(n, work)), 5)

    async def pipelined() -> None:
        await line.double_buffered(WINDOW)

    for run in (line.one_by_one, pipelined):  # warm-up that checks the results
        await line.checked(run, lambda first: _expected(first, work))
    seconds = await alternated({"seq": line.one_by_one, "pipe": pipelined}, repeats)
    seq_s, pipe_s = seconds["seq"], seconds["pipe"]
    speedup = statistics.median(s / p for s, p in zip(seq_s, pipe_s, strict=True))
    extra = {"batches": batches, "batch_bytes": nbytes, "work_per_block": work, "block": BLOCK}
    extra |= {"copy_exec_us": copy_s * 1e6, "kernel_exec_us": kernel_s * 1e6, "cores": os.cpu_count()}
    return [
        result(
            "cl_pipeline_speedup",
            statistics.median(pipe_s) * 1e3,
            "ms",
            statistics.median(seq_s) * 1e3,
            speedup,
            ">= 1.6x faster than one by one",
            speedup >= 1.6,
            **extra,
        )
    ]


BENCHMARKS: list[Benchmark] = [cl_roundtrip, cl_copies, cl_pipeline]
