"""The native engine: each queue's commands run on a C worker thread that never takes the GIL.

:meth:`NativeEngine._enqueue` turns an op's commands into records of the queue's native ring (one ctypes call
each; the worker is woken only when it sleeps). Copies run as ``memmove`` in chunks, kernels with a C
:class:`~aruntime.engine.kernel.Entry` are called directly, waits block in native code, and the op's last
command sets the queue's timeline signal, which wakes threads and loops through their notifiers. Commands
that are Python callables (a backend's Python program, a Python copy function) and dependency checks after a
failure are handed to the engine's Python thread, started on first need; the worker waits for its answer.

Failures are logged natively (op value, command index, kind, status) before the op's value is set; Python
turns them into the ops' errors in :meth:`NativeEngine.retire`, which also releases what each finished op
kept alive (its pinned host memory, its commands). ``retire`` runs whenever a finished op is observed: on a
loop woken for the queue's signal, after a thread's wait, when an op's ``done()`` or result is read, and at
each submission.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
from array import array
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from time import monotonic_ns
from typing import Any

from aruntime.engine import native
from aruntime.engine.kernel import _NATIVE_COPIES, _NOTHING, Entry, KernelError
from aruntime.engine.metrics import HIST
from aruntime.engine.native import submit
from aruntime.engine.native.signal import NativeSignal, current_notified
from aruntime.engine.ops import (
    ABANDONED,
    COPY,
    EXEC,
    HELD,
    SIGNAL,
    TIMESTAMP,
    WAIT,
    Command,
    Engine,
    Op,
    Prepared,
    check_deps,
    fault_error,
    run_copy,
    skip_error,
)
from aruntime.errors import DeviceError, OpError, SignalTimeout
from aruntime.events import RangeEvent, RangeLog, recorder
from aruntime.helpers import bytes_address

K_WAIT, K_SIGNAL, K_TIMESTAMP, K_COPY, K_EXEC, K_NOP, K_CHECK, K_PY, K_STOP = range(9)
F_END, F_RECORD = 1, 2
E_KERNEL, E_TIMEOUT, E_PYTHON, E_ORDER, E_SKIPPED, E_DEADLINE, E_FAULT = 1, 2, 3, 4, 5, 6, 7
CHECK_BIT = 1 << 31
TAG = 1 << 63
"""In a dependency check's (engine, value) pair: the value is read from the cell at this address."""
_RECORD = struct.Struct("=IIQQQQQQII8x")
"""One command record, as core.c's ``ar_cmd``: kind, flags, a, b, c, d, op value, op id, name id, index (and the
time it is appended, which the core writes)."""
_WORDS = _RECORD.size // 8
"""The 64-bit words of a ring record."""
_OP_WORD = 6
"""The word of a ring record that holds its op's id."""
_INDEX_WORD = 7
"""The word of a ring record that holds its name's number (low half) and its command's index (high half)."""
RETIRE_EVERY = 64
"""Finished ops a submission lets pile up before it retires them (awaiting or observing an op retires it at once)."""
SPIN_NS = 100_000
"""The longest a worker that ran out of commands polls for more before it sleeps. A wake-up costs the thread that
wakes it: a few microseconds on a bare machine, 13-15 µs on a virtual machine whose other CPU sits idle (the
event loop's thread pays it for every op it hands to a sleeping worker), and a loop that awaits an op sleeps
and wakes in between, so polling pays across a whole round trip (6-10 µs on this project's 2-CPU virtual machines
against 80-95 µs when the worker slept each time). It adapts: each time work comes back within this long of
running out the next poll is this long again, each time it does not the poll halves (down to none), so a
worker whose work comes in bursts polls and one fed now and then soon sleeps at once. A shared worker polls only
while a CPU is left for the threads that submit (fewer other workers run than the CPUs less one), and no more
workers of their own poll at once than the CPUs less one (at least one: many devices never poll on every CPU); a
process allowed a single CPU never polls: the CPU is the submitter's."""


