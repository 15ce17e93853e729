"""Hostile arguments to the op API (``copyin``, ``copyout`` and ``launch``, on a device and through a
``Scheduler``), on the C submission path and on the Python one.

Each is refused at the call with an error of the right type whose message names what was wrong, and loses
nothing: the hazard logs are as they were, a round trip on the device still gives the right bytes, and once the
test's buffers are freed the device's ``memory_stats()["in_use"]`` is back at its baseline. Each case runs on two
devices, one per path (the C path's cases skip where it is unavailable, e.g. under ``ARUNTIME_FAST_SUBMIT=0``).
What ``tests/test_fast_submit.py`` (``_refusals``) and the reliability catalogue already pin for a device's own
methods is not repeated here.
"""

from __future__ import annotations

import array
import ctypes
import gc
import math
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from aruntime import BaseDevice, Buffer, BufferUsageError, Device, DeviceError, Program, Scheduler, dtypes
from tests.kernels import ADD_ONE, GATE, SPINS, on_path

try:
    import numpy as np
except ImportError:  # numpy is optional: its cases are left out
    np = None

pytestmark = pytest.mark.anyio

PATHS = ("c", "python")
_INDEX = {"c": 140, "python": 141}  # CPU:140 / NULL:140 submit in C, CPU:141 / NULL:141 in Python
OTHER = "CPU:142"  # the other device whose buffers and programs are foreign to both

MIX = r"""
#include <stdint.h>
void kernel(double *out, const uint8_t *x, int8_t a, uint64_t d, double f) { out[0] = x[0] + a + (double)d + f; }
"""
"""A kernel with a scalar of three packings: what it computes shows what each scalar arrived as."""

HUGE = 1 << 70


# ---- devices on each path ------------------------------------------------------------------------------------


def _device(path: str, kind: str = "CPU") -> BaseDevice:
    return on_path(Device[f"{kind}:{_INDEX[path]}"], path)


_programs: dict[tuple[str, str, tuple[int, ...] | None], Program] = {}


async def _compile(dev: BaseDevice, src: str, outs: tuple[int, ...] | None = (0,)) -> Program:
    """``dev.compile(src, outs=outs)``, once per open device."""
    key = (dev.name, src, outs)
    prog = _programs.get(key)
    if prog is None or prog.device is not dev:
        prog = _programs[key] = await dev.compile(src, outs=outs)
    return prog


def _in_use(*devs: BaseDevice) -> list[int]:
    return [dev.memory_stats()["in_use"] for dev in devs]


@dataclass
class Rig:
    """A device on one path with what the cases need: the buffers they name, and the baseline of memory."""

    dev: BaseDevice
    other: BaseDevice
    add: Program  # ADD_ONE, writes buffer 0
    add_all: Program  # ADD_ONE, compiled without outs
    mix: Program
    foreign_add: Program  # ADD_ONE on the other device
    buf: Buffer  # 8 x uint8
    out: Buffer  # 1 x float64
    x: Buffer  # 1 x uint8
    freed: Buffer
    foreign: Buffer  # 8 x uint8 on the other device
    bound_view: Buffer  # a view of a freed root, bound before the free
    unbound_view: Buffer  # a view of a freed root, never bound
    unallocated: Buffer
    baseline: list[int]

    def logs(self) -> list[list[Any]]:
        return [list(b.log.entries) for b in (self.buf, self.out, self.x)]

    async def round_trip(self) -> None:
        """The device still works: copy in, a kernel, copy out give the right bytes."""
        await self.dev.copyin(self.buf, bytes(range(8)))
        await self.dev.launch(self.add, self.buf, vals=(8,))
        assert bytes(await self.dev.copyout(self.buf)) == bytes(range(1, 9))

    async def close(self) -> None:
        """Free what the rig allocated (waiting for any op on it) and check the memory is back at the baseline."""
        for b in (self.buf, self.out, self.x):
            await self.dev.free(b)
        await self.other.free(self.foreign)
        assert _in_use(self.dev, self.other) == self.baseline


async def _rig(path: str) -> Rig:
    dev, other = _device(path), Device[OTHER]
    add, add_all = await _compile(dev, ADD_ONE), await _compile(dev, ADD_ONE, None)
    mix, foreign_add = await _compile(dev, MIX), await _compile(other, ADD_ONE)
    baseline = _in_use(dev, other)
    freed, root, root2 = await dev.allocate(8), await dev.allocate(16), await dev.allocate(16)
    bound_view, unbound_view = root.view(8, dtypes.uint8, 8), root2.view(8, dtypes.uint8, 0)
    await dev.copyin(bound_view, bytes(8))  # the view has its handle
    for b in (freed, root, root2):
        await dev.free(b)
    x = await dev.allocate(1)
    await dev.copyin(x, b"\x03")
    return Rig(
        dev=dev,
        other=other,
        add=add,
        add_all=add_all,
        mix=mix,
        foreign_add=foreign_add,
        buf=await dev.allocate(8),
        out=await dev.allocate(1, dtypes.float64),
        x=x,
        freed=freed,
        foreign=await other.allocate(8),
        bound_view=bound_view,
        unbound_view=unbound_view,
        unallocated=Buffer(dev.name, 8),
        baseline=baseline,
    )


