"""Hostile arguments and misuse of the public APIs other than the op methods: graph capture and replay,
``aruntime.transfer`` between devices, the DISK device, views, ``dev.compile``, DLPack, the profiler, ``dev.close``,
``dev.metrics()`` and ``Scheduler.request(deadline=...)``, on the CPU, NULL and DISK devices.

The rule is the one ``tests/test_bad_arguments.py`` holds the op methods to: a clear error that names what was wrong,
and nothing lost (no crash, no memory touched out of bounds, the device still round-trips, ``in_use`` back at its
baseline, no hung task). What that file, ``tests/test_hostile_state.py`` and the reliability catalogue already pin is
not repeated. Cases that behave wrong today are ``xfail(strict=True)`` with what goes wrong; the ones that crash,
hang or change process-wide state run in a child interpreter.
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import pytest

from aruntime import (
    BaseDevice,
    Buffer,
    BufferUsageError,
    Device,
    DeviceError,
    Scheduler,
    dtypes,
    from_dlpack,
    profile,
    transfer,
)
from aruntime.engine.native import copier
from aruntime.errors import AllocationError, DeadlineExceeded
from aruntime.graph import Graph, Param
from tests.kernels import ADD_ONE, SLEEP, on_path

try:
    import numpy as np
except ImportError:  # numpy is optional: its cases are left out
    np = None

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
PATHS = ("c", "python")
_INDEX = {"c": 180, "python": 181}  # CPU:180 / NULL:180 submit in C, CPU:181 / NULL:181 in Python
SPARE = (182, 183, 184, 185, 186, 187, 188, 189)  # devices a test closes or opens fresh

needs_numpy = pytest.mark.skipif(np is None, reason="numpy is not installed")


@pytest.fixture
def anyio_backend() -> Any:
    """asyncio only: what is pinned here is the runtime's behaviour, not the event loop's (and it keeps this fast)."""
    return ("asyncio", {})


# ---- helpers ---------------------------------------------------------------------------------------------------


def _device(path: str, kind: str = "CPU") -> BaseDevice:
    return on_path(Device[f"{kind}:{_INDEX[path]}"], path)


async def _works(dev: BaseDevice) -> None:
    """The device still round-trips: copy-in, a kernel, copy-out (the kernel on CPU only) give the right bytes."""
    buf = await dev.allocate(8)
    try:
        await dev.copyin(buf, bytes(range(8)))
        if dev.kind == "CPU":
            prog = await dev.compile(ADD_ONE, outs=(0,))
            await dev.launch(prog, buf, vals=(8,))
            assert bytes(await dev.copyout(buf)) == bytes(range(1, 9))
        else:
            await dev.copyout(buf)
    finally:
        await dev.free(buf)


async def _nothing_lost(baseline: dict[str, int], *devs: BaseDevice) -> None:
    gc.collect()
    for dev in devs:
        await _works(dev)
    gc.collect()
    assert {d.name: d.memory_stats()["in_use"] for d in devs} == baseline


def _baseline(*devs: BaseDevice) -> dict[str, int]:
    gc.collect()
    return {d.name: d.memory_stats()["in_use"] for d in devs}


def _spare(i: int, kind: str = "CPU") -> BaseDevice:
    dev = Device[f"{kind}:{SPARE[i]}"]
    return dev


# ---- children: the cases that crash, hang or change process-wide state ----------------------------------------

PRELUDE = """
import ctypes, gc, os, sys, tempfile, threading, time
import anyio
sys.path.insert(0, {root!r})
from aruntime import Buffer, BufferUsageError, CompileError, Device, DeviceError, dtypes
"""

TRUNCATED = """
        import json
        from aruntime import BufferSpec, transfer
        from aruntime.graph import Graph
        WHOLE, KEPT = 1 << 16, 8192
        CONTENTS = bytes(range(256)) * (WHOLE // 256)

        async def outcome(awaitable):
            try:
                await awaitable
            except Exception as exc:
                return [type(exc).__name__, isinstance(exc, DeviceError), str(exc)]
            return "ok"

        async def truncated():
            path = os.path.join(tempfile.mkdtemp(), "f")
            with open(path, "wb") as f:
                f.write(CONTENTS)
            disk = Device[f"DISK:{path}"]
            buf = await disk.allocate(WHOLE)
            os.truncate(path, KEPT)  # another process would do the same
            return path, disk, buf

        def report(**found):
            print("RESULT", json.dumps(found))
"""

DISK_TRUNCATED: dict[str, str] = {
    # copy-out on the copy queue (awaited, then left unobserved for synchronize), and a blocking Buffer.copyout
    "copyout": """
        async def main():
            path, disk, buf = await truncated()
            error = await outcome(disk.copyout(buf))
            head = await disk.allocate(4096)  # another buffer, still inside the file
            after = bytes(await disk.copyout(head)) == CONTENTS[:4096]
            disk.copyout(buf)  # nobody awaits it
            unobserved = await outcome(disk.synchronize())
            again = await outcome(disk.synchronize())  # reported once
            blocking = await outcome(anyio.to_thread.run_sync(buf.copyout, memoryview(bytearray(WHOLE))))
            report(path=path, error=error, after=after, unobserved=unobserved, again=again, blocking=blocking)
        anyio.run(main)
        """,
    # copy-in into the bytes past the end, then into another buffer, still inside the file
    "copyin": """
        async def main():
            path, disk, buf = await truncated()
            error = await outcome(disk.copyin(buf, bytes(WHOLE)))
            head = await disk.allocate(4096)
            await disk.copyin(head, bytes(4096))
            after = bytes(await disk.copyout(head)) == bytes(4096)
            blocking = await outcome(anyio.to_thread.run_sync(buf.copyin, memoryview(bytes(WHOLE))))
            report(path=path, error=error, after=after, blocking=blocking)
        anyio.run(main)
        """,
    # transfers DISK -> CPU and CPU -> DISK, on the CPU device's copy queue; the CPU buffers go back to baseline
    "transfers": """
        async def main():
            path, disk, buf = await truncated()
            cpu = Device["CPU:180"]
            baseline = cpu.memory_stats()["in_use"]
            x, z = await cpu.allocate(WHOLE), await cpu.allocate(WHOLE)
            out = await outcome(transfer(x, buf))
            await cpu.copyin(z, bytes(WHOLE))
            into = await outcome(transfer(buf, z))
            head, y = await disk.allocate(4096), await cpu.allocate(4096)  # another buffer, inside the file
            await cpu.copyin(y, CONTENTS[4096:8192])
            await transfer(head, y)
            await cpu.copyin(y, bytes(4096))
            await transfer(y, head)
            after = bytes(await cpu.copyout(y)) == CONTENTS[4096:8192]
            for b in (x, y, z):
                await cpu.free(b)
            gc.collect()
            report(path=path, out=out, into=into, after=after, leaked=cpu.memory_stats()["in_use"] - baseline)
        anyio.run(main)
        """,
    # small copies (at most inline_copy_max) of 64 bytes past the end: a copy-out, a graph replay's, a copy-in, and
    # one run on the compute queue right after a kernel (a CPU buffer over the mapping)
    "small": """
        async def main():
            path, disk, buf = await truncated()
            tail = buf.view(64, dtypes.uint8, 4 * KEPT)
            assert disk.inline_copy_max >= 64
            out = await outcome(disk.copyout(tail))
            graph = Graph()
            graph.copyout(tail, "y")
            replay = await outcome(graph.replay())
            into = await outcome(disk.copyin(tail, bytes(64)))
            cpu = Device["CPU:180"]
            over = await cpu.allocate(64, dtypes.uint8, BufferSpec(external_ptr=tail.handle))
            gate = await cpu.allocate(1, dtypes.int32)
            await cpu.copyin(gate, bytes(4))
            src = "void touch(unsigned char *b, volatile int *go) { (void)b; while (!*go) {} }"
            prog = await cpu.compile(src, "touch", outs=(0,))
            cpu.launch(prog, over, gate)  # runs until the gate opens
            behind = cpu.copyout(over)  # waits for the kernel: it runs on the compute queue
            inline = behind.engine is cpu.compute
            ctypes.c_int32.from_address(gate.handle).value = 1
            after_kernel = await outcome(behind)
            after = bytes(await disk.copyout(await disk.allocate(64))) == CONTENTS[:64]
            report(path=path, out=out, into=into, inline=inline, after_kernel=after_kernel, replay=replay, after=after)
        anyio.run(main)
        """,
    # the limit: bytes read through a zero-copy view are not guarded; such a fault goes on to the handler that was
    # there before (faulthandler's report, then the default action), and a guarded copy before it reports nothing
    "zero-copy": """
        import faulthandler
        faulthandler.enable()
        async def main():
            path, disk, buf = await truncated()
            print("RESULT", json.dumps({"error": await outcome(disk.copyout(buf))}), flush=True)
            view = buf.as_buffer(allow_zero_copy=True)
            print("READ", view[WHOLE - 1], flush=True)
        anyio.run(main)
        """,
    # the pinned staging ring of CUDA copies from and to pageable memory (on host memory standing in for the device)
    "staging": """
        from aruntime.backends.cuda import StagingPool
        from aruntime.engine import CopyFault
        from tests.test_cuda import FakeStream
        async def main():
            path, disk, buf = await truncated()
            stream = FakeStream()
            pool = StagingPool(2, 4096, stream.alloc, stream.record, stream.wait)
            device = ctypes.create_string_buffer(WHOLE)
            faults = []
            for copy, dst, src in (
                (pool.copy_in, ctypes.addressof(device), buf.handle),
                (pool.copy_out, buf.handle, ctypes.addressof(device)),
            ):
                try:
                    copy(dst, src, WHOLE, stream.dma)
                    faults.append(0)
                except CopyFault as fault:
                    faults.append(fault.side)
            stream.drain()
            left = sum(1 for slot in pool._pending if slot is not None and slot[1])  # copy-out chunks to deliver
            head = await disk.allocate(KEPT)
            pool.copy_in(ctypes.addressof(device), head.handle, KEPT, stream.dma)
            stream.drain()
            back = ctypes.create_string_buffer(KEPT)
            pool.copy_out(ctypes.addressof(back), ctypes.addressof(device), KEPT, stream.dma)
            report(path=path, faults=faults, left=left, after=back.raw == CONTENTS[:KEPT])
        anyio.run(main)
        """,
}

CHILDREN: dict[str, str] = {
    # a kernel named like a function the process already has (libc's abort / free): the entry's call to it binds
    # to that function, not to the kernel, so the launch aborts the process, or frees the buffer's memory into
    # malloc's free lists
    **{
        f"kernel-named-{name}": """
        async def main():
            dev = Device["CPU:180"]
            try:
                prog = await dev.compile("void NAME(unsigned char *b) { b[0] = 7; }", "NAME", outs=(0,))
            except (CompileError, ValueError) as exc:
                print("REFUSED", exc)
                return
            buf = await dev.allocate(1)
            await dev.copyin(buf, bytes(1))
            await dev.launch(prog, buf)
            print("RESULT", bytes(await dev.copyout(buf)))
        anyio.run(main)
        """.replace("NAME", name)
        for name in ("abort", "free")
    },
    # a compile whose compiler never ends (it reads a FIFO nobody writes: the same as `#include "/dev/zero"`, which
    # also eats memory without bound): cancelling the compile must return at once, not wait for the compiler
    "compile-cancelled": """
        from tests.kernels import ADD_ONE
        async def main():
            fifo = os.path.join(tempfile.mkdtemp(), "fifo")
            os.mkfifo(fifo)
            def unblock():  # let the compiler go in the end (EOF), so that nothing is left behind
                time.sleep(3)
                with __import__("contextlib").suppress(OSError):
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            threading.Thread(target=unblock, daemon=True).start()
            start = time.monotonic()
            with anyio.move_on_after(0.5):
                try:
                    await Device["CPU:180"].compile(f'#include "{fifo}"\\n' + ADD_ONE)
                except CompileError:
                    pass
            print("RESULT", round(time.monotonic() - start, 2))
        anyio.run(main)
        """,
    # leaving a profile region twice (or one never entered): the count of open regions goes negative, and every
    # later region then leaves recording on for good (the global recorder keeps every op of the process)
    "profile-exited-twice": """
        from aruntime import profile
        from aruntime.events import recorder
        async def main():
            region = profile()
            async with region:
                pass
            try:
                await region.__aexit__(None, None, None)
                print("second exit accepted")
            except RuntimeError as exc:
                print("REFUSED", exc)
            async with profile():
                await Device["CPU:180"].synchronize()
            print("RESULT", recorder.enabled)
        anyio.run(main)
        """,
    # numpy refuses a bfloat16 tensor: the capsule's destructor (a ctypes callback) then runs with numpy's error
    # pending, fails, never ends the export's loan (the buffer's memory is never released once freed) and swallows
    # numpy's error (a SystemError)
    "dlpack-refused-by-consumer": """
        import numpy as np
        async def main():
            dev = Device["CPU:180"]
            buf = await dev.allocate(1 << 16, dtypes.bfloat16)
            try:
                np.from_dlpack(buf)
                print("exported")
            except Exception as exc:
                print("ERROR", type(exc).__name__, exc)
            await dev.free(buf)
            gc.collect()
            print("RESULT", dev.memory_stats()["in_use"])
        anyio.run(main)
        """,
    # a DISK buffer's file truncated by someone else after it was mapped: reading the buffer is a SIGBUS
    # a DISK file truncated by another process under a live buffer (to 8 KiB of its 64 KiB): every copy aruntime
    # makes into or out of the bytes past the new end fails with FileTruncated, and the device goes on (below)
    **{
        f"disk-truncated-{case}{suffix}": TRUNCATED + body
        for case, body in DISK_TRUNCATED.items()
        for suffix in ("@native", "@python")
    },
}


def _run_child(name: str) -> subprocess.CompletedProcess[str]:
    """Run the child ``name``; one named ``...@native`` or ``...@python`` runs on that engine."""
    code = PRELUDE.format(root=str(ROOT)) + textwrap.dedent(CHILDREN[name])
    env = {**os.environ, "ARUNTIME_WAIT_TIMEOUT": "10"}
    if "@" in name:
        env["ARUNTIME_ENGINE"] = name.rpartition("@")[2]
    try:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, -999, str(exc.stdout or ""), "timed out")


_results: dict[str, subprocess.CompletedProcess[str]] = {}


def _child(name: str) -> subprocess.CompletedProcess[str]:
    """The child's outcome; the first call runs every child at once (two at a time), to keep this file short."""
    if not _results:
        with ThreadPoolExecutor(max_workers=2) as pool:
            _results.update(zip(CHILDREN, pool.map(_run_child, CHILDREN), strict=True))
    return _results[name]


def _result(name: str) -> str:
    proc = _child(name)
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stdout[-500:]} {proc.stderr[-1500:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("RESULT", "REFUSED"))]
    assert lines, (proc.stdout, proc.stderr[-1500:])
    return lines[-1]


