"""The scheduler's hazard property on each kind: random op sequences over its two devices match a sequential
reference byte for byte (a small budget; ``ARUNTIME_FUZZ_EXAMPLES`` raises it)."""

from __future__ import annotations

import os

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aruntime import BaseDevice, Buffer, Program, dtypes
from aruntime.scheduler import Scheduler
from tests.conformance.kinds import Kind
from tests.test_scheduler_property import Region, reference

pytestmark = pytest.mark.anyio

EXAMPLES = max(1, int(os.environ.get("ARUNTIME_FUZZ_EXAMPLES", "15")) // 3)
SLOTS = 6  # view offsets are multiples of the kind's view alignment: 0 .. SLOTS - 1 of them
TAIL = 40  # bytes past the last slot


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[int], list[tuple[object, ...]], int, int]:
    """(home device of each buffer, ops in the reference's form with offsets in slots, window, seed)."""
    n_bufs = draw(st.integers(2, 5))
    homes = draw(st.lists(st.integers(0, 1), min_size=n_bufs, max_size=n_bufs))

    def region(length: int | None = None, among: list[int] | None = None) -> Region:
        buf = draw(st.sampled_from(among or list(range(n_bufs))))
        slot = draw(st.integers(0, SLOTS - 1))
        n = length if length is not None else draw(st.integers(1, TAIL))
        return Region(buf, slot, n, draw(st.booleans()))

    ops: list[tuple[object, ...]] = []
    for _ in range(draw(st.integers(1, 15))):
        kind = draw(st.sampled_from(["copyin", "affine", "accumulate", "copyout", "transfer"]))
        if kind == "copyin":
            r = region()
            ops.append((kind, r, draw(st.binary(min_size=r.length, max_size=r.length))))
        elif kind == "affine":
            ops.append((kind, region(), draw(st.integers(0, 255)), draw(st.integers(0, 255))))
        elif kind == "copyout":
            ops.append((kind, region()))
        elif kind == "accumulate":
            a = region()
            ops.append((kind, a, region(a.length, [i for i in range(n_bufs) if homes[i] == homes[a.buf]])))
        else:
            a = region()
            ops.append((kind, a, region(a.length)))
    return homes, ops, draw(st.integers(1, 16)), draw(st.integers(0, 250))


def in_bytes(r: Region, unit: int) -> Region:
    return Region(r.buf, r.offset * unit, r.length, r.nested)


def view_of(roots: list[Buffer], r: Region) -> Buffer:
    root = roots[r.buf]
    if r.nested:  # a view of a view at the same place: the offsets add up
        return root.view(root.nbytes - r.offset, dtypes.uint8, r.offset).view(r.length, dtypes.uint8, 0)
    return root.view(r.length, dtypes.uint8, r.offset)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
async def test_random_programs_match_the_sequential_reference(kind: Kind, case: tuple[object, ...]) -> None:
    kernels = kind.need_kernels()
    devs: list[BaseDevice] = [kind.dev, kind.other or kind.dev]
    homes, slot_ops, window, seed = case
    assert isinstance(homes, list) and isinstance(slot_ops, list) and isinstance(window, int)
    assert isinstance(seed, int)
    unit = kind.unit
    ops = [(op[0], *(in_bytes(a, unit) if isinstance(a, Region) else a for a in op[1:])) for op in slot_ops]
    affine: dict[str, Program] = {d.name: await d.compile(kernels["affine"], "affine") for d in devs}
    accumulate = {d.name: await d.compile(kernels["accumulate"], "accumulate", outs=(0,)) for d in devs}
    size = (SLOTS - 1) * unit + TAIL
    ref = [bytearray((i * 37 + j + seed) % 251 for j in range(size)) for i in range(len(homes))]
    roots = [await devs[h].allocate(size) for h in homes]
    for root, init in zip(roots, ref, strict=True):
        await root.owner.copyin(root, bytes(init))
    expected = reference(ref, ops)
    handles = []
    with anyio.fail_after(60):
        async with Scheduler(window=window) as sched:
            for op in ops:
                name, a = op[0], op[1]
                assert isinstance(a, Region)
                if name == "copyin":
                    sched.copyin(view_of(roots, a), op[2])
                elif name == "affine":
                    sched.launch(affine[roots[a.buf].device], view_of(roots, a), vals=(a.length, op[2], op[3]))
                elif name == "accumulate":
                    b = op[2]
                    assert isinstance(b, Region)
                    prog = accumulate[roots[a.buf].device]
                    sched.launch(prog, view_of(roots, a), view_of(roots, b), vals=(a.length,))
                elif name == "copyout":
                    handles.append(sched.copyout(view_of(roots, a)))
                else:
                    b = op[2]
                    assert isinstance(b, Region)
                    sched.transfer(view_of(roots, a), view_of(roots, b))
        assert [bytes(await h) for h in handles] == expected
        finals = [bytes(await root.owner.copyout(root)) for root in roots]
    assert finals == [bytes(r) for r in ref]
    for root in roots:
        await root.owner.free(root)
