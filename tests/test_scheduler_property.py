"""Random op sequences through the scheduler match a sequential reference, byte for byte.

``ARUNTIME_FUZZ_EXAMPLES`` raises the number of examples (default 15 per event loop).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aruntime import Buffer, Device, Program, dtypes, transfer
from aruntime.graph import Graph
from aruntime.scheduler import Scheduler
from tests.kernels import ACCUMULATE, AFFINE

pytestmark = pytest.mark.anyio

SIZE = 48
DEVICES = ("CPU", "CPU:1", "CPU:2", "CPU:3")


@dataclass(frozen=True)
class Region:
    buf: int
    offset: int
    length: int
    nested: bool  # reached through a view of a view


@st.composite
def regions(draw: st.DrawFn, n_bufs: int, length: int | None = None) -> Region:
    buf = draw(st.integers(0, n_bufs - 1))
    n = length if length is not None else draw(st.integers(1, SIZE))
    offset = draw(st.integers(0, SIZE - n))
    return Region(buf, offset, n, draw(st.booleans()))


@st.composite
def programs(
    draw: st.DrawFn, devices: tuple[int, int] = (1, 4), bufs: int = 8, length: int = 25
) -> tuple[int, list[int], list[tuple[object, ...]], int]:  # a Case
    """A random program over ``devices`` (least, most) devices, 2 to ``bufs`` buffers, 1 to ``length`` ops."""
    n_dev = draw(st.integers(*devices))
    n_bufs = draw(st.integers(2, bufs))
    homes = draw(st.lists(st.integers(0, n_dev - 1), min_size=n_bufs, max_size=n_bufs))
    ops: list[tuple[object, ...]] = []
    for _ in range(draw(st.integers(1, length))):
        kind = draw(st.sampled_from(["copyin", "affine", "accumulate", "copyout", "transfer"]))
        if kind == "copyin":
            r = draw(regions(n_bufs))
            ops.append((kind, r, draw(st.binary(min_size=r.length, max_size=r.length))))
        elif kind == "affine":
            ops.append((kind, draw(regions(n_bufs)), draw(st.integers(0, 255)), draw(st.integers(0, 255))))
        elif kind == "copyout":
            ops.append((kind, draw(regions(n_bufs))))
        else:
            a = draw(regions(n_bufs))
            if kind == "accumulate":  # both regions on one device
                same = [i for i in range(n_bufs) if homes[i] == homes[a.buf]]
                b = draw(regions(n_bufs, a.length))
                b = Region(draw(st.sampled_from(same)), b.offset, b.length, b.nested)
            else:
                b = draw(regions(n_bufs, a.length))
            ops.append((kind, a, b))
    return n_dev, homes, ops, draw(st.integers(1, 16))


Case = tuple[int, list[int], list[tuple[object, ...]], int]


def view_of(roots: list[Buffer], r: Region) -> Buffer:
    root = roots[r.buf]
    if r.nested:  # a view of a view: offsets add up
        outer = root.view(SIZE - r.offset, dtypes.uint8, r.offset)
        return outer.view(r.length, dtypes.uint8, 0)
    return root.view(r.length, dtypes.uint8, r.offset)


EXAMPLES = int(os.environ.get("ARUNTIME_FUZZ_EXAMPLES", "15"))


HELD_READ_THEN_WRITE: Case = (  # a held transfer reads b1; a later read of b1 must not hide it from a write
    1,
    [0, 0],
    [
        ("affine", Region(0, 0, 1, False), 0, 0),
        ("transfer", Region(0, 0, 1, False), Region(1, 0, 1, False)),
        ("copyout", Region(0, 0, 1, False)),
        ("copyout", Region(1, 0, 1, False)),
        ("copyin", Region(1, 0, 1, False), b"\x00"),
    ],
    8,
)


def reference(ref: list[bytearray], ops: list[tuple[object, ...]]) -> list[bytes]:
    """Apply ``ops`` to ``ref`` one after another, as plain Python; the bytes each copy-out sees."""
    seen: list[bytes] = []
    for op in ops:
        kind = op[0]
        if kind == "copyin":
            r, data = op[1], op[2]
            assert isinstance(r, Region) and isinstance(data, bytes)
            ref[r.buf][r.offset : r.offset + r.length] = data
        elif kind == "affine":
            r, a, c = op[1], op[2], op[3]
            assert isinstance(r, Region) and isinstance(a, int) and isinstance(c, int)
            seg = ref[r.buf]
            for i in range(r.offset, r.offset + r.length):
                seg[i] = (seg[i] * a + c) & 0xFF
        elif kind == "accumulate":
            o, x = op[1], op[2]
            assert isinstance(o, Region) and isinstance(x, Region)
            for i in range(o.length):  # the same element order as the C loop, aliasing included
                ref[o.buf][o.offset + i] = (ref[o.buf][o.offset + i] + ref[x.buf][x.offset + i]) & 0xFF
        elif kind == "copyout":
            r = op[1]
            assert isinstance(r, Region)
            seen.append(bytes(ref[r.buf][r.offset : r.offset + r.length]))
        else:
            dst, src = op[1], op[2]
            assert isinstance(dst, Region) and isinstance(src, Region)
            ref[dst.buf][dst.offset : dst.offset + dst.length] = bytes(
                ref[src.buf][src.offset : src.offset + src.length]
            )
    return seen


async def setup(
    names: Sequence[str], homes: list[int]
) -> tuple[dict[str, Program], dict[str, Program], list[bytearray], list[Buffer]]:
    """Kernels for each device that holds a buffer, the reference's initial bytes, and device buffers holding
    them (buffer ``i`` on device ``names[homes[i]]``)."""
    devs = [Device[name] for name in names]
    used = [devs[h] for h in sorted(set(homes))]
    affine = {d.name: await d.compile(AFFINE) for d in used}
    accumulate = {d.name: await d.compile(ACCUMULATE, outs=(0,)) for d in used}
    ref = [bytearray((i * 37 + j) % 251 for j in range(SIZE)) for i in range(len(homes))]
    roots = [await devs[h].allocate(SIZE) for h in homes]
    for root, init in zip(roots, ref, strict=True):
        await root.owner.copyin(root, bytes(init))
    return affine, accumulate, ref, roots


async def check_through_scheduler(
    names: Sequence[str], case: Case, direct: Sequence[bool] = (), priorities: Sequence[int] = ()
) -> None:
    """Run ``case``'s program through a :class:`Scheduler` over the devices ``names`` (op ``i`` straight on its
    device instead where ``direct[i]``, at priority ``priorities[i]``, default 0); check every copy-out and the
    buffers' final bytes against :func:`reference`."""
    n_dev, homes, ops, window = case
    affine, accumulate, ref, roots = await setup(names[:n_dev], homes)
    expected = reference(ref, ops)
    handles = []
    with anyio.fail_after(60):
        async with Scheduler(window=window) as sched:
            for i, op in enumerate(ops):
                on_device = i < len(direct) and direct[i]
                p = priorities[i] if i < len(priorities) else 0
                kind = op[0]
                if kind == "copyin":
                    r, data = op[1], op[2]
                    assert isinstance(r, Region)
                    buf = view_of(roots, r)
                    (buf.owner.copyin if on_device else sched.copyin)(buf, data, priority=p)
                elif kind in ("affine", "accumulate"):
                    r = op[1]
                    assert isinstance(r, Region)
                    if kind == "affine":
                        prog, bufs, vals = affine[roots[r.buf].device], [view_of(roots, r)], (r.length, op[2], op[3])
                    else:
                        x = op[2]
                        assert isinstance(x, Region)
                        prog, bufs, vals = (
                            accumulate[roots[r.buf].device],
                            [view_of(roots, r), view_of(roots, x)],
                            (r.length,),
                        )
                    (prog.device.launch if on_device else sched.launch)(prog, *bufs, vals=vals, priority=p)  # type: ignore[arg-type]
                elif kind == "copyout":
                    r = op[1]
                    assert isinstance(r, Region)
                    buf = view_of(roots, r)
                    handles.append((buf.owner.copyout if on_device else sched.copyout)(buf, priority=p))
                else:
                    dst, src = op[1], op[2]
                    assert isinstance(dst, Region) and isinstance(src, Region)
                    (transfer if on_device else sched.transfer)(view_of(roots, dst), view_of(roots, src), priority=p)
        got = [bytes(await h) for h in handles]
        assert got == expected
        finals = [bytes(await root.owner.copyout(root)) for root in roots]
    assert finals == [bytes(r) for r in ref]
    for root in roots:
        await root.owner.free(root)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@example(case=HELD_READ_THEN_WRITE)