@pytest.mark.parametrize("name", ["abort", "free"])
def test_a_kernel_named_like_a_libc_function_runs_the_kernel_or_is_refused(name: str) -> None:
    line = _result(f"kernel-named-{name}")
    assert line.startswith("REFUSED") or line == "RESULT b'\\x07'", line


def test_a_cancelled_compile_returns_at_once() -> None:
    line = _result("compile-cancelled")
    assert float(line.split()[1]) < 2.0, line


def test_leaving_a_profile_region_twice_is_refused_and_recording_stops() -> None:
    proc = _child("profile-exited-twice")
    assert "REFUSED" in proc.stdout, proc.stdout
    assert _result("profile-exited-twice") == "RESULT False"


@needs_numpy
def test_a_dlpack_export_refused_by_the_consumer_loses_nothing() -> None:
    """numpy refuses a bfloat16 tensor and frees the capsule with its error pending: the capsule's destructor
    (native) still ends the loan, and numpy's own error is the one raised."""
    proc = _child("dlpack-refused-by-consumer")
    assert "SystemError" not in proc.stdout, proc.stdout
    assert "ERROR" in proc.stdout, proc.stdout  # numpy's refusal, not an export
    assert _result("dlpack-refused-by-consumer") == "RESULT 0"


ENGINES = ("@native", "@python")


