"""The Python engine: commands run on one Python worker thread (the fallback where the native core is unavailable)."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Sequence
from time import monotonic_ns, perf_counter_ns, sleep

from aruntime.engine.metrics import HIST, bucket
from aruntime.engine.ops import (
    EXEC,
    SIGNAL,
    WAIT,
    Command,
    CopyFault,
    Engine,
    Op,
    check_deps,
    fault_error,
    gate_error,
    run_copy,
)
from aruntime.events import now_us, recorder

YIELD_S = 50e-6
"""How long a worker that lets its high-priority sibling go first sleeps before it looks again."""


class ThreadEngine(Engine):
    """An engine whose commands run on one Python worker thread.

    ``chunk`` bounds the bytes of one copy call, so a big copy is a series of
    short calls (each releases the GIL) rather than one long one. The worker
    sleeps on a pipe when it has nothing to do; a submission writes the pipe
    only then. A worker that :meth:`yield_to` a high-priority engine sleeps
    in short steps while that one has work it can run.
    """

    reads_gates = True

    def __init__(self, device: str, kind: str, timeout: float, chunk: int = 8 << 20) -> None:
        super().__init__(device, kind, timeout)
        self.chunk = chunk
        self._ops: deque[Op | None] = deque()
        self._handed: deque[int] = deque()  # when each op in _ops was handed over (ns)
        self._started = 0
        self._taken = 0  # when the op running was taken (0: none runs)
        self._busy = 0
        self._queued_hist = [0] * HIST
        self._run_hist = [0] * HIST
        self._idle = False  # the worker is (about to be) asleep on the pipe and must be woken
        self._waiting = False  # the worker is blocked in a wait for another queue
        self._high: ThreadEngine | None = None  # the engine this one lets go first (see yield_to)
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name=self.signal.name, daemon=True)
        self._thread.start()
        self.thread_id = self._thread.native_id or 0

    def _enqueue(self, cmds: list[Command], op: Op | None) -> None:
        self._handed.append(monotonic_ns() if self.keeps_metrics else 0)
        self._ops.append(op)
        if self._idle:
            self._idle = False
            os.write(self._wake_w, b"\0")  # the system call runs without the GIL

    def counters(self) -> tuple[int, int, Sequence[int], Sequence[int]]:
        """The metrics this engine keeps (see :meth:`Engine.counters`)."""
        taken = self._taken
        running = max(monotonic_ns() - taken, 0) if taken else 0
        return self._started, self._busy + running, list(self._queued_hist), list(self._run_hist)

    def yield_to(self, high: Engine) -> None:
        """Let ``high`` go first (see :meth:`Engine.yield_to`): checked in :meth:`_next`."""
        assert isinstance(high, ThreadEngine)
        self._high = high

    def close(self) -> None:
        """Stop accepting work; wait until what was submitted has run (unless called from this engine's thread)."""
        super().close()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _stop(self) -> None:
        self._enqueue([], None)

    def _unfinished(self) -> list[Op]:
        return [op for op in self._ops if op is not None]

    def _next(self) -> Op | None:
        high = self._high
        if high is not None:
            while high._ops and not high._waiting and not high.closed:  # it has work it can run: it goes first
                sleep(YIELD_S)
        ops = self._ops
        while not ops:
            self._idle = True
            if ops:  # appended after the check above: no wake-up is coming for it
                self._idle = False
                break
            os.read(self._wake_r, 4096)  # sleeps without the GIL; extra bytes only cost a spare loop turn
        op = ops.popleft()
        handed = self._handed.popleft()
        if op is not None:
            self._started = op.value
            if self.keeps_metrics:
                self._taken = monotonic_ns()
                self._queued_hist[bucket(self._taken - handed)] += 1
        return op

    def _run(self) -> None:
        get = self._next
        execute = self._execute
        complete = self._complete
        current: Op | None = None
        try:
            while (op := get()) is not None:
                current = op
                try:
                    execute(op)
                except BaseException as exc:  # the op's awaiter (or synchronize) receives it
                    error: BaseException | None = exc
                else:
                    error = None
                if self._taken:
                    ran = monotonic_ns() - self._taken
                    self._run_hist[bucket(ran)] += 1
                    self._busy += ran
                    self._taken = 0
                complete(op, error)
                current = None
        except BaseException as exc:  # the engine's own code failed: nobody must be left waiting
            if current is not None:
                self._ops.appendleft(current)
            self.crash(exc)
        finally:
            os.close(self._wake_r)  # nothing writes after the end: only a sleeping worker is ever woken
            os.close(self._wake_w)

    def _execute(self, op: Op) -> None:
        assert op.cmds is not None
        checked = not op.inputs
        gated = op.gate is None
        cmds = op.cmds
        for i, cmd in enumerate(cmds):
            try:
                kind = cmd[0]
                if kind < EXEC:
                    if kind == WAIT:
                        self._waiting = True
                        try:
                            cmd[1].wait(cmd[2])
                        finally:
                            self._waiting = False
                        checked = not op.inputs  # a producer on the queue waited for may have failed: check again
                    elif kind == SIGNAL:
                        cmd[1].set(cmd[2])
                    else:
                        cmd[1].append(now_us())
                    continue
                if not gated:  # the waits before it passed: from here on it starts, unless its request is gone
                    gated = True
                    skipped = gate_error(op)
                    if skipped is not None:
                        self.skipped += 1
                        raise skipped
                if not checked:
                    check_deps(op, settle=False)  # the waits before it passed
                    checked = True
                recording = recorder.enabled
                start = perf_counter_ns() if recording else 0
                if kind == EXEC:
                    cmd[2](*cmd[3])
                else:
                    try:
                        run_copy(cmd[2], cmd[3], cmd[4], cmd[5], self.chunk)
                    except CopyFault as fault:
                        raise fault_error(op.name, cmd[1], self.signal.name, fault.side) from None
                if recording:  # RangeLog.add, inlined: this runs once per command
                    ranges = self.ranges
                    ranges.ends.append(perf_counter_ns())
                    ranges.starts.append(start)
                    ranges.names.append(cmd[1])
                    ranges.ops.append(op.id)
            except BaseException as exc:
                # the rest of this queue is skipped, but its signals are still set: engines waiting on them
                # (e.g. other queues of a graph replay) go on, and their dependency checks, which find this
                # op's error already in place, fail their ops instead
                self._fail(op, exc)
                for rest in cmds[i + 1 :]:
                    if rest[0] == SIGNAL:
                        rest[1].set(rest[2])
                raise
