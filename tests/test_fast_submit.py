"""The C submission path (``aruntime/engine/native/submit.c``) and the Python path it stands in for.

An eager op on a native engine is submitted in C where the extension builds; the Python path stays the reference
and the fallback. These tests hold both to the same hazards, commands and results, check that the C path lets go
of what its ops hold, and that a process without the extension (switched off, or unable to build it) runs on the
Python path.
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import subprocess
import sys
import textwrap
import threading
from typing import Any

import anyio
import pytest

from aruntime import BaseDevice, Device, DeviceError, Op, Scheduler, dtypes, profile
from aruntime.engine import KernelError, NativeEngine
from aruntime.engine.native import submit
from aruntime.engine.ops import HELD
from aruntime.events import DependencyEvent, RangeEvent
from tests.kernels import ADD_ONE, SPINS, closed_gate

pytestmark = pytest.mark.anyio


def _fast(dev: BaseDevice) -> bool:
    """Whether ``dev``'s queues submit in C; skips the test (with the reason) where they cannot."""
    if not isinstance(dev.compute, NativeEngine):
        pytest.skip("the Python engine has no C submission path")
    if dev.compute.fast is None:
        pytest.skip(f"the C submission path is unavailable: {submit.unavailable}")
    return True


def _python_path(dev: BaseDevice) -> None:
    """Make ``dev``'s queues submit on the Python path from now on."""
    for engine in dev.engines:
        engine.fast = None