def _guarded() -> None:
    if copier() is None:
        pytest.skip("no native core here (no C compiler): copies are not guarded")


def _found(name: str) -> dict[str, Any]:
    _guarded()
    found: dict[str, Any] = json.loads(_result(name).removeprefix("RESULT "))
    return found


def _truncation(error: Any, path: str, end: str) -> None:
    """``error`` (a child's ``outcome``) is the FileTruncated of a copy whose ``end`` met the truncated file."""
    assert isinstance(error, list), error
    kind, is_device_error, message = error
    assert kind == "FileTruncated" and is_device_error, error
    assert path in message and "truncated (or shrank) under the buffer" in message, message
    assert f"its {end} reaches past the end" in message or f"{end} a buffer reaches past" in message, message


@pytest.mark.parametrize("engine", ENGINES)
def test_a_disk_file_truncated_under_a_buffer_fails_its_copy_out_and_the_device_goes_on(engine: str) -> None:
    found = _found(f"disk-truncated-copyout{engine}")
    _truncation(found["error"], found["path"], "source")
    assert found["after"] is True  # bytes still inside the file copy as before
    _truncation(found["unobserved"], found["path"], "source")  # an op nobody awaited: synchronize raises it
    assert found["again"] == "ok"
    _truncation(found["blocking"], found["path"], "out of")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_copy_in_past_the_end_of_a_truncated_disk_file_fails(engine: str) -> None:
    found = _found(f"disk-truncated-copyin{engine}")
    _truncation(found["error"], found["path"], "destination")
    assert found["after"] is True
    _truncation(found["blocking"], found["path"], "into")


