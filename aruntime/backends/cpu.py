"""The CPU device: C kernels built by the system C compiler, run on host memory.

A kernel is a C function that returns ``void``, or an ``int`` status where non-zero means it failed (its op
then fails with :class:`~aruntime.engine.KernelError` carrying the status). Its parameters are pointers,
integers (``int64_t``, ``int``, ``uint32_t``, ``size_t``, ``char``, ...) and ``float``/``double``. At compile
time the kernel's definition is read from the source; a name that is not a function defined there is a
:class:`~aruntime.errors.CompileError`. :meth:`BaseDevice.launch` fills its pointer parameters with the
buffers, in order, and its other parameters with ``vals``, in order: ``launch(prog, out, x, vals=(n, 2.0))``
runs ``void kernel(float *out, const float *x, int64_t n, double scale)``. Buffer and scalar counts must match
the definition; an int given for a floating-point parameter is converted, a float given for an integer one is
refused, and an integer must fit its parameter's type. What the kernel does with its pointers is not checked.

A CPU device's queues run on the shared workers (one native thread per CPU the process may use, serving every
CPU and NULL queue in the order they get work; ``ARUNTIME_WORKERS``, see :func:`aruntime.engine.workers_shared`)
unless ``ARUNTIME_WORKERS=queue`` or ``ARUNTIME_CPU_AFFINITY`` gives each a thread of its own. Where those
threads run is ``ARUNTIME_CPU_AFFINITY``: ``off`` (the default) leaves them wherever the system puts them;
``auto`` runs both queues of a device on one CPU, so that a kernel reads what
the copy before it wrote from that CPU's cache, spreading devices over the CPUs the process may use
(``os.sched_getaffinity``): ``CPU:N`` on the N-th, wrapping around when there are more devices than CPUs; a
comma-separated list of CPU numbers spreads them over those. :attr:`CPUDevice.cpu` reads or moves one
device's queues. Pinning is not the default because on a machine with few cores it costs more than the cache
gains (docs/benchmarks.md has the figures): the event loop and the other queues then cannot move to a CPU
that is free.

Kernels are built with ``-O3 -march=native`` (the binary is cached under this machine's processor, so a cache
shared between machines never loads code the processor cannot run); ``CPUDevice.flags`` (or
``ARUNTIME_CPU_FLAGS``, split on spaces) sets others.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aruntime.compile import Compiler, cc
from aruntime.device import BaseDevice, Bound, Program
from aruntime.engine import CopyFn, Engine, Entry
from aruntime.errors import BufferUsageError, CompileError
from aruntime.helpers import getenv
from aruntime.memory import HostAllocator, pin

FLAGS = ("-O3", "-march=native")
"""The default optimisation flags of CPU kernels."""
_BUILD = ("-fPIC", "-shared", "-Wl,-Bsymbolic")  # a kernel named like a libc function calls itself
_ENTRY = "__aruntime_entry_"
_SIGNATURE = "__aruntime_signature_"

# (signed, bits) of integer parameter types, by their words; LP64
_INT_TYPES: dict[str, tuple[bool, int]] = {
    "char": (True, 8),
    "signed char": (True, 8),
    "unsigned char": (False, 8),
    "short": (True, 16),
    "unsigned short": (False, 16),
    "int": (True, 32),
    "signed": (True, 32),
    "unsigned": (False, 32),
    "unsigned int": (False, 32),
    "long": (True, 64),
    "unsigned long": (False, 64),
    "long long": (True, 64),
    "unsigned long long": (False, 64),
    "_Bool": (False, 1),
    "bool": (False, 1),
    "size_t": (False, 64),
    "ssize_t": (True, 64),
    "ptrdiff_t": (True, 64),
    "intptr_t": (True, 64),
    "uintptr_t": (False, 64),
    **{f"int{n}_t": (True, n) for n in (8, 16, 32, 64)},
    **{f"uint{n}_t": (False, n) for n in (8, 16, 32, 64)},
}
_QUALIFIERS = {"const", "volatile", "restrict", "__restrict", "__restrict__", "register"}
_IDENT = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class Param:
    """One kernel parameter: ``kind`` is ``p`` (pointer), ``f`` (floating point), ``i`` or ``u`` (signed or
    unsigned integer of ``bits``); ``text`` is its declaration as written."""

    kind: str
    bits: int
    text: str


@dataclass(frozen=True)
class Signature:
    """A kernel's parameters and whether it returns an ``int`` status."""

    params: tuple[Param, ...]
    status: bool

    def describe(self, kinds: str) -> str:
        """The declarations of the parameters whose kind is in ``kinds``."""
        return ", ".join(p.text for p in self.params if p.kind in kinds) or "none"


