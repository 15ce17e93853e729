"""Scheduler benchmarks: a copy/compute pipeline, a serving burst, and graph replay against eager submission.

* ``scheduler_pipeline``: batches of copy-in -> kernel -> copy-out over two CPU
  devices, the kernel calibrated in the same run so that it runs as long as one
  copy of the batch. Submitted through a :class:`Scheduler`, against the same
  ops awaited one by one, and against the ideal makespan: the larger of (the
  sum of every op's time / cores) and (the busiest queue's sum), each op's time
  being how long it took, submitted and awaited, in the one-by-one pass of the
  same repeat.
* ``scheduler_serving``: 1000 concurrent tasks, each copying its request in,
  launching a small kernel and awaiting the copied-out result (directly on the
  device, and through one shared :class:`Scheduler`), against the same memmoves
  and compiled C function called with ``anyio.to_thread.run_sync`` from 1000
  tasks; the same requests served through a :class:`~aruntime.batching.Batcher`
  that packs those that come together into one launch
  (``serving_batched_throughput``); and the same burst of tasks that only pass
  a checkpoint, the most any runtime could reach against that baseline
  (``serving_ceiling``).
* ``scheduler_graph_replay``: a 30-op sequence (10 x copy-in, launch, copy-out on
  tiny buffers) submitted through the device methods, against a replay of the
  same sequence captured as a :class:`Graph`; cost per op with many sequences
  in flight, and each sequence awaited before the next; on the CPU device and
  on the NULL device (pure runtime overhead).
"""

from __future__ import annotations

import array
import ctypes
import os
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from aruntime import Device, Op, dtypes
from aruntime.batching import Batcher
from aruntime.device import BaseDevice
from aruntime.graph import Graph
from aruntime.scheduler import Scheduler
from benchmarks.common import (
    Pipeline,
    Result,
    address,
    alternated,
    burst,
    calibrate,
    exec_seconds,
    percentile,
    result,
    settings,
)

# ---- shared helpers -------------------------------------------------------------------------------------------------


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


SPIN = r"""
#include <stdint.h>
void kernel(double *x, int64_t iters) {
  double v = x[0];
  for (int64_t i = 0; i < iters; i++) v = v * 0.5 + 1.0;
  x[0] = v;
}
"""


