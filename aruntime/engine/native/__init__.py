"""The native core: ``core.c`` built with the system C compiler into the compile cache, loaded with ctypes.

The core is built at first use (about half a second) through the cached compile of
:class:`~aruntime.compile.compiler.Compiler`, stored in the compile cache under the compiler's identity, the flags and
the digest of its source, and loaded from there by every later process. A stored core that fails to load (a
damaged or truncated binary, a stale version) is dropped and rebuilt, ``ARUNTIME_DISABLE_COMPILER_CACHE=1``
builds it without touching the cache, and where the cache is unusable it is built without it, with a warning.

``ARUNTIME_ENGINE`` chooses the engine of every queue, once per process: ``native`` (the core; an error if it
cannot be built), ``python`` (the :class:`~aruntime.engine.thread.ThreadEngine` fallback, everything in
Python), or unset: native where the core builds, else Python with a ``RuntimeWarning`` and the reason kept in
:data:`unavailable`. Any other value is a ``ValueError``; a value changed after the choice is ignored, with a
``RuntimeWarning``.

The core's guarded copy (:func:`copier`) serves the Python side's copies too, on either engine.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from collections.abc import Callable
from ctypes import c_int, c_int64, c_size_t, c_uint32, c_uint64, c_void_p
from importlib import resources

from aruntime.compile import Compiler, cc
from aruntime.errors import CacheError, DeviceError
from aruntime.helpers import getenv

FLAGS = ("-O2", "-pthread", "-fPIC", "-shared")
VERSION = 5
"""The core's ABI version (``ar_version()``); a mismatch means a stale build."""

unavailable: str | None = None
"""Why the native engine is not in use (None while it is, or before it was first asked for)."""
_lib: ctypes.CDLL | None = None
_decided = False
_chosen_by: str | None = None  # the ARUNTIME_ENGINE value the engine was chosen with
_warned_change = False
_lock = threading.Lock()
_copier: Callable[[int, int, int], int] | None = None
_copier_decided = False


def _given() -> str:
    return getenv("ENGINE", "").strip().lower()


def mode() -> str:
    """``ARUNTIME_ENGINE`` as given: ``native``, ``python`` or ``""`` (choose); any other value is a
    ``ValueError``."""
    value = _given()
    if value not in ("", "native", "python"):
        raise ValueError(f"environment variable ARUNTIME_ENGINE={value!r}: expected 'native' or 'python'")
    return value


class _CoreCompiler(Compiler):
    """The system C compiler building the core with :data:`FLAGS`."""

    @property
    def cachekey(self) -> str | None:
        """``NATIVE_core_<hash of the compiler's path and --version output and the flags>``; None without a
        compiler."""
        path = cc.compiler_path()
        return None if path is None else self.make_cachekey("NATIVE_core", path, cc.compiler_version(path), *FLAGS)

    def compile(self, src: str) -> bytes:
        return cc.build(src, FLAGS)


def _load(binary: bytes) -> ctypes.CDLL:
    """The core loaded from ``binary``; ``OSError`` if it does not load or is not this :data:`VERSION`."""
    lib = cc.load(binary)
    if lib.ar_version() != VERSION:
        raise OSError(f"the native core reports version {lib.ar_version()}, expected {VERSION}")
    return lib


def _build() -> ctypes.CDLL:
    src = resources.files(__package__).joinpath("core.c").read_text()
    compiler = _CoreCompiler()
    try:
        return compiler.compile_cached(src, load=_load)
    except CacheError as exc:
        if getenv("ASSERT_COMPILE", 0, minimum=0, maximum=1):
            raise
        warnings.warn(f"the native core is built without the compile cache: {exc}", RuntimeWarning, stacklevel=5)
        return _load(compiler.compile(src))


