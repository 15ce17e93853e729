"""RAY devices: remote devices behind Ray actors, on a local cluster started once for the module."""

from __future__ import annotations

import array
import gc
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aruntime

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'aruntime[ray]')")

from aruntime import (  # noqa: E402
    AllocationError,
    Buffer,
    BufferUsageError,
    CompileError,
    DependencyError,
    Device,
    DeviceError,
    OpError,
    dtypes,
)
from aruntime.backends.ray import DeviceLost, RemoteDevice  # noqa: E402
from aruntime.events import DeviceEvent, RangeEvent  # noqa: E402
from aruntime.profile import profile  # noqa: E402
from aruntime.scheduler import Scheduler  # noqa: E402
from tests.kernels import ADD_ONE, SCALE, SLEEP, Failing  # noqa: E402

pytestmark = pytest.mark.anyio

LONG_MS = 1500
"""A kernel this long is still running when a test looks right after launching it."""


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        for dev in Device.devices():
            if isinstance(dev, RemoteDevice):
                dev.close()
        ray.shutdown()


def floats(data: Any) -> list[float]:
    return array.array("f", bytes(data)).tolist()


async def test_roundtrip_kernel_views_and_free() -> None:
    dev = Device["RAY:any/CPU:1"]
    assert dev.host["pid"] > 0 and dev.inner == "CPU:1"
    prog = await dev.compile(SCALE, outs=(0,))
    n = 1000
    x, y = await dev.allocate(n, dtypes.float32), await dev.allocate(n, dtypes.float32)
    dev.copyin(x, array.array("f", range(n)))
    dev.launch(prog, y, x, vals=(n, 2.0))
    assert floats(await dev.copyout(y)) == [2.0 * i for i in range(n)]
    half = y.view(n // 2, dtypes.float32, 4 * (n // 2))  # the second half, written by a kernel on the view
    dev.launch(prog, half, half, vals=(n // 2, 0.5))
    into = bytearray(4 * n)
    assert await dev.copyout(y, into) is into
    assert floats(into) == [2.0 * i for i in range(n // 2)] + [float(i) for i in range(n // 2, n)]
    in_use = dev.allocator.in_use
    await dev.free(x)
    assert dev.allocator.in_use == in_use - 4 * n
    await dev.free(y)
    await dev.synchronize()


async def test_bad_arguments_raise_naming_the_remote_device() -> None:
    dev, other = Device["RAY:any/CPU:1"], Device["CPU"]
    buf = await dev.allocate(16)
    with pytest.raises(BufferUsageError, match="source has 15 bytes"):
        dev.copyin(buf, bytes(15))
    with pytest.raises(BufferUsageError, match=r"belongs to RAY:any/CPU:1, not CPU"):
        other.copyin(buf, bytes(16))
    with pytest.raises(CompileError, match=r"error: .*undeclared_thing"):
        await dev.compile("void kernel(void) { undeclared_thing = 1; }")
    prog = await dev.compile(ADD_ONE)
    with pytest.raises(DeviceError, match="not a program of CPU"):
        other.launch(prog, buf)
    with pytest.raises(ValueError, match="does not fit in a 64-bit"):
        dev.launch(prog, buf, vals=(1 << 63,))
    with pytest.raises(AllocationError, match=r"RAY:any/CPU:1: out of memory allocating"):
        await dev.allocate(1 << 60)
    await dev.free(buf)
    with pytest.raises(BufferUsageError, match="was freed"):
        dev.launch(prog, buf, vals=(16,))
    with pytest.raises(DeviceError, match=r"RAY:<host>/<device>"):
        Device["RAY"]
    with pytest.raises(DeviceError, match="no live Ray node is 'nowhere'"):
        Device["RAY:nowhere/CPU"]


async def test_a_cancelled_wait_leaves_the_remote_op_running_and_its_memory_held() -> None:
    gc.collect()
    dev = Device["RAY:any/CPU:2"]
    prog = await dev.compile(SLEEP, outs=(0,))
    alloc = dev.allocator
    in_use = alloc.in_use
    buf = await dev.allocate(8)
    await dev.copyin(buf, bytes(8))
    op = dev.launch(prog, buf, vals=(8, LONG_MS))
    with anyio.move_on_after(0.05) as scope:
        await op
    assert scope.cancelled_caught and not op.done()
    handle = buf.handle
    with anyio.move_on_after(0.05):  # cancel-then-free: the release waits for the remote op
        await dev.free(buf)
    assert not buf.is_allocated()
    assert alloc.in_use == in_use + 8, "memory the remote device still uses must not be released"
    other = await dev.allocate(8)
    assert other.handle != handle
    with anyio.fail_after(30):
        await op
    assert alloc.in_use == in_use + 8
    await dev.free(other)
    assert alloc.in_use == in_use


async def test_a_pipeline_over_two_hosts_keeps_its_hazards() -> None:
    """Items flow host -> r1 (x2) -> r2 (+1 per byte) -> host through a ring of buffers a Scheduler reuses:
    every reuse is a hazard (write after read) across the two hosts."""
    r1, r2 = Device["RAY:any/CPU:1"], Device["RAY:any/CPU:2"]
    scale = await r1.compile(SCALE, outs=(0,))
    add = await r2.compile(ADD_ONE)
    n, items, ring = 64, 12, 2
    xs = [await r1.allocate(n, dtypes.float32) for _ in range(ring)]
    ys = [await r1.allocate(n, dtypes.float32) for _ in range(ring)]
    zs = [await r2.allocate(n, dtypes.float32) for _ in range(ring)]
    outs = []
    async with Scheduler(window=16) as sched:
        for i in range(items):
            x, y, z = xs[i % ring], ys[i % ring], zs[i % ring]
            sched.copyin(x, array.array("f", [float(i)] * n))
            sched.launch(scale, y, x, vals=(n, 2.0))
            sched.transfer(z, y)
            sched.launch(add, z, vals=(4 * n,))
            outs.append(sched.copyout(z))
    for i, op in enumerate(outs):
        expected = bytes(b + 1 for b in array.array("f", [2.0 * i] * n).tobytes())
        assert bytes(await op) == expected, i
    for buf in xs + ys:
        await r1.free(buf)
    for buf in zs:
        await r2.free(buf)


async def test_ops_across_hosts_are_all_sent_before_their_producers_finish() -> None:
    """The driver does not wait between hosts: the transfer and what reads it on the second host are sent
    while the kernel they depend on still runs on the first; the bytes (1 MiB, through the object store)
    arrive intact."""
    r1, r2 = Device["RAY:any/CPU:1"], Device["RAY:any/CPU:2"]
    sleep = await r1.compile(SLEEP, outs=(0,))
    n = 1 << 20
    y, z = await r1.allocate(n), await r2.allocate(n)
    r1.copyin(y, bytes(range(256)) * (n // 256))
    kernel = r1.launch(sleep, y, vals=(n, 300))
    moved = aruntime.transfer(z, y)
    out = r2.copyout(z)
    assert not kernel.done()
    for dev in (r1, r2):
        assert not dev._ready, f"{dev.name} holds calls back"
    with anyio.fail_after(30):
        assert bytes(await out) == bytes((b + 1) & 255 for b in range(256)) * (n // 256)
    assert kernel.done() and moved.done()
    await r1.free(y)
    await r2.free(z)


async def test_transfers_between_remote_and_local_devices_both_ways() -> None:
    r1, local = Device["RAY:any/CPU:1"], Device["CPU"]
    add = await local.compile(ADD_ONE)
    a, b = await r1.allocate(256 << 10), await local.allocate(256 << 10)
    data = bytes(range(256)) * 1024
    r1.copyin(a, data)
    aruntime.transfer(b, a)  # remote -> local, then a local kernel ordered after it
    local.launch(add, b, vals=(256 << 10,))
    aruntime.transfer(a, b)  # local -> remote, ordered after the kernel
    assert bytes(await r1.copyout(a)) == bytes((x + 1) & 255 for x in data)
    await r1.free(a)
    await local.free(b)


async def test_a_transfer_from_a_failed_local_write_fails_and_the_remote_device_goes_on() -> None:
    r1, local = Device["RAY:any/CPU:1"], Device["CPU"]
    a, b = await local.allocate(8), await r1.allocate(8)
    local.launch(Failing(local, "producer", b""), a)
    moved = aruntime.transfer(b, a)
    with pytest.raises(DependencyError, match="depends on producer, which failed"):
        await moved
    r1.copyin(b, b"12345678")  # the call order on the remote device has no gap where the transfer was
    assert bytes(await r1.copyout(b)) == b"12345678"
    with pytest.raises(OpError, match="producer"):
        await local.synchronize()
    await local.free(a)
    await r1.free(b)


async def test_a_killed_actor_fails_its_ops_refuses_new_ones_and_others_keep_working() -> None:
    dead, r1, local = Device["RAY:any/CPU:3"], Device["RAY:any/CPU:1"], Device["CPU"]
    prog = await dead.compile(SLEEP, outs=(0,))
    src, dst = await dead.allocate(8), await r1.allocate(8)
    await dead.copyin(src, bytes(8))
    running = dead.launch(prog, src, vals=(8, LONG_MS))
    moved = aruntime.transfer(dst, src)  # its export waits behind the kernel on the host that dies
    dependent = r1.copyout(dst)  # reads what the failed transfer should have written
    ray.kill(dead.actor, no_restart=True)
    with anyio.fail_after(30):
        with pytest.raises(DeviceLost, match=r"failed on RAY:any/CPU:3 compute queue: RAY:any/CPU:3 is lost"):
            await running
        with pytest.raises(DeviceError, match="RAY:any/CPU:3 is lost"):
            await moved
        with pytest.raises(DependencyError, match=r"depends on transfer 8 B RAY:any/CPU:3->RAY:any/CPU:1"):
            await dependent
    with pytest.raises(DeviceError, match=r"RAY:any/CPU:3 is lost \(its Ray actor died"):
        dead.launch(prog, src, vals=(8, 0))
    with pytest.raises(DeviceError, match="RAY:any/CPU:3 is lost"):
        await dead.allocate(8)
    add = await r1.compile(ADD_ONE)
    r1.copyin(dst, bytes(8))  # the surviving host and the local device go on
    r1.launch(add, dst, vals=(8,))
    assert bytes(await r1.copyout(dst)) == b"\x01" * 8
    buf = await local.allocate(4)
    await local.copyin(buf, b"abcd")
    assert bytes(await local.copyout(buf)) == b"abcd"
    await dead.synchronize()  # every failure was awaited: nothing left to raise
    dead.close()
    again = Device["RAY:any/CPU:3"]  # a closed device reopens with a new actor
    assert again is not dead
    fresh = await again.allocate(4)
    await again.copyin(fresh, b"wxyz")
    assert bytes(await again.copyout(fresh)) == b"wxyz"
    await again.free(fresh)
    await r1.free(dst)
    await local.free(buf)


async def test_profile_ranges_come_back_on_the_drivers_clock() -> None:
    r1, r2 = Device["RAY:any/CPU:1"], Device["RAY:any/CPU:2"]
    add = await r2.compile(ADD_ONE)
    a, b = await r1.allocate(1024), await r2.allocate(1024)
    async with profile() as prof:
        r1.copyin(a, bytes(1024))
        aruntime.transfer(b, a)
        await r2.launch(add, b, vals=(1024,))
    ranges = [e for e in prof.events if isinstance(e, RangeEvent)]
    names = {(e.device, e.name) for e in ranges}
    assert ("RAY:any/CPU:1", "copyin 1024 B") in names
    assert ("RAY:any/CPU:2", "transfer 1024 B RAY:any/CPU:1->RAY:any/CPU:2") in names
    assert ("RAY:any/CPU:2", "kernel") in names
    offsets = {e.device: e for e in prof.events if isinstance(e, DeviceEvent)}
    assert {"RAY:any/CPU:1", "RAY:any/CPU:2"} <= set(offsets)
    trace = prof.trace()
    processes = {m["args"]["name"] for m in trace["traceEvents"] if m.get("name") == "process_name"}
    assert {"RAY:any/CPU:1", "RAY:any/CPU:2"} <= processes  # one lane group per remote device
    await r1.free(a)
    await r2.free(b)


def test_the_blocking_buffer_api_and_a_host_named_by_its_address() -> None:
    address = Device["RAY:any/CPU:1"].host["address"]
    dev = Device[f"RAY:{address}/CPU:4"]
    assert dev.host["address"] == address
    buf = Buffer(dev.name, 4).ensure_allocated()
    buf.copyin(memoryview(b"ping"))
    assert bytes(buf.as_buffer()) == b"ping"
    buf.deallocate()
    dev.close()


async def test_a_graph_replay_on_a_remote_device_fails_clearly() -> None:
    from aruntime.graph import Graph

    dev = Device["RAY:any/CPU:1"]
    buf = await dev.allocate(4)
    graph = Graph()
    graph.copyin(buf, "data")
    graph.copyout(buf, "out")
    with anyio.fail_after(10), pytest.raises(OpError, match=r"RAY:any/CPU:1 runs the ops of its own methods only"):
        await graph.replay(data=b"abcd")
    await dev.free(buf)


@pytest.mark.slow
async def test_a_long_pipeline_over_two_hosts_and_back_through_a_local_device() -> None:
    """Many items, small and big (inline and through the object store), with every kind of transfer."""
    r1, r2, local = Device["RAY:any/CPU:1"], Device["RAY:any/CPU:2"], Device["CPU:1"]
    add1, add2, add3 = [await dev.compile(ADD_ONE) for dev in (r1, r2, local)]
    for n in (64, 200 << 10):
        ring = [(await r1.allocate(n), await r2.allocate(n), await local.allocate(n)) for _ in range(3)]
        outs = []
        async with Scheduler(window=64) as sched:
            for i in range(150):
                a, b, c = ring[i % 3]
                sched.copyin(a, bytes([i % 200]) * n)
                sched.launch(add1, a, vals=(n,))
                sched.transfer(b, a)
                sched.launch(add2, b, vals=(n,))
                sched.transfer(c, b)
                sched.launch(add3, c, vals=(n,))
                sched.transfer(a, c)
                outs.append(sched.copyout(a))
        for i, op in enumerate(outs):
            assert bytes(await op) == bytes([i % 200 + 3]) * n, (n, i)
        for a, b, c in ring:
            await r1.free(a)
            await r2.free(b)
            await local.free(c)


def test_without_ray_the_backend_loads_and_opening_says_what_is_missing() -> None:
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from aruntime import Device, DeviceError\n"
        "assert Device['CPU'] is not None\n"
        "try:\n    Device['RAY:any/CPU']\nexcept DeviceError as exc:\n    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "RAY:any/CPU: RAY devices need Ray: pip install 'aruntime[ray]'" in proc.stdout
