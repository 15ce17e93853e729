"""What travels between the driver and a host's actor: handles, answers, errors, exported bytes."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any, NamedTuple

from aruntime.errors import DependencyError, OpError

try:
    import ray as ray  # the other modules of the backend take it from here
except ImportError:  # the extra is not installed: the backend loads, opening a device says what is missing
    ray = None  # type: ignore[assignment]

INLINE_MAX = 100 << 10
"""Exports up to this many bytes travel inside the call's answer; bigger ones are put in the object store."""


class RemoteHandle(NamedTuple):
    """What the driver holds of remote memory: the remote buffer's id, and a byte range of it."""

    id: int
    offset: int
    nbytes: int


Failure = tuple[Any, ...]
"""An error as it travels back from an actor (see :func:`pack_error`)."""
Result = tuple[Any, Failure | None, Sequence[tuple[str, float, float, bool]]]
"""What an actor call returns: (value, failure or None, profile ranges (name, start µs, end µs, is_copy))."""


def pack_error(exc: BaseException) -> Failure:
    """``exc`` as it can travel through Ray: the root cause of an op failure, rebuilt by :func:`unpack_error`."""
    if isinstance(exc, DependencyError):
        return ("dependency", str(exc), exc.first)
    if type(exc) is OpError and exc.__cause__ is not None:
        exc = exc.__cause__
    try:
        pickle.dumps(exc)
    except Exception:
        return ("error", RuntimeError(f"{type(exc).__name__}: {exc}"))
    return ("error", exc)


def unpack_error(failure: Failure) -> BaseException:
    if failure[0] == "dependency":
        return DependencyError(failure[1], failure[2])
    error: BaseException = failure[1]
    return error


DONE: Result = (None, None, ())
"""The answer of a call that succeeded with nothing to return (it travels as None, the cheapest result)."""


def decode(answer: Any) -> Result:
    """An actor call's answer, unpickled where the actor pickled it."""
    if answer is None:
        return DONE
    return pickle.loads(answer) if isinstance(answer, bytes) else answer  # type: ignore[no-any-return]


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (Ray's carry whole remote tracebacks)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def materialize(payload: Any) -> memoryview:
    """The bytes of an export's payload: inline data, or ``[ref]`` of data put in the object store."""
    if isinstance(payload, list):
        payload = ray.get(payload[0])
    return memoryview(payload).cast("B")