def _strip(src: str) -> str:
    """The source without comments, preprocessor lines and string literals (their length kept)."""
    src = re.sub(r"/\*.*?\*/|//[^\n]*", lambda m: re.sub(r"[^\n]", " ", m.group()), src, flags=re.S)
    src = re.sub(r'"(?:\\.|[^"\\\n])*"', lambda m: " " * len(m.group()), src)
    return re.sub(r"(?m)^[ \t]*#.*$", "", src)


def _param(text: str, index: int, name: str) -> Param:
    text = " ".join(text.split())
    where = f"parameter {index} ({text!r}) of kernel {name!r}"
    if "(" in text:
        raise CompileError(f"{where}: function pointer parameters are not supported")
    if "*" in text or "[" in text:
        return Param("p", 64, text)
    words = [w for w in _IDENT.findall(text) if w not in _QUALIFIERS]
    if len(words) > 1 and words[-1] not in _INT_TYPES and words[-1] not in ("float", "double"):
        words = words[:-1]  # the parameter's name
    if "int" in words and any(w in ("short", "long", "unsigned", "signed") for w in words):
        words = [w for w in words if w != "int"]  # "unsigned int" is "unsigned", "long int" is "long"
    base = " ".join(words) or "int"
    if base in ("float", "double"):
        return Param("f", 64 if base == "double" else 32, text)
    found = _INT_TYPES.get(base)
    if found is None:
        raise CompileError(
            f"{where}: only pointers, integer types and float/double can be kernel parameters, not {base!r}"
        )
    signed, bits = found
    return Param("i" if signed else "u", bits, text)


def parse_signature(src: str, name: str) -> Signature:
    """The signature of the C function ``name`` defined in ``src``; :class:`CompileError` if there is none."""
    code = _strip(src)
    for match in re.finditer(rf"(?<![\w.]){re.escape(name)}\s*\(", code):
        depth, end = 1, match.end()
        while end < len(code) and depth:
            depth += {"(": 1, ")": -1}.get(code[end], 0)
            end += 1
        rest = code[end:].lstrip()
        while rest.startswith("__attribute__"):  # attributes between the parameters and the body
            rest = rest[rest.index(")") + 2 :].lstrip() if ")" in rest else ""
        if not rest.startswith("{"):
            continue  # a declaration or a call: not the definition
        head = code[: match.start()]
        cut = max(head.rfind(";"), head.rfind("}"), head.rfind("{"))
        ret = [w for w in _IDENT.findall(re.sub(r"__attribute__\s*\(\(.*?\)\)", "", head[cut + 1 :])) if w]
        ret = [w for w in ret if w not in ("static", "inline", "extern", "__inline", "__inline__", *_QUALIFIERS)]
        returns = " ".join(ret)
        if "*" in head[cut + 1 :] or not ret:
            raise CompileError(f"kernel {name!r} must return void or int, not {head[cut + 1 :].strip()!r}")
        if returns != "void" and _INT_TYPES.get(returns) is None:
            raise CompileError(f"kernel {name!r} must return void or an integer status, not {returns!r}")
        inner = code[match.end() : end - 1].strip()
        if inner in ("", "void"):
            return Signature((), returns != "void")
        parts = inner.split(",")
        if any(p.strip() == "..." for p in parts):
            raise CompileError(f"kernel {name!r} is variadic; kernels take a fixed list of parameters")
        return Signature(tuple(_param(p, i, name) for i, p in enumerate(parts)), returns != "void")
    if re.search(rf"(?<![\w.]){re.escape(name)}\b", code):
        raise CompileError(f"{name!r} is not a function defined in the source (kernels are C function definitions)")
    raise CompileError(f"the source defines no function named {name!r}")