def allowed_cpus() -> int:
    """How many CPUs this process may run on: as many shared workers serve the queues that run on them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_spin_ns() -> int:
    """:data:`SPIN_NS` where this process may run on more than one CPU, else 0."""
    return SPIN_NS if allowed_cpus() > 1 else 0


CELLS = 512
"""The cells (words where the core writes the value of an op pending in it) allocated together, in one array."""


def new_cells() -> array[int]:
    """A new array of :data:`CELLS` cells, zeroed (see :meth:`NativeEngine.pend`)."""
    return array("Q", bytes(8 * CELLS))


_log = logging.getLogger("aruntime")
_names: dict[str, int] = {}
_name_list: list[str] = []


def _name_id(name: str) -> int:
    found = _names.get(name)
    if found is None:
        found = _names[name] = len(_name_list)
        _name_list.append(name)
    return found


def _records(take: Callable[[int, int, int], int], eng: int) -> Iterator[tuple[int, ...]]:
    """The 4-word records that ``take(engine, out, max)`` (``ar_take_ranges``, ``ar_take_failures``) moves out of
    the native engine ``eng``, until it has none left."""
    buf = array("Q", bytes(8 * 4 * 1024))
    address = buf.buffer_info()[0]
    while n := take(eng, address, 1024):
        for i in range(n):
            yield tuple(buf[4 * i : 4 * i + 4])


def _work_kind(cmd: Command) -> int:
    """How the worker runs the kernel or copy ``cmd``: ``K_EXEC`` (a C entry), ``K_COPY`` (one memmove: chunks
    only let the Python engine yield the GIL), ``K_NOP`` (nothing to do), or ``K_PY`` (a Python callable, run
    by the engine's Python thread)."""
    fn = cmd[2]
    if cmd[0] == EXEC and type(fn) is Entry:
        return K_EXEC
    if id(fn) in _NOTHING:
        return K_NOP
    return K_COPY if cmd[0] == COPY and id(fn) in _NATIVE_COPIES else K_PY


def _work_record(cmd: Command, kind: int, flags: int, op_id: int, index: int, gate: int) -> bytes:
    """The ring record of the kernel or copy ``cmd`` run as ``kind`` (command ``index`` of op ``op_id``;
    ``gate``: the address of the op's gate on its first one, else 0)."""
    name = _name_id(cmd[1]) if flags & F_RECORD else 0
    if kind == K_EXEC:
        return _RECORD.pack(K_EXEC, flags, cmd[2].address, cmd[3][1], 0, gate, 0, op_id, name, index)
    if kind == K_COPY:
        return _RECORD.pack(K_COPY, flags, cmd[3], cmd[4], cmd[5], gate, 0, op_id, name, index)
    return _RECORD.pack(kind, flags, 0, 0, 0, gate, 0, op_id, name, index)


def _wait_record(cmd: Command, flags: int, index: int, op_id: int = 0) -> bytes:
    """The ring record of the WAIT command ``cmd`` (command ``index`` of op ``op_id``)."""
    sig = cmd[1]
    return _RECORD.pack(K_WAIT, flags, sig.ptr, cmd[2], int(sig.timeout * 1e9), 0, 0, op_id, 0, index)


def _signal_record(cmd: Command, flags: int, index: int, op_id: int = 0) -> bytes:
    """The ring record of the SIGNAL command ``cmd`` (command ``index`` of op ``op_id``)."""
    return _RECORD.pack(K_SIGNAL, flags, cmd[1].ptr, cmd[2], 0, 0, 0, op_id, 0, index)


def _check_record(pairs: bytes, op_id: int, index: int, gate: int) -> bytes:
    """The ring record that checks the inputs of op ``op_id`` named by ``pairs`` (see
    :meth:`NativeEngine._check_pairs`) before its command ``index``, carrying its ``gate``."""
    return _RECORD.pack(K_CHECK, 0, bytes_address(pairs), len(pairs) // 16, 0, gate, 0, op_id, 0, index | CHECK_BIT)


def _as_kept(cmd: Command, kind: int) -> Command:
    """What an op keeps of a command the core runs by itself (``kind``), for the error it may fail with: a wait
    as ``(WAIT, its signal's name, value, timeout)``, a kernel or copy with its function replaced by the entry's
    address (a kernel: its packed arguments stay) or None (a copy). Its parts are then numbers, strings and
    ``bytes``, as a kernel's arguments usually are, so that the garbage collector stops tracking the op's commands
    (a list and a tuple per command of each op in flight otherwise)."""
    if kind == K_WAIT:
        return (WAIT, cmd[1].name, cmd[2], cmd[1].timeout)
    if kind == K_EXEC:
        return (EXEC, cmd[1], cmd[2].address, cmd[3])
    return (COPY, cmd[1], None, cmd[3], cmd[4], cmd[5])


def _waited(cmd: Command) -> tuple[str, int, float]:
    """The signal's name, the value and the timeout of a WAIT command, as given or as an op keeps it."""
    if len(cmd) == 4:
        return cmd[1], cmd[2], cmd[3]
    return cmd[1].name, cmd[2], cmd[1].timeout


class _Packed(Prepared):
    """Commands prepared for a native engine, with their ring records packed (op id 0, no gate, no profile), as
    the words :meth:`put` patches; ``words`` is None once a command was put that the records cannot follow.
    ``checks``: the commands before which the worker checks an op's inputs (its first kernel or copy, and the
    first after each wait), as :meth:`NativeEngine._pack` places them."""

    __slots__ = ("checks", "words")

    def __init__(self, cmds: list[Command], words: array[int] | None, checks: tuple[int, ...]) -> None:
        super().__init__(cmds)
        self.words = words
        self.checks = checks

    def fresh(self) -> _Packed:
        return _Packed(self, None if self.words is None else array("Q", self.words), self.checks)

    def after(self, waits: list[Command]) -> _Packed:
        words = self.words
        if words is None or any(cmd[0] != WAIT for cmd in waits):
            return _Packed(waits + self, None, ())
        shift = len(waits)
        ahead = [_wait_record(cmd, 0, i) for i, cmd in enumerate(waits)]
        shifted = array("Q", words)
        shifted[_INDEX_WORD::_WORDS] = array("Q", [w + (shift << 32) for w in words[_INDEX_WORD::_WORDS]])
        return _Packed(waits + self, array("Q", b"".join(ahead)) + shifted, tuple(i + shift for i in self.checks))

    def put(self, index: int, cmd: Command) -> None:
        old = self[index]
        self[index] = cmd
        words = self.words
        if words is None:
            return
        at = _WORDS * index
        kind = cmd[0]
        if kind in (WAIT, SIGNAL):
            words[at + 2] = cmd[2]
        elif cmd[2] is not old[2]:  # another function: the records are packed again at submission
            self.words = None
        elif words[at] & 0xFFFFFFFF == K_NOP:
            pass
        elif kind == EXEC:
            words[at + 2] = cmd[3][1]
        else:
            words[at + 1], words[at + 2], words[at + 3] = cmd[3], cmd[4], cmd[5]


def _cell_address(op: Op) -> int:
    """The address of the word the core writes a pending ``op``'s value into (see :attr:`Op.cell`)."""
    assert op.cell is not None
    return _cells_word(op, op.cell, op.at)


def _cells_word(op: Op, cells: array[int], at: int) -> int:
    """The address of word ``at`` of the array of ``cells`` (``op``'s, named in errors)."""
    if not (type(at) is int and 0 <= at < len(cells)):  # the core writes there
        raise ValueError(f"{op!r}: its cell is out of range")
    return int(cells.buffer_info()[0]) + 8 * at


def _u64s(address: int, count: int) -> memoryview:
    """The ``count`` 64-bit words of native memory at ``address``, read where they are."""
    return memoryview((ctypes.c_uint64 * count).from_address(address)).cast("B").cast("Q")


def _u64(address: int) -> memoryview:
    return _u64s(address, 1)


class NativeRangeLog(RangeLog):
    """The ranges one native engine recorded, taken from native memory when drained."""

    __slots__ = ("_count", "_eng", "_lib", "_seen")

    def __init__(self, device: str, is_copy: bool) -> None:
        super().__init__(device, is_copy)
        self._count = memoryview(array("Q", [0]))  # until bound (an engine that failed to start never is)
        self._seen = 0

    def bind(self, lib: ctypes.CDLL, eng: int) -> None:
        """Read the ranges of the native engine at ``eng``."""
        self._lib = lib
        self._eng = eng
        self._count = _u64(eng + lib.ar_engine_field(2))
        self._seen = 0

    def drain(self) -> list[RangeEvent]:
        """Take the ranges recorded so far as events."""
        events = super().drain()
        if self._count[0] == self._seen:
            return events
        for start, end, op, name in _records(self._lib.ar_take_ranges, self._eng):
            self._seen += 1
            events.append(RangeEvent(self.device, _name_list[name], start / 1000.0, end / 1000.0, self.is_copy, op))
        return events

    def detach(self) -> None:
        """Keep what the engine recorded in Python, and stop reading its memory (it is about to be freed)."""
        for event in self.drain():
            self.add(event.name, int(event.start * 1000), int(event.end * 1000), event.op)
        self._count = memoryview(array("Q", [0]))
        self._seen = 0


class NativeEngine(Engine):
    """An engine whose commands run on a native worker thread (see the module docstring)."""

    __slots__ = (  # slots: the native submission path reads them where they lie
        "_cell_at",
        "_cells",
        "_cells_pin",
        "_fast_state",
        "_pended",
        "_pended_at",
        "_pended_keep",
        "_thread",
        "closed",
        "failures_seen",
        "fast",
        "held",
        "signal",
    )
    assigns_values = True  # the core numbers ops: it also hands on pending ops itself
    pends = True
    reads_gates = True

    def __init__(
        self,
        device: str,
        kind: str,
        timeout: float,
        chunk: int = 8 << 20,
        spin_ns: int | None = None,
        shared: bool = False,
    ) -> None:
        lib = native.lib()
        assert lib is not None
        # a bad ARUNTIME_FAST_SUBMIT refuses the engine before it makes anything
        fast = submit.load(lib, NativeEngine, new_cells, _name_id)
        self.fast = None  # until its state is made (below)
        self.failures_seen = 0
        super().__init__(device, kind, timeout)
        assert isinstance(self.signal, NativeSignal)
        self._lib = lib
        self.chunk = chunk
        spin = default_spin_ns() if spin_ns is None else spin_ns
        eng = lib.ar_engine_new(self.signal.ptr, spin, allowed_cpus() if shared else 0)
        if not eng:
            raise MemoryError(f"{self.signal.name}: the native engine could not start")
        lib.ar_engine_metrics(eng, int(self.keeps_metrics))
        self.address: int = eng
        """The native engine's address (what other engines' dependency checks name)."""
        self.shared = shared
        """Whether the shared workers run its commands (:func:`allowed_cpus` threads serving every such queue in
        the order they got work), rather than a worker thread of its own."""
        self.failures = _u64(eng + lib.ar_engine_field(1))
        self._last = _u64(eng + lib.ar_engine_field(3))
        self.thread_id = int(_u64(eng + lib.ar_engine_field(4))[0])
        self._skipped = _u64(eng + lib.ar_engine_field(5))
        self._started = _u64(eng + lib.ar_engine_field(6))
        self._busy = _u64(eng + lib.ar_engine_field(7))
        self._taken_at = _u64(eng + lib.ar_engine_field(10))
        self._spin = _u64(eng + lib.ar_engine_field(11))
        self._queued_hist = _u64s(eng + lib.ar_engine_field(8), HIST)
        self._run_hist = _u64s(eng + lib.ar_engine_field(9), HIST)
        assert isinstance(self.ranges, NativeRangeLog)
        self.ranges.bind(lib, eng)
        self._submit = lib.ar_submit
        self._handle = ctypes.c_void_p(eng)  # passed as it is: no argument conversion per submission
        self._inflight: deque[Op] = deque()  # ops handed to the ring, not yet retired
        self._inflight_keep: deque[Sequence[Any] | None] = deque()  # what each one's records keep alive
        self._failed: dict[int, tuple[int, int, int]] = {}  # op value -> (command index, kind, status)
        self._python: dict[int, Op] = {}  # op id -> op, for ops with commands the Python thread runs
        self._pended: list[Op] = []  # ops pending in the core, not yet retired
        self._pended_keep: list[Sequence[Any] | None] = []  # what each keeps alive, its cells' pin with it (see pend)
        self._cells = array("Q")  # the array the cells of new pending ops are taken from, CELLS at a time
        self._cells_pin = memoryview(self._cells)  # its pin: see pend
        self._cell_at = CELLS  # the next free one in it (CELLS: none left)
        self._pended_at = -1  # the signal value _pended was last looked through at (-1: changed since)
        self._thread: threading.Thread | None = None
        self._lock = submit.new_lock()  # submissions
        self._retire_lock = submit.new_lock()
        self._joined = False
        self._high: NativeEngine | None = None  # the engine this one lets go first: kept alive as long as this one
        self.signal.retire = self.retire
        self.fast = fast
        failures = eng + lib.ar_engine_field(1)
        self._fast_state = (
            None
            if fast is None
            else fast.state(
                self.signal.ptr,
                eng,
                failures,
                self._lock,
                self._retire_lock,
                self._inflight,
                self._inflight_keep,
                self._python,
                self._failed,
            )
        )

    @property
    def spin_ns(self) -> int:
        """How long the worker polls for work now before it sleeps, in ns (see :data:`SPIN_NS`)."""
        return int(self._spin[0])

    def __del__(self) -> None:
        if getattr(self, "_joined", False):
            self._lib.ar_engine_free(self.address)

    def _range_log(self) -> NativeRangeLog:
        return NativeRangeLog(self.device, self.is_copy)

    @property
    def last(self) -> int:  # type: ignore[override]  # read-only here: the core numbers this engine's ops
        """The value of the op appended to the ring last (by a submission or by the core, for a pending op)."""
        return int(self._last[0])

    @property
    def skipped(self) -> int:  # type: ignore[override]  # read-only here: the core counts them
        """Ops the worker skipped because their gate said so."""
        return int(self._skipped[0])

    def counters(self) -> tuple[int, int, Sequence[int], Sequence[int]]:
        """The core's metrics (see :meth:`Engine.counters`), read from native memory."""
        busy, taken_at = int(self._busy[0]), int(self._taken_at[0])
        running = max(monotonic_ns() - taken_at, 0) if taken_at else 0
        return int(self._started[0]), busy + running, self._queued_hist.tolist(), self._run_hist.tolist()

    # ---- submission ---------------------------------------------------------------------------------

    def _enqueue(self, cmds: list[Command], op: Op) -> None:
        fast = self.fast
        if fast is not None and type(cmds) is not _Packed and fast.enqueue(self, cmds, op):  # the same, in C
            return
        inflight = self._inflight
        if len(inflight) >= RETIRE_EVERY and inflight[0].value <= self.signal.value:
            self.retire()  # in batches: an op that is awaited or observed is retired then anyway
        records, count, keep = self._pack(cmds, op)
        value = self._submit(self._handle, records, count)
        if not value:
            self._python.pop(op.id, None)
            raise MemoryError(f"{op.name}: no memory for the commands of {self.signal.name}")
        op._value = value
        op.deps = ()  # its waits are in the ring: nothing asks for them any more (as in C)
        self._inflight_keep.append(keep)  # before the op: a retire that finds the op finds what it keeps
        inflight.append(op)

    def pend(self, cmds: list[Command], op: Op, blockers: Sequence[tuple[bool, Op]]) -> None:
        """Hand ``op`` to the core with the signal values (or pending ops) it waits for: the core appends it to
        the ring from whichever thread meets the last of them. ``op`` is held until then (see :class:`Op`)."""
        lib = self._lib
        with self._lock:
            self.check_open(op.name)
            if len(self._pended) >= RETIRE_EVERY and self._oldest_pended_done():
                self.retire()  # in batches, as _enqueue does
            op.engine = self
            op.cmds = cmds
            records, count, keep = self._pack(cmds, op)
            at = self._cell_at  # the op's cell: a word of an array shared with other ops (no object per op)
            if at == CELLS:
                self._cells, at = new_cells(), 0
                self._cells_pin = memoryview(self._cells)
            self._cell_at = at + 1
            cells = self._cells
            pend = lib.ar_pend_new(self.address, records, count, _cells_word(op, cells, at))
            if not pend:
                self._python.pop(op.id, None)
                raise MemoryError(f"{op.name}: no memory for the commands of {self.signal.name}")
            op._pend = pend
            op.hold(self)
            # its cell last, once it has its pend: another thread that finds it pending (a cell, held) may hand
            # its pend to the core
            op.at, op.cell = at, cells
            with self._retire_lock:  # retire() replaces the lists
                self._pended.append(op)
                # the array's pin too: a view, which keeps the array where it is (it cannot be resized or freed
                # meanwhile, whatever becomes of op.cell) until no op pending in it is left
                self._pended_keep.append((*(keep or ()), self._cells_pin))
                self._pended_at = -1
        for on_dispatch, dep in blockers:
            dep_engine = dep.engine
            assert isinstance(dep_engine, NativeEngine)
            if dep.cell is not None and dep.value == HELD:
                lib.ar_pend_on_pend(pend, dep.pend, _cell_address(dep), dep_engine.address, not on_dispatch)
            elif not on_dispatch:
                assert isinstance(dep_engine.signal, NativeSignal)
                lib.ar_pend_on_sig(pend, dep_engine.signal.ptr, dep.value)
        lib.ar_pend_go(pend)
        op.resolve_when_handed_on()  # what waited for it while it was held

    def _oldest_pended_done(self) -> bool:
        """Whether the oldest op pending in the core is done (or was abandoned there)."""
        with self._retire_lock:  # retire() changes the list
            if not self._pended:
                return False
            op = self._pended[0]
        assert op.cell is not None
        value = op.cell[op.at]
        return value == ABANDONED or 0 < value <= self.signal.value

    def prepare(self, cmds: list[Command]) -> Prepared:
        """``cmds`` with their ring records packed once, where the worker runs each of them without Python."""
        records = []
        checks: list[int] = []
        check = True
        last = len(cmds) - 1
        for i, cmd in enumerate(cmds):
            kind, flags = cmd[0], F_END if i == last else 0
            if kind == WAIT:
                records.append(_wait_record(cmd, flags, i))
                check = True
            elif kind == SIGNAL:
                records.append(_signal_record(cmd, flags, i))
            elif kind in (EXEC, COPY) and (work := _work_kind(cmd)) != K_PY:
                records.append(_work_record(cmd, work, flags, 0, i, 0))
                if check:
                    checks.append(i)
                    check = False
            else:  # a timestamp, a Python callable
                return Prepared(cmds)
        return _Packed(cmds, array("Q", b"".join(records)) if records else None, tuple(checks))

    def _pack(self, cmds: list[Command], op: Op) -> tuple[bytes, int, Sequence[Any] | None]:
        """The ring records of ``op``'s commands (their value is set by the core), how many, and what must be
        kept alive until the op has run (a tuple: of bytes only, unless the op takes timestamps, so that the
        garbage collector stops tracking it)."""
        op_id = op.id
        record = F_RECORD if recorder.enabled else 0
        if type(cmds) is _Packed and cmds.words is not None and not record and op.gate is None:
            return self._packed(cmds, cmds.words, op)
        checked = not op.inputs
        gate = 0 if op.gate is None else op.gate.buffer_info()[0]
        if len(cmds) == 1 and cmds[0][0] >= EXEC:  # most ops: one kernel or copy
            cmd = cmds[0]
            kind = _work_kind(cmd)
            if kind != K_PY:
                pairs = None if checked else self._check_pairs(op)
                run = _work_record(cmd, kind, F_END | record, op_id, 0, gate if pairs is None else 0)
                if op.cmds is cmds and kind in (K_EXEC, K_COPY):
                    op.cmds = (_as_kept(cmd, kind),)
                if pairs is None:
                    return run, 1, None
                self._python_runs(op)  # the cells the pairs name are kept alive by the inputs' ops
                return _check_record(pairs, op_id, 0, gate) + run, 2, (pairs,)
        pack = _RECORD.pack
        keep: list[Any] | None = None
        last = len(cmds) - 1
        records: list[bytes] = []
        add = records.append
        kept: list[Command] | None = [] if op.cmds is cmds and last >= 0 else None  # see _as_kept
        if last < 0:
            add(pack(K_NOP, F_END, 0, 0, 0, 0, 0, op_id, 0, 0))
        for i, cmd in enumerate(cmds):
            kind = cmd[0]
            flags = F_END if i == last else 0
            if kind == WAIT:
                add(_wait_record(cmd, flags, i, op_id))
                if kept is not None:
                    kept.append(_as_kept(cmd, K_WAIT))
                checked = not op.inputs
                continue
            if kind == SIGNAL:
                add(_signal_record(cmd, flags, i, op_id))
                kept = None
                continue
            if kind == TIMESTAMP:
                slot = array("q", [0])
                keep = keep or []
                keep.append((cmd[1], slot))
                add(pack(K_TIMESTAMP, flags, slot.buffer_info()[0], 0, 0, 0, 0, op_id, 0, i))
                kept = None
                continue
            if kind not in (EXEC, COPY):
                raise ValueError(f"{op.name}: unknown command kind {kind!r}")
            if not checked:
                checked = True
                pairs = self._check_pairs(op)
                if pairs is not None:  # the cells it names are kept alive by the inputs' ops (``op.inputs``)
                    keep = keep or []
                    keep.append(pairs)
                    self._python_runs(op)
                    add(_check_record(pairs, op_id, i, gate))
                    gate = 0
            work = _work_kind(cmd)
            if work == K_PY:
                self._python_runs(op)
            if kept is not None:
                if work in (K_EXEC, K_COPY) and i == last:
                    kept.append(_as_kept(cmd, work))
                else:
                    kept = None
            add(_work_record(cmd, work, flags | record, op_id, i, gate))
            gate = 0
        if kept is not None:
            op.cmds = tuple(kept)
        packed = records[0] if len(records) == 1 else b"".join(records)
        return packed, len(records), None if keep is None else tuple(keep)

    def _packed(self, cmds: _Packed, words: array[int], op: Op) -> tuple[bytes, int, Sequence[Any] | None]:
        """:meth:`_pack` for commands packed ahead: the op's id put in, and its input checks where it has any."""
        count = len(cmds)
        words[_OP_WORD::_WORDS] = array("Q", [op.id]) * count
        pairs = self._check_pairs(op) if op.inputs else None
        if pairs is None:
            return words.tobytes(), count, None
        self._python_runs(op)  # the cells the pairs name are kept alive by the inputs' ops
        parts, at = [], 0
        for i in cmds.checks:
            parts.append(words[at * _WORDS : i * _WORDS].tobytes())
            parts.append(_check_record(pairs, op.id, i, 0))
            at = i
        parts.append(words[at * _WORDS :].tobytes())
        return b"".join(parts), count + len(cmds.checks), (pairs,)

    def _python_runs(self, op: Op) -> None:
        """Let the engine's Python thread (started now if need be) find ``op`` (before its command is pushed)."""
        self._python[op.id] = op
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve_python, name=f"{self.signal.name} python")
            self._thread.daemon = True
            self._thread.start()

    def _check_pairs(self, op: Op) -> bytes | None:
        """The (engine address, value) pairs the worker checks before the op's first copy or kernel (as native
        words), or None if none of its inputs can still fail it. A pair (0, 0) makes the worker ask Python."""
        pairs = array("Q")
        for dep in op.inputs:
            if dep.done():
                if dep.error is not None:
                    pairs.extend((0, 0))
                continue
            engine = dep.engine
            if not isinstance(engine, NativeEngine):
                pairs.extend((0, 0))
            elif dep.value == HELD and dep.cell is not None:  # its value is read from its cell (kept with pairs)
                pairs.extend((engine.address, _cell_address(dep) | TAG))
            else:
                pairs.extend((engine.address, dep.value))
        return pairs.tobytes() if pairs else None

    def when_handed_on(self, op: Op, callback: Callable[[], None]) -> None:
        """See :meth:`Engine.when_handed_on`: the core writes the calling thread's notifier when it hands ``op`` on
        (one wake-up, whatever ``op`` waits for)."""
        assert op.cell is not None
        current_notified().add_handed_on(op.cell, op.at, op.pend, _cell_address(op), callback)

    def pin(self, cpus: Collection[int]) -> None:
        """See :meth:`Engine.pin`; a queue the shared workers run has no thread of its own to pin."""
        if self.shared:
            raise DeviceError(
                f"{self.signal.name} runs on the shared workers: it has no thread of its own to pin "
                "(ARUNTIME_WORKERS=queue gives each queue a worker thread of its own)"
            )
        super().pin(cpus)

    def yield_to(self, high: Engine) -> None:
        """Let ``high`` go first (see :meth:`Engine.yield_to`): the worker checks it at each op boundary."""
        assert isinstance(high, NativeEngine)
        self._high = high  # its native memory is freed only after this engine's
        self._lib.ar_engine_yield_to(self.address, high.address)

    def _stop(self) -> None:
        self._submit(self._handle, _RECORD.pack(K_STOP, 0, 0, 0, 0, 0, 0, 0, 0, 0), 1)

    def close(self) -> None:
        """Stop accepting work; wait until what was submitted has run (unless called from this engine's thread)."""
        super().close()
        if threading.current_thread() is self._thread:
            return
        self._lib.ar_engine_join(self.address)
        assert isinstance(self.ranges, NativeRangeLog)
        self.ranges.detach()
        self._joined = True
        if self._thread is not None:
            self._thread.join()
        self.retire()

    # ---- the Python thread --------------------------------------------------------------------------

    def _serve_python(self) -> None:
        lib, eng = self._lib, self.address
        value, index = ctypes.c_uint64(), ctypes.c_uint32()
        while lib.ar_py_next(eng, ctypes.byref(value), ctypes.byref(index)):
            i = index.value
            op = self._python.get(value.value)
            if op is None:  # cannot happen: the op is registered before its command is pushed
                _log.error("%s: no op for python command %d of op #%d", self.signal.name, i, value.value)
                lib.ar_py_done(eng, 1)
                continue
            try:
                if i & CHECK_BIT:
                    check_deps(op, settle=False)  # inputs it waited for are done; a graph part may wait only for a part
                else:
                    assert op.cmds is not None
                    cmd = op.cmds[i]
                    if cmd[0] == EXEC:
                        cmd[2](*cmd[3])
                    else:
                        run_copy(cmd[2], cmd[3], cmd[4], cmd[5], self.chunk)
            except BaseException as exc:
                self._fail(op, exc)
                lib.ar_py_done(eng, 1)
            else:
                lib.ar_py_done(eng, 0)

    # ---- completion ---------------------------------------------------------------------------------

    def retire(self) -> None:
        """Set the errors of finished ops from the native failure log, release what they kept alive and fill in
        their timestamps (on any thread)."""
        fast = self.fast
        if fast is None or not fast.retire(self):  # the same, in C, where no failure or timestamp is to be set
            self._retire()

    def _retire(self) -> None:
        failed: list[Op] = []
        with self._retire_lock:
            reached = self.signal.value
            if self.failures[0] != self.failures_seen:
                self._take_failures()
            inflight, keeps = self._inflight, self._inflight_keep
            while inflight and inflight[0].value <= reached:
                op = inflight.popleft()
                self._retire_op(op, op.value, keeps.popleft(), failed)
            if self._pended and (self._pended_at != reached or self.closed):  # else nothing new can be done
                pended: list[Op] = []
                pended_keep: list[Sequence[Any] | None] = []
                for op, keep in zip(self._pended, self._pended_keep, strict=True):
                    cell = op.cell
                    assert cell is not None
                    value = cell[op.at]
                    if value == ABANDONED:
                        op.keep = op.cmds = None
                    elif value and value <= reached:
                        self._retire_op(op, value, keep, failed)
                    else:
                        pended.append(op)
                        pended_keep.append(keep)
                self._pended, self._pended_keep = pended, pended_keep
                self._pended_at = reached
        for op in failed:
            self._note_failure(op)

    def _retire_op(self, op: Op, value: int, keep: Sequence[Any] | None, failed: list[Op]) -> None:
        failure = self._failed.pop(value, None) if self._failed else None
        if failure is not None:
            self._set_error(op, *failure)
            failed.append(op)
        if keep is not None:
            for item in keep:
                if type(item) is tuple:
                    item[0].append(item[1][0] / 1000.0)
        if self._python:
            self._python.pop(op.id, None)
        op.keep = op.cmds = None
        op.deps = op.inputs = ()

    def failure_logged(self, op: Op) -> bool:
        """Whether the core has logged ``op``'s failure (it does before it publishes the op's value)."""
        value = op.value if op.value != HELD or op.cell is None else op.cell[op.at]
        if not value or value in (HELD, ABANDONED):
            return False
        with self._retire_lock:
            if self.failures[0] != self.failures_seen:
                self._take_failures()
            return value in self._failed

    def _take_failures(self) -> None:
        for value, index, kind, status in _records(self._lib.ar_take_failures, self.address):
            self.failures_seen += 1
            self._failed[value] = (index, kind, status)

    def _set_error(self, op: Op, index: int, kind: int, status: int) -> None:
        if kind == E_PYTHON and op.error is not None:
            return
        cmd = op.cmds[index & ~CHECK_BIT] if op.cmds is not None else None
        error: BaseException
        if kind == E_KERNEL:
            status -= 1 << 64 if status >= 1 << 63 else 0
            error = KernelError(f"{op.name} failed on {self.signal.name}: the kernel returned status {status}", status)
        elif kind == E_TIMEOUT and cmd is not None:
            name, value, timeout = _waited(cmd)
            error = SignalTimeout(
                f"{name}: wait for value >= {value} did not pass within {timeout:g} s (signal value is {status})"
            )
        elif kind in (E_SKIPPED, E_DEADLINE):
            error = skip_error(op, kind == E_DEADLINE)
        elif kind == E_FAULT:  # a guarded copy met a file-backed page that is gone (status: 1 source, 2 destination)
            error = fault_error(op.name, None if cmd is None else cmd[1], self.signal.name, status)
        elif kind == E_ORDER and cmd is not None:
            error = ValueError(f"{cmd[1].name}: timeline must increase (asked to set {cmd[2]})")
        else:
            error = OpError(f"{op.name} failed on {self.signal.name}")
        self._fail(op, error)


__all__ = ["NativeEngine"]
