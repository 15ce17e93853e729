"""The native core: ``core.c`` built with the system C compiler into the compile cache, loaded with ctypes.

The core is built at first use (about half a second), stored in the compile cache under the digest of its
source, the compiler's identity and the flags, and loaded from there by every later process. ``ARUNTIME_ENGINE``
chooses the engine of every queue: ``native`` (the core; an error if it cannot be built), ``python`` (the
:class:`~aruntime.engine.thread.ThreadEngine` fallback, everything in Python), or unset: native where the core
builds, else Python, with the reason kept in :data:`unavailable`.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from ctypes import c_int, c_int64, c_size_t, c_uint32, c_uint64, c_void_p
from importlib import resources

from aruntime.errors import DeviceError
from aruntime.helpers import getenv

FLAGS = ("-O2", "-pthread", "-fPIC", "-shared")
VERSION = 1
"""The core's ABI version (``ar_version()``); a mismatch means a stale build."""
_TABLE = "NATIVE_core"

unavailable: str | None = None
"""Why the native engine is not in use (None while it is, or before it was first asked for)."""
_lib: ctypes.CDLL | None = None
_decided = False
_lock = threading.Lock()


def mode() -> str:
    """``ARUNTIME_ENGINE`` as given: ``native``, ``python`` or ``""`` (choose)."""
    value = getenv("ENGINE", "").strip().lower()
    if value not in ("", "native", "python"):
        raise DeviceError(f"environment variable ARUNTIME_ENGINE={value!r}: expected 'native' or 'python'")
    return value


def _build() -> ctypes.CDLL:
    from aruntime import cc
    from aruntime.compile_cache import cache_get, cache_put

    src = resources.files(__package__).joinpath("core.c").read_text()
    path = cc.compiler_path()
    if path is None:
        raise OSError(f"no C compiler ({cc.compiler()!r} is not on PATH; set CC)")
    key = hashlib.sha256("\0".join((src, path, cc.compiler_version(path), *FLAGS)).encode()).hexdigest()
    binary = cache_get(_TABLE, key)
    if binary is None:
        binary = cc.build(src, FLAGS)
        cache_put(_TABLE, key, binary)
    lib = cc.load(binary)
    if lib.ar_version() != VERSION:
        raise OSError(f"the native core reports version {lib.ar_version()}, expected {VERSION}")
    return lib


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
        ("ar_engine_new", p, [p, i64]),
        ("ar_submit", c_int, None),  # (engine, records, count): no argtypes, the fastest ctypes call
        ("ar_take_failures", c_size_t, [p, p, c_size_t]),
        ("ar_take_ranges", c_size_t, [p, p, c_size_t]),
        ("ar_py_next", c_int, [p, ctypes.POINTER(u64), ctypes.POINTER(u32)]),
        ("ar_py_done", None, [p, c_int]),
        ("ar_py_stop", None, [p]),
        ("ar_engine_join", None, [p]),
        ("ar_engine_free", None, [p]),
        ("ar_engine_field", c_size_t, [c_int]),
        ("ar_now_ns", i64, []),
        ("ar_completion_new", p, [p, u64]),
    )
    # the calls that cannot block keep the GIL: releasing it costs more than they take, and getting it back
    # can wait behind another thread for a whole switch interval
    keep_gil = ctypes.PyDLL(lib._name, handle=lib._handle)
    blocking = {"ar_sig_wait", "ar_py_next", "ar_engine_join", "ar_engine_free"}
    for name, res, args in declared:
        fn = getattr(lib if name in blocking else keep_gil, name)
        fn.restype = res
        if args is not None:
            fn.argtypes = args
        setattr(lib, name, fn)


def lib() -> ctypes.CDLL | None:
    """The loaded core, or None where the Python engine is in use (see :data:`unavailable`)."""
    global _lib, _decided, unavailable
    if _decided:
        return _lib
    with _lock:
        if not _decided:
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
            _decided = True
    return _lib


def engine_name() -> str:
    """``native`` or ``python``: the engine new queues run on."""
    return "native" if lib() is not None else "python"