# ---- hostile objects -----------------------------------------------------------------------------------------


class _Index:
    """Not an int, but has ``__index__``."""

    def __index__(self) -> int:
        return 8


class _LyingInt(int):
    """An int whose comparisons say whatever the check wants to hear."""

    def __lt__(self, other: object) -> bool:
        return True

    def __le__(self, other: object) -> bool:
        return True

    def __gt__(self, other: object) -> bool:
        return True

    def __ge__(self, other: object) -> bool:
        return True


class _ShortBytes(bytes):
    """Four bytes whose ``__len__`` says eight."""

    def __len__(self) -> int:
        return 8


class _IterRaises(tuple):
    """A tuple of scalars whose iteration raises."""

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("iterating these vals fails")


class _FloatLies(int):
    """An int whose ``float()`` is another number."""

    def __float__(self) -> float:
        return 99.0


def _released() -> memoryview:
    view = memoryview(bytearray(8))
    view.release()
    return view


def _read_only_mmap() -> mmap.mmap:
    return mmap.mmap(-1, 8, prot=mmap.PROT_READ)


def _closed_mmap() -> mmap.mmap:
    m = mmap.mmap(-1, 8)
    m.close()
    return m


def _iterated() -> Iterator[int]:
    yield 8


# ---- the cases -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[..., object]  # given the rig (and the scheduler)
    error: type[BaseException]
    match: str  # a regular expression the message must match: it names what was wrong


B = BufferUsageError
PRIORITY = r"priority must be 0 \(normal\) or -1 \(high\), got "

