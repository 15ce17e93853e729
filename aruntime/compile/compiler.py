"""The compiler base class: ``compile(src) -> bytes`` plus a cached compile.

A cached compile looks the source up in the persistent compile cache
(:mod:`aruntime.compile.cache`), in the table named by the compiler's
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
import warnings
from collections.abc import Callable
from typing import TypeVar, overload

from aruntime.compile.cache import cache_delete, cache_get, cache_path, cache_put
from aruntime.errors import CacheError, CompileError
from aruntime.helpers import getenv

T = TypeVar("T")

__all__ = ["Compiler", "check_source"]

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

    @overload
    def compile_cached(self, src: str) -> bytes: ...

    @overload
    def compile_cached(self, src: str, load: Callable[[bytes], T]) -> T: ...

    def compile_cached(self, src: str, load: Callable[[bytes], T] | None = None) -> bytes | T:
        """:meth:`compile` through the persistent cache, keyed by ``cachekey`` and the source's SHA-256.

        Without a ``cachekey`` or with ``ARUNTIME_DISABLE_COMPILER_CACHE=1``
        it just compiles. A hit returns the stored bytes (their checksum verified by the
        cache); a miss compiles and stores the result, or raises
        :class:`~aruntime.errors.CacheError` under ``ARUNTIME_ASSERT_COMPILE=1``. A failed
        compile stores nothing. An empty source, or one that is not UTF-8 text
        (a lone surrogate), is a :class:`~aruntime.errors.CompileError`.

        With ``load`` (e.g. what dlopens the binary) it returns ``load(binary)``.
        A cached binary whose ``load`` raises ``OSError`` is damaged: it is
        dropped from the cache with a warning naming the cache file, rebuilt and
        loaded once more; a fresh binary is stored only once it has loaded.
        """
        check_source(src)
        if getenv("DISABLE_COMPILER_CACHE", 0, minimum=0, maximum=1) or (table := self.cachekey) is None:
            binary = self.compile(src)
            return binary if load is None else load(binary)
        key = hashlib.sha256(src.encode()).hexdigest()
        hit = cache_get(table, key)
        if hit is not None:
            if load is None:
                return hit
            try:
                return load(hit)
            except OSError as exc:
                cache_delete(table, key)
                warnings.warn(
                    f"compile cache {cache_path()}: the binary stored for source sha256 {key} (compiler key "
                    f"{table!r}) failed to load ({exc}); dropped it and compiling again",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if getenv("ASSERT_COMPILE", 0, minimum=0, maximum=1):
            raise CacheError(
                f"compile cache miss for source sha256 {key} with compiler key {table!r} "
                "while ARUNTIME_ASSERT_COMPILE=1"
            )
        binary = memoryview(self.compile(src)).tobytes()
        loaded = binary if load is None else load(binary)
        cache_put(table, key, binary)
        return loaded


def check_source(src: str) -> None:
    """Raise :class:`~aruntime.errors.CompileError` naming the problem if ``src`` is empty (or only
    whitespace) or is not encodable as UTF-8 (a lone surrogate)."""
    if not src.strip():
        raise CompileError("kernel source is empty")
    try:
        src.encode()
    except UnicodeEncodeError as exc:
        raise CompileError(
            f"kernel source is not valid UTF-8 text: {exc.reason} {src[exc.start]!r} at index {exc.start}"
        ) from None
