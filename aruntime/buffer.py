"""Re-exports :mod:`aruntime.memory.buffer`, its new home, until the next release (see docs/migration.md)."""

import warnings

from aruntime.memory.buffer import Buffer, BufferScope, typed

warnings.warn(
    "aruntime.buffer moved to aruntime.memory.buffer; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["Buffer", "BufferScope", "typed"]
