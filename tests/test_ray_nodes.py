"""RAY devices across the nodes of a local multi-node cluster (``ray.cluster_utils.Cluster``: a head and two
more nodes on this machine, each with its own raylet and object store), started once for the module."""

from __future__ import annotations

import array
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aruntime

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'aruntime[ray]')")

from ray.cluster_utils import Cluster  # noqa: E402

from aruntime import DependencyError, Device, DeviceError, DeviceLost, dtypes  # noqa: E402
from aruntime.backends.ray import RemoteDevice, devices, nodes  # noqa: E402
from aruntime.events import RangeEvent  # noqa: E402
from aruntime.profile import profile  # noqa: E402
from aruntime.scheduler import Scheduler  # noqa: E402
from tests.kernels import ADD_ONE, SCALE, SLEEP  # noqa: E402

pytestmark = pytest.mark.anyio

LONG_MS = 3000
"""A kernel this long is still running when a test removes its node right after launching it."""
STORE = 80 << 20
"""Each node's object store, bytes (near Ray's minimum: the machine is small)."""


class LocalCluster:
    """The module's cluster: nodes by their Ray node name, and replacing one (remove it, start a new one)."""

    def __init__(self) -> None:
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "node_name": "head",
                "object_store_memory": STORE,
                "include_dashboard": False,
                "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
            },
        )
        self.nodes: dict[str, Any] = {}
        for name in ("n1", "n2"):
            self.add(name)

    def add(self, name: str) -> None:
        self.nodes[name] = self.cluster.add_node(num_cpus=1, node_name=name, object_store_memory=STORE)
        self.cluster.wait_for_nodes()

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name))


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # The nodes' workers import the same aruntime as this process: the raylets inherit the environment.
    root = str(Path(aruntime.__file__).resolve().parents[1])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, saved) if p)
    local = LocalCluster()
    try:
        ray.init(address=local.cluster.address, log_to_driver=False)
        yield local
    finally:
        for dev in list(Device.devices()):
            if isinstance(dev, RemoteDevice):
                dev.close()
        ray.shutdown()
        local.cluster.shutdown()
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def close_lost() -> None:
    """Close the RAY devices whose node is gone (a removed node takes every device on it, other tests' too)."""
    live = {n.id for n in nodes()}
    for dev in list(Device.devices()):
        if isinstance(dev, RemoteDevice) and dev.host["node"] not in live:
            dev.close()


def node_of(name: str) -> str:
    return next(n.id for n in nodes() if n.node_name == name)


def floats(data: Any) -> list[float]:
    return array.array("f", bytes(data)).tolist()


def test_nodes_are_named_and_their_devices_listed(cluster: LocalCluster) -> None:
    found = nodes()
    assert sorted(n.name for n in found) == ["head", "n1", "n2"]
    assert len({n.id for n in found}) == 3 and len({n.address for n in found}) == 1  # one machine
    assert devices(kinds=("CPU", "sim:1")) == [f"RAY:{n.name}/{k}" for n in found for k in ("CPU", "SIM:1")]
    listed = devices()
    for name in ("head", "n1", "n2"):
        assert {f"RAY:{name}/CPU", f"RAY:{name}/SIM"} <= set(listed), listed

    @ray.remote(num_cpus=0)
    def where() -> str:
        return str(Path(aruntime.__file__).resolve())

    on_n1 = ray.get(where.options(scheduling_strategy=_on(node_of("n1"))).remote())
    assert on_n1 == str(Path(aruntime.__file__).resolve()), "the nodes' workers import another aruntime"

    n1 = node_of("n1")
    by_prefix = Device[f"RAY:{n1[:8]}/CPU:7"]  # a node id prefix of 8 hex digits names the node
    assert by_prefix.host["node"] == n1
    by_prefix.close()
    address = found[0].address
    with pytest.raises(DeviceError, match=rf"'{address}' names 3 live Ray nodes .*prefix of its id"):
        Device[f"RAY:{address}/CPU"]
    with pytest.raises(DeviceError, match=r"no live Ray node is 'n9'; live nodes: .*head \("):
        Device["RAY:n9/CPU"]
    with pytest.raises(TypeError, match="kinds must be a sequence"):
        devices(kinds="CPU")
    with pytest.raises(DeviceError, match="cannot itself be a RAY device"):
        devices(kinds=("RAY:n1/CPU",))


def _on(node: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node, soft=False)


async def test_a_pipeline_over_two_nodes_through_the_object_store(cluster: LocalCluster) -> None:
    """Items go driver -> n1 (x2) -> n2 (+1 per byte) -> driver; the transfers go node to node, small ones
    inline in an answer, big ones (over 100 KiB) through the object stores."""
    r1, r2 = Device["RAY:n1/CPU"], Device["RAY:n2/CPU"]
    assert r1.host["node"] == node_of("n1") and r2.host["node"] == node_of("n2")
    scale = await r1.compile(SCALE, outs=(0,))
    add = await r2.compile(ADD_ONE)
    for n in (64, 64 << 10):  # 256 B and 256 KiB of floats
        ring = 2
        xs = [await r1.allocate(n, dtypes.float32) for _ in range(ring)]
        ys = [await r1.allocate(n, dtypes.float32) for _ in range(ring)]
        zs = [await r2.allocate(n, dtypes.float32) for _ in range(ring)]
        outs = []
        async with Scheduler(window=16) as sched:
            for i in range(6):
                x, y, z = xs[i % ring], ys[i % ring], zs[i % ring]
                sched.copyin(x, array.array("f", [float(i)] * n))
                sched.launch(scale, y, x, vals=(n, 2.0))
                sched.transfer(z, y)
                sched.launch(add, z, vals=(4 * n,))
                outs.append(sched.copyout(z))
        with anyio.fail_after(60):
            for i, op in enumerate(outs):
                expected = bytes(b + 1 for b in array.array("f", [2.0 * i] * n).tobytes())
                assert bytes(await op) == expected, (n, i)
        for buf in xs + ys:
            await r1.free(buf)
        for buf in zs:
            await r2.free(buf)


