"""The compiler base class: ``compile(src) -> bytes`` plus a cached compile.

A cached compile looks the source up in the persistent compile cache
(:mod:`aruntime.compile_cache`), in the table named by the compiler's
``cachekey``, under the SHA-256 of the source, and stores misses.

Environment, read at every call:

* ``ARUNTIME_DISABLE_COMPILER_CACHE=1``: compile every time, never touching the cache.
* ``ARUNTIME_ASSERT_COMPILE=1``: a cache miss raises :class:`~aruntime.errors.CacheError`
  instead of compiling (proves a warm cache).
* ``ARUNTIME_CACHELEVEL=0``: the cache is off, so every lookup misses.
"""

from __future__ import annotations

import hashlib
import re

from aruntime.compile_cache import cache_get, cache_put
from aruntime.errors import CacheError
from aruntime.helpers import getenv

__all__ = ["Compiler"]

_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_]")


class Compiler:
    """Base class of the compilers: turns a source string into a binary blob.

    A subclass implements :meth:`compile`, raising
    :class:`~aruntime.errors.CompileError` with the compiler's own message (its
    stderr/log) when the source is rejected.

    ``cachekey`` names the cache table of this compiler, or is None to never
    cache. It must identify everything besides the source that changes the
    output: the compiler itself (its path and version, e.g. the output of
    ``cc --version``), the target and every flag. Two compilers whose output
    can differ for one source must have different keys. Build it with
    :meth:`make_cachekey`, e.g.::

        key = Compiler.make_cachekey("clang", path, version_output, *flags)
    """

    def __init__(self, cachekey: str | None = None) -> None:
        """Create a compiler caching under ``cachekey`` (None: no caching)."""
        self._cachekey = cachekey

    @property
    def cachekey(self) -> str | None:
        """The cache table name of this compiler, or None when it does not cache."""
        return self._cachekey

    @classmethod
    def make_cachekey(cls, name: str, *identity: str) -> str:
        """A cache key ``<name>_<hash>`` from a readable name and the identity parts.

        ``identity`` holds everything that determines the compiler's output
        besides the source: e.g. the compiler's path, its ``--version`` output,
        the target and the flags, in a fixed order. They are hashed (SHA-256,
        first 16 hex digits) so the key is short, stable across processes and
        runs, and a valid table name: ``name`` is reduced to ``[A-Za-z0-9_]``.
        """
        safe = _UNSAFE_CHARS.sub("_", name) or "compiler"
        h = hashlib.sha256()
        for part in identity:
            data = part.encode("utf-8", "surrogateescape")
            h.update(len(data).to_bytes(8, "little"))  # length prefix: ("ab","c") != ("a","bc")
            h.update(data)
        return f"{safe}_{h.hexdigest()[:16]}"

    def compile(self, src: str) -> bytes:
        """Compile ``src`` to a binary.

        Raises :class:`~aruntime.errors.CompileError` carrying the compiler's
        message when the source is rejected. The base class raises
        ``NotImplementedError``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement compile()")

    def compile_cached(self, src: str) -> bytes:
        """:meth:`compile` through the persistent cache, keyed by ``cachekey`` and the source's SHA-256.

        Without a ``cachekey`` or with ``ARUNTIME_DISABLE_COMPILER_CACHE=1`` it just
        compiles. A hit returns the stored bytes; a miss compiles and stores the
        result, or raises :class:`~aruntime.errors.CacheError` under
        ``ARUNTIME_ASSERT_COMPILE=1``. A failed compile stores nothing.
        """
        if getenv("DISABLE_COMPILER_CACHE", 0) or (table := self.cachekey) is None:
            return self.compile(src)
        key = hashlib.sha256(src.encode("utf-8", "surrogatepass")).hexdigest()
        hit = cache_get(table, key)
        if hit is not None:
            return hit
        if getenv("ASSERT_COMPILE", 0):
            raise CacheError(
                f"compile cache miss for source sha256 {key} with compiler key {table!r} "
                "while ARUNTIME_ASSERT_COMPILE=1"
            )
        binary = memoryview(self.compile(src)).tobytes()
        cache_put(table, key, binary)
        return binary
