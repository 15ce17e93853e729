"""Where a CPU device's queues run: on the shared workers (the default, ``ARUNTIME_WORKERS``), or on threads of
their own that may be pinned to one CPU (``ARUNTIME_CPU_AFFINITY``, ``CPUDevice.cpu``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from aruntime import Device, DeviceError
from aruntime.backends.cpu import CPUDevice, default_cpu
from aruntime.engine import NativeEngine, workers_shared
from tests.kernels import ping_pong

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux-only")


def affinity(dev: CPUDevice) -> tuple[set[int], set[int]]:
    return os.sched_getaffinity(dev.compute.thread_id), os.sched_getaffinity(dev.copy.thread_id)


def _native(dev: CPUDevice) -> None:
    if not isinstance(dev.compute, NativeEngine):
        pytest.skip("the Python engine runs a thread per queue")


def test_devices_run_on_the_shared_workers_by_default() -> None:
    dev = Device["CPU:1"]
    assert isinstance(dev, CPUDevice)
    _native(dev)
    assert dev.cpu is None
    assert [engine.shared for engine in dev.engines] == [True, True]
    assert dev.compute.thread_id == dev.copy.thread_id == 0  # no thread of their own


def test_pinning_a_device_on_the_shared_workers_is_refused_and_changes_nothing() -> None:
    dev = Device["CPU:1"]
    assert isinstance(dev, CPUDevice)
    _native(dev)
    with pytest.raises(DeviceError, match=r"shared workers.*ARUNTIME_WORKERS=queue"):
        dev.cpu = min(os.sched_getaffinity(0))
    assert dev.cpu is None


def test_the_workers_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, shared in (("shared", True), (" Queue ", False)):
        monkeypatch.setenv("ARUNTIME_WORKERS", value)
        assert workers_shared() is shared
    monkeypatch.setenv("ARUNTIME_WORKERS", "threads")
    with pytest.raises(ValueError, match="ARUNTIME_WORKERS='threads'"):
        Device["CPU:101"]  # refused before the device makes anything
    monkeypatch.setenv("ARUNTIME_WORKERS", "queue")
    dev = Device["CPU:101"]
    try:
        assert isinstance(dev, CPUDevice)
        _native(dev)
        allowed = os.sched_getaffinity(0)
        assert [engine.shared for engine in dev.engines] == [False, False]
        assert affinity(dev) == (allowed, allowed)  # threads of their own, unpinned
    finally:
        dev.close()


def test_auto_spreads_devices_over_the_cpus_the_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARUNTIME_CPU_AFFINITY", "auto")
    allowed = sorted(os.sched_getaffinity(0))
    devs = [Device[f"CPU:{20 + number}"] for number in range(len(allowed) + 1)]
    try:
        for dev in devs:
            assert isinstance(dev, CPUDevice)
            cpu = allowed[int(dev.name.partition(":")[2]) % len(allowed)]
            assert dev.cpu == cpu
            assert affinity(dev) == ({cpu}, {cpu})
    finally:
        for dev in devs:
            dev.close()


def test_moving_and_unpinning_a_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARUNTIME_WORKERS", "queue")
    dev = Device["CPU:102"]
    assert isinstance(dev, CPUDevice)
    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    try:
        dev.cpu = None
        assert dev.cpu is None
        assert affinity(dev) == (allowed, allowed)
        dev.cpu = first
        assert affinity(dev) == ({first}, {first})
        dev.cpu = None
        assert affinity(dev) == (allowed, allowed)
    finally:
        dev.close()


@pytest.mark.parametrize("bad", [-1, 4096, 1.0, True, "0"])
def test_a_cpu_the_process_may_not_use_is_refused_and_changes_nothing(bad: object) -> None:
    dev = Device["CPU:5"]
    assert isinstance(dev, CPUDevice)
    before = dev.cpu, affinity(dev)
    with pytest.raises(ValueError, match=r"CPU:5: cpu must be one of the CPUs"):
        dev.cpu = bad  # type: ignore[assignment]
    assert (dev.cpu, affinity(dev)) == before


def test_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("ARUNTIME_CPU_AFFINITY", "off")
    assert default_cpu("CPU:1") is None
    monkeypatch.setenv("ARUNTIME_CPU_AFFINITY", "auto")
    assert default_cpu("CPU:1") == allowed[1 % len(allowed)]
    monkeypatch.setenv("ARUNTIME_CPU_AFFINITY", f"{allowed[-1]}")
    assert default_cpu("CPU") == default_cpu("CPU:3") == allowed[-1]
    monkeypatch.setenv("ARUNTIME_CPU_AFFINITY", ",".join(map(str, reversed(allowed))))
    assert default_cpu("CPU:1") == allowed[::-1][1 % len(allowed)]
    for bad in ("4096", "zero", " ", "0,,1"):
        monkeypatch.setenv("ARUNTIME_CPU_AFFINITY", bad)
        with pytest.raises(ValueError, match="ARUNTIME_CPU_AFFINITY"):
            default_cpu("CPU")


@pytest.mark.anyio
async def test_devices_work_when_the_process_may_use_one_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one CPU allowed, every device's queues share it; a two-device pipeline still completes."""
    monkeypatch.setenv("ARUNTIME_CPU_AFFINITY", "auto")
    mask = os.sched_getaffinity(0)
    only = max(mask)
    os.sched_setaffinity(0, {only})  # this thread's mask: what the new devices' threads inherit and see
    try:
        devs = [Device["CPU:11"], Device["CPU:12"]]
    finally:
        os.sched_setaffinity(0, mask)
    try:
        for dev in devs:
            assert isinstance(dev, CPUDevice)
            assert dev.cpu == only
            assert affinity(dev) == ({only}, {only})
        assert await ping_pong(devs, 1024, 0, 50) == [i + 100 for i in range(1024)]
    finally:
        for dev in devs:
            await dev.aclose()


def test_the_shared_workers_serve_two_devices_when_the_process_may_use_one_cpu() -> None:
    """One CPU allowed: one shared worker (it never polls) runs a two-device pipeline whose queues wait for each
    other, eagerly (waits in the queues) and through a Scheduler (held in the core)."""
    dev = Device["CPU:1"]
    assert isinstance(dev, CPUDevice)
    _native(dev)  # the subprocess runs on the same engine
    code = textwrap.dedent(
        """
        import os
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
        import anyio
        from aruntime import Device
        from tests.kernels import ping_pong
        async def main():
            devs = [Device["CPU"], Device["CPU:1"]]
            assert all(engine.shared for dev in devs for engine in dev.engines)
            print(await ping_pong(devs, 1024, 20, 50) == [i + 140 for i in range(1024)], devs[0].compute.spin_ns)
        anyio.run(main)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "0"]
