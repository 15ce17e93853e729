"""The native engine: loops woken through their notifier, no Python on engine threads, kernel signatures."""

from __future__ import annotations

import array
import os
import random
import subprocess
import sys
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from aruntime import CompileError, Device, dtypes
from aruntime.engine import KernelError, engine_name
from tests.kernels import SCALE, SPINS, closed_gate
from tests.kernels import SPIN_MS as SPIN

pytestmark = pytest.mark.skipif(engine_name() != "native", reason="the native engine is not in use in this run")


def _python_threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.mark.anyio
async def test_ops_complete_without_any_python_thread() -> None:
    dev = Device["CPU"]
    prog = await dev.compile(SCALE, outs=(0,))
    x = await dev.allocate(1024, dtypes.float32)
    y = await dev.allocate(1024, dtypes.float32)
    before = _python_threads()
    for _ in range(50):
        await dev.copyin(x, array.array("f", range(1024)))
        await dev.launch(prog, y, x, vals=(1024, 2.0))
        out = array.array("f", bytes(await dev.copyout(y)))
        assert out[10] == 20.0
    started = _python_threads() - before
    assert not started, f"Python threads took part in completing native ops: {started}"


@pytest.mark.anyio
async def test_a_long_kernel_leaves_the_loop_free() -> None:
    dev = Device["CPU"]
    prog = await dev.compile(SPIN, outs=(0,))
    out = await dev.allocate(1)
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await dev.launch(prog, out, vals=(200,))
        done = True
    assert ticks > 1000, f"the loop ran only {ticks} times during a 200 ms kernel"


@pytest.mark.anyio
async def test_a_flood_of_awaited_ops_loses_none_and_leaves_no_waiter() -> None:
    dev = Device["NULL"]
    buf = await dev.allocate(64)
    results: list[int] = []

    async def one(i: int) -> None:
        await dev.copyin(buf.view(1, dtypes.uint8, i % 64), b"x")
        results.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(5000):
            tg.start_soon(one, i)
    assert sorted(results) == list(range(5000))
    await dev.synchronize()
    notified = dev.copy.signal.here()
    assert not notified._waits, "waiters were left registered after every op completed"


@pytest.mark.anyio
async def test_random_cancellations_leave_no_bytes_in_use() -> None:
    dev = Device["CPU:13"]  # no other test's buffers: its bytes in use are this test's alone
    baseline = dev.allocator.in_use
    rng = random.Random(7)
    prog = await dev.compile(SPIN, outs=(0,))

    async def one() -> None:
        buf = await dev.allocate(4096)
        try:
            await dev.copyin(buf, bytes(4096))
            if rng.random() < 0.05:
                await dev.launch(prog, buf, vals=(1,))
            await dev.copyout(buf)
        finally:
            with anyio.CancelScope(shield=True):
                await dev.free(buf)

    for _ in range(20):
        async with anyio.create_task_group() as tg:
            for _ in range(500):
                tg.start_soon(one)
            await anyio.sleep(rng.random() * 0.01)
            tg.cancel_scope.cancel()
    await dev.synchronize()
    assert dev.allocator.in_use == baseline


def test_no_descriptor_leaks_across_many_event_loops() -> None:
    dev = Device["NULL"]

    async def main() -> None:
        await dev.copyin(await dev.allocate(8), bytes(8))
        await dev.launch(await dev.compile("void kernel(void) {}"), await dev.allocate(8))

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    for backend in ("asyncio", "trio"):
        anyio.run(main, backend=backend)
    before = fds()
    for i in range(1000):
        anyio.run(main, backend=("asyncio", "trio")[i % 2])
    assert fds() <= before + 2, f"{fds() - before} descriptors leaked over 1000 loops"


@pytest.mark.anyio
async def test_a_loop_in_another_thread_awaits_the_same_ops() -> None:
    dev = Device["CPU"]
    prog = await dev.compile(SPIN, outs=(0,))
    out = await dev.allocate(1)
    op = dev.launch(prog, out, vals=(50,))
    seen: list[object] = []

    def other_loop() -> None:
        async def wait() -> None:
            seen.append(await op)

        anyio.run(wait, backend="trio")

    thread = threading.Thread(target=other_loop)
    thread.start()
    await op
    await anyio.to_thread.run_sync(thread.join)
    assert seen == [None]


# ---- kernel signatures ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_int_for_a_double_parameter_is_converted() -> None:
    dev = Device["CPU"]
    prog = await dev.compile(SCALE, outs=(0,))
    x = await dev.allocate(2, dtypes.float32)
    y = await dev.allocate(2, dtypes.float32)
    await dev.copyin(x, array.array("f", [1.5, 2.0]))
    await dev.launch(prog, y, x, vals=(2, 4))  # 4 -> 4.0 for `double s`
    assert list(array.array("f", bytes(await dev.copyout(y)))) == [6.0, 8.0]


