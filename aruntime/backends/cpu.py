"""The CPU device: C kernels built by the system C compiler, run on host memory.

A kernel is a C function; :meth:`BaseDevice.launch` calls it once with each
buffer as a pointer, then each scalar: Python ints as ``int64_t``, floats as
``double``. For example ``launch(prog, out, x, vals=(n, 2.0))`` calls
``void kernel(void *out, void *x, int64_t n, double scale)``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

from aruntime.allocator import HostAllocator
from aruntime.compile_cache import cache_get, cache_put
from aruntime.compiler import Compiler
from aruntime.device import BaseDevice, Bound, Program
from aruntime.errors import CompileError

FLAGS = ("-O2", "-fPIC", "-shared")
_VERSIONS_TABLE = "CPU_compiler_versions"


def _compiler_version(path: str) -> str:
    """The ``--version`` output of the compiler at ``path``.

    Remembered in the compile cache under the compiler file's identity (real
    path, inode, size and modification time, like ccache's ``mtime`` check), so
    a warm process runs no compiler at all; reinstalling the compiler changes
    that identity and runs ``--version`` again.
    """
    st = os.stat(path)
    ident = f"{os.path.realpath(path)}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    known = cache_get(_VERSIONS_TABLE, ident)
    if known is not None:
        return known.decode()
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    cache_put(_VERSIONS_TABLE, ident, version.encode())
    return version


class CCompiler(Compiler):
    """The system C compiler (``CC`` in the environment, default ``cc``) building a shared library."""

    def __init__(self) -> None:
        super().__init__(None)
        self.cc = os.environ.get("CC", "cc")
        self._key: str | None = None
        self._key_lock = threading.Lock()

    @property
    def cachekey(self) -> str | None:
        """``CPU_<hash of the compiler's path, its --version output and the flags>``."""
        with self._key_lock:
            if self._key is None:
                path = shutil.which(self.cc)
                if path is None:
                    return None
                self._key = self.make_cachekey("CPU", path, _compiler_version(path), *FLAGS)
            return self._key

    def compile(self, src: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="aruntime-cc-") as tmp:
            out = os.path.join(tmp, "kernel.so")
            try:
                proc = subprocess.run(
                    [self.cc, *FLAGS, "-x", "c", "-", "-o", out, "-lm"],
                    input=src.encode(),
                    capture_output=True,
                )
            except FileNotFoundError:
                raise CompileError(f"C compiler {self.cc!r} not found; set CC to a C compiler") from None
            if proc.returncode != 0:
                message = proc.stderr.decode(errors="replace").strip()
                raise CompileError(f"{self.cc} failed with exit code {proc.returncode}:\n{message}")
            with open(out, "rb") as f:
                return f.read()


@functools.cache
def _load_dir() -> str | None:
    """Where libraries are written for dlopen: RAM-backed /dev/shm where it allows that, else the temp directory."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    usable = not st.f_flag & (os.ST_NOEXEC | os.ST_RDONLY) and os.access("/dev/shm", os.W_OK | os.X_OK)
    return "/dev/shm" if usable else None


_loaded: dict[bytes, ctypes.CDLL] = {}


def _load_library(lib: bytes) -> ctypes.CDLL:
    """The shared library ``lib``, loaded with dlopen once per process.

    Programs compiled to the same binary share it (static variables included),
    so compiling a kernel again maps nothing new. dlopen needs a file: the
    library is written to a private temporary file, loaded and unlinked at once.
    """
    loaded = _loaded.get(lib)
    if loaded is None:
        fd, path = tempfile.mkstemp(prefix="aruntime-", suffix=".so", dir=_load_dir())
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(lib)
            loaded = _loaded.setdefault(lib, ctypes.CDLL(path))
        finally:
            os.unlink(path)
    return loaded


class CPUProgram(Program):
    """A kernel loaded with dlopen from the compiled shared library."""

    def __init__(self, device: BaseDevice, name: str, lib: bytes, outs: Sequence[int] | None = None) -> None:
        super().__init__(device, name, lib, outs)
        self._lib = _load_library(lib)
        try:
            self._lib[name]
        except AttributeError:
            raise CompileError(f"the compiled library has no function {name!r}") from None
        self._bound: dict[tuple[Any, ...], Any] = {}  # (buffer count, scalar types) -> the C function typed for them

    def bind(self, addresses: Sequence[int], vals: Sequence[int | float]) -> Bound:
        """The C function itself, typed for this many pointers and these scalars (``int``: int64, ``float``: double).

        Each distinct signature gets its own typed function object, so the
        arguments are plain Python numbers, converted by ctypes in the call.
        """
        key = (len(addresses), *map(type, vals))
        fn = self._bound.get(key)
        if fn is None:
            fn = self._lib[self.name]
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p] * len(addresses) + [
                ctypes.c_double if isinstance(v, float) else ctypes.c_int64 for v in vals
            ]
            self._bound[key] = fn
        return fn, (*addresses, *vals)


class CPUDevice(BaseDevice):
    """Host memory, C kernels, a compute and a copy engine thread."""

    kind = "CPU"
    program_type = CPUProgram
    allocator_type = HostAllocator
    compiler_type = CCompiler
    copy_fn = staticmethod(ctypes.memmove)


device_class = CPUDevice
"""The class the registry opens for this kind."""
