"""RAY devices against bare Ray, on a local cluster (``ray.init(num_cpus=2)``) started by the first benchmark.

* ``ray_launch_overhead``: one awaited empty launch on a RAY device against one awaited call of an empty
  method of a bare async actor (goal <= 1.3x).
* ``ray_pipeline``: a two-stage pipeline (kernel, transfer, kernel) over two RAY devices against the same
  pipeline over one (goal >= 1.6x faster), and against the same two-device pipeline on local CPU devices
  (the row's ``local_two_vs_one_speedup`` is what two local devices gain over one in the same run).
* ``ray_transfer``: bytes/s of a transfer between two RAY devices against a bare ``ray.put`` in one actor and
  ``ray.get`` (into memory it owns) in another, of the same size (goal >= 0.8).

Without ray installed, ``BENCHMARKS`` is empty.
"""

from __future__ import annotations

import asyncio
import importlib.util
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

import aruntime
from aruntime import Device, dtypes
from aruntime.backends.ray.driver import settled
from aruntime.device import BaseDevice, Program
from aruntime.scheduler import Scheduler
from benchmarks.common import Benchmark, Result, interleaved, loop_independent, result, settings

SPIN = r"""
#include <stdint.h>
/* out[i] = x[i] pushed through `work` dependent multiply-adds per element (a kernel of adjustable length) */
void kernel(float *out, const float *x, int64_t n, int64_t work) {
  for (int64_t i = 0; i < n; i++) {
    float v = x[i];
    for (int64_t k = 0; k < work; k++) v = v * 0.999f + 0.001f;
    out[i] = v;
  }
}
"""
EMPTY = "void kernel(void) {}"


def _cluster() -> Any:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return ray


class _Bare:
    """The baseline actor: an empty method, and a put in one actor / a get into owned memory in another."""

    def __init__(self, nbytes: int) -> None:
        self.data = bytearray(nbytes)

    async def noop(self) -> None:
        return None

    async def put(self) -> list[Any]:
        import ray

        return [ray.put(pickle.PickleBuffer(self.data))]

    async def get(self, box: list[Any]) -> None:

        memoryview(self.data)[:] = memoryview(await box[0]).cast("B")


_actors: dict[int, Any] = {}


def _bare(nbytes: int, which: int) -> Any:
    ray = _cluster()
    key = nbytes * 2 + which
    if key not in _actors:
        _actors[key] = ray.remote(_Bare).options(num_cpus=0).remote(nbytes)
    return _actors[key]


async def _await_ref(ref: Any) -> Any:
    """An ObjectRef's value on any loop: ``await ref`` on asyncio, the thread-safe callback path on trio."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # trio, which cannot await a ref
        future = ref.future()
        await settled(future)
        return future.result()
    return await ref


async def _many(count: int, one: Callable[[], Awaitable[object]]) -> None:
    for _ in range(count):
        await one()


async def ray_launch_overhead() -> list[Result]:
    """An awaited empty remote launch vs an awaited call of a bare actor's empty method."""
    _cluster()
    dev = Device["RAY:any/CPU:1"]
    prog = await dev.compile(EMPTY)
    actor = _bare(1, 0)
    count, repeats = (20, 1) if settings.quick else (200, 7)

    async def ours() -> None:
        await _many(count, lambda: dev.launch(prog))

    async def base() -> None:
        await _many(count, lambda: _await_ref(actor.noop.remote()))

    ours_s, base_s = await interleaved(ours, base, repeats)
    ratio = ours_s / base_s
    return [
        result(
            "ray_launch_overhead",
            ours_s / count * 1e6,
            "us/op",
            base_s / count * 1e6,
            ratio,
            "<= 1.3x a bare actor call",
            ratio <= 1.3,
            calls=count,
            repeats=repeats,
        )
    ]


