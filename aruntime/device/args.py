"""Checking a launch's arguments: its scalars and the indices of the buffers it writes."""

from __future__ import annotations

import functools
from collections.abc import Iterable


def check_scalars(what: str, vals: object, skip: type | None = None) -> None:
    """Raise unless ``vals`` is a list or tuple of launch scalars (see :func:`check_scalar`); items that are
    instances of ``skip`` are left for the caller."""
    if not isinstance(vals, (list, tuple)):
        raise TypeError(f"{what}: vals must be a tuple or list of scalars, got {type(vals).__name__}")
    for i, val in enumerate(vals):
        if skip is None or not isinstance(val, skip):
            check_scalar(what, i, val)


def check_scalar(what: str, index: int, val: object) -> None:
    """Raise unless ``val`` can be a launch's scalar ``index``: a float, or an int that fits in int64."""
    if isinstance(val, float):
        return
    if not isinstance(val, int):
        raise TypeError(f"{what}: scalar {index} must be int or float, got {type(val).__name__}")
    if not -(1 << 63) <= val < 1 << 63:
        raise ValueError(f"{what}: scalar {index} = {val} does not fit in a 64-bit signed int")


def _indices(what: str, outs: object) -> tuple[int, ...]:
    """``outs`` as a tuple of buffer indices, or a TypeError naming ``what``."""
    items = tuple(outs) if isinstance(outs, Iterable) and not isinstance(outs, (str, bytes)) else None
    indices = tuple(i for i in items if type(i) is int) if items is not None else ()
    if items is None or len(indices) != len(items):
        raise TypeError(f"{what}: outs must be a sequence of buffer indices (int), got {outs!r}")
    return indices


@functools.lru_cache(maxsize=256)
def _split(count: int, written: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (read-only, written) indices of ``count`` launch buffers of which ``written`` are written."""
    if not all(0 <= i < count for i in written):
        raise ValueError(f"{written} out of range")
    return tuple(i for i in range(count) if i not in written), tuple(sorted(set(written)))