def _declare(lib: ctypes.CDLL) -> None:
    p, u64, i64, u32 = c_void_p, c_uint64, c_int64, c_uint32
    declared: tuple[tuple[str, object, list[object] | None], ...] = (
        ("ar_sig_new", p, [u64]),
        ("ar_sig_free", None, [p]),
        ("ar_sig_set", c_int, [p, u64]),
        ("ar_sig_arm", c_int, [p, c_int, u64]),
        ("ar_sig_wait", c_int, [p, u64, i64]),
        ("ar_notifier_new", c_int, [c_int, c_int]),
        ("ar_notifier_free", None, [c_int]),
        ("ar_notifier_ack", None, [c_int]),
        ("ar_notify", None, [c_int]),
        ("ar_engine_new", p, [p, i64, c_int]),
        ("ar_submit", u64, None),  # (engine, records, count): no argtypes, the fastest ctypes call
        ("ar_pend_new", p, [p, ctypes.c_char_p, u32, p]),
        ("ar_pend_on_sig", None, [p, p, u64]),
        ("ar_pend_on_pend", None, [p, p, p, p, c_int]),
        ("ar_pend_go", None, [p]),
        ("ar_pend_notify", c_int, [p, p, c_int]),
        ("ar_notifier_handed", c_size_t, [c_int, p, c_size_t]),
        ("ar_take_failures", c_size_t, [p, p, c_size_t]),
        ("ar_take_ranges", c_size_t, [p, p, c_size_t]),
        ("ar_py_next", c_int, [p, ctypes.POINTER(u64), ctypes.POINTER(u32)]),
        ("ar_py_done", None, [p, c_int]),
        ("ar_py_stop", None, [p]),
        ("ar_engine_join", None, [p]),
        ("ar_engine_free", None, [p]),
        ("ar_engine_field", c_size_t, [c_int]),
        ("ar_engine_metrics", None, [p, c_int]),
        ("ar_engine_yield_to", None, [p, p]),
        ("ar_now_ns", i64, []),
        ("ar_completion_new", p, [p, u64]),
        ("ar_copy", c_int, [p, p, c_size_t]),
    )
    # the calls that cannot block keep the GIL: releasing it costs more than they take, and getting it back
    # can wait behind another thread for a whole switch interval
    keep_gil = ctypes.PyDLL(lib._name, handle=lib._handle)
    blocking = {"ar_sig_wait", "ar_py_next", "ar_engine_join", "ar_engine_free", "ar_copy"}
    for name, res, args in declared:
        fn = getattr(lib if name in blocking else keep_gil, name)
        fn.restype = res
        if args is not None:
            fn.argtypes = args
        setattr(lib, name, fn)


def _choose() -> None:
    """Choose the engine (once, under the lock): load the core unless ``ARUNTIME_ENGINE=python``."""
    global _lib, _decided, _chosen_by, unavailable
    chosen = mode()
    if chosen == "python":
        unavailable = "ARUNTIME_ENGINE=python"
    else:
        try:
            core = _build()
            _declare(core)
            _lib = core
        except Exception as exc:  # no compiler, a failed build or load: the Python engine stays
            if chosen == "native":
                raise DeviceError(f"ARUNTIME_ENGINE=native, but the native core is unavailable: {exc}") from exc
            unavailable = f"the native core could not be built: {exc}"
            warnings.warn(f"aruntime runs on the Python engine: {unavailable}", RuntimeWarning, stacklevel=4)
    _chosen_by = chosen
    _decided = True


def lib() -> ctypes.CDLL | None:
    """The loaded core, or None where the Python engine is in use (see :data:`unavailable`).

    The first call chooses the engine; a later call that finds ``ARUNTIME_ENGINE`` changed since warns, once.
    """
    global _warned_change
    if not _decided:
        with _lock:
            if not _decided:
                _choose()
    given = _given()
    if given != _chosen_by:
        with _lock:
            warn, _warned_change = not _warned_change, True
        if warn:
            warnings.warn(
                f"ARUNTIME_ENGINE changed to {given!r} after the {'python' if _lib is None else 'native'} engine "
                f"was chosen with {_chosen_by!r}; the engine is chosen once per process, so the change is ignored",
                RuntimeWarning,
                stacklevel=2,
            )
    return _lib


def copier() -> Callable[[int, int, int], int] | None:
    """The core's guarded copy, ``ar_copy(dst, src, nbytes)``, or None where there is no core.

    A ``memmove`` that returns 0 once done, or 1 (2) where a page of its source (destination) faulted: a file-backed
    page that is gone, its file truncated under the mapping, which would otherwise kill the process with SIGBUS
    (``core.c``, "guarded copies"). The GIL is let go of while it copies. Where the Python engine runs by choice
    (``ARUNTIME_ENGINE=python``) the core is built (or taken from the compile cache) for it at the first call; where
    it could not be built (no C compiler) there is none, and copies are plain ``memmove`` calls.
    """
    global _copier, _copier_decided
    if _copier_decided:
        return _copier
    core = lib()
    with _lock:
        if not _copier_decided:
            if core is None and _chosen_by == "python":
                try:
                    core = _build()
                    _declare(core)
                except Exception:  # no compiler, a failed build or load: copies stay unguarded
                    core = None
            _copier = None if core is None else core.ar_copy
            _copier_decided = True
    return _copier


def engine_name() -> str:
    """``native`` or ``python``: the engine new queues run on."""
    return "native" if lib() is not None else "python"
