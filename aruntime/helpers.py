"""Small shared utilities: environment flags."""

from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T", int, float, str)


def getenv(key: str, default: T) -> T:
    """Read the environment variable ``key`` converted to the type of ``default``.

    Unset or empty reads as ``default``. A value that does not convert raises a
    ``ValueError`` naming the variable.
    """
    raw = os.environ.get(key, "")
    if raw == "":
        return default
    try:
        return type(default)(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not a valid {type(default).__name__}") from None
