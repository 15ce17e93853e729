"""Small shared utilities: environment flags, device names, counting callbacks, the checkpoint, the address of a
``bytes`` object's data."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import re
import threading
import types
from collections.abc import Callable, Generator
from typing import Any, TypeVar

from aruntime.errors import DeviceError

T = TypeVar("T", int, float, str)


ENV_PREFIX = "ARUNTIME_"
"""Every environment variable aruntime reads is named with this prefix (``ARUNTIME_WAIT_TIMEOUT``...)."""


def getenv(key: str, default: T, minimum: T | None = None, maximum: T | None = None) -> T:
    """Read the environment variable ``ARUNTIME_<key>`` converted to the type of ``default``.

    The one place aruntime reads its settings from the environment (it never
    writes them). Unset or empty reads as ``default``. A value that does not
    convert (a float that is not a number included), or that lies outside
    ``minimum`` .. ``maximum`` (inclusive, where given), raises a ``ValueError``
    naming the variable and what it accepts.
    """
    name = ENV_PREFIX + key
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    kind = type(default)
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {kind.__name__}") from None
    if isinstance(value, float) and value != value:
        raise ValueError(f"environment variable {name}={raw!r} is not a number")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = " and ".join(
            f"{word} {bound!r}" for word, bound in (("at least", minimum), ("at most", maximum)) if bound is not None
        )
        raise ValueError(f"environment variable {name}={raw!r} is out of range: it must be {bounds}")
    return value


_KIND = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_EXPECTED = "expected KIND, KIND:N with N >= 0, or KIND:ARG (a path for DISK)"


def canonicalize(name: str) -> str:
    """The canonical device name: ``KIND``, ``KIND:N`` (N > 0, a device index) or ``KIND:ARG``.

    The kind (letters, digits, ``_``) is upper-cased; an index of 0 is dropped
    and leading zeros go (``"cpu:0" -> "CPU"``, ``"cpu:010" -> "CPU:10"``); any
    other argument (a path: ``"disk:/tmp/A" -> "DISK:/tmp/A"``) is kept, less a
    final ``":0"`` (``"disk:/tmp/x:0" -> "DISK:/tmp/x"``). A malformed name (no
    kind, an empty argument, a negative index) is a :class:`DeviceError`; which
    arguments a kind takes is checked when the device opens.
    """
    if not isinstance(name, str):
        raise DeviceError(f"invalid device name {name!r}: not a str; {_EXPECTED}")
    return _canonical(name)


@functools.lru_cache(maxsize=1024)
def _canonical(name: str) -> str:
    """:func:`canonicalize` for a str (kept: every op on a buffer asks for its device's name)."""
    kind, sep, rest = name.partition(":")
    if not _KIND.fullmatch(kind):
        raise DeviceError(f"invalid device name {name!r}: no kind before ':'; {_EXPECTED}")
    if sep and not rest:
        raise DeviceError(f"invalid device name {name!r}: nothing after ':'; {_EXPECTED}")
    if rest.startswith("-") and rest[1:].isdecimal():
        raise DeviceError(f"invalid device name {name!r}: a device index must be >= 0; {_EXPECTED}")
    if rest.isdecimal() and rest.isascii():
        index = int(rest)
        return kind.upper() + (f":{index}" if index else "")
    if rest.endswith(":0") and not (rest[:-2].isdecimal() and rest[:-2].isascii()):
        rest = rest[:-2]
    return kind.upper() + sep + rest


def is_index(arg: str) -> bool:
    """Whether the argument of a canonical device name is a device index (or absent)."""
    return arg == "" or (arg.isdecimal() and arg.isascii())


def after_all(count: int, callback: Callable[[], object]) -> Callable[[], None]:
    """A function that calls ``callback`` on its ``count``-th call, from whichever thread makes it."""
    left = [count]
    lock = threading.Lock()

    def one() -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        callback()

    return one


MAX_SECONDS = 1e9
"""The longest timeout or deadline (about 31 years): beyond it a wait in nanoseconds no longer fits 64 bits."""


def check_seconds(what: str, seconds: object) -> float:
    """``seconds`` as a float where it is a positive number of seconds (an int or float, not a bool) below
    :data:`MAX_SECONDS`; else a :class:`ValueError` naming ``what``."""
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 < seconds < MAX_SECONDS:
        return float(seconds)
    raise ValueError(f"{what} must be a positive number of seconds, finite and below 1e9, got {seconds!r}")


@types.coroutine
def checkpoint() -> Generator[Any, None, None]:
    """Check for cancellation and let the event loop run other tasks once: ``await checkpoint()``, or
    ``yield from checkpoint()`` in a generator-based ``__await__``.

    Every public awaitable of aruntime passes through one, even when its result is ready (trio's rule, which
    anyio follows). On asyncio and uvloop it is the bare yield of ``asyncio.sleep(0)``: the task runs again on
    the loop's next turn, and a cancellation delivered meanwhile (an anyio cancel scope cancels the task) raises
    here. On trio it is ``trio.lowlevel.checkpoint()``. It does what ``anyio.lowlevel.checkpoint()`` does without
    looking the event loop up by name and without its three coroutine frames (about 1 µs less per await on
    asyncio).
    """
    if asyncio._get_running_loop() is not None:
        yield
    else:
        import trio

        yield from trio.lowlevel.checkpoint().__await__()  # noqa: ASYNC105  (awaited: this is a generator coroutine)


_PROBE = b"aruntime"
_BYTES_DATA = int(ctypes.cast(_PROBE, ctypes.c_void_p).value or 0) - id(_PROBE)  # type: ignore[arg-type]


def bytes_address(data: bytes) -> int:
    """The address of the data of ``data`` (a ``bytes``, exactly), valid while it lives: its ``id`` plus where
    CPython's layout puts the data (a constant, measured once; cheaper than a ctypes call per object)."""
    return id(data) + _BYTES_DATA
