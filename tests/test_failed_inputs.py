"""A failed op's readers never run or never deliver: whenever they were submitted, whichever queue they are on.

The failure of a kernel that returns a non-zero status becomes known on its engine's thread while the loop
keeps submitting; these tests submit a reader right behind the failing kernel, many times, and stop at the
first reader that returns the failed kernel's bytes instead of raising a :class:`DependencyError`.
"""

from __future__ import annotations

import array

import anyio
import pytest

from aruntime import DependencyError, Device, Scheduler, dtypes
from aruntime.engine import KernelError
from tests.kernels import COPY_QUEUE_INTS

pytestmark = pytest.mark.anyio

STATUS = r"""
#include <stdint.h>
/* Write n copies of 1 to out and return `status` (non-zero: the launch fails). */
int kernel(int32_t *out, int64_t n, int64_t status) {
  for (int64_t i = 0; i < n; i++) out[i] = 1;
  return (int)status;
}
"""
ATTEMPTS = 2000
"""Enough to fail in every run before readers waited for their inputs' failures to be known (about 1 in 200
attempts returned the failed kernel's bytes)."""


@pytest.mark.parametrize("elements", [1, COPY_QUEUE_INTS], ids=["small", "large"])
async def test_a_reader_of_a_failed_kernel_never_sees_its_bytes(elements: int) -> None:
    """A small copy-out goes on the compute queue right behind the kernel if it is still running, else on
    the copy queue; a large one always goes on the copy queue, with a wait for the kernel."""
    dev = Device["CPU"]
    prog = await dev.compile(STATUS, outs=(0,))
    zeros = array.array("i", bytes(4 * elements))
    attempts = ATTEMPTS if elements == 1 else ATTEMPTS // 4
    async with dev.buffer(elements, dtypes.int32) as out:
        for attempt in range(attempts):
            await dev.launch(prog, out, vals=(elements, 0))
            failing = dev.launch(prog, out, vals=(elements, 3))
            reader = dev.copyout(out)
            if elements > 1:
                assert reader.engine is dev.copy
            with pytest.raises(KernelError) as failed:
                await failing
            assert failed.value.status == 3
            try:
                data = await reader
            except DependencyError as exc:
                assert exc.first == failing.name
            else:
                pytest.fail(f"attempt {attempt}: the reader of a failed kernel returned {list(data)[:4]}...")
            await dev.copyin(out, zeros)


async def test_a_scheduled_reader_of_a_failed_kernel_never_sees_its_bytes() -> None:
    dev = Device["CPU"]
    prog = await dev.compile(STATUS, outs=(0,))
    elements = COPY_QUEUE_INTS  # the copy-out goes on the copy queue, held off it until the kernel is done
    zeros = array.array("i", bytes(4 * elements))
    async with dev.buffer(elements, dtypes.int32) as out:
        for attempt in range(ATTEMPTS // 4):
            with pytest.raises(KernelError):
                async with Scheduler() as sched:
                    sched.launch(prog, out, vals=(elements, 3))
                    reader = sched.copyout(out)
                    with pytest.raises(DependencyError):
                        data = await reader
                        pytest.fail(f"attempt {attempt}: the reader returned {list(data)[:4]}...")
            await dev.copyin(out, zeros)


async def test_a_reader_on_another_device_never_sees_a_failed_kernels_bytes() -> None:
    from aruntime import transfer

    src_dev, dst_dev = Device["CPU"], Device["CPU:1"]
    prog = await src_dev.compile(STATUS, outs=(0,))
    async with src_dev.buffer(1, dtypes.int32) as out, dst_dev.buffer(1, dtypes.int32) as dst:
        for attempt in range(ATTEMPTS // 2):
            await dst_dev.copyin(dst, array.array("i", [0]))
            failing = src_dev.launch(prog, out, vals=(1, 3))
            moved = transfer(dst, out)
            reader = dst_dev.copyout(dst)
            with pytest.raises(KernelError):
                await failing
            for op in (moved, reader):
                with pytest.raises(DependencyError):
                    data = await op
                    pytest.fail(f"attempt {attempt}: {op.name} after a failed kernel returned {data!r}")
            await src_dev.copyin(out, array.array("i", [0]))


async def test_a_reader_of_a_launch_the_cl_driver_refuses_never_runs() -> None:
    pytest.importorskip("pyopencl", reason="the opencl extra (pyopencl[pocl]) is not installed")
    try:
        dev = Device["CL"]
    except Exception as exc:  # no OpenCL platform here
        pytest.skip(f"CL does not open here: {exc}")
    src = "__kernel void iota(__global int *out) { out[get_global_id(0)] = (int)get_global_id(0) + 1; }"
    prog = await dev.compile(src, "iota", outs=(0,))
    async with dev.buffer(12, dtypes.int32) as out:
        for attempt in range(200):
            await dev.copyin(out, array.array("i", bytes(48)))
            failing = dev.launch(prog.sized((10,), (3,)), out)  # 3 does not divide 10: the driver refuses it
            reader = dev.copyout(out)
            with pytest.raises(Exception, match="WORK_GROUP_SIZE"):
                await failing
            with pytest.raises(DependencyError):
                data = await reader
                pytest.fail(f"attempt {attempt}: the reader returned {list(data)}")
        with anyio.fail_after(10):
            await dev.synchronize()