@pytest.mark.parametrize("engine", ENGINES)
def test_transfers_out_of_and_into_a_truncated_disk_file_fail_and_lose_nothing(engine: str) -> None:
    found = _found(f"disk-truncated-transfers{engine}")
    _truncation(found["out"], found["path"], "source")
    _truncation(found["into"], found["path"], "destination")
    assert found["after"] is True
    assert found["leaked"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_small_copies_past_the_end_of_a_truncated_disk_file_fail(engine: str) -> None:
    found = _found(f"disk-truncated-small{engine}")
    _truncation(found["out"], found["path"], "source")
    _truncation(found["into"], found["path"], "destination")
    assert found["inline"] is True
    kind, is_device_error, message = found["after_kernel"]  # a CPU buffer over the mapping: no file to name
    assert kind == "FileTruncated" and is_device_error and "CPU:180 compute queue" in message, message
    _truncation(found["replay"], found["path"], "source")
    assert found["after"] is True


@pytest.mark.parametrize("engine", ENGINES)
def test_a_zero_copy_read_past_the_end_of_a_truncated_disk_file_still_faults(engine: str) -> None:
    _guarded()
    proc = _child(f"disk-truncated-zero-copy{engine}")
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr[-1500:])
    assert json.loads(proc.stdout.splitlines()[0].removeprefix("RESULT "))["error"][0] == "FileTruncated"
    assert "READ" not in proc.stdout
    assert proc.stderr.count("Fatal Python error: Bus error") == 1, proc.stderr[-1500:]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_cuda_staging_ring_fails_a_copy_from_or_to_a_truncated_disk_file_and_goes_on(engine: str) -> None:
    found = _found(f"disk-truncated-staging{engine}")
    assert found["faults"] == [1, 2]  # the copy in read past the end, the copy out wrote past it
    assert found["left"] == 0  # no chunk of the failed copy out is delivered later
    assert found["after"] is True


# ---- graphs ----------------------------------------------------------------------------------------------------