async def _parallel_ceiling(dev: BaseDevice) -> float:
    """How much faster two threads run a compute-bound C loop than one, right now.

    About 2 on two idle cores, about 1 while another process keeps one of them busy: no overlap of work across
    queues can beat it, so it is reported next to the pipeline's figures.
    """
    prog = await dev.compile(SPIN, outs=(0,))
    outs = [await dev.allocate(1, dtypes.float64) for _ in range(2)]
    for out in outs:
        await dev.copyin(out, array.array("d", [0.0]))
    iters = 2_000_000

    def spin(k: int) -> None:
        fn, args = prog.bind([outs[k].handle], [iters])
        fn(*args)

    def measure() -> float:
        start = time.perf_counter()
        spin(0)
        spin(1)
        serial = time.perf_counter() - start
        threads = [threading.Thread(target=spin, args=(k,)) for k in range(2)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return serial / (time.perf_counter() - start)

    return statistics.median([await anyio.to_thread.run_sync(measure) for _ in range(3)])


# ---- 1. pipeline ----------------------------------------------------------------------------------------------------

PASSES = r"""
#include <stdint.h>
#include <string.h>
#define BLOCK 2048
/* y = x after `work` multiply-adds per BLOCK elements, done on an L1-resident copy of each block (full passes, then
   a partial one): the memory traffic of one copy plus a run-time tunable amount of arithmetic. */
void kernel(float *y, const float *x, int64_t n, int64_t work) {
  float t[BLOCK] = {0};
  for (int64_t b = 0; b < n; b += BLOCK) {
    int64_t m = n - b < BLOCK ? n - b : BLOCK;
    memcpy(t, x + b, (size_t)m * sizeof(float));
    for (int64_t w = work; w > 0; w -= BLOCK) {
      int64_t k = w < BLOCK ? w : BLOCK;
      for (int64_t i = 0; i < k; i++) t[i] = t[i] * 0.5f + 1.0f;
    }
    memcpy(y + b, t, (size_t)m * sizeof(float));
  }
}
"""

BLOCK = 2048
"""The kernel's block of floats (``#define BLOCK``)."""
BATCH_BYTES = 2 << 20
"""Small enough that a device's buffers stay in cache: bigger copies are bound by memory bandwidth that two cores
share, so two of them at once take about as long as one after the other."""
WINDOW = 12
"""The pipeline scheduler's window: two batches (6 ops) per device in flight."""


async def scheduler_pipeline() -> list[Result]:
    """Copy-in -> kernel -> copy-out batches over CPU and CPU:1: overlap through a Scheduler vs one by one."""
    quick = settings.quick
    nbytes = (256 << 10) if quick else BATCH_BYTES
    batches = 6 if quick else 64
    repeats = 1 if quick else 7
    n = nbytes // 4
    devs = [Device["CPU"], Device["CPU:1"]]
    progs = [await d.compile(PASSES, outs=(0,)) for d in devs]
    line = await Pipeline.make(devs, progs, n, (n, 0), batches)
    x, y = line.xs[0][0], line.ys[0][0]
    work, copy_s = await calibrate(devs[0], progs[0], x, y, line.srcs[0], 3 if quick else 15, BLOCK)
    line.vals = (n, work)
    kernel_s = await exec_seconds(devs[0], lambda: devs[0].launch(progs[0], y, x, vals=(n, work)), 5)

    async def pipelined() -> None:
        await line.double_buffered(WINDOW)

    cores = _cores()
    ceiling = await _parallel_ceiling(devs[0])
    for run in (line.one_by_one, pipelined):  # warm-up that checks the results
        await line.checked(run, lambda first: _expected(first, work))
    ideal_s: list[float] = []  # per repeat: the larger of (every op's time / cores) and the busiest queue's sum

    def note_ideal() -> None:
        ideal_s.append(max(sum(line.op_s) / cores, line.busiest_queue_s()))

    seconds = await alternated({"seq": line.one_by_one, "pipe": pipelined}, repeats, note_ideal)
    seq_s, pipe_s = seconds["seq"], seconds["pipe"]
    speedup = statistics.median(seq / pipe for seq, pipe in zip(seq_s, pipe_s, strict=True))
    vs_ideal = statistics.median(pipe / ideal for pipe, ideal in zip(pipe_s, ideal_s, strict=True))
    pipe_ms = statistics.median(pipe_s) * 1e3
    extra = {
        "batches": batches,
        "batch_bytes": nbytes,
        "work_per_block": work,
        "copy_exec_us": copy_s * 1e6,
        "kernel_exec_us": kernel_s * 1e6,
        "cores": cores,
        "two_thread_speedup": ceiling,
        "repeats": repeats,
    }
    return [
        result(
            "pipeline_speedup",
            pipe_ms,
            "ms",
            statistics.median(seq_s) * 1e3,
            speedup,
            ">= 1.6x faster than one by one",
            speedup >= 1.6,
            **extra,
        ),
        result(
            "pipeline_makespan_vs_ideal",
            pipe_ms,
            "ms",
            statistics.median(ideal_s) * 1e3,
            vs_ideal,
            "<= 1.25x the ideal makespan",
            vs_ideal <= 1.25,
            **extra,
        ),
    ]


def _expected(x: Sequence[float], work: int) -> bytes:
    """What the pipeline kernel makes of the first elements ``x`` of a batch (fewer than BLOCK of them)."""
    out = array.array("f", x)
    for i in range(len(out)):
        v = out[i]
        for _ in range(work // BLOCK + (i < work % BLOCK)):
            v = array.array("f", [v * 0.5 + 1.0])[0]  # float32 rounding at every step, as the kernel does
        out[i] = v
    return out.tobytes()


# ---- 2. serving -----------------------------------------------------------------------------------------------------

SCALE = r"""
#include <stdint.h>
void kernel(float *out, const float *x, int64_t n, double s) {
  for (int64_t i = 0; i < n; i++) out[i] = x[i] * (float)s;
}
"""

TASKS = 1000
REQUEST = 256
"""Floats per request."""


async def scheduler_serving() -> list[Result]:
    """1000 concurrent copy-in -> launch -> copy-out requests vs the same calls through anyio.to_thread.run_sync."""
    quick = settings.quick
    repeats = 1 if quick else 7
    dev = Device["CPU"]
    prog = await dev.compile(SCALE, outs=(0,))
    n, nbytes = REQUEST, REQUEST * 4
    xs = [await dev.allocate(n, dtypes.float32) for _ in range(TASKS)]
    ys = [await dev.allocate(n, dtypes.float32) for _ in range(TASKS)]
    requests = [array.array("f", [float(i)] * n) for i in range(TASKS)]
    outs = [bytearray(nbytes) for _ in range(TASKS)]
    req_addr = [r.buffer_info()[0] for r in requests]
    out_addr = [address(o) for o in outs]
    memmove = ctypes.memmove

    async def runtime(i: int) -> None:
        dev.copyin(xs[i], requests[i])
        dev.launch(prog, ys[i], xs[i], vals=(n, 2.0))
        await dev.copyout(ys[i], outs[i])

    def call(i: int) -> None:
        x, y = xs[i].handle, ys[i].handle
        memmove(x, req_addr[i], nbytes)
        fn, args = prog.bind((y, x), (n, 2.0))
        fn(*args)
        memmove(out_addr[i], y, nbytes)

    async def threaded(i: int) -> None:
        await anyio.to_thread.run_sync(call, i)

    sched: Scheduler | None = None

    async def scheduled(i: int) -> None:
        assert sched is not None
        sched.copyin(xs[i], requests[i])
        sched.launch(prog, ys[i], xs[i], vals=(n, 2.0))
        await sched.copyout(ys[i], outs[i])

    async def scheduled_burst() -> tuple[float, list[float]]:
        nonlocal sched
        async with Scheduler() as sched:
            return await burst(TASKS, scheduled)

    # batched: the requests that come together are packed into one buffer, one launch and one copy-out
    xb, yb = await dev.allocate(TASKS * n, dtypes.float32), await dev.allocate(TASKS * n, dtypes.float32)
    stage_in, stage_out = memoryview(bytearray(TASKS * nbytes)), memoryview(bytearray(TASKS * nbytes))
    request_bytes = [memoryview(r).cast("B") for r in requests]

    async def run_batch(batch: list[int]) -> list[None]:
        k = len(batch)
        for j, i in enumerate(batch):
            stage_in[j * nbytes : (j + 1) * nbytes] = request_bytes[i]
        x, y = xb.view(k * n, dtypes.float32, 0), yb.view(k * n, dtypes.float32, 0)
        dev.copyin(x, stage_in[: k * nbytes])
        dev.launch(prog, y, x, vals=(k * n, 2.0))
        await dev.copyout(y, stage_out[: k * nbytes])
        for j, i in enumerate(batch):
            outs[i][:] = stage_out[j * nbytes : (j + 1) * nbytes]
        return [None] * k

    batcher: Batcher[int, None] | None = None

    async def batched(i: int) -> None:
        assert batcher is not None
        await batcher(i)

    async def batched_burst() -> tuple[float, list[float]]:
        nonlocal batcher
        async with Batcher(run_batch, max_batch=TASKS) as batcher:
            return await burst(TASKS, batched)

    async def harness(i: int) -> None:  # no request at all: what the burst itself costs
        await anyio.lowlevel.checkpoint()

    variants: dict[str, Callable[[], Awaitable[tuple[float, list[float]]]]] = {
        "runtime": lambda: burst(TASKS, runtime),
        "scheduler": scheduled_burst,
        "batched": batched_burst,
        "to_thread": lambda: burst(TASKS, threaded),
        "harness": lambda: burst(TASKS, harness),
    }
    for key, run in variants.items():  # warm-up (threads started, code paths hot) that checks every result
        for out in outs:
            out[:] = bytes(nbytes)
        await run()
        if key != "harness":
            assert all(set(array.array("f", out)) == {2.0 * i} for i, out in enumerate(outs)), f"{key}: wrong result"
    seconds: dict[str, list[float]] = {k: [] for k in variants}
    latencies: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for key, run in variants.items():
            took, lat = await run()
            seconds[key].append(took)
            latencies[key].extend(lat)

    def rps(key: str) -> float:
        return TASKS / statistics.median(seconds[key])

    def ms(key: str, q: float) -> float:
        return percentile(latencies[key], q) * 1e3

    base_rps = rps("to_thread")
    base_lat = {"baseline_p50_ms": ms("to_thread", 50), "baseline_p99_ms": ms("to_thread", 99)}
    common = {"tasks": TASKS, "request_bytes": nbytes, "repeats": repeats}

    def throughput(key: str, name: str, per_request: bool) -> Result:
        """``key``'s req/s row; the 10x goal is for a launch per request, the batched row only reports."""
        ratio = rps(key) / base_rps
        goal, passed = (">= 10x to_thread", ratio >= 10) if per_request else ("report only", None)
        ours_lat = {"p50_ms": ms(key, 50), "p99_ms": ms(key, 99)}
        return result(name, rps(key), "req/s", base_rps, ratio, goal, passed, **ours_lat, **base_lat, **common)

    rows: list[Result] = []
    for key, label in (("runtime", "serving"), ("scheduler", "serving_sched")):
        rows.append(throughput(key, f"{label}_throughput", True))
        for q in (50, 99):
            ours, theirs = ms(key, q), ms("to_thread", q)
            rows.append(result(f"{label}_p{q}", ours, "ms", theirs, theirs / ours, "report only", None, **common))
    rows.append(throughput("batched", "serving_batched_throughput", False))
    ceiling = rps("harness") / base_rps  # the ratio a runtime that cost nothing would reach
    rows.append(result("serving_ceiling", rps("harness"), "req/s", base_rps, ceiling, "report only", None, **common))
    await dev.free(xb)
    await dev.free(yb)
    return rows


# ---- 3. graph replay vs eager ---------------------------------------------------------------------------------------

CHAIN = 10
"""Copy-in, launch, copy-out triples in the sequence (3 ops each)."""
TINY = 16
"""Floats per buffer."""


async def _replay_vs_eager(dev: BaseDevice, iterations: int, repeats: int) -> dict[str, float]:
    """Microseconds per op of each variant (see :func:`scheduler_graph_replay`)."""
    prog = await dev.compile(SCALE, outs=(0,))
    xs = [await dev.allocate(TINY, dtypes.float32) for _ in range(CHAIN)]
    ys = [await dev.allocate(TINY, dtypes.float32) for _ in range(CHAIN)]
    srcs = [array.array("f", [float(k)] * TINY) for k in range(CHAIN)]
    dsts = [bytearray(TINY * 4) for _ in range(CHAIN)]
    graph = Graph()
    for k in range(CHAIN):
        graph.copyin(xs[k], f"x{k}")
        graph.launch(prog, ys[k], xs[k], vals=(TINY, 2.0))
        graph.copyout(ys[k], f"y{k}")
    inputs: dict[str, Any] = {f"x{k}": srcs[k] for k in range(CHAIN)} | {f"y{k}": dsts[k] for k in range(CHAIN)}

    def sequence() -> list[Op]:
        outs = []
        for k in range(CHAIN):
            dev.copyin(xs[k], srcs[k])
            dev.launch(prog, ys[k], xs[k], vals=(TINY, 2.0))
            outs.append(dev.copyout(ys[k], dsts[k]))
        return outs

    async def eager() -> None:  # every sequence submitted, then every copy-out awaited
        outs = [op for _ in range(iterations) for op in sequence()]
        for op in outs:
            await op

    async def replay() -> None:  # every replay submitted, then each awaited
        runs = [graph.replay(**inputs) for _ in range(iterations)]
        for run in runs:
            await run

    async def eager_each() -> None:  # one sequence at a time: submitted, then awaited
        for _ in range(iterations):
            for op in sequence():
                await op

    async def replay_each() -> None:
        for _ in range(iterations):
            await graph.replay(**inputs)

    async def scheduled() -> None:
        async with Scheduler() as sched:
            for _ in range(iterations):
                outs = []
                for k in range(CHAIN):
                    sched.copyin(xs[k], srcs[k])
                    sched.launch(prog, ys[k], xs[k], vals=(TINY, 2.0))
                    outs.append(sched.copyout(ys[k], dsts[k]))
                for op in outs:
                    await op

    variants = {
        "replay": replay,
        "eager": eager,
        "replay_each": replay_each,
        "eager_each": eager_each,
        "scheduled": scheduled,
    }
    for run in variants.values():  # warm-up that checks the results (the NULL device copies nothing)
        for dst in dsts:
            dst[:] = bytes(TINY * 4)
        await run()
        if dev.kind != "NULL":
            assert all(set(array.array("f", dst)) == {2.0 * k} for k, dst in enumerate(dsts)), "wrong result"
    seconds = await alternated(variants, repeats)
    return {name: statistics.median(v) * 1e6 / (iterations * CHAIN * 3) for name, v in seconds.items()}


async def scheduler_graph_replay() -> list[Result]:
    """Per-op cost of a 30-op sequence: graph replay vs eager submission, on CPU (tiny buffers) and NULL."""
    quick = settings.quick
    iterations = 10 if quick else 300
    repeats = 1 if quick else 9
    rows = []
    for label, name in (("graph_replay_cpu", "CPU"), ("graph_replay_null", "NULL")):
        us = await _replay_vs_eager(Device[name], iterations, repeats)
        ratio = us["eager"] / us["replay"]
        rows.append(
            result(
                label,
                us["replay"],
                "us/op",
                us["eager"],
                ratio,
                ">= 3x cheaper than eager",
                ratio >= 3,
                awaited_each_us_per_op=us["replay_each"],
                eager_awaited_each_us_per_op=us["eager_each"],
                eager_sched_us_per_op=us["scheduled"],
                ops=CHAIN * 3,
                iterations=iterations,
                repeats=repeats,
            )
        )
    return rows


BENCHMARKS = [scheduler_pipeline, scheduler_serving, scheduler_graph_replay]
