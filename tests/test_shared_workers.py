"""The shared workers: the native queues of CPU and NULL devices run on one worker thread per CPU the process may
use (``ARUNTIME_WORKERS=shared``, the default), in the order they get work."""

from __future__ import annotations

import array
import ctypes
import subprocess
import sys
import textwrap

import anyio
import pytest

from aruntime import Device, OpError, SignalTimeout, dtypes, transfer
from aruntime.engine import NativeEngine
from aruntime.engine.native.engine import allowed_cpus
from tests.kernels import ADD_ONE, SPINS, closed_gate, gate_output, gate_started

pytestmark = pytest.mark.anyio


def _shared(name: str) -> Device:
    dev = Device[name]
    if not (isinstance(dev.compute, NativeEngine) and dev.compute.shared):
        pytest.skip("the queues do not run on the shared workers here")
    return dev


async def test_queues_held_by_long_kernels_do_not_starve_the_others() -> None:
    """A gate kernel on the compute queue of one device more than there are shared workers keeps every worker
    busy; a round trip on another device's queues still completes (the watchdog starts a worker for it), and
    once the gates open everything finishes."""
    gated = [_shared(f"CPU:{110 + i}") for i in range(allowed_cpus() + 1)]
    other = _shared("CPU:120")
    gates = []
    for dev in gated:
        gate, flag = await closed_gate(dev)
        out = await gate_output(dev)
        gates.append((dev.launch(gate, out, vals=(flag.handle, SPINS)), out, flag))
    for _, out, _ in gates:
        await gate_started(out)
    buf = await other.allocate(256, dtypes.int32)
    with anyio.fail_after(20):
        await other.copyin(buf, array.array("i", range(256)))
        assert list(await other.copyout(buf)) == list(range(256))
    assert not any(op.done() for op, _, _ in gates)  # the gates still hold their workers
    for _, _, flag in gates:
        ctypes.c_int32.from_address(flag.handle).value = 1
    with anyio.fail_after(20):
        for op, out, _ in gates:
            await op
            assert list(await out.owner.copyout(out)) == [1]


async def test_a_chain_across_more_queues_than_workers_runs_in_order() -> None:
    """Eager ops that wait in their queues for ops of other queues (parked waits), over four devices' eight
    queues: every hazard is honoured."""
    devs = [_shared(f"CPU:{121 + i}") for i in range(4)]
    n = 64
    progs = [await dev.compile(ADD_ONE, outs=(0,)) for dev in devs]
    bufs = [await dev.allocate(n) for dev in devs]
    devs[0].copyin(bufs[0], bytes(n))
    rounds = 50
    with anyio.fail_after(60):
        for _ in range(rounds):
            for i, dev in enumerate(devs):
                dev.launch(progs[i], bufs[i], vals=(n,))
                transfer(bufs[(i + 1) % len(devs)], bufs[i])
        assert bytes(await devs[0].copyout(bufs[0])) == bytes([(rounds * len(devs)) % 256]) * n


async def test_a_parked_wait_times_out() -> None:
    """An op whose queue waits (parked) for another queue's op that does not finish within that queue's timeout
    fails (with a SignalTimeout as its cause); the queues go on with their next ops."""
    dev, late = _shared("CPU:125"), _shared("CPU:126")
    gate, flag = await closed_gate(dev)
    out = await dev.allocate(1, dtypes.int32)
    held = dev.launch(gate, out, vals=(flag.handle, SPINS))
    mine = await late.allocate(1, dtypes.int32)
    dev.compute.signal.timeout = 0.2  # a queue's wait for dev's kernels times out after 0.2 s
    try:
        with anyio.fail_after(20):
            waiting = transfer(mine, out)  # on a copy queue, after the gate on dev's compute queue
            with pytest.raises(OpError, match="SignalTimeout") as failed:
                await waiting
            assert isinstance(failed.value.__cause__, SignalTimeout)
            for each in (dev, late):  # big enough for the copy queue: the one that waited goes on
                big = await each.allocate(1 << 18, dtypes.int32)
                await each.copyin(big, array.array("i", range(1 << 18)))
                assert list(await each.copyout(big)) == list(range(1 << 18))
    finally:
        dev.compute.signal.timeout = late.timeout
        ctypes.c_int32.from_address(flag.handle).value = 1
    with anyio.fail_after(20):
        await held


def test_a_forked_child_opens_devices_on_workers_of_its_own() -> None:
    """A child forked after the parent's shared workers started has none of them: its own devices start theirs."""
    code = textwrap.dedent(
        """
        import array, os
        import anyio
        from aruntime import Device, dtypes

        async def use(name):
            dev = Device[name]
            x = await dev.allocate(16, dtypes.int32)
            with anyio.fail_after(20):
                await dev.copyin(x, array.array("i", range(16)))
                return list(await dev.copyout(x))

        assert anyio.run(use, "CPU") == list(range(16))
        pid = os.fork()
        if pid == 0:
            os._exit(0 if anyio.run(use, "CPU:9") == list(range(16)) else 1)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0"]
