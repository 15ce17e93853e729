"""A CPU device's two queues run on one CPU (``ARUNTIME_CPU_AFFINITY``, ``CPUDevice.cpu``)."""

from __future__ import annotations

import array
import os

import pytest

from aruntime import Device, Scheduler, dtypes
from aruntime.backends.cpu import CPUDevice, default_cpu

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux-only")

INC = r"""
#include <stdint.h>
void kernel(int32_t *b, int64_t n) { for (int64_t i = 0; i < n; i++) b[i] += 1; }
"""


def affinity(dev: CPUDevice) -> tuple[set[int], set[int]]:
    return os.sched_getaffinity(dev.compute.thread_id), os.sched_getaffinity(dev.copy.thread_id)


def test_devices_are_unpinned_by_default() -> None:
    dev = Device["CPU:1"]
    assert isinstance(dev, CPUDevice)
    assert dev.cpu is None
    allowed = os.sched_getaffinity(0)
    assert affinity(dev) == (allowed, allowed)


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


def test_moving_and_unpinning_a_device() -> None:
    dev = Device["CPU:5"]
    assert isinstance(dev, CPUDevice)
    allowed = os.sched_getaffinity(0)
    first = min(allowed)
    try:
        dev.cpu = None
        assert dev.cpu is None
        assert affinity(dev) == (allowed, allowed)
        dev.cpu = first
        assert affinity(dev) == ({first}, {first})
    finally:
        dev.cpu = default_cpu(dev.name)


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
        n = 1024
        progs = [await dev.compile(INC, outs=(0,)) for dev in devs]
        async with devs[0].buffer(n, dtypes.int32) as a, devs[1].buffer(n, dtypes.int32) as b:
            async with Scheduler() as sched:
                sched.copyin(a, array.array("i", range(n)))
                for _ in range(50):
                    sched.launch(progs[0], a, vals=(n,))
                    sched.transfer(b, a)
                    sched.launch(progs[1], b, vals=(n,))
                    sched.transfer(a, b)
                result = sched.copyout(a)
            assert list(await result) == [i + 100 for i in range(n)]
    finally:
        for dev in devs:
            await dev.aclose()