@given(case=programs())
async def test_random_programs_match_sequential_reference(case: Case) -> None:
    await check_through_scheduler(DEVICES, case)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=programs(), direct=st.lists(st.booleans(), min_size=25, max_size=25))
async def test_random_programs_mixing_direct_and_scheduled_ops_match_sequential_reference(
    case: Case, direct: list[bool]
) -> None:
    """Ops straight on a device ordered against ops a scheduler holds: a direct op whose dependency is held
    (pending in the native core) on another queue must still wait for it to be done."""
    await check_through_scheduler(DEVICES, case, direct)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@example(case=HELD_READ_THEN_WRITE)
@given(case=programs())
async def test_random_graphs_replayed_twice_match_sequential_reference(case: Case) -> None:
    n_dev, homes, ops, _ = case
    affine, accumulate, ref, roots = await setup(DEVICES[:n_dev], homes)
    graph = Graph()
    inputs: dict[str, bytes] = {}
    outputs: list[str] = []
    for k, op in enumerate(ops):
        kind = op[0]
        if kind == "copyin":
            r, data = op[1], op[2]
            assert isinstance(r, Region) and isinstance(data, bytes)
            graph.copyin(view_of(roots, r), f"in{k}")
            inputs[f"in{k}"] = data
        elif kind == "affine":
            r, a, c = op[1], op[2], op[3]
            assert isinstance(r, Region) and isinstance(a, int) and isinstance(c, int)
            graph.launch(affine[roots[r.buf].device], view_of(roots, r), vals=(r.length, a, c))
        elif kind == "accumulate":
            o, x = op[1], op[2]
            assert isinstance(o, Region) and isinstance(x, Region)
            graph.launch(accumulate[roots[o.buf].device], view_of(roots, o), view_of(roots, x), vals=(o.length,))
        elif kind == "copyout":
            r = op[1]
            assert isinstance(r, Region)
            graph.copyout(view_of(roots, r), f"out{k}")
            outputs.append(f"out{k}")
        else:
            dst, src = op[1], op[2]
            assert isinstance(dst, Region) and isinstance(src, Region)
            graph.transfer(view_of(roots, dst), view_of(roots, src))
    first, second = reference(ref, ops), reference(ref, ops)
    with anyio.fail_after(60):
        runs = [graph.replay(**inputs), graph.replay(**inputs)]  # both in flight: the second sees the first's state
        results = [await run for run in runs]
        assert [bytes(results[0][name]) for name in outputs] == first
        assert [bytes(results[1][name]) for name in outputs] == second
        finals = [bytes(await root.owner.copyout(root)) for root in roots]
    assert finals == [bytes(r) for r in ref]
    for root in roots:
        await root.owner.free(root)