async def _program(dev: BaseDevice, seed: int, scheduled: bool = False) -> tuple[list[tuple[Any, ...]], list[bytes]]:
    """Submit a seeded random program of copy-ins, kernels and copy-outs (straight on ``dev``, or through a
    ``Scheduler`` with a small window) behind a closed gate that holds both queues (nothing finishes while it is
    submitted); return each op's shape as submitted (queue, value past the gate's, the indices of its
    dependencies and inputs, its command kinds) and the bytes the buffers end with."""
    gate, flag = await closed_gate(dev)
    add = await dev.compile(ADD_ONE, outs=(0,))
    big = dev.inline_copy_max + 4  # too big to ride on the compute queue
    started = await dev.allocate(big // 4, dtypes.int32)  # its copy-out holds the copy queue behind the gate
    bufs = [await dev.allocate(big) for _ in range(4)]
    rng = random.Random(seed)
    ops: list[Op] = [dev.launch(gate, started, vals=(flag.handle, SPINS)), dev.copyout(started)]
    base = {op.engine.kind: op.value for op in ops if op.engine is not None}  # values from the gate's on
    shapes: list[tuple[Any, ...]] = []
    sched = Scheduler(window=16)
    on: Any = await sched.__aenter__() if scheduled else dev
    for _ in range(60):
        buf = rng.choice(bufs)
        pick = rng.randrange(4)
        if pick == 0:
            op = on.copyin(buf, bytes([rng.randrange(256)]) * big)
        elif pick == 1:
            op = on.launch(add, buf, vals=(big,))
        elif pick == 2:
            op = on.copyout(buf)
        else:
            op = on.copyout(buf, into=bytearray(big))
        index = {id(o): i for i, o in enumerate(ops)}
        engine = op.engine  # None: held in the window for room
        shapes.append(
            (
                None if engine is None else engine.kind,
                None if engine is None else "held" if op.value == HELD else op.value - base[engine.kind],
                sorted(index[id(d)] for d in op.deps),
                sorted(index[id(d)] for d in op.inputs),
                [cmd[0] for cmd in op.cmds or ()],
            )
        )
        ops.append(op)
    assert not ops[1].done()  # the gate held everything
    ctypes.c_int32.from_address(flag.handle).value = 1
    with anyio.fail_after(30):
        for op in ops:
            await op
        if scheduled:
            await sched.__aexit__(None, None, None)
    return shapes, [bytes(await dev.copyout(buf)) for buf in bufs]


async def test_the_c_and_python_paths_submit_alike() -> None:
    """The same random programs on two devices, one on each path: the same queues, values, dependencies,
    inputs, commands (a wait per other queue depended on) and results."""
    fast, slow = Device["CPU:5"], Device["CPU:6"]
    _fast(fast)
    _python_path(slow)
    for seed in range(3):
        assert await _program(fast, seed) == await _program(slow, seed)


async def _recorded(dev: BaseDevice) -> tuple[list[tuple[int, str, bool]], list[tuple[int, int]]]:
    """Record a profile of copy-in -> kernel -> copy-out chains on ``dev``, eagerly (waits in the queues) and
    through a Scheduler (held in the core): each op's recorded ranges (op index, name, copy queue) and the flows
    between ops (dependency events, by op index)."""
    gate, flag = await closed_gate(dev)
    add = await dev.compile(ADD_ONE, outs=(0,))
    big = dev.inline_copy_max + 4  # on the copy queue: every step waits for another queue
    started = await dev.allocate(big // 4, dtypes.int32)
    bufs = [await dev.allocate(big) for _ in range(4)]
    async with profile() as prof:
        # the gate holds both queues while the rest is submitted: nothing it waits for is done yet
        ops = [dev.launch(gate, started, vals=(flag.handle, SPINS)), dev.copyout(started)]
        for buf in bufs[:2]:
            ops += [dev.copyin(buf, bytes(big)), dev.launch(add, buf, vals=(big,)), dev.copyout(buf)]
        async with Scheduler() as sched:
            for buf in bufs[2:]:
                ops += [sched.copyin(buf, bytes(big)), sched.launch(add, buf, vals=(big,)), sched.copyout(buf)]
            ctypes.c_int32.from_address(flag.handle).value = 1
        for op in ops:
            await op
    index = {op.id: i for i, op in enumerate(ops)}
    recorded = sorted(
        (index[e.op], e.name, e.is_copy) for e in prof.events if isinstance(e, RangeEvent) and e.device == dev.name
    )
    flows = sorted((index[e.src], index[e.dst]) for e in prof.events if isinstance(e, DependencyEvent))
    return recorded, flows


async def test_a_profile_records_the_same_on_both_paths() -> None:
    """While a profile is recorded the C path still takes the ops, and records what the Python path does: a
    range per op under its name, and a flow per dependency on another queue."""
    fast, slow = Device["CPU:5"], Device["CPU:6"]
    _fast(fast)
    _python_path(slow)
    recorded, flows = await _recorded(fast)
    assert (recorded, flows) == await _recorded(slow)
    assert len(recorded) == 14 and len(flows) == 9  # the gate's copy-out, each kernel, each copy-out wait


async def test_the_c_and_python_paths_schedule_alike() -> None:
    """The same, through a Scheduler whose window fills: ops admitted, held for another queue, or queued for
    room alike on both paths."""
    fast, slow = Device["CPU:5"], Device["CPU:6"]
    _fast(fast)
    _python_path(slow)
    for seed in range(3):
        assert await _program(fast, seed, scheduled=True) == await _program(slow, seed, scheduled=True)


async def test_a_schedulers_ops_are_submitted_in_c_and_what_it_refuses_takes_the_python_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scheduler's copy-ins, kernels and copy-outs go from its method straight to the C path, past the device's
    Python methods; an op that path does not take (high priority, a view) goes through them, and a closed
    scheduler is refused by its Python check."""
    dev = Device["CPU:5"]
    _fast(dev)
    add = await dev.compile(ADD_ONE, outs=(0,))
    big = dev.inline_copy_max + 4  # copies on the copy queue: the kernel waits for another queue
    called: list[str] = []
    for name in ("copyin", "copyout", "launch"):
        method = getattr(BaseDevice, name)

        def counted(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Op:
            called.append(_name)
            return _method(*args, **kwargs)  # type: ignore[no-any-return]

        monkeypatch.setattr(BaseDevice, name, counted)
    async with dev.buffer(big) as buf:
        async with Scheduler() as sched:
            sched.copyin(buf, bytes(big))
            sched.launch(add, buf, vals=(big,))
            assert bytes(await sched.copyout(buf)) == b"\x01" * big
            assert called == []
            sched.launch(add, buf, vals=(big,), priority=-1)
            assert bytes(await sched.copyout(buf.view(8, dtypes.uint8, 0))) == b"\x02" * 8
            assert called == ["launch", "copyout"]
        with pytest.raises(RuntimeError, match="not open"):
            sched.copyin(buf, bytes(big))


def _module_lock() -> Any:
    """A lock of the C module (which the first CPU device's engines build); skips where it cannot be built."""
    dev = Device["CPU"]
    _fast(dev)
    lock = submit.new_lock()
    assert type(lock).__name__ == "Lock" and type(lock).__module__ == "aruntime.engine.native.submit"
    return lock


_LOCK_PRELUDE = """
import signal, threading, time
import anyio
from aruntime import Device
from aruntime.engine.native import submit

async def main():
    Device["CPU"].compute  # its engines build the module
anyio.run(main)
lock = submit.new_lock()
assert type(lock).__module__ == "aruntime.engine.native.submit"
"""


def _in_a_child(body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a child interpreter after a prelude that makes ``lock``, one of the module's, with a time
    limit (so that a wait that never ends fails the test instead of hanging the suite); it must exit cleanly."""
    _module_lock()  # skips where the module cannot be built
    script = _LOCK_PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def test_the_modules_lock_is_a_lock() -> None:
    """Taken, held, let go of, as threading.Lock is; letting go of a lock nobody holds is an error that says so."""
    lock = _module_lock()
    assert lock.acquire() is True and lock.locked()
    lock.release()
    assert not lock.locked()
    with lock:
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(RuntimeError, match="release unlocked lock"):
        lock.release()
    with pytest.raises(TypeError, match="no arguments"):
        type(lock)(1)


def test_a_busy_lock_is_waited_for_with_the_gil_let_go() -> None:
    """A thread that takes a lock another thread holds waits without the GIL: the holder runs Python on and lets
    go, then the waiter has it. Run in a child interpreter, so that a wait that kept the GIL (which would never see
    the holder let go) fails the test by its time limit instead of hanging the suite."""
    done = _in_a_child(
        """
        holding, waiting, order = threading.Event(), threading.Event(), []

        def holder():
            with lock:
                holding.set()
                waiting.wait(10)
                time.sleep(0.3)  # Python, which needs the GIL, while the waiter waits
                order.append("holder lets go")

        def waiter():
            waiting.set()
            with lock:
                order.append("waiter has it")

        first = threading.Thread(target=holder)
        first.start()
        holding.wait(10)
        second = threading.Thread(target=waiter)
        second.start()
        first.join()
        second.join()
        print(order)
        """
    )
    assert done.stdout.strip() == "['holder lets go', 'waiter has it']"


def test_a_wait_on_the_modules_lock_runs_signal_handlers() -> None:
    """A thread waiting for a busy lock runs the signal handlers that come meanwhile (Ctrl-C interrupts it), as a
    wait on threading.Lock does; in a child interpreter, against a holder that lets go only after 5 s."""
    done = _in_a_child(
        """
        holding = threading.Event()

        def holder():
            with lock:
                holding.set()
                time.sleep(5)

        def interrupt(signum, frame):
            raise KeyboardInterrupt

        threading.Thread(target=holder, daemon=True).start()
        holding.wait(10)
        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        start = time.monotonic()
        try:
            lock.acquire()
        except KeyboardInterrupt:
            print("interrupted after", round(time.monotonic() - start, 1), "s, held:", lock.locked())
        """
    )
    words = done.stdout.split()
    assert words[:2] == ["interrupted", "after"], done.stdout
    assert float(words[2]) < 2.0 and words[-1] == "True", done.stdout  # by the handler, not the holder letting go


async def test_engines_and_schedulers_take_the_modules_lock_and_any_other_lock_works_too() -> None:
    """Engines and schedulers opened with the C path take its lock without a call; one given a threading.Lock
    instead is taken through its methods, with the same results."""
    dev = Device["CPU:5"]
    _fast(dev)
    lock_type = type(submit.new_lock())
    assert all(type(e._lock) is lock_type and type(e._retire_lock) is lock_type for e in dev.engines)
    add = await dev.compile(ADD_ONE, outs=(0,))
    big = dev.inline_copy_max + 4  # on the copy queue: the kernel waits for another queue
    for plain in (False, True):
        async with dev.buffer(big) as buf, Scheduler() as sched:
            assert type(sched._lock) is lock_type
            if plain:
                sched._lock = threading.Lock()
            for _ in range(50):
                sched.copyin(buf, bytes(big))
                sched.launch(add, buf, vals=(big,))
                assert bytes(await sched.copyout(buf)) == b"\x01" * big
            assert not sched._lock.locked() and not any(e._lock.locked() for e in dev.engines)


async def test_the_c_path_lets_go_of_what_its_ops_hold() -> None:
    """Sources, destinations and results are referenced while their ops run and released once they have."""
    dev = Device["CPU"]
    _fast(dev)
    buf = await dev.allocate(64)
    data, into = bytes(range(64)), bytearray(64)
    before = sys.getrefcount(data), sys.getrefcount(into)
    for _ in range(1_000):
        dev.copyin(buf, data)
        dev.copyout(buf, into=into)
    await dev.synchronize()
    await dev.copyin(buf, bytes(64))  # the hazard log's last entries now name ops that hold neither
    gc.collect()
    assert (sys.getrefcount(data), sys.getrefcount(into)) == before
    assert into == data


@pytest.mark.parametrize("path", ["c", "python"])
async def test_a_closed_queue_refuses_an_op_on_either_path(path: str) -> None:
    """An op for a queue that no longer takes work is refused before the hazard logs learn of it."""
    dev = Device["CPU:7"]
    if path == "c":
        _fast(dev)
    else:
        _python_path(dev)
    add = await dev.compile(ADD_ONE, outs=(0,))
    buf = await dev.allocate(8)
    await dev.copyin(buf, bytes(8))
    entries = list(buf.log.entries)
    dev.compute.close()
    try:
        with pytest.raises(DeviceError, match="closed"):
            dev.launch(add, buf, vals=(8,))
        assert buf.log.entries == entries
    finally:
        await dev.aclose()


MIXED = r"""
#include <stdint.h>
void kernel(double *out, const uint8_t *x, int8_t a, uint16_t b, int32_t c, uint64_t d, float e, double f) {
  out[0] = x[0] + a + b + c + (double)d + e + f;
}
"""
"""A kernel with a scalar of every packing: what it computes shows each scalar arrived as given."""


async def test_launch_scalars_arrive_alike_on_either_path() -> None:
    fast, slow = Device["CPU:5"], Device["CPU:6"]
    _fast(fast)
    _python_path(slow)
    cases = [
        (-128, 0, -(1 << 31), 0, 0.5, -1.25),
        (127, 65535, (1 << 31) - 1, (1 << 63) - 1, 3, True),
        (0, 7, 5, 9, -2.5, 1e300),
    ]
    for dev in (fast, slow):
        prog = await dev.compile(MIXED, outs=(0,))
        out, x = await dev.allocate(1, dtypes.float64), await dev.allocate(1)
        await dev.copyin(x, b"\x03")
        got = []
        for vals in cases:
            await dev.launch(prog, out, x, vals=vals)
            got.append((await dev.copyout(out)).tolist())
        if dev is fast:  # these launches were the C path's
            op = dev.compute.fast.launch(dev, prog, (out, x), cases[0], None, False, None, 0)
            assert isinstance(op, Op)
            await op
        if dev is fast:
            expected = got
        else:
            assert got == expected


def _refusal(method: Any, *args: Any, **kwargs: Any) -> tuple[type, str]:
    try:
        method(*args, **kwargs)
    except Exception as exc:  # the refusal to compare
        return type(exc), str(exc).replace("CPU:5", "DEV").replace("CPU:6", "DEV")
    raise AssertionError(f"not refused: {method.__name__}{args} {kwargs}")


async def _refusals(dev: BaseDevice, other: BaseDevice) -> list[tuple[type, str]]:
    """The errors ``dev``'s op methods raise for bad arguments (``other``: another device); the hazard logs of
    the buffers they name are left as they were."""
    prog = await dev.compile(MIXED, outs=(0,))
    add = await dev.compile(ADD_ONE, outs=(0,))
    out, x = await dev.allocate(1, dtypes.float64), await dev.allocate(1)
    freed = await dev.allocate(1)
    await dev.free(freed)
    foreign = await other.allocate(1)
    good = (1, 2, 3, 4, 5.0, 6.0)
    launch, copyin, copyout = dev.launch, dev.copyin, dev.copyout
    before = [list(b.log.entries) for b in (out, x)]
    found = [
        _refusal(launch, prog, out, x, vals=(1, 2, 3, 4, 5.0)),  # a scalar short
        _refusal(launch, prog, out, x, vals=(*good, 7)),  # one too many
        _refusal(launch, prog, out, vals=good),  # a buffer short
        _refusal(launch, prog, out, x, vals=(128, 2, 3, 4, 5.0, 6.0)),  # int8 overflow
        _refusal(launch, prog, out, x, vals=(1, -1, 3, 4, 5.0, 6.0)),  # negative unsigned
        _refusal(launch, prog, out, x, vals=(1, 2, 3, 1 << 63, 5.0, 6.0)),  # beyond int64
        _refusal(launch, prog, out, x, vals=(1.5, 2, 3, 4, 5.0, 6.0)),  # a float for an int
        _refusal(launch, prog, out, x, vals=(1, 2, 3, 4, "5", 6.0)),  # not a number
        _refusal(launch, prog, out, x, vals=7),  # not a sequence
        _refusal(launch, prog, out, freed, vals=good),
        _refusal(launch, prog, out, foreign, vals=good),
        _refusal(launch, prog, out, b"x", vals=good),
        _refusal(launch, add, x, vals=(1,), outs=(3,)),
        _refusal(launch, "kernel", x),
        _refusal(copyin, x, b"ab"),
        _refusal(copyin, x, b""),
        _refusal(copyin, freed, b"a"),
        _refusal(copyin, foreign, b"a"),
        _refusal(copyin, x, 5),
        _refusal(copyout, x, into=b"a"),  # read-only
        _refusal(copyout, x, into=bytearray(2)),
        _refusal(copyout, freed),
    ]
    assert [list(b.log.entries) for b in (out, x)] == before
    await other.free(foreign)
    return found


async def test_every_refusal_is_the_python_paths() -> None:
    """Arguments the C path cannot take go to the Python path, which refuses them with its own errors; nothing
    is left in the hazard logs."""
    fast, slow = Device["CPU:5"], Device["CPU:6"]
    _fast(fast)
    _python_path(slow)
    assert await _refusals(fast, slow) == await _refusals(slow, fast)


def _run(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter with ``env`` added; its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


PIPELINE = """
import anyio
from aruntime import Device
from aruntime.engine.native import submit
ADD = "#include <stdint.h>\\nvoid kernel(uint8_t *b, int64_t n) { for (int64_t i = 0; i < n; i++) b[i] += 1; }"
async def main():
    dev = Device["CPU"]
    prog = await dev.compile(ADD, outs=(0,))
    buf = await dev.allocate(1 << 17)
    outs = []
    for i in range(50):
        dev.copyin(buf, bytes([i]) * (1 << 17))
        dev.launch(prog, buf, vals=(1 << 17,))
        outs.append(dev.copyout(buf))
    assert [bytes(await o) for o in outs] == [bytes([i + 1]) * (1 << 17) for i in range(50)]
    print(dev.compute.fast is None, submit.unavailable)
anyio.run(main)
"""


def test_switched_off_the_python_path_serves_every_op() -> None:
    assert _run(PIPELINE, ARUNTIME_FAST_SUBMIT="0", ARUNTIME_ENGINE="native").split() == ["True", "None"]


def test_without_python_headers_the_python_path_serves_every_op() -> None:
    """A build that fails (no ``Python.h``) leaves the reason in ``unavailable``; ops run as before."""
    code = "import aruntime.engine.native.submit as s; s._include = lambda: '/nonexistent'\n" + PIPELINE
    out = _run(code, ARUNTIME_DISABLE_COMPILER_CACHE="1", ARUNTIME_ENGINE="native", ARUNTIME_FAST_SUBMIT="1")
    assert out.startswith("True the C submission path could not be built")
    assert "Python.h" in out


def test_a_bad_switch_is_refused_with_its_name() -> None:
    code = "from aruntime import Device\ntry:\n    Device['CPU']\nexcept ValueError as e:\n    print(e)\n"
    assert "ARUNTIME_FAST_SUBMIT" in _run(code, ARUNTIME_FAST_SUBMIT="2", ARUNTIME_ENGINE="native")


STATUS = r"""
#include <stdint.h>
int kernel(uint8_t *b) { return b[0] == 7 ? 3 : 0; }
"""
"""Fails (status 3) on a buffer whose first byte is 7."""


async def test_failures_among_many_ops_in_flight_reach_their_ops() -> None:
    """The C path retires finished ops in batches as it submits: a kernel's failure among hundreds of ops in
    flight is still set on its op, and only on its op."""
    dev = Device["CPU:5"]
    _fast(dev)
    prog = await dev.compile(STATUS)
    bufs = [await dev.allocate(1) for _ in range(8)]
    for i, buf in enumerate(bufs):
        await dev.copyin(buf, bytes([7 if i == 3 else 0]))
    ops = [dev.launch(prog, bufs[i % 8]) for i in range(800)]
    failed = []
    for i, op in enumerate(ops):
        try:
            await op
        except KernelError as exc:
            assert exc.status == 3
            failed.append(i)
    assert failed == [i for i in range(800) if i % 8 == 3]


async def test_a_damaged_hazard_log_is_an_error_not_a_crash() -> None:
    """The C path reads the hazard log's entries as the Python one writes them; anything else there is a
    TypeError naming it, not memory read as an op."""
    dev = Device["CPU:5"]
    _fast(dev)
    buf = await dev.allocate(8)
    await dev.copyin(buf, bytes(8))
    buf.log.entries.append((0, 8, True, "not an op"))
    with pytest.raises(TypeError, match="hazard log holds 'not an op'"):
        dev.copyin(buf, bytes(8))
    buf.log.entries[-1] = "not an entry"
    with pytest.raises(TypeError, match="hazard log holds 'not an entry'"):
        dev.copyin(buf, bytes(8))
    buf.log.entries.clear()
    await dev.copyin(buf, bytes(8))


_WINDOW_SLOT: Any = vars(Scheduler)["_window"]  # the slot's descriptor, behind the `window` property


class _NarrowScheduler(Scheduler):
    """A Scheduler whose window's slot is a property here: two ops in flight, whatever the slot holds."""

    @property  # type: ignore[misc]  # a slot made a property, as a subclass may
    def _window(self) -> int:
        return 2

    @_window.setter
    def _window(self, value: int) -> None:
        _WINDOW_SLOT.__set__(self, value)  # the slot holds what it was made with


class _LaterScheduler(Scheduler):
    """A Scheduler subclass whose window this test changes after its first ops (a class changed meanwhile)."""


async def _admitted(dev: BaseDevice, sched: Scheduler, count: int = 5) -> list[bool]:
    """Whether each of ``count`` launches through ``sched`` was admitted to its queue (held behind a closed gate,
    so none finishes meanwhile) rather than queued for room."""
    gate, flag = await closed_gate(dev)
    add = await dev.compile(ADD_ONE, outs=(0,))
    bufs = [await dev.allocate(8) for _ in range(count)]
    dev.launch(gate, await dev.allocate(1, dtypes.int32), vals=(flag.handle, SPINS))
    async with sched:
        ops = [sched.launch(add, buf, vals=(8,)) for buf in bufs]
        admitted = [op.value != HELD for op in ops]  # none depends on another: HELD is queued for room
        ctypes.c_int32.from_address(flag.handle).value = 1
        with anyio.fail_after(30):
            for op in ops:
                await op
    return admitted


async def test_attributes_read_in_place_follow_a_subclass_and_a_changed_class() -> None:
    """The C path reads slots where they lie, but an attribute a subclass makes a property, or a class changed
    after the first read, is read as Python reads it."""
    dev = Device["CPU:5"]
    _fast(dev)
    assert await _admitted(dev, Scheduler(window=1024)) == [True] * 5
    assert await _admitted(dev, _NarrowScheduler(window=1024)) == [True, True, False, False, False]
    assert await _admitted(dev, _LaterScheduler(window=1024)) == [True] * 5
    setattr(_LaterScheduler, "_window", property(lambda self: 3, _WINDOW_SLOT.__set__))  # noqa: B010  (mypy refuses the assignment)
    try:
        assert await _admitted(dev, _LaterScheduler(window=1024)) == [True, True, True, False, False]
    finally:
        delattr(_LaterScheduler, "_window")


class _Foreign:
    """A class with more slots than a Scheduler has before ``_window``: its ``_window`` lies elsewhere."""

    __slots__ = (
        "_a",
        "_b",
        "_c",
        "_d",
        "_e",
        "_f",
        "_g",
        "_h",
        "_i",
        "_j",
        "_k",
        "_l",
        "_m",
        "_n",
        "_o",
        "_p",
        "_window",
    )


async def test_another_classs_slot_put_on_a_class_is_an_error_not_a_read_of_the_wrong_memory() -> None:
    """A member descriptor of another class, put on a scheduler's class, applies to no scheduler: the C path
    raises the TypeError Python raises instead of reading the scheduler at the other class's offset."""
    dev = Device["CPU:5"]
    _fast(dev)
    add = await dev.compile(ADD_ONE, outs=(0,))
    buf = await dev.allocate(8)
    sched = _LaterScheduler(window=1024)
    async with sched:
        sched.launch(add, buf, vals=(8,))  # the window's slot read once, in place
        setattr(_LaterScheduler, "_window", vars(_Foreign)["_window"])  # noqa: B010  (mypy refuses the assignment)
        try:
            with pytest.raises(TypeError, match="doesn't apply"):
                for _ in range(2_000):  # past the window's room, whichever read comes first
                    sched.launch(add, buf, vals=(8,))
        finally:
            delattr(_LaterScheduler, "_window")
