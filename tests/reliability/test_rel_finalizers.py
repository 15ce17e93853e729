"""Finalizers never deadlock: a buffer collected while a lock that freeing takes is held (a garbage collection
starts wherever Python allocates, under any lock) leaves its free to the next allocator call, and the bytes in
use are exact again once that call has run it; an event loop collected while the callback thread's lock is held
leaves the closing of its notifier, and the moving of its pending callbacks, to the callback thread."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import aruntime.memory.buffer
from aruntime import Buffer, Device
from aruntime.engine import native


class ReentryCheck:
    """A lock that notes a re-entry from the thread that holds it, where a plain lock would block for ever."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self.reentered = False

    def __enter__(self) -> None:
        self._lock.acquire()
        self._depth += 1
        self.reentered |= self._depth > 1

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1
        self._lock.release()


@contextmanager
def collected_under(owner: Any, name: str) -> Iterator[ReentryCheck]:
    """Replace the lock ``owner.name`` with a :class:`ReentryCheck` and run a garbage collection while holding it
    (the block runs after it, with the lock back in place)."""
    check = ReentryCheck()
    saved = getattr(owner, name)
    setattr(owner, name, check)
    try:
        with check:
            gc.collect()
    finally:
        setattr(owner, name, saved)
    yield check


def garbage_buffer(size: int) -> None:
    """An allocated buffer of ``size`` bytes on CPU:91 that only a garbage collection frees (a reference cycle)."""
    buf = Buffer("CPU:91", size, preallocate=True)
    box: list[Any] = [buf]
    box.append(box)


@pytest.mark.anyio
@pytest.mark.parametrize("lock", ["allocator", "buffer counters"])
async def test_a_buffer_collected_under_a_lock_that_freeing_takes_does_not_take_it(lock: str) -> None:
    dev = Device["CPU:91"]
    before = dev.memory_stats()["in_use"]
    garbage_buffer(4096)
    assert dev.memory_stats()["in_use"] == before + 4096
    owner, name = (dev.allocator, "_lock") if lock == "allocator" else (aruntime.memory.buffer, "_counter_lock")
    with collected_under(owner, name) as check:
        assert not check.reentered, f"the buffer's finalizer took the {lock} lock its thread held"
    assert dev.memory_stats()["in_use"] == before  # the free left to the next allocator call ran there


REPRODUCTION = textwrap.dedent(
    """
    import gc, json, sys
    import anyio
    from aruntime import Device

    async def main():
        dev = Device["CPU"]
        gc.set_threshold(10, 1, 1)  # a collection, with the finalizers it runs, every few allocations
        before = dev.memory_stats()["in_use"]
        for i in range(3000):
            c = await dev.allocate(64 + i % 7); box = [c]; box.append(box); del c, box  # a buffer in a cycle
            b = await dev.allocate(64 + i % 5); await dev.free(b)  # frees while a collection may start
        gc.collect()
        assert dev.memory_stats()["in_use"] == before, dev.memory_stats()
        print("done")

    anyio.run(main, backend=sys.argv[1], backend_options=json.loads(sys.argv[2]))
    """
)


def test_buffers_in_cycles_collected_during_frees_do_not_deadlock(anyio_backend: tuple[str, dict[str, Any]]) -> None:
    backend, options = anyio_backend
    proc = subprocess.run(
        [sys.executable, "-c", REPRODUCTION, backend, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=60,  # a deadlock never ends: fail instead
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr


@pytest.mark.skipif(native.lib() is None, reason="the native core is not available here")
@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_loop_collected_under_the_callback_threads_lock_does_not_take_it(kind: str) -> None:
    from aruntime.engine.native.notify import callback_thread
    from aruntime.engine.native.signal import NativeSignal

    callbacks = callback_thread()
    sig = NativeSignal("collected loop", 30)
    ran = threading.Event()

    async def register() -> None:
        sig.on_reach(1, ran.set)  # pending on this loop's notifier when the loop goes

    if kind == "uvloop":
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    loop.run_until_complete(register())
    loop.close()
    box: list[Any] = [loop]
    box.append(box)  # collected by a garbage collection, under the lock below
    del loop, box
    with collected_under(callbacks, "_lock") as check:
        assert not check.reentered, "the loop's finalizer took the callback thread's lock its thread held"
    sig.set(1)
    assert ran.wait(10), "the loop's pending callback was lost"