async def _pipeline(
    stage1: tuple[BaseDevice, Program], stage2: tuple[BaseDevice, Program], items: int, n: int, work: int
) -> Callable[[], Awaitable[None]]:
    """A run of the pipeline: copy-in, kernel on stage 1, transfer, kernel on stage 2, copy-out per item."""
    (d1, p1), (d2, p2) = stage1, stage2
    slots = 3
    xs = [await d1.allocate(n, dtypes.float32) for _ in range(slots)]
    ys = [await d1.allocate(n, dtypes.float32) for _ in range(slots)]
    zs = [await d2.allocate(n, dtypes.float32) for _ in range(slots)]
    ws = [await d2.allocate(n, dtypes.float32) for _ in range(slots)]
    src = bytes(4 * n)
    outs = [bytearray(4 * n) for _ in range(slots)]

    async def run() -> None:
        async with Scheduler(window=64) as sched:
            for i in range(items):
                s = i % slots
                sched.copyin(xs[s], src)
                sched.launch(p1, ys[s], xs[s], vals=(n, work))
                sched.transfer(zs[s], ys[s])
                sched.launch(p2, ws[s], zs[s], vals=(n, work))
                sched.copyout(ws[s], outs[s])

    return run


@loop_independent
async def ray_pipeline() -> list[Result]:
    """The pipeline over two RAY devices vs over one, and vs over two local CPU devices."""
    _cluster()
    quick = settings.quick
    items, repeats = (4, 1) if quick else (16, 5)
    n, work = 4096, 200 if quick else 2000  # about 10 ms a kernel here when not quick
    devs = {name: Device[name] for name in ("RAY:any/CPU:1", "RAY:any/CPU:2", "CPU:1", "CPU:2")}
    progs = {name: await dev.compile(SPIN, outs=(0,)) for name, dev in devs.items()}

    def stage(name: str) -> tuple[BaseDevice, Program]:
        return devs[name], progs[name]

    one = await _pipeline(stage("RAY:any/CPU:1"), stage("RAY:any/CPU:1"), items, n, work)
    two = await _pipeline(stage("RAY:any/CPU:1"), stage("RAY:any/CPU:2"), items, n, work)
    local = await _pipeline(stage("CPU:1"), stage("CPU:2"), items, n, work)
    local_one = await _pipeline(stage("CPU:1"), stage("CPU:1"), items, n, work)
    one_s, two_s = await interleaved(one, two, repeats)
    local_s, local_one_s = await interleaved(local, local_one, 1 if quick else 3)
    speedup = one_s / two_s
    extra = {
        "items": items,
        "elements": n,
        "work": work,
        "repeats": repeats,
        "local_two_vs_one_speedup": local_one_s / local_s,  # what the machine's cores allow right now
    }
    return [
        result(
            "ray_pipeline_two_hosts",
            two_s * 1e3,
            "ms",
            one_s * 1e3,
            speedup,
            ">= 1.6x faster than one remote device",
            speedup >= 1.6,
            **extra,
        ),
        result(
            "ray_pipeline_vs_local",
            two_s * 1e3,
            "ms",
            local_s * 1e3,
            two_s / local_s,
            "none (two RAY devices vs two local CPU devices)",
            None,
            **extra,
        ),
    ]


@loop_independent
async def ray_transfer() -> list[Result]:
    """Bytes/s of a RAY-to-RAY transfer vs a bare put in one actor and get in another."""
    _cluster()
    nbytes, repeats = (1 << 20, 1) if settings.quick else (64 << 20, 7)
    r1, r2 = Device["RAY:any/CPU:1"], Device["RAY:any/CPU:2"]
    src, dst = await r1.allocate(nbytes), await r2.allocate(nbytes)
    await r1.copyin(src, bytes(nbytes))
    a, b = _bare(nbytes, 0), _bare(nbytes, 1)

    async def ours() -> None:
        await aruntime.transfer(dst, src)

    async def base() -> None:
        await _await_ref(b.get.remote(a.put.remote()))

    ours_s, base_s = await interleaved(ours, base, repeats)
    await r1.free(src)
    await r2.free(dst)
    ratio = base_s / ours_s
    return [
        result(
            "ray_transfer",
            nbytes / ours_s / 1e9,
            "GB/s",
            nbytes / base_s / 1e9,
            ratio,
            ">= 0.8x a bare put/get",
            ratio >= 0.8,
            nbytes=nbytes,
            repeats=repeats,
        )
    ]


BENCHMARKS: list[Benchmark] = (
    [ray_launch_overhead, ray_pipeline, ray_transfer] if importlib.util.find_spec("ray") is not None else []
)
