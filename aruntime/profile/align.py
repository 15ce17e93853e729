"""Re-exports :mod:`aruntime.engine.clock`, its new home, until the next release (see docs/migration.md)."""

import warnings

from aruntime.engine.clock import SAMPLES, Sample, engine_offset, engine_sample, estimate_offset, offset_from_samples

warnings.warn(
    "aruntime.profile.align moved to aruntime.engine.clock; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["SAMPLES", "Sample", "engine_offset", "engine_sample", "estimate_offset", "offset_from_samples"]