LAUNCH = [
    Case(
        "scalar-given-as-a-buffer", lambda r: r.dev.launch(r.add, r.buf, 8), B, "argument 1: expected a Buffer, got int"
    ),
    Case(
        "None-buffer", lambda r: r.dev.launch(r.add, None, vals=(8,)), B, "argument 0: expected a Buffer, got NoneType"
    ),
    Case("foreign-buffer", lambda r: r.dev.launch(r.add, r.foreign, vals=(8,)), B, f"belongs to {OTHER}, not CPU:14"),
    Case("bound-view-of-freed-root", lambda r: r.dev.launch(r.add, r.bound_view, vals=(8,)), B, "at 8> was freed"),
    Case("unbound-view-of-freed-root", lambda r: r.dev.launch(r.add, r.unbound_view, vals=(8,)), B, "at 0> was freed"),
    Case("unallocated-buffer", lambda r: r.dev.launch(r.add, r.unallocated, vals=(8,)), B, "is not allocated"),
    Case(
        "foreign-program", lambda r: r.dev.launch(r.foreign_add, r.buf, vals=(8,)), DeviceError, "is not a program of"
    ),
    Case("None-program", lambda r: r.dev.launch(None, r.buf, vals=(8,)), DeviceError, "None is not a program of"),
    Case(
        "scalar-2**64",
        lambda r: r.dev.launch(r.add, r.buf, vals=(1 << 64,)),
        ValueError,
        "scalar 0 = 18446744073709551616 does not fit",
    ),
    Case(
        "scalar-below-int64",
        lambda r: r.dev.launch(r.add, r.buf, vals=(-(1 << 63) - 1,)),
        ValueError,
        "scalar 0 = -9223372036854775809 does not fit",
    ),
    Case(
        "nan-for-an-int",
        lambda r: r.dev.launch(r.add, r.buf, vals=(math.nan,)),
        TypeError,
        r"scalar 0 is a float \(nan\) but 'int64_t n'",
    ),
    Case(
        "inf-for-an-int",
        lambda r: r.dev.launch(r.add, r.buf, vals=(math.inf,)),
        TypeError,
        r"scalar 0 is a float \(inf\)",
    ),
    Case(
        "complex-scalar",
        lambda r: r.dev.launch(r.add, r.buf, vals=(1j,)),
        TypeError,
        "scalar 0 must be int or float, got complex",
    ),
    Case(
        "bytes-scalar",
        lambda r: r.dev.launch(r.add, r.buf, vals=(b"8",)),
        TypeError,
        "scalar 0 must be int or float, got bytes",
    ),
    Case(
        "__index__-scalar",
        lambda r: r.dev.launch(r.add, r.buf, vals=(_Index(),)),
        TypeError,
        "scalar 0 must be int or float, got _Index",
    ),
    Case(
        "nan-as-scalar-2",
        lambda r: r.dev.launch(r.mix, r.out, r.x, vals=(1, math.nan, 0.0)),
        TypeError,
        r"scalar 1 is a float \(nan\) but 'uint64_t d'",
    ),
    Case(
        "vals-None",
        lambda r: r.dev.launch(r.add, r.buf, vals=None),
        TypeError,
        "vals must be a tuple or list of scalars, got NoneType",
    ),
    Case(
        "vals-dict",
        lambda r: r.dev.launch(r.add, r.buf, vals={8: 8}),
        TypeError,
        "vals must be a tuple or list of scalars, got dict",
    ),
    Case("vals-generator", lambda r: r.dev.launch(r.add, r.buf, vals=_iterated()), TypeError, "got generator"),
    Case(
        "vals-str",
        lambda r: r.dev.launch(r.add, r.buf, vals="8"),
        TypeError,
        "vals must be a tuple or list of scalars, got str",
    ),
    Case(
        "vals-bytes",
        lambda r: r.dev.launch(r.add, r.buf, vals=b"\x08"),
        TypeError,
        "vals must be a tuple or list of scalars, got bytes",
    ),
    Case("no-scalars", lambda r: r.dev.launch(r.add, r.buf), TypeError, r"takes 1 scalar\(s\) \(int64_t n\), got 0"),
    Case(
        "outs-negative",
        lambda r: r.dev.launch(r.add, r.buf, vals=(8,), outs=(-1,)),
        ValueError,
        r"outs \[-1\] out of range for 1 buffers",
    ),
    Case(
        "outs-huge",
        lambda r: r.dev.launch(r.add, r.buf, vals=(8,), outs=(HUGE,)),
        ValueError,
        rf"outs \[{HUGE}\] out of range for 1 buffers",
    ),
    Case(
        "outs-float",
        lambda r: r.dev.launch(r.add, r.buf, vals=(8,), outs=(0.0,)),
        TypeError,
        r"outs must be a sequence of buffer indices \(int\), got \(0\.0,\)",
    ),
    Case(
        "outs-bool",
        lambda r: r.dev.launch(r.add, r.buf, vals=(8,), outs=(True,)),
        TypeError,
        r"buffer indices \(int\), got \(True,\)",
    ),
    Case(
        "outs-an-int",
        lambda r: r.dev.launch(r.add, r.buf, vals=(8,), outs=0),
        TypeError,
        r"buffer indices \(int\), got 0",
    ),
    Case(
        "outs-str",
        lambda r: r.dev.launch(r.add, r.buf, vals=(8,), outs="0"),
        TypeError,
        r"buffer indices \(int\), got '0'",
    ),
    Case(
        "no-buffers-program-outs",
        lambda r: r.dev.launch(r.add, vals=(8,)),
        ValueError,
        r"outs \[0\] out of range for 0 buffers",
    ),
    Case(
        "no-buffers", lambda r: r.dev.launch(r.add_all, vals=(8,)), B, r"takes 1 buffer\(s\) \(uint8_t \*buf\), got 0"
    ),
    Case(
        "two-buffers",
        lambda r: r.dev.launch(r.add, r.buf, r.buf, vals=(8,)),
        B,
        r"takes 1 buffer\(s\) \(uint8_t \*buf\), got 2",
    ),
    Case("17-buffers", lambda r: r.dev.launch(r.add, *[r.buf] * 17, vals=(8,)), B, r"takes 1 buffer\(s\) .*, got 17"),
    Case(
        "priority-huge",
        lambda r: r.dev.launch(r.add, r.buf, vals=(8,), priority=HUGE),
        ValueError,
        PRIORITY + str(HUGE),
    ),
    Case(
        "priority-minus-huge",
        lambda r: r.dev.launch(r.add, r.buf, vals=(8,), priority=-HUGE),
        ValueError,
        PRIORITY + str(-HUGE),
    ),
    Case("priority-float", lambda r: r.dev.launch(r.add, r.buf, vals=(8,), priority=0.0), ValueError, PRIORITY + "0.0"),
    Case(
        "priority-bool", lambda r: r.dev.launch(r.add, r.buf, vals=(8,), priority=False), ValueError, PRIORITY + "False"
    ),
    Case("priority-str", lambda r: r.dev.launch(r.add, r.buf, vals=(8,), priority="0"), ValueError, PRIORITY + "'0'"),
    Case("hold-str", lambda r: r.dev.launch(r.add, r.buf, vals=(8,), hold="no"), TypeError, "hold"),
    Case(
        "window-object",
        lambda r: r.dev.launch(r.add, r.buf, vals=(8,), window=object()),
        TypeError,
        "window",
    ),
    Case(
        "lying-int-scalar",
        lambda r: r.dev.launch(r.add, r.buf, vals=(_LyingInt(HUGE),)),
        ValueError,
        "scalar 0",
    ),
]

