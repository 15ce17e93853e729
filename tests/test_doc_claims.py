"""What the documentation claims is what the code does.

Each test runs the behaviour a page describes and checks the page's sentence
against what it measured: the default device's order and its variables, the
`ARUNTIME_` prefix, the one rule for op failures, where a held or queued op is
handed to its queue, dropped scheduler ops and ``synchronize()``, freeing
under a DLPack consumer, a cancelled buffer scope, and when a copy-out
allocates its result. ``tests/test_docs.py`` runs the pages' examples.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import aruntime
from aruntime import DependencyError, Device, OpError, Program, Scheduler, SignalTimeout, dtypes
from aruntime.device import PRIORITY
from aruntime.engine import KernelError, dispatch_when_ready

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md", ROOT / "CHANGELOG.md"]
TIMEOUT = 120

STATUS = r"""
#include <stdint.h>
int kernel(int32_t *out, int64_t status) { out[0] = 1; return (int)status; }
"""
SLOW = r"""
#include <stdint.h>
#include <time.h>
/* Sleep `ms` milliseconds, then write out[0]. */
void kernel(int32_t *out, int64_t ms) {
  struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&t, 0);
  out[0] = 1;
}
"""
BIG = 1 << 20
"""Elements of an int32 buffer whose copy-out is far above ``inline_copy_max``: it always goes on the copy queue."""


def _flat(text: str) -> str:
    return " ".join(text.split())


def _paragraph(page: str, *needles: str) -> str:
    """The one paragraph (or list item) of ``docs/page`` that contains every needle, on one line."""
    text = (DOCS / page).read_text()
    found = [p for p in re.split(r"\n\s*\n|\n(?=- )", text) if all(n in _flat(p) for n in needles)]
    assert len(found) == 1, f"docs/{page}: {len(found)} paragraphs contain {needles}"
    return _flat(found[0])


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, from the repository root, with ``env`` over a copy of ours that has no
    ``ARUNTIME_<KIND>`` variable."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ARUNTIME_") or k == "ARUNTIME_CACHEDB"}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, capture_output=True, text=True, timeout=TIMEOUT
    )


def _scenario(name: str, engine: str) -> Any:
    """Run this module's coroutine ``name`` on asyncio in a process on ``engine``; what it returned."""
    code = (
        "import json, sys, anyio; sys.path.insert(0, '.'); from tests import test_doc_claims as t; "
        f"print(json.dumps(anyio.run(t.{name})))"
    )
    proc = _run(code, {"ARUNTIME_ENGINE": engine})
    if proc.returncode != 0 and "native core is unavailable" in proc.stderr:
        pytest.skip(f"the native engine does not run here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the default device and the environment ----------------------------------------------------------


def test_the_default_order_in_the_docs_is_the_registry_s() -> None:
    sentence = _paragraph("concepts.md", "**The default device**")
    listed = re.search(r"the first of ((?:`\w+`(?:, )?)+) that opens", sentence)
    assert listed is not None, sentence
    assert tuple(re.findall(r"`(\w+)`", listed[1])) == PRIORITY
    assert "`ARUNTIME_CL=1` makes it the default" in sentence
    cl = _paragraph("backends.md", "`CL` is not the default device while `CPU` opens")
    assert PRIORITY.index("CPU") < PRIORITY.index("CL")
    assert "`ARUNTIME_CL=1` in the environment makes it the default" in cl


@pytest.mark.parametrize(
    ("env", "default", "timeout"),
    [
        ({}, None, 30.0),
        ({"CL": "1", "NULL": "1", "WAIT_TIMEOUT": "5"}, None, 30.0),  # unprefixed: ignored
        ({"ARUNTIME_CL": "1", "ARUNTIME_WAIT_TIMEOUT": "5"}, "CL", 5.0),
        ({"ARUNTIME_NULL": "1"}, "NULL", 30.0),
    ],
    ids=["none", "unprefixed", "prefixed", "null"],
)
def test_the_default_device_and_settings_come_from_prefixed_variables(
    env: dict[str, str], default: str | None, timeout: float
) -> None:
    code = "from aruntime import Device; print(Device.DEFAULT, Device['NULL'].timeout)"
    proc = _run(code, env)
    assert proc.returncode == 0, proc.stderr
    chosen, seconds = proc.stdout.split()
    if default is None:  # the first kind of PRIORITY that opens here
        expected = _run("from aruntime import Device; print(Device.DEFAULT)", {}).stdout.strip()
        assert chosen == expected and chosen in PRIORITY
    else:
        assert chosen == default
    assert float(seconds) == timeout


def _setting_names() -> set[str]:
    """What aruntime reads from the environment, without the prefix: its settings and the device kinds."""
    names = set(Device.kinds()) | {"DEBUG"}
    for path in (ROOT / "aruntime").rglob("*.py"):
        names.update(re.findall(r"getenv\(\s*\"([A-Z][A-Z0-9_]*)\"", path.read_text()))
    assert {"WAIT_TIMEOUT", "PROFILE", "ENGINE", "CPU", "CL"} <= names
    return names


def test_the_docs_set_no_unprefixed_variable() -> None:
    """An environment assignment in the docs is always ``ARUNTIME_<NAME>=``. Old names appear only next to the
    new one (the settings table's "Was" column) or as a removed line of a diff (the migration page)."""
    names = _setting_names()
    assignment = re.compile(r"(?<![\w$])(" + "|".join(sorted(names, key=len, reverse=True)) + r")=")
    wrong = []
    for page in PAGES:
        in_diff = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_diff = line.strip() == "```diff"
                continue
            if in_diff and line.startswith("-"):
                continue
            wrong += [
                f"{page.name}:{number}: {line.strip()}"
                for name in assignment.findall(line)
                if f"ARUNTIME_{name}" not in line
            ]
    assert not wrong, "unprefixed variables (aruntime ignores them):\n" + "\n".join(wrong)


# ---- failures ---------------------------------------------------------------------------------------------


class Broken(Program):
    """A Python program that fails."""

    def __call__(self, *args: object) -> None:
        raise ValueError("bad input")


async def failure_rule() -> str:
    """Every op failure is an OpError: the runtime's own kinds as they are, anything else wrapped with its
    cause. Returns the engine it ran on."""
    dev = Device["CPU"]
    prog = await dev.compile(STATUS, outs=(0,))
    queue = f"{dev.name} compute queue"
    async with dev.buffer(4, dtypes.int32) as buf:
        failing = dev.launch(prog, buf, vals=(3,))
        reader = dev.copyout(buf)
        with pytest.raises(KernelError) as kernel:
            await failing
        assert isinstance(kernel.value, OpError) and kernel.value.status == 3 and kernel.value.__cause__ is None
        with pytest.raises(DependencyError) as dependency:
            await reader
        assert dependency.value.first == failing.name and dependency.value.__cause__ is None

        with pytest.raises(OpError) as wrapped:
            await dev.launch(Broken(dev, "broken", b""), buf)
        assert type(wrapped.value) is OpError and isinstance(wrapped.value.__cause__, ValueError)
        assert "broken" in str(wrapped.value) and queue in str(wrapped.value)

    # a wait inside an op that times out: the transfer (on CPU's copy queue) waits for a kernel of CPU:7
    other = Device["CPU:7"]
    slow = await other.compile(SLOW, outs=(0,))
    async with dev.buffer(4, dtypes.int32) as src, other.buffer(4, dtypes.int32) as dst:
        other.timeout = 0.05
        try:
            kernel_op = other.launch(slow, dst, vals=(400,))
            copy = aruntime.transfer(dst, src)
            with pytest.raises(OpError) as timed_out:
                await copy
        finally:
            other.timeout = 30.0
        assert type(timed_out.value) is OpError and isinstance(timed_out.value.__cause__, SignalTimeout)
        assert "transfer" in str(timed_out.value) and f"{dev.name} copy queue" in str(timed_out.value)
        await kernel_op
    await other.aclose()
    return dev.engine_kind


async def test_op_failures_follow_one_rule(anyio_backend: Any) -> None:
    await failure_rule()


@pytest.mark.parametrize("engine", ["native", "python"])
def test_op_failures_follow_one_rule_on_each_engine(engine: str) -> None:
    assert _scenario("failure_rule", engine) == engine


def test_the_docs_state_the_failure_rule() -> None:
    rule = _paragraph("concepts.md", "**Every op failure is an `OpError`.**")
    for part in (
        "raised as they are, with no `__cause__`",
        "`KernelError`",
        "`DependencyError`",
        "is wrapped in an `OpError` that names the op, the device and the queue, with the original in `__cause__`",
    ):
        assert part in rule, part
    assert "raised as it is, with no `__cause__`" in _paragraph("backends.md", "`aruntime.engine.KernelError`")
    assert "subclasses raised as they are" in _flat(OpError.__doc__ or "")
    started = _paragraph("getting-started.md", "A failure while an op runs")
    assert "are subclasses raised as they are" in started and "`__cause__`" in started
    for page in PAGES:
        flat = _flat(page.read_text())
        assert "(`OpError`, with the original exception as `__cause__`)" not in flat, page.name
        assert "`_complete` wraps the error in an `OpError`," not in flat, page.name


# ---- held and queued ops ------------------------------------------------------------------------------------


async def hand_off_needs_the_loop() -> dict[str, bool]:
    """For a held op (a Scheduler with room) and a queued one (a full window): whether it reaches its queue
    only through a turn of the event loop. The loop is blocked while the op it waits for finishes; an op handed
    over elsewhere runs meanwhile."""
    dev = Device["CPU"]
    prog = await dev.compile(SLOW, outs=(0,))
    found = {}
    for case, window in (("held", 64), ("queued", 1)):
        async with dev.buffer(BIG, dtypes.int32) as buf, Scheduler(window=window) as sched:
            sched.launch(prog, buf, vals=(20,))
            reader = sched.copyout(buf)  # a big copy: the copy queue, after the kernel on the compute queue
            assert not reader.done()
            time.sleep(0.5)  # noqa: ASYNC251 (the point: the loop cannot run anything meanwhile)
            found[case] = not reader.done()
            await reader
    return found


@pytest.mark.parametrize("engine", ["native", "python"])
def test_the_docs_say_where_a_held_op_is_handed_on(engine: str) -> None:
    needs_loop = _scenario("hand_off_needs_the_loop", engine)
    assert not needs_loop["held"], f"a held op waited for the event loop on the {engine} engine"
    label = {"native": "native engine", "python": "Python engine"}[engine]
    held = _paragraph("concepts.md", "is **held** off")
    docstring = _flat(dispatch_when_ready.__doc__ or "")
    for where, text in (("concepts.md, the scheduler", held), ("dispatch_when_ready", docstring)):
        clause = re.search(rf"on the {label}([^;.]*)", text)
        assert clause is not None, f"{where} does not say what the {label} does"
        assert "event loop" not in clause[1] or "no trip" in clause[1], f"{where}: {clause[0]!r}"
    queued = _paragraph("concepts.md", "**Backpressure.**")
    clause = re.search(rf"on the {label}([^,;.]*)", queued)
    assert clause is not None, f"the backpressure paragraph does not say what the {label} does"
    assert ("event loop" in clause[1]) == needs_loop["queued"], f"{clause[0]!r}, but needs the loop: {needs_loop}"
    callbacks = _paragraph("concepts.md", "**The native engine.**")  # where callbacks on ops run, per engine
    if engine == "native":
        assert ("the hand-off of a scheduler's queued op" in callbacks) == needs_loop["queued"]
    else:
        assert ("On the Python engine they run on the engine thread" in callbacks) == (not needs_loop["queued"])
    for page in PAGES:
        assert "without a trip through the event loop" not in _flat(page.read_text()), page.name


# ---- dropped ops, freeing, scopes, copy-outs -----------------------------------------------------------------


async def test_dropped_scheduler_ops_are_not_failures_for_synchronize(anyio_backend: Any) -> None:
    dev = Device["CPU"]
    prog = await dev.compile(SLOW, outs=(0,))
    bufs = [await dev.allocate(1, dtypes.int32) for _ in range(4)]
    dropped = []
    with anyio.move_on_after(0.05):
        async with Scheduler(window=1, queue=16) as sched:
            sched.launch(prog, bufs[0], vals=(200,))  # the window is full while it runs
            dropped = [sched.launch(prog, buf, vals=(0,)) for buf in bufs[1:]]
            await anyio.sleep(30)
    await dev.synchronize()  # raises nothing: no dropped op counts as a failure
    for op in dropped:
        with pytest.raises(OpError, match="was dropped") as exc:
            await op
        assert type(exc.value) is OpError
    with pytest.raises(DependencyError):
        await dev.copyout(bufs[1])  # what a dropped op should have written
    for buf in bufs:
        await dev.free(buf)
    await dev.synchronize()
    text = _paragraph("concepts.md", "A cancelled `Scheduler` block drops")
    assert "the next `synchronize()` does not count it as a failure" in text
    assert "no `synchronize()` raises it" in _paragraph("concepts.md", "Nothing fails silently")


async def test_free_does_not_wait_for_a_dlpack_consumer(anyio_backend: Any) -> None:
    np = pytest.importorskip("numpy")
    dev = Device["CPU"]
    gc.collect()  # buffers earlier tests dropped in cycles are released now, not in the middle of this test
    start = dev.allocator.in_use
    buf = await dev.allocate(1 << 16)
    view = np.from_dlpack(buf)
    with anyio.fail_after(5):
        await dev.free(buf)  # returns while numpy holds the memory
    assert dev.allocator.in_use == start + (1 << 16)
    view[:] = 7  # still the buffer's memory, still valid
    del view
    gc.collect()
    assert dev.allocator.in_use == start
    text = _paragraph("concepts.md", "**DLPack export.**")
    assert "`await dev.free(buf)` does not wait for that" in text


async def test_a_cancelled_buffer_scope_does_not_wait_and_its_memory_is_not_reused(anyio_backend: Any) -> None:
    dev = Device["CPU"]
    prog = await dev.compile(SLOW, outs=(0,))
    start = dev.allocator.in_use
    began = time.monotonic()
    with anyio.move_on_after(0.05):
        async with dev.buffer(BIG, dtypes.int32) as buf:
            handle = buf.handle
            running = dev.launch(prog, buf, vals=(500,))
            await anyio.sleep(30)
    assert time.monotonic() - began < 0.4 and not running.done()  # the exit did not wait for the kernel
    assert dev.allocator.in_use == start + BIG * 4  # still held for the kernel
    other = await dev.allocate(BIG, dtypes.int32)  # same size and spec: the cache would hand it out if it had it
    other_handle = other.handle
    assert other_handle != handle
    await dev.free(other)
    await running
    assert dev.allocator.in_use == start
    again = await dev.allocate(BIG, dtypes.int32)
    assert again.handle in (handle, other_handle)  # both are in the allocator's cache now
    await dev.free(again)
    scope = _paragraph("concepts.md", "**Scopes.**")
    assert "A block that is cancelled does not wait for those ops" in scope
    assert "no allocation can be given it" in _paragraph("concepts.md", "The release is deferred")


def _mapped() -> int:
    """The process's virtual memory size in bytes (what a fresh mapping adds to at once)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmSize:")[1].split()[0]) * 1024


async def test_a_copy_out_without_into_allocates_its_result_at_submission(anyio_backend: Any) -> None:
    dev = Device["CPU"]
    prog = await dev.compile(SLOW, outs=(0,))
    nbytes = BIG * 4
    async with dev.buffer(BIG, dtypes.int32) as buf:
        mine = bytearray(nbytes)
        running = dev.launch(prog, buf, vals=(200,))
        before = _mapped()
        fresh = dev.copyout(buf)
        allocated = _mapped() - before
        before = _mapped()
        into = dev.copyout(buf, into=mine)
        allocated_into = _mapped() - before
        assert not fresh.done() and not into.done()  # both wait for the kernel
        assert allocated >= nbytes and allocated_into < nbytes // 2
        await running
        assert len(await fresh) == BIG and await into is mine
    text = _paragraph("concepts.md", "A `copyout` without `into=`")
    assert "when it is submitted, not when it runs" in text and "pass `into=`" in text
    assert "the copy's worker thread, not the event loop, pays" in text
