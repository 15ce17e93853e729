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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from aruntime import Device, Op, dtypes  # noqa: E402
from aruntime.device import BaseDevice  # noqa: E402
from aruntime.errors import DeviceError  # noqa: E402
from aruntime.scheduler import Scheduler  # noqa: E402
from benchmarks.bench_engine import BareWorker, _stream  # noqa: E402
from benchmarks.common import Benchmark, Result, interleaved, result, settings, timed  # noqa: E402

EMPTY = 'extern "C" __global__ void empty() {}'
SCALE = 'extern "C" __global__ void scale(float *y, const float *x, long long n, long long reps) {\n'
SCALE += "  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n"
SCALE += "  if (i < n) { float v = x[i]; for (long long r = 0; r < reps; r++) v = v * 0.5f + 1.0f; y[i] = v; }\n}\n"


def _open(*names: str) -> list[BaseDevice] | None:
    try:
        return [Device[name] for name in names]
    except DeviceError as exc:
        print(f"bench_cuda: skipped, {exc}", file=sys.stderr)
        return None


async def cuda_copies() -> list[Result]:
    """Pinned (and pageable) host-to-device and device-to-host GB/s."""
    devs = _open("CUDA")
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
            functools.partial(_stream, pinned, 1), functools.partial(_stream, pageable, 1), repeats
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
    devs = _open("CUDA")
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
    return [result("cuda_roundtrip", value, "us", baseline, ratio, "ratio <= 1.5", ratio <= 1.5)]


async def cuda_pipeline() -> list[Result]:
    """Copy-in -> kernel -> copy-out batches through a Scheduler against the ideal makespan."""
    devs = _open("CUDA")
    if devs is None:
        return []
    more = _open("CUDA:1")
    devs += more or []
    nbytes = (4 << 20) if settings.quick else (32 << 20)
    batches, repeats = (4, 1) if settings.quick else (24, 5)
    n = nbytes // 4
    progs = [(await d.compile(SCALE, "scale", outs=(0,))).sized(((n + 255) // 256,), (256,)) for d in devs]  # type: ignore[attr-defined]
    xs = [[await d.allocate(n, dtypes.float32) for _ in range(2)] for d in devs]
    ys = [[await d.allocate(n, dtypes.float32) for _ in range(2)] for d in devs]
    srcs: list[Any] = [d.pinned(nbytes) for d in devs]  # type: ignore[attr-defined]
    dsts: list[Any] = [[d.pinned(nbytes) for _ in range(2)] for d in devs]  # type: ignore[attr-defined]
    for src in srcs:
        src[:] = array.array("f", range(n)).tobytes()
    reps = 64
    plan: list[tuple[BaseDevice, bool, Callable[[], Op]]] = []
    for b in range(batches):
        d, s = b % len(devs), (b // len(devs)) % 2
        dev = devs[d]
        plan.append((dev, True, functools.partial(dev.copyin, xs[d][s], srcs[d])))
        plan.append((dev, False, functools.partial(dev.launch, progs[d], ys[d][s], xs[d][s], vals=(n, reps))))
        plan.append((dev, True, functools.partial(dev.copyout, ys[d][s], dsts[d][s])))
    op_s = [0.0] * len(plan)

    async def one_by_one() -> None:
        for i, (_, _, submit) in enumerate(plan):
            start = time.perf_counter()
            await submit()
            op_s[i] = time.perf_counter() - start

    async def pipelined() -> None:
        async with Scheduler(window=6 * len(devs)) as sched:
            for _, _, submit in plan:
                await _through(sched, submit)

    pipe_s, ideal_s = [], []
    await one_by_one()
    for _ in range(repeats):
        await one_by_one()
        queues: dict[tuple[str, bool], float] = {}
        for (dev, is_copy, _), took in zip(plan, op_s, strict=True):
            queues[dev.name, is_copy] = queues.get((dev.name, is_copy), 0.0) + took
        ideal_s.append(max(queues.values()))
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


async def _through(sched: Scheduler, submit: Callable[[], Op]) -> None:
    """Hand one of the plan's ops to the scheduler: its device method, by name, with the same arguments."""
    part = submit
    assert isinstance(part, functools.partial)
    method = getattr(sched, part.func.__name__)
    await method(*part.args, **part.keywords)


BENCHMARKS: list[Benchmark] = [cuda_copies, cuda_roundtrip, cuda_pipeline]


async def _main() -> None:
    for bench in BENCHMARKS:
        for row in await bench():
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    anyio.run(_main)