SOURCE = "expected a C-contiguous buffer-protocol object, got "
COPYIN = [
    Case("None-source", lambda r: r.dev.copyin(r.buf, None), B, SOURCE + "NoneType"),
    Case("str-source", lambda r: r.dev.copyin(r.buf, "12345678"), B, SOURCE + "str"),
    Case("buffer-as-source", lambda r: r.dev.copyin(r.buf, r.x), B, SOURCE + "Buffer"),
    Case(
        "strided-source",
        lambda r: r.dev.copyin(r.buf, memoryview(bytearray(16))[::2]),
        B,
        SOURCE + "memoryview: .*not C-contiguous",
    ),
    Case(
        "released-memoryview",
        lambda r: r.dev.copyin(r.buf, _released()),
        B,
        SOURCE + "memoryview: .*released memoryview",
    ),
    Case("closed-mmap", lambda r: r.dev.copyin(r.buf, _closed_mmap()), B, SOURCE + "mmap: mmap closed or invalid"),
    Case(
        "pointer-format",
        lambda r: r.dev.copyin(r.buf, memoryview(bytearray(8)).cast("P")),
        B,
        "buffer format 'P' holds pointers",
    ),
    Case(
        "ctypes-pointers",
        lambda r: r.dev.copyin(r.buf, (ctypes.c_void_p * 1)()),
        B,
        "c_void_p_Array_1 with buffer format '<P' holds pointers",
    ),
    Case("len-lies", lambda r: r.dev.copyin(r.buf, _ShortBytes(b"1234")), B, "source has 4 bytes, .* has 8"),
    Case("array-of-4-bytes", lambda r: r.dev.copyin(r.buf, array.array("i", [1])), B, "source has 4 bytes"),
    Case("empty-bytearray", lambda r: r.dev.copyin(r.buf, bytearray()), B, "source has 0 bytes"),
    Case("bound-view-of-freed-root", lambda r: r.dev.copyin(r.bound_view, bytes(8)), B, "at 8> was freed"),
    Case(
        "priority-huge",
        lambda r: r.dev.copyin(r.buf, bytes(8), priority=HUGE),
        ValueError,
        PRIORITY + str(HUGE),
    ),
    Case("priority-float", lambda r: r.dev.copyin(r.buf, bytes(8), priority=-1.0), ValueError, PRIORITY + "-1.0"),
    Case("hold-str", lambda r: r.dev.copyin(r.buf, bytes(8), hold="no"), TypeError, "hold"),
    Case("window-int", lambda r: r.dev.copyin(r.buf, bytes(8), window=1), TypeError, "window"),
]

DEST = "copyout into: expected a writable, C-contiguous buffer-protocol object, got "
COPYOUT = [
    Case(
        "read-only-memoryview",
        lambda r: r.dev.copyout(r.buf, into=memoryview(bytearray(8)).toreadonly()),
        B,
        DEST + "memoryview: .*not writable",
    ),
    Case("read-only-mmap", lambda r: r.dev.copyout(r.buf, into=_read_only_mmap()), B, DEST + "mmap"),
    Case(
        "strided-destination",
        lambda r: r.dev.copyout(r.buf, into=memoryview(bytearray(16))[::2]),
        B,
        DEST + "memoryview: .*not C-contiguous",
    ),
    Case(
        "released-memoryview",
        lambda r: r.dev.copyout(r.buf, into=_released()),
        B,
        DEST + "memoryview: .*released memoryview",
    ),
    Case("str-destination", lambda r: r.dev.copyout(r.buf, into="x" * 8), B, DEST + "str"),
    Case("list-destination", lambda r: r.dev.copyout(r.buf, into=[0] * 8), B, DEST + "list"),
    Case(
        "ctypes-pointers",
        lambda r: r.dev.copyout(r.buf, into=(ctypes.c_void_p * 1)()),
        B,
        "copyout into: c_void_p_Array_1 .* holds pointers",
    ),
    Case(
        "destination-too-big", lambda r: r.dev.copyout(r.buf, into=bytearray(9)), B, "destination has 9 bytes, .* has 8"
    ),
    Case("empty-destination", lambda r: r.dev.copyout(r.buf, into=bytearray()), B, "destination has 0 bytes"),
    Case("unbound-view-of-freed-root", lambda r: r.dev.copyout(r.unbound_view), B, "at 0> was freed"),
    Case("unallocated-buffer", lambda r: r.dev.copyout(r.unallocated), B, "is not allocated"),
    Case(
        "priority-huge",
        lambda r: r.dev.copyout(r.buf, priority=HUGE),
        ValueError,
        PRIORITY + str(HUGE),
    ),
    Case("priority-one", lambda r: r.dev.copyout(r.buf, priority=1), ValueError, PRIORITY + "1"),
    Case("window-str", lambda r: r.dev.copyout(r.buf, window="sched"), TypeError, "window"),
]