async def test_sim_devices_on_remote_nodes_one_lane_group_per_device(cluster: LocalCluster) -> None:
    s1, s1b, s2 = Device["RAY:n1/SIM:1"], Device["RAY:n1/SIM:2"], Device["RAY:n2/SIM:1"]
    assert s1.host["node"] == s1b.host["node"] == node_of("n1") and s2.host["node"] == node_of("n2")
    assert s1.inner == "SIM:1"
    add = await s2.compile(ADD_ONE)
    n = 200 << 10
    a, b, c = await s1.allocate(n), await s1b.allocate(n), await s2.allocate(n)
    data = bytes(range(256)) * (n // 256)
    async with profile() as prof:
        s1.copyin(a, data)
        aruntime.transfer(b, a)  # two devices of one node: still node to node through the object store
        aruntime.transfer(c, b)  # n1 -> n2
        s2.launch(add, c, vals=(n,))
        with anyio.fail_after(60):
            assert bytes(await s2.copyout(c)) == bytes((x + 1) & 255 for x in data)
    ranges = {(e.device, e.name) for e in prof.events if isinstance(e, RangeEvent)}
    assert (s1.name, f"copyin {n} B") in ranges
    assert (s2.name, f"transfer {n} B {s1b.name}->{s2.name}") in ranges
    assert (s2.name, "kernel") in ranges
    processes = {m["args"]["name"] for m in prof.trace()["traceEvents"] if m.get("name") == "process_name"}
    assert {s1.name, s1b.name, s2.name} <= processes  # a lane group per remote device, two of them on n1
    await s1.free(a)
    await s1b.free(b)
    await s2.free(c)


async def test_a_node_removed_mid_pipeline_fails_its_ops_only(cluster: LocalCluster) -> None:
    """n2 goes away while ops run on it: exactly those fail with DeviceLost (and what reads their results with
    a DependencyError), every awaiter wakes, local data stays, n1 goes on; a device on the node that comes back
    (a new node with the same name) opens and works."""
    close_lost()  # left by an earlier run that failed
    survivor, victim, local = Device["RAY:n1/CPU:3"], Device["RAY:n2/CPU:3"], Device["CPU"]
    sleep, add = await victim.compile(SLEEP, outs=(0,)), await survivor.compile(ADD_ONE)
    n = 256 << 10  # the transfers go through the object store
    data = bytes(range(256)) * (n // 256)
    keep, into = await local.allocate(n), await local.allocate(n)
    await local.copyin(keep, data)
    await local.copyin(into, b"\x07" * n)
    v, s, s2 = await victim.allocate(n), await survivor.allocate(n), await survivor.allocate(n)
    aruntime.transfer(v, keep)  # local -> victim
    done_before = victim.copyout(v)
    assert bytes(await done_before) == data

    running = victim.launch(sleep, v, vals=(n, LONG_MS))
    queued = victim.copyout(v)  # behind the kernel on the victim
    moved = aruntime.transfer(s, v)  # victim -> survivor, after the kernel
    reads_moved = survivor.copyout(s)
    to_local = aruntime.transfer(into, v)  # victim -> local, after the kernel
    survivor.copyin(s2, data)
    independent = survivor.launch(add, s2, vals=(n,))  # on n1, needing nothing from n2
    doomed = {"running": running, "queued": queued, "moved": moved, "to_local": to_local}
    assert not running.done()
    outcomes: dict[str, BaseException | None] = {}

    async def wait(key: str, op: Any, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            await op
            outcomes[key] = None
        except Exception as exc:
            outcomes[key] = exc

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for key, op in [*doomed.items(), ("reads_moved", reads_moved), ("independent", independent)]:
                    await tg.start(wait, key, op)
                cluster.remove("n2")  # while every awaiter waits
    finally:  # the node comes back (a new Ray node of the same name), whatever happened
        cluster.add("n2")  # (on the main thread: starting a node sets signal handlers)
    for key in doomed:
        assert isinstance(outcomes[key], DeviceLost), (key, outcomes[key])
        assert victim.name in str(outcomes[key])
    assert isinstance(outcomes["reads_moved"], DependencyError | DeviceLost), outcomes["reads_moved"]
    assert outcomes["independent"] is None
    assert done_before.done() and done_before.error is None  # what finished before stays finished
    with pytest.raises(DeviceError, match=rf"{victim.name} is lost \(its Ray actor died"):
        victim.copyout(v)
    assert bytes(await local.copyout(keep)) == data  # local data is intact
    with pytest.raises(DependencyError, match=rf"depends on transfer {n} B {victim.name}->CPU, which failed"):
        await local.copyout(into)  # what the lost transfer should have written counts as failed ...
    await local.copyin(into, data)  # ... until it is written again
    assert bytes(await local.copyout(into)) == data
    await victim.synchronize()  # every failure was awaited: nothing left to raise
    close_lost()
    assert bytes(await survivor.copyout(s2)) == bytes((x + 1) & 255 for x in data)  # n1 goes on
    await survivor.copyin(s, data)
    assert bytes(await survivor.copyout(s)) == data
    again = Device["RAY:n2/CPU:3"]
    assert again is not victim and again.host["node"] == node_of("n2")
    fresh = await again.allocate(n)
    aruntime.transfer(fresh, s)  # n1 -> the new n2
    assert bytes(await again.copyout(fresh)) == data
    await again.free(fresh)
    for buf in (s, s2):
        await survivor.free(buf)
    for buf in (keep, into):
        await local.free(buf)
