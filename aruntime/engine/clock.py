"""Clock alignment: map an engine's timestamps onto the host clock (profiling draws every queue on one timeline).

Every range an engine records is stamped with *its* clock. To draw ranges of
several devices (and host ranges) on one timeline, each engine's clock is
mapped to the host clock by adding an offset. The offset is estimated from
paired samples: the host reads its clock (``before``), asks the engine for a
timestamp, waits for it, and reads its clock again (``after``). The engine's
timestamp was taken somewhere inside ``[before, after]`` on the host clock, so
each sample says::

    before - stamp <= offset <= after - stamp

and its midpoint ``(before + after) / 2 - stamp`` is the best single guess. The
estimate is the median of several midpoints (robust against a sample delayed
by a context switch), clamped to the interval every sample agrees on when
there is one. For the CPU engines, whose clock *is* the host clock, it comes
out at about zero; a device with its own clock gets its real offset.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from aruntime.engine.ops import CommandQueue, Engine, Op
from aruntime.events import now_us

SAMPLES = 9
"""Paired samples taken per engine (odd, so the median is one of them)."""

Sample = tuple[float, float, float]
"""One paired sample: (host clock before, engine timestamp, host clock after), all in µs."""


def offset_from_samples(samples: Sequence[Sample]) -> float:
    """The offset (µs) to add to engine timestamps to get host time, from paired samples.

    The median of the per-sample midpoints, clamped into the intersection of
    the per-sample bounds when that intersection is not empty.
    """
    if not samples:
        raise ValueError("clock alignment needs at least one paired sample")
    for before, _, after in samples:
        if after < before:
            raise ValueError(f"paired sample has the host clock going backwards ({before} > {after})")
    mids = [(before + after) / 2.0 - stamp for before, stamp, after in samples]
    estimate = statistics.median(mids)
    low = max(before - stamp for before, stamp, _ in samples)
    high = min(after - stamp for _, stamp, after in samples)
    if low <= high:
        estimate = min(max(estimate, low), high)
    return estimate


def estimate_offset(sample: Callable[[], Sample], count: int = SAMPLES) -> float:
    """Take ``count`` paired samples with ``sample()`` and return the estimated offset (µs)."""
    if count < 1:
        raise ValueError(f"clock alignment needs at least one sample, got {count}")
    return offset_from_samples([sample() for _ in range(count)])


def engine_sample(engine: Engine, timeout: float | None = None) -> Sample:
    """One paired sample of ``engine``: submit a timestamp command and wait for it to run.

    Call it while the engine is idle (after synchronizing), so the timestamp is
    not queued behind other work.
    """
    sink: list[float] = []
    op = Op(f"clock sample {engine.signal.name}")
    before = now_us()
    engine.submit(CommandQueue().timestamp(sink), op)
    op.wait(timeout)
    after = now_us()
    if not sink:
        raise RuntimeError(f"{engine.signal.name}: the timestamp command produced no timestamp")
    return (before, sink[0], after)


def engine_offset(engine: Engine, count: int = SAMPLES, timeout: float | None = 5.0) -> float:
    """The offset (µs) that maps ``engine``'s timestamps onto the host clock."""
    return estimate_offset(lambda: engine_sample(engine, timeout), count)