if np is not None:
    COPYIN += [
        Case(
            "numpy-objects",
            lambda r: r.dev.copyin(r.buf, np.empty(1, dtype=object)),
            B,
            "ndarray with buffer format 'O' holds pointers",
        ),
    ]
    COPYOUT += [
        Case(
            "numpy-fortran-order",
            lambda r: r.dev.copyout(r.buf, into=np.zeros((2, 4), np.uint8, order="F")),
            B,
            DEST + "ndarray: ndarray is not C-contiguous",
        ),
        Case(
            "numpy-column-slice",
            lambda r: r.dev.copyout(r.buf, into=np.zeros((4, 4), np.uint8)[:, :2]),
            B,
            DEST + "ndarray: ndarray is not C-contiguous",
        ),
    ]


def _params(cases: dict[str, list[Case]]) -> list[Any]:
    """Each case on each path."""
    return [
        pytest.param(path, case, id=f"{path}-{method}-{case.id}")
        for method, group in cases.items()
        for case in group
        for path in PATHS
    ]


@pytest.mark.parametrize(("path", "case"), _params({"launch": LAUNCH, "copyin": COPYIN, "copyout": COPYOUT}))
async def test_a_bad_argument_is_refused_and_loses_nothing(path: str, case: Case) -> None:
    rig = await _rig(path)
    try:
        logs = rig.logs()
        with pytest.raises(case.error, match=case.match):
            case.call(rig)
        assert rig.logs() == logs  # no hazard log learnt of the refused op
        await rig.round_trip()
    finally:
        await rig.close()


# ---- through a scheduler -------------------------------------------------------------------------------------

SCHEDULED = [
    Case(
        "not-a-buffer-copyin",
        lambda r, s: s.copyin(b"x", bytes(8)),
        B,
        "expected a Buffer, got bytes",
    ),
    Case("not-a-buffer-copyout", lambda r, s: s.copyout(None), B, "expected a Buffer, got NoneType"),
    Case(
        "not-a-program",
        lambda r, s: s.launch("kernel", r.buf),
        DeviceError,
        "'kernel' is not a program",
    ),
    Case("None-source", lambda r, s: s.copyin(r.buf, None), B, SOURCE + "NoneType"),
    Case(
        "priority-huge-launch",
        lambda r, s: s.launch(r.add, r.buf, vals=(8,), priority=HUGE),
        ValueError,
        PRIORITY + str(HUGE),
    ),
    Case(
        "priority-huge-copyout",
        lambda r, s: s.copyout(r.buf, priority=-HUGE),
        ValueError,
        PRIORITY + str(-HUGE),
    ),
    Case("priority-float", lambda r, s: s.copyin(r.buf, bytes(8), priority=0.0), ValueError, PRIORITY + "0.0"),
    Case("source-too-short", lambda r, s: s.copyin(r.buf, memoryview(bytearray(7))), B, "source has 7 bytes"),
    Case("strided-source", lambda r, s: s.copyin(r.buf, memoryview(bytearray(16))[::2]), B, "not C-contiguous"),
    Case("read-only-destination", lambda r, s: s.copyout(r.buf, into=bytes(8)), B, DEST + "bytes"),
    Case("foreign-buffer", lambda r, s: s.launch(r.add, r.foreign, vals=(8,)), B, f"argument 0: .* belongs to {OTHER}"),
    Case("freed-buffer", lambda r, s: s.launch(r.add, r.freed, vals=(8,)), B, "was freed"),
    Case("view-of-freed-root", lambda r, s: s.copyout(r.bound_view), B, "at 8> was freed"),
    Case(
        "nan-for-an-int",
        lambda r, s: s.launch(r.add, r.buf, vals=(math.nan,)),
        TypeError,
        r"scalar 0 is a float \(nan\)",
    ),
    Case(
        "outs-negative",
        lambda r, s: s.launch(r.add, r.buf, vals=(8,), outs=(-1,)),
        ValueError,
        r"outs \[-1\] out of range",
    ),
]


