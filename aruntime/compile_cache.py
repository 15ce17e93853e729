"""Re-exports :mod:`aruntime.compile.cache`, its new home, until the next release (see docs/migration.md)."""

import warnings

from aruntime.compile.cache import (
    CACHE_VERSION,
    CacheInfo,
    cache_clear,
    cache_close,
    cache_delete,
    cache_get,
    cache_info,
    cache_path,
    cache_put,
)

warnings.warn(
    "aruntime.compile_cache moved to aruntime.compile.cache; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "CACHE_VERSION",
    "CacheInfo",
    "cache_clear",
    "cache_close",
    "cache_delete",
    "cache_get",
    "cache_info",
    "cache_path",
    "cache_put",
]