@pytest.mark.anyio
async def test_launch_arguments_are_checked_against_the_definition() -> None:
    dev = Device["CPU"]
    prog = await dev.compile(SCALE, outs=(0,))
    x = await dev.allocate(2, dtypes.float32)
    with pytest.raises(TypeError, match=r"scalar 0 is a float .* 'int64_t n' is an integer"):
        dev.launch(prog, x, x, vals=(2.5, 1.0))
    with pytest.raises(ValueError, match=r"takes 2 buffer\(s\) \(float \*out, const float \*x\), got 1"):
        dev.launch(prog, x, vals=(2, 1.0))
    with pytest.raises(TypeError, match=r"takes 2 scalar\(s\) \(int64_t n, double s\), got 1"):
        dev.launch(prog, x, x, vals=(2,))
    small = await dev.compile("#include <stdint.h>\nvoid kernel(uint8_t *b, uint8_t v) { b[0] = v; }")
    with pytest.raises(ValueError, match=r"scalar 0 = 256 does not fit 'uint8_t v'"):
        dev.launch(small, x, vals=(256,))


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("src", "match"),
    [
        ("int kernel = 3;", "is not a function defined in the source"),
        ("void other(void) {}", "defines no function named 'kernel'"),
        ("void kernel(int n, ...) {}", "variadic"),
        ("struct s { int a; };\nvoid kernel(struct s v) {}", "only pointers, integer types and float/double"),
        ("float kernel(void) { return 1; }", "must return void or an integer status"),
    ],
)
async def test_what_is_not_a_kernel_is_refused_at_compile_time(src: str, match: str) -> None:
    with pytest.raises(CompileError, match=match):
        await Device["CPU"].compile(src)


@pytest.mark.anyio
async def test_a_kernel_reports_failure_through_its_status() -> None:
    dev = Device["CPU"]
    src = "#include <stdint.h>\nint kernel(uint8_t *b, int64_t bad) { if (bad) return 7; b[0] = 1; return 0; }"
    prog = await dev.compile(src)
    buf = await dev.allocate(1)
    await dev.launch(prog, buf, vals=(0,))
    with pytest.raises(KernelError, match="returned status 7") as info:
        await dev.launch(prog, buf, vals=(1,))
    assert info.value.status == 7
    reader = dev.copyout(buf)
    with pytest.raises(Exception, match="depends on kernel, which failed"):
        await reader
    await dev.launch(prog, buf, vals=(0,))  # the device goes on
    assert bytes(await dev.copyout(buf)) == b"\x01"


def test_the_engine_can_be_forced_and_is_reported() -> None:
    code = "from aruntime import Device; print(Device['CPU'])"
    env = {**os.environ, "ARUNTIME_ENGINE": "python"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "python engine" in out
    env["ARUNTIME_ENGINE"] = "fast"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "ValueError: environment variable ARUNTIME_ENGINE='fast'" in proc.stderr


@pytest.mark.anyio
async def test_a_driver_callback_completes_a_signal_without_python() -> None:
    import ctypes

    from aruntime.engine import TimelineSignal, native

    lib = native.lib()
    assert lib is not None
    sig = TimelineSignal("driver queue", timeout=5)
    completion = lib.ar_completion_new(sig.ptr, 3)  # type: ignore[attr-defined]
    host_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.cast(lib.ar_completion_host_fn, ctypes.c_void_p).value)
    # what a driver's own thread does: call the host function it was given, with its argument
    thread = threading.Thread(target=host_fn, args=(completion,))
    with anyio.fail_after(5):
        thread.start()
        await sig.wait_async(3)
    thread.join()
    assert sig.value == 3


@pytest.mark.anyio
async def test_a_waiter_for_a_later_value_is_woken_after_an_earlier_one_was_taken_on_the_fast_path() -> None:
    from aruntime.engine import TimelineSignal

    sig = TimelineSignal("probe", timeout=5)
    fired: list[int] = []
    sig.on_reach(5, lambda: fired.append(5))  # armed at 5
    woken = anyio.Event()

    async def later() -> None:
        await sig.wait_async(10)
        woken.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(later)
        await anyio.wait_all_tasks_blocked()
        sig.set(5)  # the arm at 5 fires natively
        await sig.wait_async(5)  # reached: the fast path runs the callback due at 5 here
        await anyio.sleep(0.02)  # the loop polls its descriptors and drains the notifier: 10 is not reached
        sig.set(10)
        with anyio.fail_after(2):
            await woken.wait()
    assert fired == [5]


