"""Dependency dispatch: handing ops to their engines once the ops they depend on allow it."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol

from aruntime.engine.ops import Command, CommandQueue, Engine, Op, Prepared, check_gate
from aruntime.errors import DeviceError
from aruntime.events import DependencyEvent, recorder
from aruntime.helpers import after_all


class Window(Protocol):
    """Where ops wait for room before they are handed to their engines (a :class:`~aruntime.scheduler.Scheduler`):
    ``_admit(ops)`` admits them now (True) or refuses them (False); ``_queue_for_room(ops, go)`` then calls
    ``go``, from any thread, once they are admitted; ``_gate()`` is the gate of the ops submitted now (see
    :func:`~aruntime.engine.ops.skip_error`)."""

    def _gate(self) -> array[int]: ...

    def _admit(self, ops: Sequence[Op]) -> bool: ...

    def _queue_for_room(self, ops: Sequence[Op], go: Callable[[], None]) -> None: ...


def gate_of(window: Window | None) -> array[int] | None:
    """The gate of an op submitted now through ``window`` (None without a window); a TypeError naming ``window``
    where it is not one, or its gate is not a gate (see :func:`~aruntime.engine.ops.check_gate`)."""
    if window is None:
        return None
    gate = getattr(window, "_gate", None)
    if gate is None:
        raise TypeError(f"window must be a Scheduler or None, got {window!r}")
    return check_gate(gate())


def dispatch_when_ready(
    ops: Sequence[tuple[Engine, list[Command], Op]], hold: bool, window: Window | None = None
) -> None:
    """Hand ``ops`` (each with its engine and commands, its ``deps`` set) to their engines together,
    as soon as their dependencies allow (and ``window``, which refused them, admits them); until then
    they are held (see :meth:`Op.hold`).

    Without ``hold`` they go as soon as every dependency has been handed over, and
    wait commands cover cross-queue hazards (a queue runs in the order it is given
    work). With ``hold`` an op also waits off-queue, without a wait command, until
    its dependencies on other queues are done, so that later independent work on
    its queue is not stuck behind it; this is how a :class:`~aruntime.scheduler.Scheduler`,
    whose ``window`` also admits ops in order as room frees, overlaps
    straight-line code. A single op (held or not) whose dependencies all run on engines that
    :attr:`~aruntime.engine.Engine.pends` is handed over by the engine itself: on the
    native engine the core appends it to its queue from the worker thread that meets
    the last dependency, with no trip through the event loop. It carries no wait
    commands, so the core waits until its dependencies on other queues are done (those
    already handed on included) and those on its own queue are handed on. Otherwise (several ops
    at once, a refusing ``window``, another kind of engine) a callback on the
    dependencies' completion hands them over: on the native engine it runs on the
    event loop that submitted them (one turn of that loop; the callback thread outside
    any loop), on the Python engine on the engine thread that completed the dependency.
    """
    if hold and window is None and len(ops) == 1 and ops[0][0].pends and _pend_held(*ops[0]):
        return  # the common case of a scheduler's op, in one pass over its dependencies
    mine: Collection[int] = {id(op) for _, _, op in ops} if len(ops) > 1 else ()  # one op never depends on itself
    blockers: list[tuple[Op, bool, Op]] = []  # (op, wait only for the dependency's dispatch, dependency)
    for engine, _, op in ops:
        for dep in op.deps:
            if id(dep) in mine or dep.done():
                continue
            if hold and dep.engine is not engine:
                blockers.append((op, False, dep))
            elif not dep.dispatched:
                blockers.append((op, True, dep))
    if not blockers and window is None:
        _dispatch(ops, mine)
        return
    if window is None and len(ops) == 1 and ops[0][0].pends:
        # the core appends the op with no wait commands: whatever it waits for on another queue must be done
        # first (as for a held op), also a dependency handed on already, and one on its own queue handed on
        engine, body, op = ops[0]
        if hold:  # the blockers are those conditions already: done on other queues, dispatched on its own
            conds = [(on, dep) for _, on, dep in blockers]
        else:
            conds = [(False, dep) for dep in op.deps if dep.engine is not engine and not dep.done()]
            conds += [(True, dep) for _, on, dep in blockers if on and dep.engine is engine]
        if all(_pends_with(dep) for _, dep in conds):
            _pend(engine, body, op, conds)
            return
    for engine, _, op in ops:
        op.hold(engine)
    if recorder.enabled:
        recorder.add(DependencyEvent(dep.id, op.id) for op, on, dep in blockers if not on)
    one_ready = after_all(len(blockers) + (window is not None), lambda: _dispatch(ops, mine))
    for _, on_dispatch, dep in blockers:
        (dep.when_dispatched if on_dispatch else dep.when_done)(one_ready)
    if window is not None:
        window._queue_for_room([op for _, _, op in ops], one_ready)


def _pend_held(engine: Engine, body: list[Command], op: Op) -> bool:
    """Hand a held ``op`` on as :func:`dispatch_when_ready` does (to ``engine`` at once if nothing blocks it,
    else to its core with its conditions); False, with nothing done, if a dependency cannot be waited for in
    a core (then the general path holds it)."""
    conds: list[tuple[bool, Op]] = []
    for dep in op.deps:
        if dep.done():
            continue
        dep_engine = dep.engine
        if dep_engine is not engine:
            if not (dep_engine is not None and dep_engine.pends and (dep.cell is not None or dep.dispatched)):
                return False
            conds.append((False, dep))
        elif not dep.dispatched:
            if dep.cell is None:
                return False
            conds.append((True, dep))
    if conds:
        _pend(engine, body, op, conds)
    else:
        _dispatch(((engine, body, op),), ())
    return True


def _pend(engine: Engine, body: list[Command], op: Op, conds: list[tuple[bool, Op]]) -> None:
    """Hand ``op`` to ``engine``'s core with its conditions, each ``(on_dispatch, dependency)``."""
    if recorder.enabled:
        _record_deps(op, [dep for on, dep in conds if not on])
    try:
        engine.pend(body, op, conds)
    except DeviceError as exc:  # its engine was closed meanwhile
        op.abandon(engine, exc)


