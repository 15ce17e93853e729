"""Re-exports :mod:`aruntime.compile.compiler`, its new home, until the next release (see docs/migration.md)."""

import warnings

from aruntime.compile.compiler import Compiler, check_source

warnings.warn(
    "aruntime.compiler moved to aruntime.compile.compiler; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["Compiler", "check_source"]
