"""Graphs: capture a sequence of ops once, replay it with new inputs at low cost per op.

A replay hands each engine one prepared command queue holding all of that
engine's entries. Inside a replay, an entry that depends on an entry of
another engine waits on the graph's own per-engine progress signal, and only
where such a hazard crosses engines. Each engine runs its entries by depth in
the dependency graph (capture order among equal depths), so work that depends
on nothing pending is not held up behind a wait for another engine; entries
that conflict keep their captured order.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from aruntime.device import BaseDevice, Program, check_scalar, check_scalars, transfer_device
from aruntime.engine import (
    COPY,
    EXEC,
    SIGNAL,
    TIMESTAMP,
    WAIT,
    Command,
    Engine,
    Op,
    Prepared,
    TimelineSignal,
    Window,
    dispatch_when_ready,
    first_failure,
)
from aruntime.engine.ops import protect
from aruntime.errors import BufferUsageError, DeviceError, SignalTimeout
from aruntime.events import GraphEntry, GraphEvent, recorder
from aruntime.helpers import after_all
from aruntime.memory import Buffer, logs_held, pin, typed, zeroed

_graph_ids = itertools.count(1)


@dataclass(frozen=True)
class Param:
    """A scalar launch argument whose value is given by name at each replay."""

    name: str

    def __post_init__(self) -> None:
        _check_name("Param", self.name)


def _check_name(what: str, name: object) -> None:
    """Raise unless ``name`` can name a replay input or output (a keyword argument of :meth:`Graph.replay`)."""
    if not isinstance(name, str) or not name or name == "buffers":
        raise ValueError(
            f"{what}: a replay input or output needs a non-empty str name other than 'buffers', got {name!r}"
        )


@dataclass
class _Entry:
    kind: str  # "copyin" | "copyout" | "transfer" | "launch"
    device: BaseDevice
    engine: Engine
    name: str
    reads: tuple[Buffer, ...]
    writes: tuple[Buffer, ...]
    host: str = ""
    prog: Program | None = None
    bufs: tuple[Buffer, ...] = ()
    vals: tuple[int | float | Param, ...] = ()
    nbytes: int = 0  # a copy's size
    command: tuple[tuple[Any, ...], Command] | None = None  # a Param launch's last (handles, scalars, types), command


@dataclass
class _Step:
    index: int
    entry: _Entry
    slots: tuple[int, ...]  # the entry's buffers (a launch's arguments, else (source, destination)) in plan.buffers
    waits: list[tuple[TimelineSignal, int, int]]  # (progress signal, entries on its engine, position to wait for)
    signal: int  # position to signal on this engine's progress signal once done, or 0 (nobody waits for it)


@dataclass
class _Part:
    """One engine's commands of a replay, made once per set of buffer handles; each replay puts in its own
    :class:`Param` launches (``holes``: position, step), host copies (``copies``: position, whether a copy-out,
    host name, bytes, buffer handle, device, name; their steps in ``copy_steps``) and progress values
    (``marks``: position, WAIT or SIGNAL, signal, and the value as runs times ``per_run`` plus ``value``)."""

    cmds: Prepared
    holes: list[tuple[int, _Step]]
    copies: list[tuple[int, bool, str, int, Any, BaseDevice, str]]
    copy_steps: list[_Step]
    marks: list[tuple[int, int, TimelineSignal, int, int]]


@dataclass
class _Plan:
    engines: list[Engine]
    placed: list[Engine]  # the engine each entry runs on
    deps: tuple[tuple[int, ...], ...]  # each entry's direct dependencies (indices of earlier entries)
    progress: dict[Engine, TimelineSignal]
    needed: frozenset[str]  # the copy-in sources and Params every replay must name
    outputs: frozenset[str]  # the copy-out destinations a replay may name
    named: frozenset[str]  # both
    steps: dict[Engine, list[_Step]]  # what each engine's command queue is made of, in order
    buffers: list[Buffer]  # every captured buffer, once
    accesses: list[tuple[Engine, int, bool, bool]]  # (engine, buffer's index, writes, consumes), for hazard tracking
    feeds: dict[Engine, list[Engine]]  # for each engine, the other engines whose entries write what its entries read
    labels: dict[Engine, str]  # what each engine's part of a replay is named by
    what: str  # what a replay's errors name


def _owner(buf: Buffer, what: str) -> BaseDevice:
    """The device of ``buf``, checked to be an allocated buffer of it."""
    if not isinstance(buf, Buffer):
        raise BufferUsageError(f"{what}: expected a Buffer, got {type(buf).__name__}")
    dev = buf.owner
    dev._check(buf, what)
    return dev


def _label(steps: list[_Step]) -> str:
    """The entries of one engine's part of a replay, for its op's name (so an error names the kernel)."""
    names = [step.entry.name for step in steps[:4]]
    more = f", +{len(steps) - 4} more" if len(steps) > 4 else ""
    return ", ".join(names) + more


def _overlaps(a: Buffer, b: Buffer) -> bool:
    return a.base is b.base and a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes


class Graph:
    """A captured sequence of copy-in, launch, copy-out and transfer ops over fixed buffers.

    Capture with :meth:`copyin` (host data named, given at replay), :meth:`launch`
    (scalars may be :class:`Param`), :meth:`copyout` (result named) and
    :meth:`transfer`; then :meth:`replay` as often as needed, optionally with
    other buffers of the same device and size in place of captured ones.
    """

    def __init__(self) -> None:
        self.id = next(_graph_ids)
        self.entries: list[_Entry] = []
        self._plan: _Plan | None = None
        # the handles of the plan's buffers at the last replay, the commands that depend on nothing else, and
        # each engine's part of a replay made with them
        self._fixed: tuple[list[Any], list[Command | None], dict[Engine, _Part]] | None = None
        self._runs = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Graph #{self.id} {len(self.entries)} entries>"

    def _add(self, entry: _Entry) -> None:
        self.entries.append(entry)
        self._plan = self._fixed = None

    def copyin(self, buf: Buffer, source: str) -> None:
        """Capture a copy of the host input named ``source`` into ``buf``."""
        _check_name("graph copyin", source)
        dev = _owner(buf, "graph copyin")
        self._add(_Entry("copyin", dev, dev.copy, f"copyin {buf.nbytes} B", (), (buf,), host=source, nbytes=buf.nbytes))

    def copyout(self, buf: Buffer, dest: str) -> None:
        """Capture a copy of ``buf`` to the host; the replay's result ``dest`` holds it."""
        _check_name("graph copyout", dest)
        dev = _owner(buf, "graph copyout")
        self._add(_Entry("copyout", dev, dev.copy, f"copyout {buf.nbytes} B", (buf,), (), host=dest, nbytes=buf.nbytes))

    def transfer(self, dst: Buffer, src: Buffer) -> None:
        """Capture a copy of ``src`` into ``dst`` on the copy engine :func:`aruntime.transfer` would use."""
        src_dev, dst_dev = _owner(src, "graph transfer"), _owner(dst, "graph transfer")
        if src_dev.routes_transfers or dst_dev.routes_transfers:
            raise DeviceError(f"graph transfer {src_dev.name}->{dst_dev.name}: a graph cannot capture it")
        dev = transfer_device(src_dev, dst_dev)
        if dst.nbytes != src.nbytes:
            raise BufferUsageError(f"graph transfer: {src!r} has {src.nbytes} bytes, {dst!r} has {dst.nbytes}")
        self._add(_Entry("transfer", dev, dev.copy, f"transfer {src.nbytes} B", (src,), (dst,), nbytes=src.nbytes))

    def launch(
        self,
        prog: Program,
        *bufs: Buffer,
        vals: Sequence[int | float | Param] = (),
        outs: Sequence[int] | None = None,
    ) -> None:
        """Capture a kernel launch; scalars given as :class:`Param` are named inputs of each replay."""
        if not isinstance(prog, Program):
            raise DeviceError(f"graph launch: expected a Program, got {type(prog).__name__}")
        dev = prog.device
        reads, writes = dev._launch_access(prog, bufs, outs)
        vals = check_scalars(f"graph launch {prog.name}", vals, skip=Param)
        self._add(_Entry("launch", dev, dev.compute, prog.name, reads, writes, prog=prog, bufs=bufs, vals=vals))

    def _build(self) -> _Plan:
        entries = self.entries
        if not entries:
            raise ValueError(f"{self!r} has no entries to replay")
        deps: list[tuple[int, ...]] = []
        depth: list[int] = []
        for i, entry in enumerate(entries):
            mine = []
            for j in range(i):
                other = entries[j]
                if any(
                    _overlaps(a, b)
                    for a, b in itertools.chain(
                        itertools.product(entry.writes, other.reads + other.writes),
                        itertools.product(entry.reads, other.writes),
                    )
                ):
                    mine.append(j)
            deps.append(tuple(mine))
            depth.append(1 + max((depth[j] for j in mine), default=-1))
        engines = self._place(deps)
        # every conflicting pair is an edge, so this order keeps each conflict's captured order
        order: dict[Engine, list[int]] = {}
        for i in sorted(range(len(entries)), key=lambda i: (depth[i], i)):
            order.setdefault(engines[i], []).append(i)
        pos = [0] * len(entries)
        for indices in order.values():
            for p, i in enumerate(indices, 1):
                pos[i] = p
        waits: list[list[tuple[Engine, int]]] = []
        signals = [False] * len(entries)
        feeds: dict[Engine, list[Engine]] = {e: [] for e in order}
        for i in range(len(entries)):
            latest: dict[Engine, int] = {}
            for j in deps[i]:
                engine = engines[j]
                if engine is not engines[i]:
                    latest[engine] = max(latest.get(engine, 0), pos[j])
                    signals[j] = True
                    reads = any(_overlaps(a, b) for a in entries[i].reads for b in entries[j].writes)
                    if reads and engine not in feeds[engines[i]]:
                        feeds[engines[i]].append(engine)
            waits.append(list(latest.items()))
        progress = {e: TimelineSignal(f"Graph #{self.id} {e.signal.name} progress", e.signal.timeout) for e in order}
        needed = {e.host for e in entries if e.kind == "copyin"} | {
            v.name for e in entries for v in e.vals if isinstance(v, Param)
        }
        outputs = frozenset(e.host for e in entries if e.kind == "copyout")
        slot: dict[int, int] = {}
        buffers: list[Buffer] = []
        for e in entries:
            for b in (*e.bufs, *e.reads, *e.writes):
                if id(b) not in slot:
                    slot[id(b)] = len(buffers)
                    buffers.append(b)
        steps = {
            engine: [
                _Step(
                    i,
                    entries[i],
                    tuple(slot[id(b)] for b in (entries[i].bufs or (*entries[i].reads, *entries[i].writes))),
                    [(progress[e], len(order[e]), p) for e, p in waits[i]],
                    pos[i] if signals[i] else 0,
                )
                for i in indices
            ]
            for engine, indices in order.items()
        }
        strongest: dict[tuple[Engine, int], tuple[Buffer, bool]] = {}  # one access per engine and buffer
        consumes: dict[int, bool] = {}  # whether the graph's first access to a buffer uses its contents
        for i, e in enumerate(entries):
            for bufs, write in ((e.reads, False), (e.writes, True)):
                for b in bufs:
                    key = (engines[i], id(b))
                    strongest[key] = (b, write or strongest.get(key, (b, False))[1])
                    consumes.setdefault(id(b), not write)
        accesses = [(engine, slot[id(b)], write, consumes[id(b)]) for (engine, _), (b, write) in strongest.items()]
        labels = {engine: f"({_label(engine_steps)})" for engine, engine_steps in steps.items()}
        return _Plan(
            list(order),
            engines,
            tuple(deps),
            progress,
            frozenset(needed),
            outputs,
            frozenset(needed) | outputs,
            steps,
            buffers,
            accesses,
            feeds,
            labels,
            f"{self!r} replay",
        )

    def _place(self, deps: list[tuple[int, ...]]) -> list[Engine]:
        """Each entry's engine: its own, except that a small host copy (at most the device's
        ``inline_copy_max`` bytes) next to a kernel of its device, as a dependency or a dependent, runs
        on that compute queue, in order with the kernel, instead of costing a hand-off between queues."""
        entries = self.entries
        engines = [e.engine for e in entries]
        near: list[set[int]] = [set(d) for d in deps]
        for i, d in enumerate(deps):
            for j in d:
                near[j].add(i)
        for i, e in enumerate(entries):
            small = e.kind in ("copyin", "copyout") and e.nbytes <= e.device.inline_copy_max
            if small and any(entries[j].kind == "launch" and entries[j].device is e.device for j in near[i]):
                engines[i] = e.device.compute
        return engines

    def replay(self, buffers: dict[Buffer, Buffer] | None = None, **inputs: Any) -> GraphRun:
        """Submit the whole graph once; returns a :class:`GraphRun` to await.

        ``buffers`` maps captured buffers to replacements (same device and size);
        ``inputs`` gives every copy-in source and :class:`Param` by name, and may
        give a writable destination for a copy-out (else a new memoryview cast to the buffer's dtype, as
        :meth:`BaseDevice.copyout` gives).
        """
        return self._replay(buffers, inputs, None)

    def _replay(self, buffers: dict[Buffer, Buffer] | None, inputs: dict[str, Any], window: Window | None) -> GraphRun:
        """:meth:`replay`, its parts admitted through ``window`` (a scheduler's) if given."""
        with self._lock:  # one replay at a time: the progress signals count the runs in the order they are submitted
            plan = self._plan = self._plan or self._build()
            run = self._submit_run(plan, self._runs, buffers, inputs, window)
            self._runs += 1
        return run

    def _submit_run(
        self,
        plan: _Plan,
        run_index: int,
        buffers: dict[Buffer, Buffer] | None,
        inputs: dict[str, Any],
        window: Window | None,
    ) -> GraphRun:
        """Check the inputs, build each engine's commands for run ``run_index`` and submit them (under the lock)."""
        bufs = self._substituted(plan, buffers) if buffers else plan.buffers
        names = inputs.keys()
        if names != plan.needed and names != plan.named:  # else: every input, with or without every output
            missing = plan.needed - names
            if missing:
                raise ValueError(f"{self!r} replay is missing inputs: {', '.join(sorted(missing))}")
            unknown = names - plan.named
            if unknown:
                raise ValueError(f"{self!r} replay got unknown inputs: {', '.join(sorted(unknown))}")
        # a root's own handle, where it has one; anything else through the property, which raises if it was freed
        handles = [b._handle if b._base is None and b._handle is not None else b.handle for b in bufs]
        fixed = self._fixed
        if fixed is None or fixed[0] != handles:  # replays mostly repeat the buffers: reuse what depends on them only
            commands: list[Command | None] = [None] * len(self.entries)
            for steps in plan.steps.values():
                for step in steps:
                    commands[step.index] = self._fixed_command(step, handles)
            fixed = self._fixed = (handles, commands, {})
        timing = recorder.enabled
        times: list[list[float]] = [[] for _ in self.entries] if timing else []
        results: dict[str, Any] = {}
        keep: list[Any] = [bufs]
        bodies: dict[Engine, list[Command]] = {}
        parts = fixed[2]
        for engine in plan.engines:
            part = None if timing else parts.get(engine)
            if part is None:
                cmds = self._commands(plan, engine, run_index, fixed[1], handles, inputs, keep, results, times)
                if not timing:
                    part = parts[engine] = _Part(engine.prepare(cmds), [], [], [], [])
                    self._holes(part, plan, engine, fixed[1], handles)
                    cmds = part.cmds.fresh()  # what is submitted is never the part's own
                bodies[engine] = cmds
                continue
            body = bodies[engine] = part.cmds.fresh()
            put = body.put
            for at, step in part.holes:
                put(at, self._command(step, handles, inputs, keep, results))
            copies, i, fast = part.copies, 0, engine.fast
            while i < len(copies):  # in C where it can (see aruntime.engine.native.submit), else here
                i = i if fast is None else fast.put_copies(body, copies, i, inputs, keep, results)
                if i < len(copies):
                    put(copies[i][0], self._command(part.copy_steps[i], handles, inputs, keep, results))
                    i += 1
            for at, kind, signal, per_run, value in part.marks:
                put(at, (kind, signal, run_index * per_run + value))
        ops = self._submit(plan, bodies, bufs, keep, run_index, window)
        run = GraphRun(tuple(ops), results)
        if timing:
            _record_when_done(run, self, plan, times)
        return run

    def _commands(
        self,
        plan: _Plan,
        engine: Engine,
        run_index: int,
        commands: list[Command | None],
        handles: list[Any],
        inputs: dict[str, Any],
        keep: list[Any],
        results: dict[str, Any],
        times: list[list[float]],
    ) -> list[Command]:
        """``engine``'s commands of replay ``run_index``, timestamped where ``times`` are taken."""
        steps = plan.steps[engine]
        base = run_index * len(steps)
        progress = plan.progress[engine]
        cmds: list[Command] = []
        for step in steps:
            for signal, count, p in step.waits:
                cmds.append((WAIT, signal, run_index * count + p))
            if times:
                cmds.append((TIMESTAMP, times[step.index]))
            command = commands[step.index]
            cmds.append(command or self._command(step, handles, inputs, keep, results))
            if times:
                cmds.append((TIMESTAMP, times[step.index]))
            if step.signal:
                cmds.append((SIGNAL, progress, base + step.signal))
        return cmds

    @staticmethod
    def _holes(part: _Part, plan: _Plan, engine: Engine, commands: list[Command | None], handles: list[Any]) -> None:
        """Record in ``part`` which of its commands (made by :meth:`_commands` without timestamps) each replay
        puts in anew: its Param launches, host copies and progress waits and signals."""
        steps = plan.steps[engine]
        progress = plan.progress[engine]
        at = 0
        for step in steps:
            for signal, count, p in step.waits:
                part.marks.append((at, WAIT, signal, count, p))
                at += 1
            entry = step.entry
            if entry.kind == "launch" and commands[step.index] is None:
                part.holes.append((at, step))
            elif entry.kind in ("copyin", "copyout"):
                handle = handles[step.slots[0]]
                out = entry.kind == "copyout"
                part.copies.append((at, out, entry.host, entry.nbytes, handle, entry.device, entry.name))
                part.copy_steps.append(step)
            at += 1
            if step.signal:
                part.marks.append((at, SIGNAL, progress, len(steps), step.signal))
                at += 1

    def _substituted(self, plan: _Plan, buffers: dict[Buffer, Buffer]) -> list[Buffer]:
        """The plan's buffers with ``buffers``' replacements (checked) in place of captured ones."""
        if not isinstance(buffers, dict):
            raise TypeError(
                f"{self!r} replay: buffers must map captured buffers to others, got {type(buffers).__name__}"
            )
        captured = {id(b) for b in plan.buffers}
        subst: dict[int, Buffer] = {}
        for old, new in buffers.items():
            if not isinstance(new, Buffer):
                raise BufferUsageError(f"{self!r}: {old!r} can only be replaced by a Buffer, got {type(new).__name__}")
            if id(old) not in captured:
                raise BufferUsageError(f"{self!r}: {old!r} is not a buffer of this graph")
            if new.device != old.device or new.nbytes != old.nbytes:
                raise BufferUsageError(f"{self!r}: {new!r} cannot stand in for {old!r} (device and size must match)")
            new.owner._check(new, "graph replay")
            subst[id(old)] = new
        return [subst.get(id(b), b) for b in plan.buffers]

    @staticmethod
    def _fixed_command(step: _Step, handles: list[Any]) -> Command | None:
        """The command of an entry that needs nothing but buffer handles (None for the others)."""
        entry, slots = step.entry, step.slots
        if entry.kind == "transfer":
            src, dst = slots
            return (COPY, entry.name, entry.device.copy_fn, handles[dst], handles[src], entry.nbytes)
        if entry.kind == "launch" and not any(isinstance(v, Param) for v in entry.vals):
            prog = entry.prog
            assert prog is not None
            fn, args = prog.bind([handles[i] for i in slots], entry.vals)  # type: ignore[arg-type]
            return (EXEC, entry.name, fn, args)
        return None

    def _command(
        self, step: _Step, handles: list[Any], inputs: dict[str, Any], keep: list[Any], results: dict[str, Any]
    ) -> Command:
        """The command of a host copy or of a launch with :class:`Param` scalars, for one replay."""
        entry = step.entry
        if entry.kind == "launch":
            prog = entry.prog
            assert prog is not None
            args = tuple(handles[i] for i in step.slots)
            vals = [  # a Param's value checked, and the message made, only for a Param
                check_scalar(f"{self!r} replay, input {v.name!r} of {entry.name}", i, inputs[v.name])
                if isinstance(v, Param)
                else v
                for i, v in enumerate(entry.vals)
            ]
            key = (*args, *vals, *map(type, vals))  # 2 and 2.0 are equal but make different C arguments
            cached = entry.command
            if cached is not None and cached[0] == key:
                return cached[1]
            fn, bound = prog.bind(args, vals)
            command: Command = (EXEC, entry.name, fn, bound)
            entry.command = (key, command)
            return command
        nbytes = entry.nbytes
        if entry.kind == "copyin":
            holder, address, size = pin(inputs[entry.host])
            keep.append(holder)
            if size != nbytes:
                raise BufferUsageError(f"graph input {entry.host!r} has {size} bytes, {entry.writes[0]!r} has {nbytes}")
            return (COPY, entry.name, entry.device.copy_fn, handles[step.slots[0]], address, nbytes)
        dest = inputs.get(entry.host)
        dest = typed(zeroed(nbytes), entry.reads[0].dtype) if dest is None else dest
        holder, address, size = pin(dest, writable=True)
        keep.append(holder)
        if size != nbytes:
            raise BufferUsageError(f"graph output {entry.host!r} has {size} bytes, {entry.reads[0]!r} has {nbytes}")
        results[entry.host] = dest
        return (COPY, entry.name, entry.device.copy_fn, address, handles[step.slots[0]], nbytes)

    def _submit(
        self,
        plan: _Plan,
        bodies: dict[Engine, list[Command]],
        bufs: list[Buffer],
        keep: list[Any],
        run_index: int,
        window: Window | None,
    ) -> list[Op]:
        engines = plan.engines
        for engine in engines:
            engine.check_open(plan.what)
        name = f"Graph #{self.id} replay {run_index} "
        ops = {e: Op(name + plan.labels[e], (), keep) for e in engines}
        for engine, op in ops.items():
            op.hold(engine)  # bound before another thread can find it in a hazard log or a window
        try:
            return self._hand_over(plan, bodies, bufs, window, ops)
        except BaseException as exc:
            for engine, op in ops.items():
                op.drop_unsubmitted(engine, exc)
            raise

    def _hand_over(
        self,
        plan: _Plan,
        bodies: dict[Engine, list[Command]],
        bufs: list[Buffer],
        window: Window | None,
        ops: dict[Engine, Op],
    ) -> list[Op]:
        engines = plan.engines
        deps: dict[Engine, list[Op]] = {e: [] for e in engines}
        inputs: dict[Engine, list[Op]] = {e: [] for e in engines}
        fast = engines[0].fast
        parts = list(ops.values())
        with logs_held():  # the parts' accesses, and their place in the window, at once
            if fast is not None:  # the same, in C (see aruntime.engine.native.submit)
                fast.accesses(bufs, plan.accesses, ops, deps, inputs)
            for engine, i, write, uses in () if fast is not None else plan.accesses:
                b = bufs[i]
                b.log.access(
                    b.offset, b.offset + b.nbytes, write, uses, ops[engine], engine, deps[engine], inputs[engine]
                )
            admitted = window is None or window._admit(parts)
        mine = set(ops.values()) if len(engines) > 1 else ()  # an op is never among its own dependencies
        for engine in engines:
            op = ops[engine]
            op.deps = [d for d in deps[engine] if d not in mine] if mine else deps[engine]  # the rest: by progress
            # outside producers from the hazard logs; this replay's parts from the plan: a failed part fails the
            # parts that consume what it should have written
            outside = [d for d in inputs[engine] if d not in mine] if mine else inputs[engine]
            if outside:
                protect(outside, None)  # a replay is never skipped: a request it reads from is not either
            op.inputs = outside + [ops[f] for f in plan.feeds[engine]] if mine else outside
        # all engines' parts go together, once every outside dependency is on its queue: their progress
        # waits on one another must never sit in front of an outside op they depend on
        dispatch_when_ready(
            [(engine, bodies[engine], ops[engine]) for engine in plan.engines], False, None if admitted else window
        )
        return parts


