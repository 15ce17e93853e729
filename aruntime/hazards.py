"""Re-exports :mod:`aruntime.memory.hazards`, its new home, until the next release (see docs/migration.md)."""

import warnings

from aruntime.memory.hazards import AccessLog

warnings.warn(
    "aruntime.hazards moved to aruntime.memory.hazards; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["AccessLog"]
