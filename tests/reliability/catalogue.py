"""The bad-input catalogue: every public entry point, the bad inputs tried, and the error each must give.

One table, :data:`ROWS`, drives both ``test_rel_catalogue.py`` (every row is a test, on every loop) and the
table in ``docs/reliability.md`` (checked to be exactly :func:`render`'s output; rewrite it with
``python tests/reliability/catalogue.py``).
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aruntime import BaseDevice, Buffer, BufferScope, BufferSpec, Device, Program, dtypes, from_dlpack, transfer
from aruntime.dtype import to_dtype
from aruntime.errors import AllocationError, BufferUsageError, CompileError, DeviceError
from aruntime.graph import Graph
from aruntime.scheduler import Scheduler

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
BEGIN, END = "<!-- catalogue:begin -->", "<!-- catalogue:end -->"

SCALE = r"""
#include <stdint.h>
void kernel(float *out, const float *x, int64_t n, double s) { for (int64_t i = 0; i < n; i++) out[i] = x[i] * s; }
"""


@dataclass
class Ctx:
    """What the rows act on; made once per test module (see ``test_rel_catalogue.ctx``)."""

    cpu: BaseDevice
    null: BaseDevice
    disk: BaseDevice
    closed: BaseDevice  # a CPU device that was closed
    closed_buf: Buffer  # a buffer allocated on it before it closed
    prog: Program  # SCALE on cpu
    buf: Buffer  # 16 float32 on cpu
    freed: Buffer  # a cpu buffer that was freed
    unallocated: Buffer  # a cpu buffer never allocated
    nullbuf: Buffer  # 16 float32 on null
    workdir: Path


@dataclass(frozen=True)
class Row:
    entry: str  # the public entry point
    bad: str  # the bad input, as the table shows it
    error: type[BaseException]
    match: str  # a fragment the message must contain (plain text)
    run: Callable[[Ctx], Any]  # what raises; an awaitable result is awaited


_fresh = itertools.count(900)


@contextmanager
def _env(key: str, value: str) -> Iterator[None]:
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


def _open_with(key: str, value: str, kind: str = "NULL") -> Callable[[Ctx], Any]:
    def run(c: Ctx) -> Any:
        with _env(key, value):
            return Device[f"{kind}:{next(_fresh)}"]

    return run


def _compile_with(key: str, value: str) -> Callable[[Ctx], Any]:
    async def run(c: Ctx) -> Any:
        with _env(key, value):
            return await c.cpu.compile(SCALE)

    return run


def _scheduler_outside(c: Ctx) -> Any:
    return Scheduler().copyin(c.buf, bytes(64))


def _scope(make: Callable[[Ctx], BufferScope]) -> Callable[[Ctx], Any]:
    async def run(c: Ctx) -> Any:
        async with make(c):
            pass

    return run


def _readonly(n: int) -> np.ndarray[Any, Any]:
    out = np.zeros(n, dtype=np.float32)
    out.setflags(write=False)
    return out


def _set(obj: Any, attr: str, value: Any) -> Callable[[Ctx], Any]:
    def run(c: Ctx) -> Any:
        setattr(obj(c), attr, value)

    return run


B = BufferUsageError
ROWS: list[Row] = [
    # ---- device names
    Row("Device[name]", "`''`", DeviceError, "invalid device name ''", lambda c: Device[""]),
    Row("Device[name]", "`3` (not a str)", DeviceError, "invalid device name 3: not a str", lambda c: Device[3]),
    Row("Device[name]", "`'CPU:-1'`", DeviceError, "a device index must be >= 0", lambda c: Device["CPU:-1"]),
    Row(
        "Device[name]",
        "`'CPU:abc'`",
        DeviceError,
        "KIND:N with N a non-negative int, not 'abc'",
        lambda c: Device["CPU:abc"],
    ),
    Row("Device[name]", "`'CPU:'`", DeviceError, "nothing after ':'", lambda c: Device["CPU:"]),
    Row("Device[name]", "`'CPU:0:0'`", DeviceError, "not '0:0'", lambda c: Device["CPU:0:0"]),
    Row("Device[name]", "`':CPU'`", DeviceError, "no kind before ':'", lambda c: Device[":CPU"]),
    Row("Device[name]", "`'NOPE'` (unknown kind)", DeviceError, "unknown device kind 'NOPE'", lambda c: Device["NOPE"]),
    Row("Device[name]", "`'DISK'` (no path)", DeviceError, "a DISK device needs a file path", lambda c: Device["DISK"]),
    # ---- environment variables, checked when read
    Row(
        "env ARUNTIME_COPY_CHUNK",
        "`-1`",
        ValueError,
        "ARUNTIME_COPY_CHUNK='-1' is out of range: it must be at least 1",
        _open_with("ARUNTIME_COPY_CHUNK", "-1"),
    ),
    Row(
        "env ARUNTIME_COPY_CHUNK",
        "`0`",
        ValueError,
        "ARUNTIME_COPY_CHUNK='0' is out of range",
        _open_with("ARUNTIME_COPY_CHUNK", "0"),
    ),
    Row(
        "env ARUNTIME_COPY_CHUNK",
        "`8M`",
        ValueError,
        "ARUNTIME_COPY_CHUNK='8M' is not a valid int",
        _open_with("ARUNTIME_COPY_CHUNK", "8M"),
    ),
    Row(
        "env ARUNTIME_WAIT_TIMEOUT",
        "`-1`",
        ValueError,
        "ARUNTIME_WAIT_TIMEOUT='-1' is out of range",
        _open_with("ARUNTIME_WAIT_TIMEOUT", "-1"),
    ),
    Row(
        "env ARUNTIME_WAIT_TIMEOUT",
        "`nan`",
        ValueError,
        "ARUNTIME_WAIT_TIMEOUT='nan' is not a number",
        _open_with("ARUNTIME_WAIT_TIMEOUT", "nan"),
    ),
    Row(
        "env ARUNTIME_LRU",
        "`2`",
        ValueError,
        "ARUNTIME_LRU='2' is out of range: it must be at least 0 and at most 1",
        _open_with("ARUNTIME_LRU", "2"),
    ),
    Row(
        "env ARUNTIME_LRU_LIMIT",
        "`-5`",
        ValueError,
        "ARUNTIME_LRU_LIMIT='-5' is out of range",
        _open_with("ARUNTIME_LRU_LIMIT", "-5"),
    ),
    Row(
        "env ARUNTIME_INLINE_COPY_MAX",
        "`-1`",
        ValueError,
        "ARUNTIME_INLINE_COPY_MAX='-1' is out of range",
        _open_with("ARUNTIME_INLINE_COPY_MAX", "-1"),
    ),
    Row(
        "env ARUNTIME_MMAP_MIN",
        "`0`",
        ValueError,
        "ARUNTIME_MMAP_MIN='0' is out of range",
        _open_with("ARUNTIME_MMAP_MIN", "0", "CPU"),
    ),
    Row(
        "env ARUNTIME_METRICS",
        "`2`",
        ValueError,
        "ARUNTIME_METRICS='2' is out of range: it must be at least 0 and at most 1",
        _open_with("ARUNTIME_METRICS", "2"),
    ),
    Row(
        "env ARUNTIME_FAST_SUBMIT",
        "`yes`",
        ValueError,
        "ARUNTIME_FAST_SUBMIT='yes'",
        _open_with("ARUNTIME_FAST_SUBMIT", "yes"),
    ),
    Row(
        "env ARUNTIME_CPU_AFFINITY",
        "`4096`",
        ValueError,
        "ARUNTIME_CPU_AFFINITY='4096': expected 'auto', 'off' or a comma-separated list of the CPUs",
        _open_with("ARUNTIME_CPU_AFFINITY", "4096", "CPU"),
    ),
    Row(
        "env ARUNTIME_WORKERS",
        "`threads`",
        ValueError,
        "ARUNTIME_WORKERS='threads': expected 'shared' or 'queue'",
        _open_with("ARUNTIME_WORKERS", "threads", "CPU"),
    ),
    Row(
        "dev.cpu =",
        "`-1`",
        ValueError,
        "cpu must be one of the CPUs this process may use",
        lambda c: setattr(c.cpu, "cpu", -1),
    ),
    Row(
        "env ARUNTIME_CACHELEVEL",
        "`-1`",
        ValueError,
        "ARUNTIME_CACHELEVEL='-1' is out of range",
        _compile_with("ARUNTIME_CACHELEVEL", "-1"),
    ),
    Row(
        "env ARUNTIME_DISABLE_COMPILER_CACHE",
        "`yes`",
        ValueError,
        "ARUNTIME_DISABLE_COMPILER_CACHE='yes' is not a valid int",
        _compile_with("ARUNTIME_DISABLE_COMPILER_CACHE", "yes"),
    ),
    # ---- allocate
    Row("dev.allocate", "size `0`", B, "size must be a positive int of elements, got 0", lambda c: c.cpu.allocate(0)),
    Row("dev.allocate", "size `-1`", B, "got -1", lambda c: c.cpu.allocate(-1)),
    Row("dev.allocate", "size `1.5`", B, "got 1.5", lambda c: c.cpu.allocate(1.5)),
    Row("dev.allocate", "size `True`", B, "got True", lambda c: c.cpu.allocate(True)),
    Row("dev.allocate", "size `'4'`", B, "got '4'", lambda c: c.cpu.allocate("4")),
    Row(
        "dev.allocate",
        "`2**61 + 16` float64 (bytes overflow 64 bits)",
        B,
        "beyond what the device can address",
        lambda c: c.cpu.allocate(2**61 + 16, dtypes.float64),
    ),
    Row(
        "dev.allocate",
        "`2**63` bytes on NULL",
        B,
        "beyond what the device can address",
        lambda c: c.null.allocate(2**63),
    ),
    Row(
        "dev.allocate",
        "`2**60` bytes (addressable, not there)",
        AllocationError,
        "out of memory allocating",
        lambda c: c.cpu.allocate(2**60),
    ),
    Row("dev.allocate", "dtype `void`", B, "is not a storable dtype", lambda c: c.cpu.allocate(4, dtypes.void)),
    Row(
        "dev.allocate",
        "a pointer dtype",
        B,
        "is not a storable dtype",
        lambda c: c.cpu.allocate(4, dtypes.float32.ptr()),
    ),
    Row(
        "dev.allocate",
        "an image dtype",
        B,
        "is not a storable dtype",
        lambda c: c.cpu.allocate(4, dtypes.imagef((2, 2, 4))),
    ),
    Row(
        "dev.allocate",
        "dtype `'float32'` (a str)",
        B,
        "is not a storable dtype",
        lambda c: c.cpu.allocate(4, "float32"),
    ),
    Row(
        "dev.allocate",
        "spec `{}`",
        B,
        "buffer spec must be a BufferSpec",
        lambda c: c.cpu.allocate(4, dtypes.uint8, {}),
    ),
    Row("dev.allocate", "on a closed device", DeviceError, "is closed; Device[", lambda c: c.closed.allocate(4)),
    Row(
        "dev.allocate",
        "DISK file in a missing directory",
        DeviceError,
        "cannot open",
        lambda c: Device[f"DISK:{c.workdir}/missing/f"].allocate(4),
    ),
    Row(
        "Buffer(...)", "a pointer dtype", B, "not a pointer or an image", lambda c: Buffer("CPU", 4, dtypes.int32.ptr())
    ),
    Row("Buffer(...)", "size `2.0`", B, "positive number of elements, got 2.0", lambda c: Buffer("CPU", 2.0)),
    Row("buf.view", "past the end", B, "is out of range of its", lambda c: c.buf.view(8, dtypes.float32, 40)),
    Row(
        "buf.view",
        "offset `-4`",
        B,
        "view offset must be a non-negative int",
        lambda c: c.buf.view(1, dtypes.float32, -4),
    ),
    Row("dev.free", "a freed buffer", B, "was freed", lambda c: c.cpu.free(c.freed)),
    Row("dev.free", "a NULL buffer on CPU", B, "belongs to NULL, not CPU", lambda c: c.cpu.free(c.nullbuf)),
    # ---- copies
    Row("dev.copyin", "`b'x'` as the buffer", B, "expected a Buffer, got bytes", lambda c: c.cpu.copyin(b"x", b"x")),
    Row("dev.copyin", "a freed buffer", B, "was freed", lambda c: c.cpu.copyin(c.freed, bytes(64))),
    Row("dev.copyin", "an unallocated buffer", B, "is not allocated", lambda c: c.cpu.copyin(c.unallocated, bytes(16))),
    Row(
        "dev.copyin",
        "a buffer of another device",
        B,
        "belongs to NULL, not CPU",
        lambda c: c.cpu.copyin(c.nullbuf, bytes(64)),
    ),
    Row(
        "dev.copyin",
        "a buffer of a closed device",
        DeviceError,
        "is closed",
        lambda c: c.closed.copyin(c.closed_buf, bytes(8)),
    ),
    Row(
        "dev.copyin",
        "a closed device's buffer on the reopened one",
        B,
        "has been closed",
        lambda c: Device[c.closed.name].copyin(c.closed_buf, bytes(8)),
    ),
    Row("dev.copyin", "source of the wrong size", B, "source has 63 bytes", lambda c: c.cpu.copyin(c.buf, bytes(63))),
    Row(
        "dev.copyin",
        "a list as the source",
        B,
        "buffer-protocol object, got list",
        lambda c: c.cpu.copyin(c.buf, [0] * 64),
    ),
    Row(
        "dev.copyin",
        "a non-contiguous source",
        B,
        "C-contiguous",
        lambda c: c.cpu.copyin(c.buf, memoryview(bytes(128))[::2]),
    ),
    Row(
        "dev.copyin",
        "a non-contiguous numpy array",
        B,
        "C-contiguous",
        lambda c: c.cpu.copyin(c.buf, np.arange(32, dtype=np.float32)[::2]),
    ),
    Row("dev.copyout", "a read-only numpy array", B, "writable", lambda c: c.cpu.copyout(c.buf, _readonly(16))),
    Row("dev.copyout", "a read-only destination (`bytes`)", B, "writable", lambda c: c.cpu.copyout(c.buf, bytes(64))),
    Row(
        "dev.copyout",
        "a non-contiguous destination",
        B,
        "C-contiguous",
        lambda c: c.cpu.copyout(c.buf, memoryview(bytearray(128))[::2]),
    ),
    Row(
        "dev.copyout",
        "destination of the wrong size",
        B,
        "destination has 8 bytes",
        lambda c: c.cpu.copyout(c.buf, bytearray(8)),
    ),
    Row("dev.copyout", "a freed buffer", B, "was freed", lambda c: c.cpu.copyout(c.freed)),
    Row(
        "aruntime.transfer",
        "CPU -> NULL (not host memory)",
        B,
        "NULL buffers are not host memory",
        lambda c: transfer(c.nullbuf, c.buf),
    ),
    Row(
        "aruntime.transfer",
        "NULL -> CPU",
        B,
        "NULL buffers are not host memory",
        lambda c: transfer(c.buf, c.nullbuf),
    ),
    Row(
        "aruntime.transfer",
        "sizes differ",
        B,
        "has 64 bytes",
        lambda c: transfer(Buffer("CPU", 8, preallocate=True), c.buf),
    ),
    Row(
        "aruntime.transfer",
        "`None` as the destination",
        B,
        "expected a Buffer destination, got NoneType",
        lambda c: transfer(None, c.buf),
    ),
    Row(
        "aruntime.transfer",
        "`None` as the source",
        B,
        "expected a Buffer source, got NoneType",
        lambda c: transfer(c.buf, None),
    ),
    # ---- compile
    Row(
        "dev.compile",
        "`b'...'` (bytes source)",
        TypeError,
        "src and name must be str",
        lambda c: c.cpu.compile(SCALE.encode()),
    ),
    Row("dev.compile", "`''` (empty source)", CompileError, "kernel source is empty", lambda c: c.cpu.compile("")),
    Row("dev.compile", "whitespace only", CompileError, "kernel source is empty", lambda c: c.null.compile(" \n\t")),
    Row(
        "dev.compile",
        "a lone surrogate `'\\ud800'`",
        CompileError,
        "not valid UTF-8 text: surrogates not allowed",
        lambda c: c.cpu.compile("void kernel(void) {} // \ud800"),
    ),
    Row(
        "dev.compile",
        "C that does not compile",
        CompileError,
        "failed with exit code",
        lambda c: c.cpu.compile("void kernel( {"),
    ),
    Row(
        "dev.compile",
        "name `'k-1'`",
        ValueError,
        "kernel name 'k-1' is not a C identifier",
        lambda c: c.cpu.compile(SCALE, "k-1"),
    ),
    Row(
        "dev.compile",
        "a name the source does not define",
        CompileError,
        "defines no function named 'other'",
        lambda c: c.cpu.compile(SCALE, "other"),
    ),
    Row(
        "dev.compile",
        "outs `'0'`",
        TypeError,
        "outs must be a sequence of buffer indices",
        lambda c: c.cpu.compile(SCALE, outs="0"),
    ),
    Row("dev.compile", "on DISK", DeviceError, "has no compiler", lambda c: c.disk.compile(SCALE)),
    Row("dev.compile", "on a closed device", DeviceError, "is closed", lambda c: c.closed.compile(SCALE)),
    # ---- launch
    Row(
        "dev.launch",
        "a program of another device",
        DeviceError,
        "is not a program of NULL",
        lambda c: c.null.launch(c.prog, c.nullbuf),
    ),
    Row(
        "dev.launch",
        "`'x'` as a buffer",
        B,
        "argument 0: expected a Buffer, got str",
        lambda c: c.cpu.launch(c.prog, "x"),
    ),
    Row("dev.launch", "a freed buffer", B, "was freed", lambda c: c.cpu.launch(c.prog, c.buf, c.freed, vals=(16, 1.0))),
    Row(
        "dev.launch",
        "vals `5` (not a sequence)",
        TypeError,
        "vals must be a tuple or list",
        lambda c: c.cpu.launch(c.prog, c.buf, c.buf, vals=5),
    ),
    Row(
        "dev.launch",
        "a str scalar",
        TypeError,
        "scalar 0 must be int or float, got str",
        lambda c: c.cpu.launch(c.prog, c.buf, c.buf, vals=("16",)),
    ),
    Row(
        "dev.launch",
        "scalar `2**63`",
        ValueError,
        "does not fit in a 64-bit signed int",
        lambda c: c.cpu.launch(c.prog, c.buf, c.buf, vals=(2**63,)),
    ),
    Row(
        "dev.launch",
        "outs `(5,)` for 2 buffers",
        ValueError,
        "out of range for 2 buffers",
        lambda c: c.cpu.launch(c.prog, c.buf, c.buf, vals=(16, 1.0), outs=(5,)),
    ),
    Row("dev.launch", "on DISK", DeviceError, "runs no kernels", lambda c: c.disk.launch(c.prog)),
    # ---- device settings
    Row(
        "dev.timeout",
        "`-1`",
        ValueError,
        "timeout must be a positive number of seconds",
        _set(lambda c: c.cpu, "timeout", -1),
    ),
    Row(
        "dev.timeout",
        "`'1'`",
        ValueError,
        "timeout must be a positive number of seconds",
        _set(lambda c: c.cpu, "timeout", "1"),
    ),
    Row(
        "allocator.cache_limit",
        "`-1`",
        ValueError,
        "cache_limit must be a non-negative int",
        _set(lambda c: c.cpu.allocator, "cache_limit", -1),
    ),
    Row(
        "allocator.cache_limit",
        "`True`",
        ValueError,
        "cache_limit must be a non-negative int",
        _set(lambda c: c.cpu.allocator, "cache_limit", True),
    ),
    # ---- scheduler and graphs
    Row(
        "Scheduler(...)",
        "`window=True`",
        ValueError,
        "window must be a positive int, got True",
        lambda c: Scheduler(window=True),
    ),
    Row(
        "Scheduler(...)",
        "`window=0`",
        ValueError,
        "window must be a positive int, got 0",
        lambda c: Scheduler(window=0),
    ),
    Row(
        "Scheduler(...)",
        "`drain_timeout=-1`",
        ValueError,
        "drain_timeout must be a positive number",
        lambda c: Scheduler(drain_timeout=-1),
    ),
    Row(
        "Scheduler(...)",
        "`queue=-1`",
        ValueError,
        "queue must be a non-negative int, got -1",
        lambda c: Scheduler(queue=-1),
    ),
    Row("sched.copyin", "outside `async with`", RuntimeError, "the scheduler is not open", _scheduler_outside),
    Row(
        "sched.request",
        "`deadline=inf`",
        ValueError,
        "deadline must be a positive number of seconds, finite and below 1e9, got inf",
        lambda c: Scheduler().request(deadline=float("inf")),
    ),
    Row(
        "dev.copyin",
        "`priority=5`",
        ValueError,
        "priority must be 0 (normal) or -1 (high), got 5",
        lambda c: c.cpu.copyin(c.buf, bytes(c.buf.nbytes), priority=5),
    ),
    Row(
        "graph.launch",
        "`None` as the program",
        DeviceError,
        "expected a Program, got NoneType",
        lambda c: Graph().launch(None),
    ),
    Row(
        "graph.transfer",
        "CPU -> NULL (not host memory)",
        B,
        "transfer CPU->NULL: no copy engine reaches both memories",
        lambda c: Graph().transfer(c.nullbuf, c.buf),
    ),
    Row(
        "dev.timeout", "`True`", ValueError, "timeout must be a positive number", _set(lambda c: c.cpu, "timeout", True)
    ),
    Row("graph.replay", "no entries", ValueError, "has no entries to replay", lambda c: Graph().replay()),
    Row("to_dtype", "`'float33'`", ValueError, "unknown dtype name 'float33'", lambda c: to_dtype("float33")),
    Row(
        "BufferSpec(...)",
        "`external_ptr=0`",
        B,
        "external_ptr must be a positive int address",
        lambda c: BufferSpec(external_ptr=0),
    ),
    Row(
        "buf.allocate",
        "`external_ptr=-8`",
        B,
        "external_ptr must be a positive int address",
        lambda c: Buffer("CPU", 8).allocate(-8),
    ),
    Row(
        "BufferSpec on allocate",
        "an `external_ptr` on DISK",
        DeviceError,
        "external_ptr is not supported",
        lambda c: c.disk.allocate(4, dtypes.uint8, BufferSpec(external_ptr=64)),
    ),
    # ---- buffer scopes and DLPack
    Row(
        "dev.buffer", "size `0`", B, "size must be a positive int of elements, got 0", _scope(lambda c: c.cpu.buffer(0))
    ),
    Row(
        "aruntime.from_dlpack", "`b'abc'` (no DLPack)", B, "bytes does not export DLPack", lambda c: from_dlpack(b"abc")
    ),
    Row(
        "aruntime.from_dlpack",
        "a non-contiguous numpy array",
        B,
        "is not C-contiguous",
        lambda c: from_dlpack(np.zeros((4, 4), np.float32)[:, ::2]),
    ),
    Row("buf.__dlpack__", "a NULL buffer", B, "is not in host memory", lambda c: c.nullbuf.__dlpack__()),
]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The markdown table of :data:`ROWS`, between its markers."""
    lines = [BEGIN, "| Entry point | Bad input | Error | Message contains |", "|---|---|---|---|"]
    for row in ROWS:
        lines.append(f"| `{row.entry}` | {_cell(row.bad)} | `{row.error.__name__}` | {_cell(row.match)} |")
    lines.append(END)
    return "\n".join(lines)


def documented() -> str:
    """The catalogue as docs/reliability.md has it now (markers included)."""
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


if __name__ == "__main__":  # rewrite the table in docs/reliability.md
    text = DOC.read_text()
    DOC.write_text(text.replace(documented(), render()))
    print(f"wrote {len(ROWS)} rows to {DOC}", file=sys.stderr)
