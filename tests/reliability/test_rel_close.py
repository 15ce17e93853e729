"""Closing is one state machine (open -> closing -> closed): aclose and async with never block the loop, a
close from the device's own engine thread is refused, a close that times out leaves the device open and
usable, and a closed device's name is reopened only by Device[name]."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from aruntime import Device, Program
from aruntime.errors import DeviceError, OpError, SignalTimeout
from tests.kernels import SPINS, closed_gate


def open_gate(flag: Any) -> None:
    ctypes.c_int32.from_address(flag.handle).value = 1  # host memory: no op needed (the device may be closing)


@pytest.mark.anyio
async def test_aclose_waits_for_work_in_flight_without_blocking_the_loop() -> None:
    dev = Device["CPU:51"]
    prog, flag = await closed_gate(dev)
    out = await dev.allocate(1, flag.dtype)
    kernel = dev.launch(prog, out, vals=(flag.handle, SPINS))
    ticks = 0
    closed_at = 0.0

    async def close() -> None:
        nonlocal closed_at
        await dev.aclose()
        closed_at = time.monotonic()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(close)
            while dev.state != "closing":
                await anyio.lowlevel.checkpoint()
            for _ in range(20):  # the loop keeps running while the close waits for the kernel
                await anyio.sleep(0.005)
                ticks += 1
            assert dev.state == "closing" and not kernel.done()
            with pytest.raises(DeviceError, match="CPU:51 is closing"):
                dev.copyin(out, bytes(4))  # a closing device takes no new work
            open_gate(flag)
    assert ticks == 20 and closed_at and dev.state == "closed" and kernel.done()
    assert "CPU:51" not in Device.opened


@pytest.mark.anyio
async def test_async_with_closes_the_device_and_the_name_opens_a_new_one() -> None:
    async with Device["CPU:52"] as dev:
        buf = await dev.allocate(8)
        await dev.copyin(buf, b"abcdefgh")
        assert bytes(await dev.copyout(buf)) == b"abcdefgh"
    assert dev.state == "closed" and "CPU:52" not in Device.opened
    with pytest.raises(DeviceError, match=r"allocate: CPU:52 is closed; Device\['CPU:52'\] opens a new device"):
        await dev.allocate(8)  # a stray allocate on the old object does not reopen the name
    with pytest.raises(DeviceError, match="compile kernel: CPU:52 is closed"):
        await dev.compile("void kernel(void) {}")
    assert "CPU:52" not in Device.opened
    again = Device["CPU:52"]
    assert again is not dev and again.state == "open"
    fresh = await again.allocate(8)
    await again.copyin(fresh, b"12345678")
    assert bytes(await again.copyout(fresh)) == b"12345678"
    await again.aclose()
    await again.aclose()  # closing a closed device does nothing


class Closer(Program):
    """A kernel that closes its own device."""

    def __call__(self, *args: object) -> None:
        self.device.close()


@pytest.mark.anyio
async def test_closing_from_a_kernel_of_the_same_device_is_refused() -> None:
    dev = Device["CPU:53"]
    with anyio.fail_after(10), pytest.raises(OpError, match="called on its own CPU:53 compute queue thread") as info:
        await dev.launch(Closer(dev, "closer", b""))
    assert isinstance(info.value.__cause__, DeviceError)
    assert dev.state == "open"
    buf = await dev.allocate(4)  # still usable
    await dev.copyin(buf, b"wxyz")
    assert bytes(await dev.copyout(buf)) == b"wxyz"
    await dev.aclose()


@pytest.mark.anyio
async def test_a_close_that_times_out_leaves_the_device_open_and_usable() -> None:
    dev = Device["CPU:54"]
    prog, flag = await closed_gate(dev)
    out = await dev.allocate(1, flag.dtype)
    kernel = dev.launch(prog, out, vals=(flag.handle, SPINS))
    with pytest.raises(SignalTimeout):
        await anyio.to_thread.run_sync(lambda: dev.close(timeout=0.2))
    assert dev.state == "open" and Device["CPU:54"] is dev
    dev.timeout = 0.2
    with pytest.raises(SignalTimeout):
        await dev.aclose()
    assert dev.state == "open"
    dev.timeout = 30
    open_gate(flag)
    with anyio.fail_after(20):
        await kernel
        buf = await dev.allocate(4)
        await dev.copyin(buf, b"ok!!")
        assert bytes(await dev.copyout(buf)) == b"ok!!"
        await dev.aclose()
    assert dev.state == "closed"


@pytest.mark.anyio
async def test_a_cancelled_aclose_leaves_the_device_open() -> None:
    dev = Device["CPU:55"]
    prog, flag = await closed_gate(dev)
    out = await dev.allocate(1, flag.dtype)
    dev.launch(prog, out, vals=(flag.handle, SPINS))
    with anyio.move_on_after(0.1):
        await dev.aclose()
    assert dev.state == "open"
    open_gate(flag)
    with anyio.fail_after(20):
        await dev.aclose()
    assert dev.state == "closed"


def test_a_second_close_while_one_waits_is_refused() -> None:
    dev = Device["CPU:56"]
    prog, flag = anyio.run(closed_gate, dev)
    out = anyio.run(dev.allocate, 1, flag.dtype)
    dev.launch(prog, out, vals=(flag.handle, SPINS))
    errors: list[BaseException] = []

    def close() -> None:
        try:
            dev.close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    first = threading.Thread(target=close)
    first.start()
    deadline = time.monotonic() + 10
    while dev.state != "closing" and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(DeviceError, match="another close of it is already waiting"):
        dev.close()
    open_gate(flag)
    first.join(20)
    assert not errors and dev.state == "closed"
