"""The system C compiler: its identity, building shared libraries with it, and loading them.

Used by the native engine core and its submission extension (built once, into the compile cache) and by the CPU
device's kernels.
``CC`` in the environment names the compiler (default ``cc``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Sequence
from types import ModuleType

from aruntime.compile.cache import cache_get, cache_put
from aruntime.errors import CompileError
from aruntime.helpers import getenv

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
        limit = getenv("COMPILE_TIMEOUT", 300.0, minimum=0.001)
        try:
            proc = subprocess.run(
                [cc, *flags, "-x", "c", "-", "-o", out, "-lm"], input=data, capture_output=True, timeout=limit
            )
        except FileNotFoundError:
            raise CompileError(f"C compiler {cc!r} not found; set CC to a C compiler") from None
        except subprocess.TimeoutExpired:  # the compiler was killed
            raise CompileError(f"{cc} did not finish within {limit:g} s (ARUNTIME_COMPILE_TIMEOUT)") from None
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


# per ELF class (EI_CLASS): the header's e_phoff, e_shoff, e_phentsize, e_phnum, e_shentsize, e_shnum and its
# size; a program header's p_type, p_offset, p_filesz and its size
_ELF_LAYOUT = {b"\x01": ("28xII6xHHHH", 52, "II8xI", 32), b"\x02": ("32xQQ6xHHHH", 64, "I4xQ16xQ", 56)}
_ELF_ORDER = {b"\x01": "<", b"\x02": ">"}  # EI_DATA


def _check_elf(lib: bytes) -> None:
    """Raise ``OSError`` naming the damage where ``lib`` is an ELF file whose header, program headers, segments
    or section header table reach past its end (dlopen would map the missing pages: a SIGBUS at first touch).

    Anything that does not start like an ELF file is left to the platform's loader, which reads its header
    before mapping anything.
    """
    if lib[:4] != b"\x7fELF":
        return
    size = len(lib)
    layout, order = _ELF_LAYOUT.get(lib[4:5]), _ELF_ORDER.get(lib[5:6])
    if layout is None or order is None or size < layout[1]:
        raise OSError(f"a damaged shared library: {size} bytes do not hold an ELF header")
    header, _, segment, segment_size = layout
    phoff, shoff, phentsize, phnum, shentsize, shnum = struct.unpack_from(order + header, lib)
    if (phnum and phentsize < segment_size) or phoff + phnum * phentsize > size:
        raise OSError(
            f"a damaged shared library of {size} bytes: its {phnum} program headers of {phentsize} bytes at "
            f"{phoff} are not inside it"
        )
    for i in range(phnum):
        kind, offset, filesz = struct.unpack_from(order + segment, lib, phoff + i * phentsize)
        if offset + filesz > size:
            raise OSError(
                f"a damaged shared library of {size} bytes: segment {i} (type {kind}) holds bytes {offset} to "
                f"{offset + filesz} of the file"
            )
    if shnum and shoff + shnum * shentsize > size:
        raise OSError(
            f"a damaged shared library of {size} bytes: its {shnum} section headers of {shentsize} bytes at "
            f"{shoff} are not inside it"
        )


_loaded: dict[bytes, ctypes.CDLL] = {}
_modules: dict[bytes, ModuleType] = {}


def _written(lib: bytes) -> str:
    """The path of a new private temporary file holding ``lib``, checked first (see :func:`load`)."""
    _check_elf(lib)
    fd, path = tempfile.mkstemp(prefix="aruntime-", suffix=".so", dir=_load_dir())
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(lib)
    except BaseException:
        os.unlink(path)
        raise
    return path


def load(lib: bytes) -> ctypes.CDLL:
    """The shared library ``lib``, loaded with dlopen once per process.

    Programs compiled to the same binary share it (static variables included),
    so compiling a kernel again maps nothing new. dlopen needs a file: the
    library is written to a private temporary file, loaded and unlinked at once.
    Raises ``OSError`` if the loader refuses it, or, before any loading, if it
    is an ELF file whose headers or segments reach past its end (a truncated
    file, which the loader would map and crash on).
    """
    loaded = _loaded.get(lib)
    if loaded is None:
        path = _written(lib)
        try:
            loaded = _loaded.setdefault(lib, ctypes.CDLL(path))
        finally:
            os.unlink(path)
    return loaded


def load_module(lib: bytes, name: str) -> ModuleType:
    """The CPython extension module ``name`` (its init function ``PyInit_<last part of name>``) in the binary
    ``lib``, loaded once per process as :func:`load` loads a library; ``OSError`` where it cannot be (ImportError
    from the loader included)."""
    module = _modules.get(lib)
    if module is None:
        path = _written(lib)
        try:
            loader = importlib.machinery.ExtensionFileLoader(name, path)
            spec = importlib.util.spec_from_file_location(name, path, loader=loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
        except ImportError as exc:
            raise OSError(f"the extension module {name} did not load: {exc}") from exc
        finally:
            os.unlink(path)
        module = _modules.setdefault(lib, module)
    return module