@pytest.mark.anyio
async def test_a_worker_polls_only_while_work_comes_back_soon() -> None:
    """Fed now and then, a worker soon stops polling (it sleeps at once); fed again as soon as it runs dry, it
    polls again."""
    from aruntime.engine.native.engine import SPIN_NS, NativeEngine

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a process allowed one CPU never polls (tested below)")
    dev = Device["NULL:41"]
    try:
        engine = dev.compute
        assert isinstance(engine, NativeEngine)
        prog = await dev.compile("void kernel(void) {}")
        assert engine.spin_ns == SPIN_NS
        for _ in range(20):  # each gap is at least 2 ms, far longer than a poll: each halves it
            await dev.launch(prog)
            await anyio.sleep(0.002)
        assert engine.spin_ns == 0
        polled = 0
        for _ in range(1_000):  # each launch appended as soon as the previous one's end is seen: within a poll
            await dev.launch(prog)  # (on a loaded machine some come later: one that comes soon is enough)
            polled = max(polled, engine.spin_ns)
            if polled:
                break
        assert polled == SPIN_NS
    finally:
        await dev.aclose()  # a fresh worker for the next event loop's run


def test_a_process_allowed_one_cpu_never_polls() -> None:
    code = """
import os
os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
import anyio
from aruntime import Device
async def main():
    dev = Device["NULL"]
    prog = await dev.compile("void kernel(void) {}")
    for _ in range(100):
        await dev.launch(prog)
    print(dev.compute.spin_ns, dev.copy.spin_ns)
anyio.run(main)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "0"]


@pytest.mark.anyio
async def test_commands_prepared_ahead_pack_to_the_records_packed_at_submission() -> None:
    """A graph replay's commands packed once (Engine.prepare), then changed and given waits in front, give the
    same ring records as the same commands packed at submission, input checks included."""
    from aruntime.engine import COPY, EXEC, SIGNAL, WAIT, Op
    from aruntime.engine.native.engine import _RECORD, K_CHECK, NativeEngine, _Packed

    def packed(cmds: list[Any], op: Op) -> tuple[list[list[int]], list[bytes]]:
        """The records packed for ``op`` (a check's pairs by content, not where they are) and what they keep."""
        records, count, keep = engine._pack(cmds, op)
        rows = [list(_RECORD.unpack_from(records, i * _RECORD.size)) for i in range(count)]
        for row in rows:
            row[2] = 0 if row[0] == K_CHECK else row[2]
        return rows, [bytes(k) for k in keep or ()]

    a, b = Device["CPU:7"], Device["CPU:8"]
    prog = await a.compile(SCALE, outs=(0,))
    x, y = await a.allocate(256, dtypes.float32), await a.allocate(256, dtypes.float32)
    engine, other = a.compute, b.compute
    assert isinstance(engine, NativeEngine) and isinstance(other, NativeEngine)
    host = array.array("f", range(256))
    address = host.buffer_info()[0]
    fn, args = prog.bind([x.handle, y.handle], [256, 2.0])
    cmds = [
        (WAIT, other.signal, 3),
        (COPY, "copyin", a.copy_fn, x.handle, address, 1024),
        (EXEC, prog.name, fn, args),
        (SIGNAL, engine.signal, 9),
        (COPY, "copyout", a.copy_fn, 0, y.handle, 1024),  # its host memory is put in per use
    ]
    prepared = engine.prepare(cmds)
    assert type(prepared) is _Packed and prepared.words is not None
    body = prepared.fresh()
    body.put(4, (COPY, "copyout", a.copy_fn, address, y.handle, 1024))
    body.put(0, (WAIT, other.signal, 5))
    expected = [(WAIT, other.signal, 5), *cmds[1:4], (COPY, "copyout", a.copy_fn, address, y.handle, 1024)]
    assert list(body) == expected and list(prepared) == cmds
    gate, flag = await closed_gate(b)
    out = await b.allocate(1, dtypes.int32)
    running = b.launch(gate, out, vals=(flag.handle, SPINS))  # unfinished until the flag is set
    waits = [(WAIT, other.signal, 7), (WAIT, b.copy.signal, 1)]
    for inputs in ((), (running,)):  # with an input that can still fail, a check before each first kernel or copy
        op, same = Op("prepared"), Op("packed at submission")
        op.inputs = same.inputs = inputs
        same.id = op.id
        assert packed(body, op) == packed(expected, same)
        ahead = body.after(waits)
        assert type(ahead) is _Packed and ahead.words is not None and list(ahead) == waits + expected
        assert packed(ahead, op) == packed(waits + expected, same)
        assert any(row[0] == K_CHECK for row in packed(ahead, op)[0]) == bool(inputs)
        engine._python.pop(op.id, None)  # never submitted
    other_fn = engine.prepare([(COPY, "copy", a.copy_fn, x.handle, y.handle, 4)]).fresh()
    other_fn.put(0, (COPY, "copy", lambda dst, src, n: None, x.handle, y.handle, 4))
    assert type(other_fn) is _Packed and other_fn.words is None  # packed at submission, from its commands
    await b.copyin(flag, array.array("i", [1]))
    await running
