"""Checking a launch's arguments: its scalars and the indices of the buffers it writes."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any


def check_scalars(what: str, vals: object, skip: type | None = None) -> tuple[Any, ...]:
    """``vals``, a list or tuple of launch scalars, as a tuple of the plain values (see :func:`check_scalar`);
    else an error. Items that are instances of ``skip`` are left as they are, for the caller."""
    if not isinstance(vals, (list, tuple)):
        raise TypeError(f"{what}: vals must be a tuple or list of scalars, got {type(vals).__name__}")
    return tuple(
        val if skip is not None and isinstance(val, skip) else check_scalar(what, i, val) for i, val in enumerate(vals)
    )


def check_scalar(what: str, index: int, val: object) -> int | float:
    """``val`` as a launch's scalar ``index``: a float, or an int that fits in int64, as the plain ``float`` or
    ``int`` it holds (a subclass's value, not what its methods say: the C submission path reads the value); else
    an error."""
    if isinstance(val, float):
        return float.__float__(val)
    if not isinstance(val, int):
        raise TypeError(f"{what}: scalar {index} must be int or float, got {type(val).__name__}")
    plain = int.__int__(val)
    if not -(1 << 63) <= plain < 1 << 63:
        raise ValueError(f"{what}: scalar {index} = {plain} does not fit in a 64-bit signed int")
    return plain


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