def _entry_source(name: str, sig: Signature) -> str:
    """C for the kernel's entry (``int entry(const unsigned long long *args)``) and its signature string."""
    args = []
    for i, p in enumerate(sig.params):
        if p.kind == "p":
            args.append(f"(void *)(__UINTPTR_TYPE__)a[{i}]")
        elif p.kind == "f":
            args.append(f"__aruntime_double(a + {i})")
        else:
            args.append(f"a[{i}]")  # the C conversion to the parameter's type (checked to fit before)
    call = f"{name}({', '.join(args)})"
    body = f"return (int){call};" if sig.status else f"{call}; return 0;"
    described = json.dumps({"status": sig.status, "params": [[p.kind, p.bits, p.text] for p in sig.params]})
    return (
        '\n#line 1 "aruntime entry"\n'
        "static inline double __aruntime_double(const unsigned long long *p) "
        "{ double d; __builtin_memcpy(&d, p, 8); return d; }\n"
        f"int {_ENTRY}{name}(const unsigned long long *a) {{ {body} }}\n"
        f"const char {_SIGNATURE}{name}[] = {json.dumps(described)};\n"
    )


class CCompiler(Compiler):
    """The system C compiler (``CC`` in the environment, default ``cc``) building a shared library."""

    def __init__(self, flags: Sequence[str] = FLAGS) -> None:
        super().__init__(None)
        self.flags = (*flags, *_BUILD)
        self._key: str | None = None
        self._key_lock = threading.Lock()

    @property
    def cachekey(self) -> str | None:
        """``CPU_<hash of the compiler's path and --version output, the flags and this machine's processor>``."""
        with self._key_lock:
            if self._key is None:
                path = cc.compiler_path()
                if path is None:
                    return None
                self._key = self.make_cachekey("CPU", path, cc.compiler_version(path), cc.host_cpu(), *self.flags)
            return self._key

    def compile(self, src: str) -> bytes:
        return cc.build(src, self.flags)


_PACK = {"p": "Q", "f": "d"}


class CPUProgram(Program):
    """A kernel loaded with dlopen from the compiled shared library, called through its generated entry."""

    def __init__(self, device: BaseDevice, name: str, lib: bytes, outs: Sequence[int] | None = None) -> None:
        super().__init__(device, name, lib, outs)
        self._lib = cc.load(lib)  # an OSError: a damaged binary, which the compile cache drops and rebuilds
        try:
            entry = self._lib[_ENTRY + name]
            described = ctypes.c_char_p.in_dll(self._lib, _SIGNATURE + name)
        except (AttributeError, ValueError):
            raise CompileError(
                f"the compiled library has no kernel {name!r} (compile it with CPUDevice.compile)"
            ) from None
        info = json.loads(ctypes.string_at(ctypes.addressof(described)).decode())
        self.signature = Signature(tuple(Param(k, b, t) for k, b, t in info["params"]), info["status"])
        """The kernel's parameters, read from its definition."""
        self._entry = Entry(name, ctypes.cast(entry, ctypes.c_void_p).value or 0)
        params = self.signature.params
        self._pointers = sum(p.kind == "p" for p in params)
        self._scalars = [p for p in params if p.kind != "p"]
        self._format = "=" + "".join(_PACK.get(p.kind, "q" if p.kind == "i" else "Q") for p in params)
        self._order = [p.kind == "p" for p in params]
        if type(self).bind is CPUProgram.bind:  # the native path packs the words as bind does
            self._plan = (self._entry, bytes(b for p in params for b in (ord(p.kind), p.bits)))

    @property
    def entry(self) -> Entry:
        """The kernel's generated entry point, which a launch calls."""
        return self._entry

    def bind(self, addresses: Sequence[int], vals: Sequence[int | float]) -> Bound:
        """The kernel's entry and its arguments packed in one buffer: each pointer parameter gets the next
        buffer address, each other parameter the next scalar, converted and checked against its type."""
        holder, address, _ = pin(struct.pack(self._format, *self._words(addresses, vals)))
        return self._entry, (holder, address)

    def _words(self, addresses: Sequence[int], vals: Sequence[int | float]) -> list[Any]:
        """The kernel's arguments in parameter order, as ``_format`` packs them, checked (see :meth:`bind`)."""
        if len(addresses) != self._pointers:
            raise BufferUsageError(
                f"launch {self.name}: the kernel takes {self._pointers} buffer(s)"
                f" ({self.signature.describe('p')}), got {len(addresses)}"
            )
        scalars = self._scalars
        if len(vals) != len(scalars):
            raise TypeError(
                f"launch {self.name}: the kernel takes {len(scalars)} scalar(s)"
                f" ({self.signature.describe('fiu')}), got {len(vals)}"
            )
        words: list[Any] = []
        ai = vi = 0
        for is_pointer in self._order:
            if is_pointer:
                words.append(addresses[ai])
                ai += 1
                continue
            param, val = scalars[vi], vals[vi]
            if param.kind == "f":
                words.append(float(val))
            elif isinstance(val, float):
                raise TypeError(
                    f"launch {self.name}: scalar {vi} is a float ({val!r}) but {param.text!r} is an integer"
                )
            else:
                bits = param.bits
                low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if param.kind == "i" else (0, 1 << bits)
                if not low <= val < high:
                    raise ValueError(f"launch {self.name}: scalar {vi} = {val} does not fit {param.text!r}")
                words.append(val)
            vi += 1
        return words