# (id, what a replay of the graph `copyin x -> ADD_ONE(n=Param n) -> copyout y` gets, the error, a fragment)
_REPLAYS: list[tuple[str, Callable[[dict[str, Any]], tuple[Any, dict[str, Any]]], type[BaseException], str]] = [
    ("short-input", lambda b: (None, {"x": bytes(4), "n": 8}), BufferUsageError, "graph input 'x' has 4 bytes"),
    ("list-input", lambda b: (None, {"x": [0] * 8, "n": 8}), BufferUsageError, "got list"),
    ("read-only-output", lambda b: (None, {"x": bytes(8), "n": 8, "y": bytes(8)}), BufferUsageError, "writable"),
    (
        "strided-output",
        lambda b: (None, {"x": bytes(8), "n": 8, "y": memoryview(bytearray(16))[::2]}),
        BufferUsageError,
        "C-contiguous",
    ),
    ("missing-input", lambda b: (None, {"x": bytes(8)}), ValueError, "missing inputs: n"),
    ("unknown-input", lambda b: (None, {"x": bytes(8), "n": 8, "z": 1}), ValueError, "unknown inputs: z"),
    ("str-param", lambda b: (None, {"x": bytes(8), "n": "8"}), TypeError, "input 'n' of kernel"),
    ("huge-param", lambda b: (None, {"x": bytes(8), "n": 1 << 64}), ValueError, "input 'n' of kernel"),
    ("float-param", lambda b: (None, {"x": bytes(8), "n": 8.5}), TypeError, "is a float"),
    ("buffers-list", lambda b: ([(b["buf"], b["buf"])], {"x": bytes(8), "n": 8}), TypeError, "buffers must map"),
    ("foreign-key", lambda b: ({3: b["buf"]}, {"x": bytes(8), "n": 8}), BufferUsageError, "not a buffer of this"),
    ("not-a-buffer", lambda b: ({b["buf"]: 3}, {"x": bytes(8), "n": 8}), BufferUsageError, "only be replaced"),
    ("freed-stand-in", lambda b: ({b["buf"]: b["freed"]}, {"x": bytes(8), "n": 8}), BufferUsageError, "was freed"),
    (
        "unallocated-stand-in",
        lambda b: ({b["buf"]: b["unallocated"]}, {"x": bytes(8), "n": 8}),
        BufferUsageError,
        "is not allocated",
    ),
    ("other-size", lambda b: ({b["buf"]: b["small"]}, {"x": bytes(8), "n": 8}), BufferUsageError, "cannot stand in"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("make", "error", "match"), [pytest.param(*r[1:], id=r[0]) for r in _REPLAYS])
async def test_a_bad_replay_is_refused_and_loses_nothing(path: str, make: Any, error: type, match: str) -> None:
    dev = _device(path)
    baseline = _baseline(dev)
    prog = await dev.compile(ADD_ONE, outs=(0,))
    buf, small, freed = await dev.allocate(8), await dev.allocate(4), await dev.allocate(8)
    await dev.free(freed)
    graph = Graph()
    graph.copyin(buf, "x")
    graph.launch(prog, buf, vals=(Param("n"),))
    graph.copyout(buf, "y")
    try:
        assert bytes((await graph.replay(x=bytes(8), n=8))["y"]) == bytes([1] * 8)  # a good replay first
        buffers, inputs = make({"buf": buf, "small": small, "freed": freed, "unallocated": Buffer(dev.name, 8)})
        with pytest.raises(error, match=match):
            await graph.replay(buffers, **inputs)
        assert bytes((await graph.replay(x=bytes(range(8)), n=8))["y"]) == bytes(range(1, 9))  # and after
    finally:
        await dev.free(buf)
        await dev.free(small)
    await _nothing_lost(baseline, dev)


@pytest.mark.parametrize("path", PATHS)
async def test_a_graph_over_a_freed_or_closed_devices_buffer_is_refused(path: str) -> None:
    dev = _device(path)
    other = _spare(0)
    baseline = _baseline(dev)
    buf, gone = await dev.allocate(8), await other.allocate(8)
    graph, closed = Graph(), Graph()
    graph.copyin(buf, "x")
    closed.copyin(gone, "x")
    await dev.free(buf)
    await other.aclose()
    with pytest.raises(BufferUsageError, match="was freed"):
        await graph.replay(x=bytes(8))
    with pytest.raises(DeviceError, match="is closed"):
        await closed.replay(x=bytes(8))
    fresh = Device[other.name]
    stand_in = await fresh.allocate(8)
    try:
        with pytest.raises(DeviceError, match="closed"):
            await closed.replay({gone: stand_in}, x=bytes(8))
    finally:
        await fresh.aclose()
    with pytest.raises(BufferUsageError, match="no copy engine reaches both"):
        Graph().transfer(await _device(path, "NULL").allocate(8), await dev.allocate(8))
    gc.collect()
    await _nothing_lost(baseline, dev)


# ---- transfers -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
async def test_transfers_between_cpu_disk_and_views_give_the_right_bytes(path: str, tmp_path: Path) -> None:
    dev = _device(path)
    disk = Device[f"DISK:{tmp_path}/t.bin"]
    baseline = _baseline(dev)
    a, b, d = await dev.allocate(16), await dev.allocate(16), await disk.allocate(16)
    try:
        await dev.copyin(a, bytes(range(16)))
        await transfer(d, a)
        await transfer(b, d)
        assert bytes(await dev.copyout(b)) == bytes(range(16))
        await transfer(a.view(8, dtypes.uint8, 4), a.view(8, dtypes.uint8, 0))  # overlapping views of one buffer
        assert bytes(await dev.copyout(a)) == bytes([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15])
        await transfer(d.view(4, dtypes.uint8, 12), b.view(4, dtypes.uint8, 0))
        assert bytes(await disk.copyout(d))[12:] == bytes(range(4))
        freed = await dev.allocate(16)
        await dev.free(freed)
        for dst, src, error, match in (
            (a, freed, BufferUsageError, "was freed"),
            (freed, d, BufferUsageError, "was freed"),
            (Buffer(dev.name, 16), a, BufferUsageError, "is not allocated"),
            (d, Buffer(dev.name, 16), BufferUsageError, "is not allocated"),
        ):
            with pytest.raises(error, match=match):
                await transfer(dst, src)
        for kwargs, error, match in (
            ({"hold": "yes"}, TypeError, "hold must be a bool"),
            ({"window": 5}, TypeError, "window must be a Scheduler or None"),
            ({"priority": True}, ValueError, "priority must be 0"),
        ):
            with pytest.raises(error, match=match):
                await transfer(b, a, **kwargs)
    finally:
        for buf in (a, b):
            await dev.free(buf)
        await disk.aclose()
    await _nothing_lost(baseline, dev)


@pytest.mark.parametrize("case", ["into-closed-cpu", "out-of-closed-disk"])
async def test_a_transfer_touching_a_closed_devices_buffer_is_refused(case: str, tmp_path: Path) -> None:
    dev = _device("c")
    closed = _spare(1) if case == "into-closed-cpu" else Device[f"DISK:{tmp_path}/c.bin"]
    theirs, mine = await closed.allocate(8), await dev.allocate(8)
    await closed.aclose()
    try:
        with pytest.raises(DeviceError, match="is closed"):
            if case == "into-closed-cpu":
                await transfer(theirs, mine)
            else:
                await transfer(mine, theirs)
    finally:
        await dev.free(mine)


# ---- the DISK device -------------------------------------------------------------------------------------------


async def test_disk_paths_that_are_no_regular_file_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for name, error, match in (
        (f"DISK:{tmp_path}", DeviceError, "Is a directory"),
        (f"DISK:{tmp_path}/missing/f", DeviceError, "cannot open"),
        ("DISK:/dev/null", AllocationError, "cannot reserve and map"),
        (f"DISK:{fifo}", AllocationError, "cannot reserve and map"),
        ("DISK:/proc/self/status", AllocationError, "cannot reserve and map"),
        (f"DISK:{tmp_path}/huge", AllocationError, "cannot reserve and map"),
    ):
        disk = Device[name]
        try:
            with pytest.raises(error, match=match):
                await disk.allocate(1 << 50 if name.endswith("huge") else 8)
        finally:
            await disk.aclose()
    assert not (tmp_path / "huge").exists() or (tmp_path / "huge").stat().st_size == 0  # a failed reservation undone


async def test_a_short_disk_file_grows_and_keeps_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(bytes(range(1, 5)))
    async with Device[f"DISK:{path}"] as disk:
        buf = await disk.allocate(16)
        assert bytes(await disk.copyout(buf)) == bytes(range(1, 5)) + bytes(12)
        view = buf.view(4, dtypes.uint8, 12)
        await disk.copyin(view, b"abcd")
        with pytest.raises(BufferUsageError, match="out of range"):
            buf.view(8, dtypes.uint8, 12)
        await disk.free(buf)
    assert path.read_bytes() == bytes(range(1, 5)) + bytes(8) + b"abcd"


# ---- views -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("base", "offset"), [("root", 1.5), ("root", "4"), ("str", 0)])
async def test_a_view_made_with_a_bad_base_or_offset_is_refused(base: str, offset: Any) -> None:
    dev = _device("c")
    root = await dev.allocate(16, dtypes.float32)
    try:
        with pytest.raises(BufferUsageError, match=r"offset|base"):
            Buffer(dev.name, 2, dtypes.float32, base=root if base == "root" else "x", offset=offset)
    finally:
        await dev.free(root)


# ---- compile ---------------------------------------------------------------------------------------------------


async def test_unusual_outs_and_names_compile_or_are_refused_alike() -> None:
    dev, null = _device("c"), _device("c", "NULL")
    for d in (dev, null):
        assert (await d.compile(ADD_ONE, outs=iter([0]))).outs == (0,)
        for outs, error, match in (
            ((True,), TypeError, "outs must be a sequence of buffer indices"),
            ((0.0,), TypeError, "outs must be a sequence of buffer indices"),
            ((-1,), ValueError, "must be buffer indices"),
            (5, TypeError, "outs must be a sequence of buffer indices"),
        ):
            with pytest.raises(error, match=match):
                await d.compile(ADD_ONE, outs=outs)
        for name in ("ñame", "1abc", "a b", ""):
            with pytest.raises(ValueError, match="is not a C identifier"):
                await d.compile(ADD_ONE, name)
    prog = await dev.compile(ADD_ONE, outs=(10**30,))  # an index past any launch's buffers: refused at the launch
    buf = await dev.allocate(8)
    try:
        with pytest.raises(ValueError, match="out of range for 1 buffers"):
            dev.launch(prog, buf, vals=(8,))
    finally:
        await dev.free(buf)
    await _works(dev)


# ---- DLPack ----------------------------------------------------------------------------------------------------


class _Exporter:
    """A host array whose DLPack methods misbehave as told."""

    def __init__(self, device: Any = (1, 0), capsule: Callable[[], Any] = lambda: None) -> None:
        self._device, self._capsule = device, capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._capsule()

    def __dlpack_device__(self) -> Any:
        return self._device


@needs_numpy
async def test_bad_dlpack_producers_and_devices_are_refused() -> None:
    dev = _device("c")
    baseline = _baseline(dev)
    for obj, device, match in (
        (b"abc", None, "does not export DLPack"),
        (_Exporter(device=(2, 0)), None, "is not in host memory"),
        (_Exporter(), None, "gave no unused DLPack tensor"),
        (_Exporter(capsule=lambda: np.zeros(4).__dlpack__(max_version=(1, 0))), None, "gave no unused DLPack"),
        (np.zeros((3, 0)), None, "is empty"),
        (np.zeros(4, np.complex64), None, "no aruntime dtype"),
        (np.zeros(4, object), None, "refused to export"),
        (np.arange(8.0)[::-1], None, "is not C-contiguous"),
        (np.frombuffer(bytes(16), np.uint8), None, "refused to export"),  # read-only memory
        (np.zeros(4, np.float32), "NULL:180", "is not a host-memory device"),
        (np.zeros(4, np.float32), f"DISK:{tempfile.gettempdir()}/aruntime-never-made", "is not a host-memory"),
    ):
        with pytest.raises(BufferUsageError, match=match):
            from_dlpack(obj, device)
    with pytest.raises(DeviceError, match="invalid device name 3"):
        from_dlpack(np.zeros(4), 3)  # type: ignore[arg-type]
    buf = await dev.allocate(4, dtypes.float32)
    try:
        for kwargs, match in (
            ({"stream": 1}, "has no streams"),
            ({"dl_device": (2, 0)}, "is on the host"),
            ({"copy": True}, "copy=True is not supported"),
        ):
            with pytest.raises(BufferUsageError, match=match):
                buf.__dlpack__(**kwargs)
        for other in (await _device("c", "NULL").allocate(4), Buffer(dev.name, 4)):
            with pytest.raises(BufferUsageError, match=r"not in host memory|is not allocated"):
                np.from_dlpack(other)
    finally:
        await dev.free(buf)
    await _nothing_lost(baseline, dev)


@needs_numpy
@pytest.mark.parametrize("case", ["max_version=()", "max_version=3", "dl_device=5", "device()=()"])
async def test_malformed_dlpack_arguments_are_refused_naming_them(case: str) -> None:
    dev = _device("c")
    buf = await dev.allocate(4, dtypes.float32)
    try:
        with pytest.raises((BufferUsageError, TypeError, ValueError), match=r"max_version|dl_device|__dlpack_device"):
            if case == "max_version=()":
                buf.__dlpack__(max_version=())
            elif case == "max_version=3":
                buf.__dlpack__(max_version=3)  # type: ignore[arg-type]
            elif case == "dl_device=5":
                buf.__dlpack__(dl_device=5)  # type: ignore[arg-type]
            else:
                from_dlpack(_Exporter(device=()))
    finally:
        await dev.free(buf)


# ---- the profiler ----------------------------------------------------------------------------------------------


async def test_saving_a_trace_to_a_bad_path_fails_and_leaves_nothing(tmp_path: Path) -> None:
    dev = _device("c")
    (tmp_path / "afile").write_text("x")
    async with profile() as region:
        await _works(dev)
    for path, error in (
        (tmp_path, IsADirectoryError),
        (tmp_path / "afile" / "t.json", OSError),
        (f"{tmp_path}/a\x00b", ValueError),
        (3, TypeError),
    ):
        with pytest.raises(error):
            region.save(path)  # type: ignore[arg-type]
    assert sorted(os.listdir(tmp_path)) == ["afile"]  # no temporary file left behind
    assert sorted(p.name for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}.")) == []
    assert region.save(tmp_path / "sub" / "deeper" / "t.json").stat().st_size > 0


async def _pending_region(dev: BaseDevice, wait: Any) -> None:
    prog = await dev.compile(SLEEP, outs=(0,))
    buf = await dev.allocate(8)
    op = None
    try:
        async with profile(timeout=wait):
            op = dev.launch(prog, buf, vals=(8, 100))
    finally:
        if op is not None:
            await op
        await dev.free(buf)


@pytest.mark.parametrize("wait", [-1, "1", 10**400, math.nan], ids=["-1", "str", "10**400", "nan"])
async def test_a_bad_profile_timeout_is_refused_naming_it(wait: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="timeout"):
        await _pending_region(_device("c"), wait)


# ---- closing, synchronizing and metrics -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["CPU", "NULL"])
async def test_concurrent_closes_and_synchronizes_settle_once(kind: str) -> None:
    dev = _spare(2, kind)
    prog = await dev.compile(SLEEP, outs=(0,))
    buf = await dev.allocate(8)
    op = dev.launch(prog, buf, vals=(8, 50))
    outcomes: dict[str, str] = {}

    async def run(name: str, call: Callable[[], Awaitable[object]]) -> None:
        try:
            await call()
            outcomes[name] = "ok"
        except DeviceError as exc:
            assert "another close of it is already waiting" in str(exc)
            outcomes[name] = "refused"

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "sync", dev.synchronize)
        tg.start_soon(run, "close", dev.aclose)
        tg.start_soon(run, "close again", dev.aclose)
        tg.start_soon(run, "close in a thread", lambda: anyio.to_thread.run_sync(dev.close))
    assert op.done() and dev.state == "closed"
    assert outcomes.pop("sync") == "ok"
    closes = sorted(outcomes.values())
    if kind == "CPU":  # the kernel runs 50 ms: the three closes overlap; one ran, the others were refused
        assert closes == ["ok", "refused", "refused"]
    else:  # a NULL launch is done at once: a close may begin after another has closed the device (then it is ok)
        assert "ok" in closes and set(closes) <= {"ok", "refused"}, closes
    await dev.aclose()  # closing a closed device does nothing
    await dev.synchronize()
    assert set(dev.metrics()) >= {"compute", "copy"}
    await dev.free(buf)


