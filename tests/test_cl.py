"""What is particular to the CL backend: OpenCL C scalar parameters, the compile cache across processes,
event wait lists between queues, NDRange sizes, `aruntime check`."""

from __future__ import annotations

import array
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

import aruntime
from aruntime import CompileError, Device, DeviceError, OpError, dtypes
from aruntime.check import check_kind
from aruntime.engine import CommandQueue, Op, TimelineSignal
from aruntime.events import DependencyEvent, recorder

pytestmark = pytest.mark.anyio
cl = pytest.importorskip("pyopencl", reason="the opencl extra (pyopencl[pocl]) is not installed")

try:
    DEV = Device["CL"]
except DeviceError as exc:  # no platform: every test here says so
    pytest.skip(f"CL does not open here: {exc}", allow_module_level=True)

SCALARS = r"""
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
__kernel void every(__global long *ints, __global double *floats, char a, uchar b, short c, ushort d, int e,
                    uint f, long g, ulong h, float x, double y) {
  ints[0] = a; ints[1] = b; ints[2] = c; ints[3] = d; ints[4] = e; ints[5] = f; ints[6] = g; ints[7] = (long)h;
  floats[0] = x; floats[1] = y;
}
__kernel void iota(__global int *out) { out[get_global_id(0)] = (int)get_global_id(0); }
"""
VALUES = (-128, 255, -32768, 65535, -(1 << 31), (1 << 32) - 1, -(1 << 63), (1 << 63) - 1, 0.5, -1e300)


async def test_every_opencl_scalar_type_is_passed_at_its_extremes() -> None:
    prog = await DEV.compile(SCALARS, "every", outs=(0, 1))
    ints, floats = await DEV.allocate(8, dtypes.int64), await DEV.allocate(2, dtypes.float64)
    await DEV.launch(prog, ints, floats, vals=VALUES)
    got = struct.unpack("<8q", await DEV.copyout(ints))
    assert got == VALUES[:8]  # (a launch scalar is at most an int64, also for a ulong)
    assert struct.unpack("<2d", await DEV.copyout(floats)) == (0.5, -1e300)
    await DEV.free(ints)
    await DEV.free(floats)


@pytest.mark.parametrize(
    ("index", "val", "error", "message"),
    [
        (0, 128, ValueError, "scalar 0 = 128 does not fit in the char parameter"),
        (1, -1, ValueError, "does not fit in the uchar"),
        (5, 1 << 32, ValueError, "does not fit in the uint"),
        (4, 1.0, TypeError, "scalar 4 is for a int parameter; pass an int"),
        (8, 1, TypeError, "scalar 8 is for a float parameter; pass a float"),
    ],
)
async def test_scalars_are_checked_against_the_parameter_types_before_enqueueing(
    index: int, val: object, error: type[Exception], message: str
) -> None:
    prog = await DEV.compile(SCALARS, "every", outs=(0, 1))
    ints, floats = await DEV.allocate(8, dtypes.int64), await DEV.allocate(2, dtypes.float64)
    before = DEV.compute.last
    vals = list(VALUES)
    vals[index] = val  # type: ignore[call-overload]
    with pytest.raises(error, match=message):
        DEV.launch(prog, ints, floats, vals=vals)
    with pytest.raises(TypeError, match=r"takes \(buffer, buffer, char"):
        DEV.launch(prog, ints, vals=VALUES, outs=(0,))  # a buffer short
    assert DEV.compute.last == before
    await DEV.free(ints)
    await DEV.free(floats)


async def test_sized_runs_the_kernel_over_that_many_work_items() -> None:
    prog = await DEV.compile(SCALARS, "iota", outs=(0,))
    out = await DEV.allocate(1000, dtypes.int32)
    await DEV.copyin(out, array.array("i", [-1] * 1000))
    await DEV.launch(prog.sized((1000,)), out)
    assert list(array.array("i", bytes(await DEV.copyout(out)))) == list(range(1000))
    assert prog.global_size == (1,)  # sized() made a copy
    with pytest.raises(ValueError, match="global_size must be 1 to 3 positive ints"):
        prog.sized((0,))
    await DEV.free(out)


