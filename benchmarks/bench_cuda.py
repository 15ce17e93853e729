"""The CUDA device's figures, rows named ``cuda_*`` (a machine where CUDA does not open gets no rows).

* ``cuda_h2d`` / ``cuda_d2h``: ``copyin``/``copyout`` of 256 MiB from and to pinned host memory
  (:meth:`CUDADevice.pinned`) in GB/s, against 40 GB/s (about 75% of PCIe Gen5 x16); the
  pageable (staged) figures are reported with them.
* ``cuda_roundtrip``: ``await dev.launch(empty kernel)`` against a bare wake: a thread that records
  a blocking-sync event on a stream of its own, waits for it in ``cuEventSynchronize`` and wakes a
  future on the loop (time per round trip; goal <= 1.5x).
* ``cuda_pipeline``: copy-in -> kernel -> copy-out batches through a :class:`Scheduler` on CUDA
  (and CUDA:1 when there is one), against the ideal makespan: the busiest queue's sum of the
  op times measured one by one (goal <= 1.15x).

Run it alone with ``python benchmarks/bench_cuda.py`` (one JSON object per line), or through
``benchmarks/run.py --only cuda_roundtrip`` and the like.
"""

from __future__ import annotations

import array
import functools
import json
import statistics
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from aruntime import dtypes  # noqa: E402
from benchmarks.common import (  # noqa: E402
    SLOTS,
    BareWorker,
    Benchmark,
    Pipeline,
    Result,
    interleaved,
    open_devices,
    ratio_goal,
    result,
    settings,
    stream,
    timed,
)

EMPTY = 'extern "C" __global__ void empty() {}'
SCALE = 'extern "C" __global__ void scale(float *y, const float *x, long long n, long long reps) {\n'
SCALE += "  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n"
SCALE += "  if (i < n) { float v = x[i]; for (long long r = 0; r < reps; r++) v = v * 0.5f + 1.0f; y[i] = v; }\n}\n"


async def cuda_copies() -> list[Result]:
    """Pinned (and pageable) host-to-device and device-to-host GB/s."""
    devs = open_devices("bench_cuda", "CUDA")
    if devs is None:
        return []
    dev: Any = devs[0]
    size = (16 << 20) if settings.quick else (256 << 20)
    repeats = 2 if settings.quick else 7
    buf = await dev.allocate(size)
    pinned_in, pinned_out = dev.pinned(size), dev.pinned(size)
    pageable_in, pageable_out = bytearray(b"\x5a") * size, bytearray(size)
    rows: list[Result] = []
    for direction, pinned, pageable in (
        ("h2d", functools.partial(dev.copyin, buf, pinned_in), functools.partial(dev.copyin, buf, pageable_in)),
        ("d2h", functools.partial(dev.copyout, buf, pinned_out), functools.partial(dev.copyout, buf, pageable_out)),
    ):
        pinned_s, pageable_s = await interleaved(
            functools.partial(stream, pinned, 1), functools.partial(stream, pageable, 1), repeats
        )
        value, staged = size / pinned_s / 1e9, size / pageable_s / 1e9
        rows.append(
            result(f"cuda_{direction}", value, "GB/s", 40.0, value / 40.0, ">= 40 GB/s", value >= 40.0, pageable=staged)
        )
    await dev.free(buf)
    return rows


def _bare_wake(dev: Any) -> Callable[[], Any]:
    """A thread of its own that, per request, records a blocking-sync event, waits in cuEventSynchronize
    and resolves the request's future; returns the function that submits one and gives its future."""
    import queue as queues

    from cuda.core import EventOptions

    from aruntime.backends.cuda import wait_event

    requests: queues.SimpleQueue[Any] = queues.SimpleQueue()
    stream = dev.cu.create_stream()
    options = EventOptions(timing_enabled=False, blocking_sync=True)
    worker = BareWorker()  # its loop wake-up path

    def run() -> None:
        dev.cu.set_current()
        while (fut := requests.get()) is not None:
            wait_event(stream.record(options=options))
            worker._call_soon(fut.set_result, None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def one() -> Any:
        fut = worker.future()
        requests.put(fut)
        return fut

    def close() -> None:
        requests.put(None)
        thread.join()
        worker.close()

    one.close = close  # type: ignore[attr-defined]
    return one


async def cuda_roundtrip() -> list[Result]:
    """Awaited empty kernel against a bare cuEventSynchronize wake of a future."""
    devs = open_devices("bench_cuda", "CUDA")
    if devs is None:
        return []
    dev: Any = devs[0]
    n, repeats = (50, 3) if settings.quick else (1000, 9)
    prog = await dev.compile(EMPTY, "empty")
    bare = _bare_wake(dev)

    async def ours() -> None:
        for _ in range(n):
            await dev.launch(prog)

    async def base() -> None:
        for _ in range(n):
            await bare()

    try:
        ours_s, base_s = await interleaved(ours, base, repeats)
    finally:
        bare.close()  # type: ignore[attr-defined]
    value, baseline = ours_s / n * 1e6, base_s / n * 1e6
    ratio = value / baseline
    return [result("cuda_roundtrip", value, "us", baseline, ratio, *ratio_goal(ratio, "<=", 1.5))]


async def cuda_pipeline() -> list[Result]:
    """Copy-in -> kernel -> copy-out batches through a Scheduler against the ideal makespan."""
    devs = open_devices("bench_cuda", "CUDA")
    if devs is None:
        return []
    more = open_devices("bench_cuda", "CUDA:1")
    devs += more or []
    nbytes = (4 << 20) if settings.quick else (32 << 20)
    batches, repeats = (4, 1) if settings.quick else (24, 5)
    n = nbytes // 4
    progs = [(await d.compile(SCALE, "scale", outs=(0,))).sized(((n + 255) // 256,), (256,)) for d in devs]  # type: ignore[attr-defined]
    xs = [[await d.allocate(n, dtypes.float32) for _ in range(SLOTS)] for d in devs]
    ys = [[await d.allocate(n, dtypes.float32) for _ in range(SLOTS)] for d in devs]
    srcs: list[Any] = [d.pinned(nbytes) for d in devs]  # type: ignore[attr-defined]
    dsts: list[Any] = [[d.pinned(nbytes) for _ in range(SLOTS)] for d in devs]  # type: ignore[attr-defined]
    for src in srcs:
        src[:] = array.array("f", range(n)).tobytes()
    line = Pipeline(devs, progs, xs, ys, srcs, dsts, (n, 64), batches)

    async def pipelined() -> None:
        await line.in_order(window=6 * len(devs))

    pipe_s, ideal_s = [], []
    await line.one_by_one()
    for _ in range(repeats):
        await line.one_by_one()
        ideal_s.append(line.busiest_queue_s())
        pipe_s.append(await timed(pipelined))
    vs_ideal = statistics.median(p / i for p, i in zip(pipe_s, ideal_s, strict=True))
    return [
        result(
            "cuda_pipeline_makespan_vs_ideal",
            statistics.median(pipe_s) * 1e3,
            "ms",
            statistics.median(ideal_s) * 1e3,
            vs_ideal,
            "<= 1.15x the ideal makespan",
            vs_ideal <= 1.15,
            devices=len(devs),
            batches=batches,
            batch_bytes=nbytes,
        )
    ]


BENCHMARKS: list[Benchmark] = [cuda_copies, cuda_roundtrip, cuda_pipeline]


async def _main() -> None:
    for bench in BENCHMARKS:
        for row in await bench():
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    anyio.run(_main)
