"""Kernels shared by the tests: C sources, a gate kernel a test opens by hand, a program that fails, a two-device
ping-pong, and a device on the C or the Python submission path."""

from __future__ import annotations

import array
import ctypes
from collections.abc import Sequence

import anyio
import pytest

from aruntime import BaseDevice, Buffer, Program, Scheduler, dtypes, transfer
from aruntime.engine import NativeEngine
from aruntime.engine.native import submit

SPINS = 4_000_000_000
"""A gate's spin bound: far more than any test waits (a gate never opened would hang the test's fail_after)."""


class Failing(Program):
    """A program whose every run raises, as a kernel that fails."""

    def __call__(self, *args: object) -> None:
        raise ArithmeticError("kernel blew up")


async def closed_gate(dev: BaseDevice) -> tuple[Program, Buffer]:
    """The GATE kernel of ``dev`` and its flag, set to 0: launched with ``vals=(flag.handle, SPINS)``, the
    kernel holds the compute queue until a copy sets the flag."""
    prog = await dev.compile(GATE, outs=(0,))
    flag = await dev.allocate(1, dtypes.int32)
    await dev.copyin(flag, array.array("i", [0]))
    return prog, flag


async def gate_output(dev: BaseDevice) -> Buffer:
    """A zeroed int32 buffer of ``dev`` for a GATE kernel's ``out``: a new buffer may reuse memory where an earlier
    gate left its -1, and :func:`gate_started` would then not wait for this one to start."""
    out = await dev.allocate(1, dtypes.int32)
    await dev.copyin(out, array.array("i", [0]))
    return out


async def gate_started(out: Buffer) -> None:
    """Wait until the GATE kernel writing ``out`` (a CPU device's buffer, zeroed before the launch: see
    :func:`gate_output`) has started: it then runs, and an op behind it on its queue has not started."""
    seen = ctypes.c_int32.from_address(out.handle)
    with anyio.fail_after(10):
        while seen.value != -1:  # noqa: ASYNC110  (a kernel writes it: there is no event to wait on)
            await anyio.sleep(0.001)


SCALE = r"""
#include <stdint.h>
void kernel(float *out, const float *x, int64_t n, double s) {
  for (int64_t i = 0; i < n; i++) out[i] = x[i] * (float)s;
}
"""

SLEEP = r"""
#include <stdint.h>
#include <unistd.h>
/* Hold the compute queue for `ms` milliseconds, then add one to each byte. */
void kernel(uint8_t *buf, int64_t n, int64_t ms) {
  usleep((useconds_t)(ms * 1000));
  for (int64_t i = 0; i < n; i++) buf[i] += 1;
}
"""

COPY_QUEUE_INTS = 1 << 19
"""int32 elements of a buffer over the default ``inline_copy_max`` (2 MiB): its copies go on the copy queue, a copy
that reads what a kernel writes held off it until the kernel is done."""

ADD_ONE = r"""
#include <stdint.h>
void kernel(uint8_t *buf, int64_t n) { for (int64_t i = 0; i < n; i++) buf[i] += 1; }
"""

GATE = r"""
#include <stdint.h>
/* Write -1 to out[0] (it has started), spin until the int32 at address `flag` becomes non-zero (bounded), then
 * write what it saw to out[0]. */
void kernel(int32_t *out, int64_t flag, int64_t max_spins) {
  volatile int32_t *f = (volatile int32_t *)(intptr_t)flag;
  *(volatile int32_t *)out = -1;
  int64_t i = 0;
  while (*f == 0 && i < max_spins) i++;
  out[0] = *f;
}
"""

AFFINE = r"""
#include <stdint.h>
void kernel(uint8_t *b, int64_t n, int64_t a, int64_t c) {
  for (int64_t i = 0; i < n; i++) b[i] = (uint8_t)(b[i] * a + c);
}
"""

ACCUMULATE = r"""
#include <stdint.h>
void kernel(uint8_t *o, const uint8_t *x, int64_t n) { for (int64_t i = 0; i < n; i++) o[i] = (uint8_t)(o[i] + x[i]); }
"""

SPIN_MS = r"""
#include <stdint.h>
#include <time.h>
void kernel(uint8_t *out, int64_t ms) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  do clock_gettime(CLOCK_MONOTONIC, &t);
  while ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 < ms);
  out[0] = 1;
}
"""
"""A kernel that busy-waits ``ms`` milliseconds (``vals=(ms,)``), then sets ``out[0] = 1``."""


INC = r"""
#include <stdint.h>
void kernel(int32_t *b, int64_t n) { for (int64_t i = 0; i < n; i++) b[i] += 1; }
"""


async def ping_pong(devs: Sequence[BaseDevice], n: int, eager: int, scheduled: int) -> list[int]:
    """Add 1 to ``n`` int32 values (0 to n-1) on each of two devices in turn, moving them across each time:
    ``eager`` rounds straight on the devices (each step waits in its queue for the one before, on another queue),
    then ``scheduled`` rounds through a Scheduler (each held in the core); the values at the end."""
    progs = [await dev.compile(INC, outs=(0,)) for dev in devs]
    async with devs[0].buffer(n, dtypes.int32) as a, devs[1].buffer(n, dtypes.int32) as b:
        devs[0].copyin(a, array.array("i", range(n)))
        for _ in range(eager):
            devs[0].launch(progs[0], a, vals=(n,))
            transfer(b, a)
            devs[1].launch(progs[1], b, vals=(n,))
            transfer(a, b)
        async with Scheduler() as sched:
            for _ in range(scheduled):
                sched.launch(progs[0], a, vals=(n,))
                sched.transfer(b, a)
                sched.launch(progs[1], b, vals=(n,))
                sched.transfer(a, b)
            result = sched.copyout(a)
        return list(await result)


def on_path(dev: BaseDevice, path: str) -> BaseDevice:
    """``dev``, submitting on ``path`` (``"c"`` or ``"python"``); the test skips where the C path is unavailable."""
    if path == "c":
        if not isinstance(dev.compute, NativeEngine):
            pytest.skip("the Python engine has no C submission path")
        if dev.compute.fast is None:
            pytest.skip(f"the C submission path is unavailable: {submit.unavailable or 'ARUNTIME_FAST_SUBMIT=0'}")
    else:
        for engine in dev.engines:
            engine.fast = None
    return dev
