"""The system C compiler: its identity, building shared libraries with it, and loading them.

Used by the native engine core (built once, into the compile cache) and by the CPU device's kernels.
``CC`` in the environment names the compiler (default ``cc``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

from aruntime.compile_cache import cache_get, cache_put
from aruntime.errors import CompileError

_VERSIONS_TABLE = "CPU_compiler_versions"


def compiler() -> str:
    """The C compiler command: ``CC`` from the environment, else ``cc``."""
    return os.environ.get("CC") or "cc"


def compiler_path() -> str | None:
    """The resolved path of :func:`compiler`, or None when it is not installed."""
    return shutil.which(compiler())


def compiler_version(path: str) -> str:
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


@functools.cache
def host_cpu() -> str:
    """A digest of this machine's processor model and features: binaries built with ``-march=native`` are
    cached under it, so a cache shared between machines never loads code the processor cannot run."""
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.partition(":")[0].strip()
                if key in ("model name", "flags", "Features", "CPU part"):
                    ident += line
                if line.strip() == "":  # the first processor describes the others
                    break
    except OSError:
        ident += platform.processor()
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def build(src: str, flags: Sequence[str]) -> bytes:
    """Compile C ``src`` into a shared library with ``flags``; raise :class:`CompileError` with the compiler's
    message if it fails or is missing."""
    cc = compiler()
    try:
        data = src.encode()
    except UnicodeEncodeError as exc:
        raise CompileError(f"the C source is not valid text: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="aruntime-cc-") as tmp:
        out = os.path.join(tmp, "lib.so")
        try:
            proc = subprocess.run([cc, *flags, "-x", "c", "-", "-o", out, "-lm"], input=data, capture_output=True)
        except FileNotFoundError:
            raise CompileError(f"C compiler {cc!r} not found; set CC to a C compiler") from None
        if proc.returncode != 0:
            message = proc.stderr.decode(errors="replace").strip()
            raise CompileError(f"{cc} failed with exit code {proc.returncode}:\n{message}")
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


def load(lib: bytes) -> ctypes.CDLL:
    """The shared library ``lib``, loaded with dlopen once per process.

    Programs compiled to the same binary share it (static variables included),
    so compiling a kernel again maps nothing new. dlopen needs a file: the
    library is written to a private temporary file, loaded and unlinked at once.
    Raises ``OSError`` if the loader refuses it.
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