@pytest.mark.parametrize(("path", "case"), _params({"sched": SCHEDULED}))
async def test_a_bad_argument_through_a_scheduler_is_refused_and_loses_nothing(path: str, case: Case) -> None:
    """Refused by the scheduler's op method as by the device's; the scheduler holds nothing of it (no op in
    flight or queued) and still runs ops, and leaving it raises nothing."""
    rig = await _rig(path)
    try:
        async with Scheduler(window=4) as sched:
            logs = rig.logs()
            with pytest.raises(case.error, match=case.match):
                case.call(rig, sched)
            assert rig.logs() == logs
            assert (sched.in_flight, sched.queued) == (0, 0)
            sched.copyin(rig.buf, bytes(range(8)))
            sched.launch(rig.add, rig.buf, vals=(8,))
            assert bytes(await sched.copyout(rig.buf)) == bytes(range(1, 9))
        await rig.round_trip()
    finally:
        await rig.close()


@pytest.mark.parametrize("path", PATHS)
async def test_a_closed_scheduler_refuses_every_op_first(path: str) -> None:
    """A closed scheduler says so whatever else is wrong with the op, and submits nothing."""
    rig = await _rig(path)
    try:
        async with Scheduler() as sched:
            pass
        logs = rig.logs()
        for call in (
            lambda: sched.copyin(rig.buf, bytes(8)),
            lambda: sched.copyin(rig.buf, None),
            lambda: sched.copyout(rig.buf, into=bytes(8)),
            lambda: sched.launch(rig.add, rig.buf, vals=(8,)),
            lambda: sched.launch(rig.add, rig.buf, vals=("8",), priority=HUGE),
        ):
            with pytest.raises(RuntimeError, match="the scheduler is not open"):
                call()
        assert rig.logs() == logs
        await rig.round_trip()
    finally:
        await rig.close()


# ---- the NULL device -----------------------------------------------------------------------------------------


@dataclass
class NullRig:
    dev: BaseDevice
    prog: Program
    buf: Buffer
    cpu_buf: Buffer  # of the CPU device on the same path
    cpu_prog: Program


NULL_CASES = [
    Case("None-source", lambda n: n.dev.copyin(n.buf, None), B, SOURCE + "NoneType"),
    Case(
        "priority-huge",
        lambda n: n.dev.launch(n.prog, n.buf, priority=HUGE),
        ValueError,
        PRIORITY + str(HUGE),
    ),
    Case(
        "vals-None",
        lambda n: n.dev.launch(n.prog, n.buf, vals=None),
        TypeError,
        "vals must be a tuple or list of scalars, got NoneType",
    ),
    Case(
        "str-scalar",
        lambda n: n.dev.launch(n.prog, n.buf, vals=("x",)),
        TypeError,
        "scalar 0 must be int or float, got str",
    ),
    Case(
        "scalar-2**64",
        lambda n: n.dev.launch(n.prog, n.buf, vals=(1 << 64,)),
        ValueError,
        "scalar 0 = 18446744073709551616",
    ),
    Case(
        "outs-out-of-range",
        lambda n: n.dev.launch(n.prog, n.buf, outs=(3,)),
        ValueError,
        r"outs \[3\] out of range for 1 buffers",
    ),
    Case("cpu-buffer", lambda n: n.dev.launch(n.prog, n.cpu_buf), B, "argument 0: .* belongs to CPU:14., not NULL:14"),
    Case("cpu-program", lambda n: n.dev.launch(n.cpu_prog, n.buf), DeviceError, "is not a program of NULL:14"),
    Case("source-too-short", lambda n: n.dev.copyin(n.buf, bytes(7)), B, "source has 7 bytes"),
    Case("read-only-destination", lambda n: n.dev.copyout(n.buf, into=bytes(8)), B, DEST + "bytes"),
    Case(
        "strided-destination",
        lambda n: n.dev.copyout(n.buf, into=memoryview(bytearray(16))[::2]),
        B,
        "not C-contiguous",
    ),
]


@pytest.mark.parametrize(("path", "case"), _params({"null": NULL_CASES}))
async def test_a_bad_argument_on_the_null_device_is_refused_and_loses_nothing(path: str, case: Case) -> None:
    """The NULL device runs nothing, but its ops take the same checks."""
    dev, cpu_dev = _device(path, "NULL"), _device(path)
    prog, cpu_prog = await _compile(dev, "anything"), await _compile(cpu_dev, ADD_ONE)
    baseline = _in_use(dev, cpu_dev)
    rig = NullRig(dev, prog, await dev.allocate(8), await cpu_dev.allocate(8), cpu_prog)
    try:
        logs = list(rig.buf.log.entries)
        with pytest.raises(case.error, match=case.match):
            case.call(rig)
        assert list(rig.buf.log.entries) == logs
        await dev.copyin(rig.buf, bytes(8))
        await dev.launch(prog, rig.buf)
        assert len(await dev.copyout(rig.buf)) == 8
    finally:
        await dev.free(rig.buf)
        await cpu_dev.free(rig.cpu_buf)
    assert _in_use(dev, cpu_dev) == baseline