async def test_a_missing_kernel_name_and_an_unaligned_view_are_clear_errors() -> None:
    with pytest.raises(CompileError, match=r"no kernel 'nope'.*every, iota"):
        await DEV.compile(SCALARS, "nope")
    prog = await DEV.compile(SCALARS, "iota", outs=(0,))
    buf = await DEV.allocate(64, dtypes.int32)
    with pytest.raises(ValueError, match=f"multiple of {DEV.view_alignment} bytes"):
        DEV.launch(prog, buf.view(4, dtypes.int32, 4))
    await DEV.free(buf)


def test_a_second_process_loads_the_binary_from_the_cache(tmp_path: Path) -> None:
    env = {**os.environ, "ARUNTIME_CACHEDB": str(tmp_path / "cache.db")}
    program = textwrap.dedent(
        f"""
        import anyio
        from aruntime import Device
        async def main():
            prog = await Device["CL"].compile({SCALARS!r}, "iota")
            print(prog.name)
        anyio.run(main)
        """
    )
    first = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    with pytest.raises(subprocess.CalledProcessError):  # proves ASSERT_COMPILE=1 refuses a real miss
        subprocess.run(
            [sys.executable, "-c", program.replace("iota(", "iota2(").replace('"iota"', '"iota2"')],
            env={**env, "ARUNTIME_ASSERT_COMPILE": "1"},
            capture_output=True,
            check=True,
            timeout=120,
        )
    second = subprocess.run(
        [sys.executable, "-c", program],
        env={**env, "ARUNTIME_ASSERT_COMPILE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 0 and second.stdout.strip() == "iota", second.stderr


async def test_a_cross_queue_hazard_is_an_event_wait_list_not_a_host_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    other, cpu = Device["CL:1"], Device["CPU"]
    src = await DEV.allocate(1 << 20)
    dst = await other.allocate(1 << 20)
    host = await cpu.allocate(1 << 20)
    data = bytes(range(256)) * 4096
    user_events: list[object] = []
    real = cl.UserEvent

    def counted(context: object) -> object:
        user_events.append(context)
        return real(context)

    iota = await DEV.compile(SCALARS, "iota", outs=(0,))
    monkeypatch.setattr(cl, "UserEvent", counted)
    recorder.enabled = True
    try:
        mark = len(recorder.events)
        gate = TimelineSignal("gate", 10.0)
        DEV.copy.submit(CommandQueue().wait(gate, 1), Op("gate"))  # holds CL's copy queue until opened
        user_events.clear()  # (that wait is one)
        DEV.copyin(src, data)
        move = aruntime.transfer(dst, src)  # CL -> CL:1 on CL's copy queue, in order after the copy-in
        launch = DEV.launch(iota, src.view(4, dtypes.int32, 0))  # CL's compute queue after the transfer read src
        read = other.copyout(dst)  # CL:1's copy queue after CL's
        assert user_events == [], "a hazard between CL queues went through the host"
        gate.set(1)
        with anyio.fail_after(10):
            assert bytes(await read) == data
            await launch
        gate = TimelineSignal("gate", 10.0)
        cpu.copy.submit(CommandQueue().wait(gate, 1), Op("gate"))  # holds CPU's copy queue until opened
        cpu.copyin(host, data)
        back = aruntime.transfer(src, host)  # CPU -> CL runs on CL's copy queue, after CPU's copy queue: a host wait
        assert len(user_events) == 1
        gate.set(1)
        with anyio.fail_after(10):
            await back
    finally:
        recorder.enabled = False
    deps = [e for e in recorder.events[mark:] if isinstance(e, DependencyEvent)]
    assert DependencyEvent(move.id, read.id) in deps
    await DEV.free(src)
    await other.free(dst)
    await cpu.free(host)


def test_check_lists_cl_as_passing() -> None:
    result = check_kind("CL", None)
    assert result.opened and result.kernel, result.reason


async def test_a_launch_the_driver_refuses_fails_its_op_and_the_queue_goes_on() -> None:
    prog = await DEV.compile(SCALARS, "iota", outs=(0,))
    out = await DEV.allocate(12, dtypes.int32)
    bad = DEV.launch(prog.sized((10,), (3,)), out)  # 3 does not divide 10: clEnqueueNDRangeKernel refuses it
    with pytest.raises(OpError, match=r"iota failed on CL compute queue: .*WORK_GROUP_SIZE"):
        await bad
    await DEV.launch(prog.sized((12,), (3,)), out)
    assert list(array.array("i", bytes(await DEV.copyout(out)))) == list(range(12))
    await DEV.synchronize()
    await DEV.free(out)
