"""RAY devices against bare Ray, on a local cluster of three nodes started by the first benchmark (see
:func:`_cluster`): the single-node rows run on its head node, ``ray_transfer_nodes`` between its two others.

* ``ray_launch_overhead``: one awaited empty launch on a RAY device against one awaited call of an empty
  method of a bare async actor (goal <= 1.3x).
* ``ray_pipeline``: a two-stage pipeline (kernel, transfer, kernel) over two RAY devices against the same
  pipeline over one (goal >= 1.6x faster), and against the same two-device pipeline on local CPU devices
  (the row's ``local_two_vs_one_speedup`` is what two local devices gain over one in the same run).
* ``ray_pipeline_sim_nodes``: the same pipeline over SIM devices on two nodes (``RAY:n1/SIM:1`` then
  ``RAY:n2/SIM:1``) against it over one SIM device (``RAY:n1/SIM:1``): modelled kernels of
  :data:`SIM_KERNEL_S`, no CPU contention (goal >= 1.8x faster).
* ``ray_transfer``: bytes/s of a transfer between two RAY devices against a bare ``ray.put`` in one actor and
  ``ray.get`` (into memory it owns) in another, of the same size (goal >= 0.8), all on one node.
* ``ray_transfer_nodes``: the same from a RAY device on node ``n1`` to one on node ``n2`` (each with its own
  raylet and object store), against the bare put on ``n1`` and get on ``n2`` (goal >= 0.8).

Without ray installed, ``BENCHMARKS`` is empty.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import os
import pickle
from collections.abc import Awaitable, Callable
from pathlib import Path
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


STORE = 256 << 20
"""Each node's object store, bytes."""
SIM_KERNEL_S = 5e-3
"""The modelled seconds of a kernel on the cluster's SIM devices (``ARUNTIME_SIM_KERNEL`` of its nodes)."""
SIM_SLOTS = 8
"""Items in flight in the SIM pipeline: enough to cover a transfer's trip between nodes."""


def _cluster() -> Any:
    """Ray, joined to a local cluster of three nodes on this machine (started once): ``head`` (2 CPUs), where
    the single-node rows' devices run, and ``n1`` and ``n2`` (no CPUs), each with its own raylet and object
    store, for the node-to-node row. Its workers import the same aruntime as this process."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        return ray
    root = str(Path(aruntime.__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    os.environ["ARUNTIME_SIM_KERNEL"] = repr(SIM_KERNEL_S)  # the nodes' SIM devices (none opens here)
    head = {"num_cpus": 2, "node_name": "head", "object_store_memory": STORE, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for name in ("n1", "n2"):
        cluster.add_node(num_cpus=0, node_name=name, object_store_memory=STORE)
    cluster.wait_for_nodes()
    atexit.register(cluster.shutdown)
    ray.init(address=cluster.address, log_to_driver=False)
    atexit.register(ray.shutdown)  # runs first: the driver leaves before its cluster ends
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


_actors: dict[tuple[int, int, str], Any] = {}


def _bare(nbytes: int, which: int, node: str = "head") -> Any:
    """A bare actor (``which`` tells apart two of one size) on the node named ``node``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from aruntime.backends.ray import nodes

    ray = _cluster()
    key = (nbytes, which, node)
    if key not in _actors:
        node_id = next(n.id for n in nodes() if n.name == node)
        where = NodeAffinitySchedulingStrategy(node_id, soft=False)
        _actors[key] = ray.remote(_Bare).options(num_cpus=0, scheduling_strategy=where).remote(nbytes)
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
    dev = Device["RAY:head/CPU:1"]
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
    stage1: tuple[BaseDevice, Program],
    stage2: tuple[BaseDevice, Program],
    items: int,
    n: int,
    work: int,
    slots: int = 3,
) -> Callable[[], Awaitable[None]]:
    """A run of the pipeline: copy-in, kernel on stage 1, transfer, kernel on stage 2, copy-out per item, with
    ``slots`` sets of buffers in turn (the items in flight)."""
    (d1, p1), (d2, p2) = stage1, stage2
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
    devs = {name: Device[name] for name in ("RAY:head/CPU:1", "RAY:head/CPU:2", "CPU:1", "CPU:2")}
    progs = {name: await dev.compile(SPIN, outs=(0,)) for name, dev in devs.items()}

    def stage(name: str) -> tuple[BaseDevice, Program]:
        return devs[name], progs[name]

    one = await _pipeline(stage("RAY:head/CPU:1"), stage("RAY:head/CPU:1"), items, n, work)
    two = await _pipeline(stage("RAY:head/CPU:1"), stage("RAY:head/CPU:2"), items, n, work)
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
async def ray_pipeline_sim_nodes() -> list[Result]:
    """The pipeline over SIM devices on two nodes vs over one SIM device: overlap without CPU contention."""
    _cluster()
    items, repeats = (4, 1) if settings.quick else (24, 5)
    n = 4096
    devs = {name: Device[name] for name in ("RAY:n1/SIM:1", "RAY:n2/SIM:1")}
    progs = {name: await dev.compile(SPIN, outs=(0,)) for name, dev in devs.items()}

    def stage(name: str) -> tuple[BaseDevice, Program]:
        return devs[name], progs[name]

    one = await _pipeline(stage("RAY:n1/SIM:1"), stage("RAY:n1/SIM:1"), items, n, 0, SIM_SLOTS)
    two = await _pipeline(stage("RAY:n1/SIM:1"), stage("RAY:n2/SIM:1"), items, n, 0, SIM_SLOTS)
    one_s, two_s = await interleaved(one, two, repeats)
    speedup = one_s / two_s
    return [
        result(
            "ray_pipeline_sim_nodes",
            two_s * 1e3,
            "ms",
            one_s * 1e3,
            speedup,
            ">= 1.8x faster than one SIM device",
            speedup >= 1.8,
            items=items,
            kernel_s=SIM_KERNEL_S,
            ideal_speedup=2.0,
        )
    ]


async def _transfer(name: str, first: str, second: str, nodes: tuple[str, str]) -> list[Result]:
    """Bytes/s of a transfer from RAY device ``first`` to ``second`` vs a bare put in an actor on the first
    of ``nodes`` and a get in one on the second."""
    _cluster()
    nbytes, repeats = (1 << 20, 1) if settings.quick else (64 << 20, 7)
    r1, r2 = Device[first], Device[second]
    src, dst = await r1.allocate(nbytes), await r2.allocate(nbytes)
    await r1.copyin(src, bytes(nbytes))
    a, b = _bare(nbytes, 0, nodes[0]), _bare(nbytes, 1, nodes[1])

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
            name,
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


@loop_independent
async def ray_transfer() -> list[Result]:
    """Bytes/s of a RAY-to-RAY transfer within one node vs a bare put in one actor and get in another."""
    return await _transfer("ray_transfer", "RAY:head/CPU:1", "RAY:head/CPU:2", ("head", "head"))


@loop_independent
async def ray_transfer_nodes() -> list[Result]:
    """Bytes/s of a RAY-to-RAY transfer from node n1 to node n2 vs a bare put on n1 and get on n2."""
    return await _transfer("ray_transfer_nodes", "RAY:n1/CPU", "RAY:n2/CPU", ("n1", "n2"))


BENCHMARKS: list[Benchmark] = (
    [ray_launch_overhead, ray_pipeline, ray_pipeline_sim_nodes, ray_transfer, ray_transfer_nodes]
    if importlib.util.find_spec("ray") is not None
    else []
)
