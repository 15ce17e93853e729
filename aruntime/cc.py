"""Re-exports :mod:`aruntime.compile.cc`, its new home, until the next release (see docs/migration.md)."""

import warnings

from aruntime.compile.cc import build, compiler, compiler_path, compiler_version, host_cpu, load

warnings.warn(
    "aruntime.cc moved to aruntime.compile.cc; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["build", "compiler", "compiler_path", "compiler_version", "host_cpu", "load"]
