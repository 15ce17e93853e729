"""Live queue metrics: counts, busy share and latency histograms that engines keep without a profile.

Each engine that keeps them (the native and Python engines) counts into two histograms of nanoseconds, with
eight buckets per power of two (a percentile read from them is within 12.5% of the exact one): how long an op
waited in its queue (from being handed to the queue to the worker taking it) and how long it then ran (from
being taken, its waits for other queues included, to done). :meth:`Engine.metrics
<aruntime.engine.Engine.metrics>` turns them into plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

HIST = 496
"""Buckets per histogram (as core.c's ``HIST``)."""
PERCENTILES = (50, 90, 99)
"""The percentiles :func:`summary` reports."""


def bucket(ns: int) -> int:
    """The histogram bucket of ``ns`` nanoseconds (as core.c's ``bucket``)."""
    if ns < 8:
        return max(ns, 0)
    msb = ns.bit_length() - 1
    return (msb - 2) * 8 + ((ns >> (msb - 3)) & 7)


def floor(index: int) -> int:
    """The least number of nanoseconds in bucket ``index``."""
    if index < 8:
        return index
    msb, sub = index // 8 + 2, index % 8
    return (8 + sub) << (msb - 3)


def summary(counts: Sequence[int]) -> dict[str, Any]:
    """``{"count": n, "p50_us": ..., "p90_us": ..., "p99_us": ...}`` of a histogram (percentiles None when it is
    empty; each is its bucket's lower bound)."""
    total = sum(counts)
    out: dict[str, Any] = {"count": total}
    for q in PERCENTILES:
        out[f"p{q}_us"] = None
    if not total:
        return out
    wanted = [(q, q / 100 * total) for q in PERCENTILES]
    seen = 0
    for index, count in enumerate(counts):
        seen += count
        while wanted and seen >= wanted[0][1]:
            out[f"p{wanted[0][0]}_us"] = floor(index) / 1000.0
            wanted.pop(0)
        if not wanted:
            break
    return out


__all__ = ["HIST", "PERCENTILES", "bucket", "floor", "summary"]