def default_cpu(name: str) -> int | None:
    """The CPU the queues of the CPU device ``name`` run on by default (``ARUNTIME_CPU_AFFINITY``, see the
    module docstring); None: unpinned."""
    setting = getenv("CPU_AFFINITY", "off").strip().lower()
    if setting == "off" or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    if setting == "auto":
        cpus = sorted(allowed)
    else:
        try:
            cpus = [int(part) for part in setting.split(",")]
        except ValueError:
            cpus = []
        if not cpus or not set(cpus) <= allowed:
            raise ValueError(
                f"environment variable ARUNTIME_CPU_AFFINITY={setting!r}: expected 'auto', 'off' or a "
                f"comma-separated list of the CPUs this process may use ({sorted(allowed)})"
            )
    return cpus[int(name.partition(":")[2] or 0) % len(cpus)]


class CPUDevice(BaseDevice):
    """Host memory, C kernels, a compute and a copy engine."""

    kind = "CPU"
    program_type = CPUProgram
    allocator_type = HostAllocator
    compiler_type = CCompiler
    copy_fn: CopyFn = staticmethod(ctypes.memmove)
    _cpu: int | None = None

    def __init__(self, name: str) -> None:
        cpu = default_cpu(name)  # a bad setting is refused before any thread starts
        self._pinned = cpu is not None
        super().__init__(name)
        flags = getenv("CPU_FLAGS", "")
        if flags:
            self.flags = tuple(flags.split())
        self._cpu: int | None = None
        self.cpu = cpu

    def _shares_workers(self) -> bool:
        return not self._pinned  # pinned queues have worker threads of their own

    @property
    def cpu(self) -> int | None:
        """The CPU this device's queues run on (None: wherever the system puts them). Setting it moves them;
        a CPU the process may not use is a ``ValueError``, and queues on the shared workers (no thread of their
        own to move) a :class:`~aruntime.errors.DeviceError`. Default: see ``ARUNTIME_CPU_AFFINITY``."""
        return self._cpu

    @cpu.setter
    def cpu(self, cpu: int | None) -> None:
        if cpu is None and self._cpu is None:
            return
        allowed = os.sched_getaffinity(0)
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu not in allowed):
            raise ValueError(
                f"{self.name}: cpu must be one of the CPUs this process may use {sorted(allowed)}, not {cpu!r}"
            )
        self.check_usable("cpu")
        moved: list[Engine] = []
        try:
            for engine in self.engines:
                engine.pin(allowed if cpu is None else (cpu,))
                moved.append(engine)
        except BaseException:
            for engine in moved:  # every queue stays where it was
                engine.pin(allowed if self._cpu is None else (self._cpu,))
            raise
        self._cpu = cpu

    @property
    def flags(self) -> tuple[str, ...]:
        """The compiler flags kernels of this device are built with (default :data:`FLAGS`)."""
        assert isinstance(self.compiler, CCompiler)
        return self.compiler.flags[: -len(_BUILD)]

    @flags.setter
    def flags(self, flags: Sequence[str]) -> None:
        if isinstance(flags, str) or not all(isinstance(f, str) for f in flags):
            raise TypeError(f"{self.name}: flags must be a sequence of str, got {flags!r}")
        self.compiler = CCompiler(tuple(flags))

    def _kernel_source(self, src: str, name: str) -> str:
        """``src`` with the entry of kernel ``name`` added (see the module docstring for what a kernel may be).

        Where the definition cannot be read, the source is compiled with an ``#error`` saying why, so the
        compiler's own messages about the source (a syntax error) come with it in the :class:`CompileError`.
        """
        try:
            return src + _entry_source(name, parse_signature(src, name))
        except CompileError as exc:
            reason = " ".join(str(exc).split()).replace('"', "'")
            return f'{src}\n#line 1 "aruntime"\n#error "{reason}"\n'


device_class = CPUDevice
"""The class the registry opens for this kind."""