# ---- buffers freed, closed devices -------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
async def test_a_buffer_freed_between_two_ops_is_refused_and_released_after_the_first(path: str) -> None:
    """A kernel held behind a closed gate keeps a freed buffer's memory until it has run; the ops after the free,
    on the buffer or on a view of it, are refused; then the memory is back."""
    rig = await _rig(path)
    dev = rig.dev
    gate = await _compile(dev, GATE)
    flag, started = await dev.allocate(1, dtypes.int32), await dev.allocate(1, dtypes.int32)
    await dev.copyin(flag, array.array("i", [0]))
    try:
        held = dev.launch(gate, started, vals=(flag.handle, SPINS))  # holds the compute queue
        before = _in_use(dev)[0]
        root = await dev.allocate(1 << 16)
        view = root.view(8, dtypes.uint8, 8)
        first = [dev.copyin(root, bytes(1 << 16)), dev.launch(rig.add, view, vals=(8,))]
        root.deallocate()
        for call in (
            lambda: dev.copyout(root),
            lambda: dev.copyin(root, bytes(1 << 16)),
            lambda: dev.launch(rig.add, root, vals=(8,)),
            lambda: dev.copyout(view),
            lambda: dev.copyin(view, bytes(8)),
            lambda: dev.launch(rig.add, view, vals=(8,)),
        ):
            with pytest.raises(BufferUsageError, match="was freed"):
                call()
        with pytest.raises(BufferUsageError, match="is not allocated"):
            root.deallocate()  # a second free is refused too
        assert not first[1].done()
        assert _in_use(dev)[0] == before + (1 << 16)  # the root's memory, kept for the kernel
        ctypes.c_int32.from_address(flag.handle).value = 1
        with anyio.fail_after(30):
            for op in (held, *first):
                await op
        assert _in_use(dev)[0] == before  # the root's memory is back
        await rig.round_trip()
    finally:
        ctypes.c_int32.from_address(flag.handle).value = 1
        await dev.free(started)
        await dev.free(flag)
        await rig.close()


@pytest.mark.parametrize("path", PATHS)
async def test_a_view_follows_its_root_allocated_again(path: str) -> None:
    """A view bound to an earlier allocation of its root is not used with the stale handle: its ops land in the
    root's present memory."""
    rig = await _rig(path)
    try:
        dev = rig.dev
        root = await dev.allocate(16)
        view = root.view(8, dtypes.uint8, 8)
        await dev.copyin(view, bytes(8))  # bound
        await dev.free(root)
        root.allocate()
        await dev.copyin(root, bytes(16))
        await dev.copyin(view, bytes(range(8)))
        await dev.launch(rig.add, view, vals=(8,))
        assert bytes(await dev.copyout(root)) == bytes(8) + bytes(range(1, 9))
        await dev.free(root)
    finally:
        await rig.close()


@pytest.mark.parametrize("path", PATHS)
async def test_ops_on_a_closed_device_and_its_buffers_on_a_reopened_one_are_refused(path: str) -> None:
    name = f"CPU:{_INDEX[path] + 3}"
    dev = on_path(Device[name], path)
    prog = await dev.compile(ADD_ONE, outs=(0,))
    buf = await dev.allocate(8)
    await dev.aclose()
    for call, what in (
        (lambda: dev.copyin(buf, bytes(8)), "copyin 8 B"),
        (lambda: dev.copyout(buf), "copyout 8 B"),
        (lambda: dev.copyout(buf, into=bytearray(8)), "copyout 8 B"),
        (lambda: dev.launch(prog, buf, vals=(8,)), "kernel"),
    ):
        with pytest.raises(DeviceError, match=f"{what}: {name} is closed"):
            call()
    fresh = on_path(Device[name], path)
    try:
        assert fresh is not dev
        with pytest.raises(BufferUsageError, match=f"was allocated on a {name} that has been closed"):
            fresh.copyin(buf, bytes(8))
        with pytest.raises(BufferUsageError, match=f"was allocated on a {name} that has been closed"):
            fresh.copyout(buf)
        other = await fresh.allocate(8)
        with pytest.raises(DeviceError, match=f"is not a program of {name}"):
            fresh.launch(prog, other, vals=(8,))
        await fresh.copyin(other, bytes(8))
        await fresh.launch(await fresh.compile(ADD_ONE, outs=(0,)), other, vals=(8,))
        assert bytes(await fresh.copyout(other)) == b"\x01" * 8
    finally:
        await fresh.aclose()


# ---- the two paths agree -------------------------------------------------------------------------------------


