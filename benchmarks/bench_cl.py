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

import array
import ctypes
import functools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from aruntime import Device, Op
from aruntime.device import BaseDevice
from aruntime.errors import DeviceError
from benchmarks.bench_engine import _memmoves, _stream, _threads_on_one_cpu, launch_vs_bare_wake
from benchmarks.bench_scheduler import BLOCK, SLOTS, _allocate, _calibrate, _exec_seconds, _expected, double_buffered
from benchmarks.common import Benchmark, Result, interleaved, result, settings, timed

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


def _open(*names: str) -> list[BaseDevice] | None:
    try:
        return [Device[name] for name in names]
    except DeviceError as exc:
        print(f"bench_cl: skipped, {exc}", file=sys.stderr)
        return None


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
    devs = _open("CL")
    if devs is None:
        return []
    dev = devs[0]
    n, repeats = (50, 3) if settings.quick else (400, 9)
    prog = await dev.compile(EMPTY, "empty")
    with _threads_on_one_cpu():
        value, baseline = await launch_vs_bare_wake(dev, prog, n, repeats)
        driver_us = _driver_roundtrip(dev, n) * 1e6
    ratio = value / baseline
    return [result("cl_roundtrip", value, "us", baseline, ratio, "ratio <= 1.5", ratio <= 1.5, driver_us=driver_us)]


async def cl_copies() -> list[Result]:
    """CL copyin/copyout GB/s against plain memmove of the same size."""
    devs = _open("CL")
    if devs is None:
        return []
    dev = devs[0]
    sizes = (1 << 20, 8 << 20) if settings.quick else (1 << 20, 64 << 20)
    rows: list[Result] = []
    for size in sizes:
        count = max(1, (32 << 20) // size)
        repeats = 3 if settings.quick else 7
        host_in, host_out, scratch = bytearray(b"\x5a") * size, bytearray(size), bytearray(size)
        buf = await dev.allocate(size)
        at = [ctypes.addressof((ctypes.c_char * size).from_buffer(b)) for b in (host_in, host_out, scratch)]
        cases: dict[str, tuple[Callable[[], Op], tuple[int, int]]] = {
            "copyin": (functools.partial(dev.copyin, buf, host_in), (at[2], at[0])),
            "copyout": (functools.partial(dev.copyout, buf, host_out), (at[1], at[2])),
        }
        for direction, (submit, (dst, src)) in cases.items():
            ours_s, base_s = await interleaved(
                functools.partial(_stream, submit, count), functools.partial(_memmoves, dst, src, size, count), repeats
            )
            value, baseline = size * count / ours_s / 1e9, size * count / base_s / 1e9
            ratio = value / baseline
            name = f"cl_{direction}_{size >> 20}MiB"
            rows.append(result(name, value, "GB/s", baseline, ratio, "ratio >= 0.85", ratio >= 0.85, in_flight=count))
        await dev.free(buf)
    return rows


async def cl_pipeline() -> list[Result]:
    """Copy-in -> kernel -> copy-out batches over CL and CL:1: through a Scheduler against one by one."""
    devs = _open("CL", "CL:1")
    if devs is None:
        return []
    quick = settings.quick
    nbytes = (256 << 10) if quick else (2 << 20)
    batches, repeats = (6, 1) if quick else (32, 5)
    n = nbytes // 4
    progs = [await d.compile(PASSES, "passes", outs=(0,)) for d in devs]
    xs = [await _allocate(d, SLOTS, n) for d in devs]
    ys = [await _allocate(d, SLOTS, n) for d in devs]
    srcs = [array.array("f", range(n)) for _ in devs]
    dsts = [[bytearray(nbytes) for _ in range(SLOTS)] for _ in devs]
    work, copy_s = await _calibrate(devs[0], progs[0], xs[0][0], ys[0][0], srcs[0], 3 if quick else 9)
    kernel_s = await _exec_seconds(devs[0], lambda: devs[0].launch(progs[0], ys[0][0], xs[0][0], vals=(n, work)), 5)

    def where(b: int) -> tuple[int, int]:
        return b % len(devs), (b // len(devs)) % SLOTS

    async def one_by_one() -> None:
        for b in range(batches):
            d, s = where(b)
            await devs[d].copyin(xs[d][s], srcs[d])
            await devs[d].launch(progs[d], ys[d][s], xs[d][s], vals=(n, work))
            await devs[d].copyout(ys[d][s], dsts[d][s])

    async def pipelined() -> None:
        await double_buffered(devs, progs, xs, ys, srcs, dsts, (n, work), batches)

    for run in (one_by_one, pipelined):  # warm-up that checks the results
        for slots in dsts:
            for dst in slots:
                dst[:] = bytes(nbytes)
        await run()
        expected = [_expected(src[:2], work) for src in srcs]
        assert all(dst[:8] == expected[d] for d, slots in enumerate(dsts) for dst in slots), "wrong result"
    seq_s, pipe_s = [], []
    for _ in range(repeats):
        seq_s.append(await timed(one_by_one))
        pipe_s.append(await timed(pipelined))
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