def _record_when_done(run: GraphRun, graph: Graph, plan: _Plan, times: list[list[float]]) -> None:
    """Record the replay's :class:`GraphEvent` once all its parts are done: when they finish, or when the run is
    awaited, whichever comes first (callbacks may run a little after the parts finish)."""
    recorded = [False]
    lock = threading.Lock()

    def record() -> None:
        with lock:
            if recorded[0]:
                return
            recorded[0] = True
        for op in run.ops:
            op.refresh()  # the parts' timestamps are filled in
        entries = tuple(
            GraphEntry(e.device.name, e.name, engine.is_copy)
            for e, engine in zip(graph.entries, plan.placed, strict=True)
        )
        starts = tuple(t[0] if len(t) == 2 else 0.0 for t in times)
        ends = tuple(t[1] if len(t) == 2 else 0.0 for t in times)
        recorder.add((GraphEvent(entries, plan.deps, starts, ends),))

    run.settled_hook = record
    one_done = after_all(len(run.ops), record)
    for op in run.ops:
        op.when_done(one_done)


class GraphRun:
    """One replay in flight: ``await run`` gives its copy-out results by name, or raises its first failure
    (a checkpoint even once the replay is done)."""

    def __init__(self, ops: tuple[Op, ...], results: dict[str, Any]) -> None:
        self.ops = ops
        self.results = results
        self.settled_hook: Callable[[], None] | None = None  # runs once every part is done, when awaited

    def done(self) -> bool:
        """Whether every engine has finished its part of the replay."""
        return all(op.done() for op in self.ops)

    def __await__(self) -> Generator[Any, None, dict[str, Any]]:
        return self._wait().__await__()

    async def _wait(self) -> dict[str, Any]:
        for op in self.ops:
            try:
                await op.settled()
            except SignalTimeout as exc:
                raise SignalTimeout(f"{op.name}: {exc}") from exc
        if self.settled_hook is not None:
            self.settled_hook()
        for op in self.ops:  # an engine that logs failures natively sets a done op's error when it retires it
            op.refresh()
        failed = [op for op in self.ops if op.error is not None]
        if failed:
            raise first_failure(failed, "of this replay failed")
        return self.results