async def _outcome(dev: BaseDevice, vals: Any) -> object:
    """What launching MIX with ``vals`` on ``dev`` gives: its result, or the error's type and message."""
    prog = await _compile(dev, MIX)
    async with dev.buffer(1, dtypes.float64) as out, dev.buffer(1) as x:
        await dev.copyin(x, b"\x03")
        try:
            await dev.launch(prog, out, x, vals=vals)
        except Exception as exc:  # the outcome to compare
            return type(exc), str(exc).replace(dev.name, "DEV")
        return (await dev.copyout(out)).tolist()


async def test_a_tuple_subclass_of_scalars_is_taken_alike_on_both_paths() -> None:
    fast, slow = _device("c"), _device("python")
    vals = _IterRaises((1, 2, 5.0))
    assert await _outcome(fast, vals) == await _outcome(slow, vals)


async def test_an_int_subclass_for_a_double_is_converted_alike_on_both_paths() -> None:
    fast, slow = _device("c"), _device("python")
    vals = (1, 2, _FloatLies(5))
    assert await _outcome(fast, vals) == await _outcome(slow, vals)


async def test_awkward_but_valid_scalars_arrive_alike_on_both_paths() -> None:
    """Bools, a list, NaN and infinity for a double, the int64 limits: accepted, and the same on both paths."""
    fast, slow = _device("c"), _device("python")
    for vals in [(True, False, True), [1, 2, 5.0], (0, 0, math.nan), (0, 0, -math.inf), (-128, (1 << 63) - 1, 0.0)]:
        got = await _outcome(fast, vals)
        assert isinstance(got, list), got
        assert repr(got) == repr(await _outcome(slow, vals))  # repr: nan == nan


# ---- nothing held, nothing crashed -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
async def test_refused_ops_hold_no_reference_to_their_arguments(path: str) -> None:
    rig = await _rig(path)
    try:
        short, read_only, vals, strided = bytes(7), bytes(8), ("8",), memoryview(bytearray(16))[::2]
        calls = (
            lambda: rig.dev.copyin(rig.buf, short),
            lambda: rig.dev.copyin(rig.buf, strided),
            lambda: rig.dev.copyout(rig.buf, into=read_only),
            lambda: rig.dev.copyin(rig.foreign, read_only),
            lambda: rig.dev.launch(rig.add, rig.buf, vals=vals),
            lambda: rig.dev.launch(rig.add, rig.buf, rig.x, vals=(8,)),
        )
        held = (short, read_only, vals, strided, rig.buf, rig.x, rig.add, rig.foreign)
        gc.collect()
        before = [sys.getrefcount(o) for o in held]
        for _ in range(200):
            for call in calls:
                with pytest.raises((BufferUsageError, TypeError)):
                    call()
        gc.collect()
        assert [sys.getrefcount(o) for o in held] == before
        await rig.round_trip()
    finally:
        await rig.close()


FAKE_WINDOW = r"""
import ctypes, mmap, anyio
from aruntime import Device

libc = ctypes.CDLL(None)
pages = mmap.mmap(-1, 2 * mmap.PAGESIZE)
start = ctypes.addressof(ctypes.c_char.from_buffer(pages))
assert libc.mprotect(ctypes.c_void_p(start + mmap.PAGESIZE), mmap.PAGESIZE, 0) == 0
last_byte = memoryview(pages)[mmap.PAGESIZE - 1 : mmap.PAGESIZE]  # the page after it cannot be read


class FakeWindow:
    # Not a Scheduler: a one-byte 'gate' where the core reads three 8-byte words.
    def _gate(self):
        return last_byte

    def _admit(self, ops):
        return True


async def main():
    dev = Device["CPU"]
    print("fast", dev.copy.fast is not None, flush=True)
    buf = await dev.allocate(8)
    try:
        op = dev.copyin(buf, bytes(8), window=FakeWindow())
    except Exception as exc:
        print("refused", type(exc).__name__, exc, flush=True)
    else:
        try:
            await op
        except Exception as exc:
            print("failed", type(exc).__name__, exc, flush=True)
        else:
            print("ran", flush=True)

anyio.run(main)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mprotect through libc")
@pytest.mark.parametrize("path", PATHS)
def test_a_fake_windows_gate_never_reaches_the_core(path: str) -> None:
    """Run in a child, so that a crash fails the test and not the run: the window's gate is refused, naming it."""
    env = {**os.environ, "ARUNTIME_FAST_SUBMIT": "1" if path == "c" else "0"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FAKE_WINDOW)], env=env, capture_output=True, text=True, timeout=120
    )
    if path == "c" and proc.stdout.startswith("fast False"):
        pytest.skip(f"the C submission path is unavailable: {proc.stderr[-500:]}")
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "refused TypeError a window's gate must be a writable array('q') of 3 words" in proc.stdout, proc.stdout
