"""Compiling: the compiler base class, the system C toolchain (:mod:`~aruntime.compile.cc`) and the persistent
compile cache (:mod:`~aruntime.compile.cache`)."""

from aruntime.compile.cache import CacheInfo, cache_clear, cache_info
from aruntime.compile.compiler import Compiler, check_source

__all__ = ["CacheInfo", "Compiler", "cache_clear", "cache_info", "check_source"]