async def test_metrics_read_from_threads_while_ops_run() -> None:
    dev, null = _device("c"), _device("c", "NULL")
    prog = await dev.compile(ADD_ONE, outs=(0,))
    stop = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        while not stop.is_set():
            try:
                dev.metrics()
                null.metrics()
            except BaseException as exc:  # reported below
                errors.append(exc)
                return

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    buf, nbuf = await dev.allocate(8), await null.allocate(8)
    try:
        before = dev.metrics()["compute"]["submitted"]
        for _ in range(500):
            dev.launch(prog, buf, vals=(8,))
            null.copyin(nbuf, bytes(8))
        await dev.synchronize()
        await null.synchronize()
    finally:
        stop.set()
        for t in threads:
            t.join()
        await dev.free(buf)
        await null.free(nbuf)
    assert errors == []
    assert dev.metrics()["compute"]["submitted"] - before == 500


@pytest.mark.parametrize("wait", [-1, "x", 10**400, math.nan], ids=["-1", "str", "10**400", "nan"])
async def test_a_bad_close_timeout_is_refused_naming_it(wait: Any) -> None:
    dev = _spare(3)
    try:
        with pytest.raises((TypeError, ValueError), match="timeout"):
            dev.close(timeout=wait)
    finally:
        await dev.aclose()
        assert dev.state == "closed"