def _record_deps(op: Op, deps: Iterable[Op]) -> None:
    """Record, in the profile being recorded, that ``op`` waited for each of ``deps`` on another queue (the
    timeline draws each as a flow); the C submission path calls it too."""
    recorder.add(DependencyEvent(dep.id, op.id) for dep in deps)


def _pends_with(dep: Op) -> bool:
    """Whether an op pending in an engine's core can wait for ``dep`` there: ``dep`` runs on such an engine
    too, and has been handed to it or is pending in it."""
    engine = dep.engine
    return engine is not None and engine.pends and (dep.cell is not None or dep.dispatched)


def _dispatch(ops: Sequence[tuple[Engine, list[Command], Op]], mine: Collection[int]) -> None:
    for engine, body, op in ops:
        waits = _cross_engine_waits(op.deps, engine, mine)
        if waits:
            cq = CommandQueue()
            for dep_engine, value in waits.items():
                cq.wait(dep_engine.signal, value)
            if recorder.enabled:
                _record_deps(op, [d for d in op.deps if d.engine in waits and id(d) not in mine])
            body = body.after(cq.cmds) if isinstance(body, Prepared) else cq.cmds + body
        try:
            engine.push(body, op)
        except DeviceError as exc:  # its engine was closed while it was held
            op.abandon(engine, exc)


def _cross_engine_waits(deps: Sequence[Op], engine: Engine, mine: Collection[int]) -> dict[Engine, int]:
    """For each other engine among the ``deps`` not done (and not among ``mine``), the latest value ``engine``
    must wait for. Dependencies on ``engine`` itself need no wait: its queue runs in order."""
    waits: dict[Engine, int] = {}
    for dep in deps:
        dep_engine = dep.engine
        if (
            dep_engine is not engine
            and dep_engine is not None
            and dep.value > waits.get(dep_engine, 0)
            and id(dep) not in mine
            and not dep.done()
        ):
            waits[dep_engine] = dep.value
    return waits