# ---- request deadlines -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
async def test_tiny_and_refused_deadlines_lose_nothing(path: str) -> None:
    dev = _device(path)
    baseline = _baseline(dev)
    buf = await dev.allocate(8)
    try:
        async with Scheduler() as sched:
            for deadline in (5e-324, 1e-300):
                with pytest.raises(DeadlineExceeded):
                    async with sched.request(deadline=deadline):
                        sched.copyin(buf, bytes(8))
                        await anyio.sleep(0.01)
            for deadline in (-0.0, math.nan, math.inf, True, "1"):
                with pytest.raises(ValueError, match="deadline must be a positive number of seconds"):
                    sched.request(deadline=deadline)  # type: ignore[arg-type]
            async with sched.request(deadline=5.0):  # what the skipped copy-ins would have written is written anew
                sched.copyin(buf, bytes(range(8)))
                assert bytes(await sched.copyout(buf)) == bytes(range(8))
    finally:
        await dev.free(buf)
    await _nothing_lost(baseline, dev)


@pytest.mark.parametrize("deadline", [1e300, sys.float_info.max, 10**400], ids=["1e300", "max", "10**400"])
async def test_a_huge_deadline_is_no_bound_or_refused_naming_it(deadline: Any) -> None:
    dev = _device("c")
    buf = await dev.allocate(8)
    try:
        async with Scheduler() as sched:
            try:  # refused naming the deadline: fine; no bound: fine too
                async with sched.request(deadline=deadline):
                    sched.copyin(buf, bytes(8))
            except ValueError as exc:
                assert "deadline" in str(exc)
    finally:
        await dev.free(buf)
