"""The eager submission path in C: ``submit.c``, a CPython extension module built like the core.

Submitting an op in Python costs several microseconds on the event loop's thread (the checks, the op object,
the hazard logs, packing the arguments and records, a ctypes call). ``submit.c`` does the same for the common op
(one kernel or copy that the worker runs without Python, with no hold and normal priority, straight on a device
or through a :class:`~aruntime.scheduler.Scheduler`, recording its range and flows where a profile records) with
the same rules:
``launch`` and ``copy`` from :meth:`BaseDevice.launch <aruntime.device.base.BaseDevice.launch>`, ``copyin`` and
``copyout`` (a kernel whose program has a launch plan, see :attr:`Program._plan
<aruntime.device.program.Program>`; plain buffers of numbers), ``submit`` from
:meth:`BaseDevice._submit <aruntime.device.base.BaseDevice._submit>` for the other op methods (a scheduler's op
that waits for another queue is pended in the core there too, as ``NativeEngine.pend`` does), ``enqueue`` from
``NativeEngine._enqueue`` for an op handed on later, ``retire`` from ``NativeEngine.retire``, and a
:class:`~aruntime.scheduler.Scheduler`'s own (``sched_launch`` and ``sched_copy`` from its op methods, past the
device's, ``retire_window`` for the done ops of its window). Anything else (an
argument to check and refuse, a view not yet bound, a program without a plan) returns None before any side
effect and takes the Python path, which stays the reference; so does every op where the extension cannot be
built.

The locks it takes (a native engine's submission and retire locks, a scheduler's) are its own ``Lock`` (see
:func:`new_lock`): one it takes and lets go of without a method call, which Python code holds with ``with`` as a
:class:`threading.Lock`; a busy one is waited for with the GIL let go (signal handlers run meanwhile), without a
timeout.

It is built at first use with the system C compiler against the running interpreter's headers (``Python.h``;
on Debian and Ubuntu the ``python3-dev`` package), through the compile cache like the core, under a key that
names the interpreter's version and ABI. Where it cannot be built or loaded (no headers, no compiler) the Python
path serves every op and :data:`unavailable` says why; ``ARUNTIME_FAST_SUBMIT=0`` gives the engines opened
while it is set the Python path.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
import threading
from collections.abc import Callable, Sized
from contextlib import AbstractContextManager
from importlib import resources
from typing import Any

from aruntime.compile import Compiler, cc
from aruntime.helpers import getenv

FLAGS = ("-O2", "-fPIC", "-shared")
Fast = Any
"""The built module: ``submit(engine, name, body, reads, writes, keep, result, window)``, ``launch(dev, prog, bufs,
vals, outs, hold, window, priority)`` and ``copy(dev, buf, host, out, hold, window, priority)`` (``out`` True: a
copy-out into ``host``, or into a new result where it is None; False: a copy-in from ``host``), each returning the
op, ``enqueue(engine, cmds, op)`` and ``retire(engine)``, returning True; each None where the Python path must
take it (see ``submit.c``); ``sched_launch(sched, prog, bufs, vals, outs, priority)`` and ``sched_copy(sched,
buf, host, out, priority)``, a :class:`~aruntime.scheduler.Scheduler`'s op methods without the device's Python
method in between (None likewise); ``retire_window(inflight, failed)``, the scheduler's retiring of its
window; and ``capsule_destructor(delete)``, the DLPack capsules' destructor (see
:func:`aruntime.memory.dlpack.use_capsule_destructor`)."""

unavailable: str | None = None
"""Why the C submission path could not be built (None once it was, or before it was first asked for)."""
_module: Fast = None
_built = False
_lock = threading.Lock()


def _include() -> str:
    return sysconfig.get_paths()["include"]


class _ExtensionCompiler(Compiler):
    """The system C compiler building ``submit.c`` for the running interpreter."""

    @property
    def cachekey(self) -> str | None:
        """``NATIVE_submit_<hash of the compiler, its flags, and the interpreter's version, ABI and headers>``."""
        path = cc.compiler_path()
        if path is None:
            return None
        abi = sysconfig.get_config_var("EXT_SUFFIX") or ""
        version = cc.compiler_version(path)
        return self.make_cachekey("NATIVE_submit", path, version, *FLAGS, sys.version, abi, _include())

    def compile(self, src: str) -> bytes:
        return cc.build(src, (*FLAGS, f"-I{_include()}"))


def _build(lib: ctypes.CDLL, native_type: type, new_cells: Callable[[], Sized], name_id: Callable[[str], int]) -> Fast:
    from aruntime.engine.dispatch import _record_deps, dispatch_when_ready
    from aruntime.engine.kernel import _NATIVE_COPIES, _NOTHING, Entry
    from aruntime.engine.ops import ABANDONED, HELD, WAIT, Op, _later_lock, handed_over
    from aruntime.events import op_ids, recorder
    from aruntime.memory import Buffer, dlpack, hazards, typed, zeroed

    src = resources.files(__package__).joinpath("submit.c").read_text()
    name = f"{__package__}._submit"
    module = _ExtensionCompiler().compile_cached(src, load=lambda binary: cc.load_module(binary, name))
    functions = (lib.ar_submit, lib.ar_pend_new, lib.ar_pend_on_sig, lib.ar_pend_on_pend, lib.ar_pend_go)
    addresses = (ctypes.cast(f, ctypes.c_void_p).value for f in functions)
    logs_lock = module.Lock()
    module.init(
        *addresses, HELD, ABANDONED, len(new_cells()), Op, native_type, Entry, _NOTHING, _NATIVE_COPIES, op_ids,
        WAIT, Buffer, recorder, dispatch_when_ready, zeroed, typed, new_cells, name_id,
        _record_deps, _later_lock, handed_over, logs_lock,
    )  # fmt: skip
    hazards.use_lock(logs_lock, module.held_here)  # the C path takes it without a call
    dlpack.use_capsule_destructor(module.capsule_destructor)
    return module


def new_lock() -> AbstractContextManager[bool]:
    """A lock for what the C submission path takes: its ``Lock`` once the module is built (taken and let go of
    in C without a call; in Python, ``with`` it as with :class:`threading.Lock`: its ``acquire()`` takes no
    arguments and always waits, running signal handlers meanwhile), else a :class:`hazards.SubmissionLock
    <aruntime.memory.hazards.SubmissionLock>`. Either way :func:`hazards.in_submission
    <aruntime.memory.hazards.in_submission>` sees the thread that holds it."""
    from aruntime.memory.hazards import SubmissionLock

    return SubmissionLock() if _module is None else _module.Lock()


def loaded() -> Fast:
    """The C submission path if it has been built (by the first native engine opened), else None."""
    return _module


def load(lib: ctypes.CDLL, native_type: type, new_cells: Callable[[], Sized], name_id: Callable[[str], int]) -> Fast:
    """The C submission path for native engines of ``native_type`` over the core ``lib`` (``new_cells``: what
    makes the array of cells their pending ops' values are written into; ``name_id``: the number a recorded
    range's name goes by), built on the first call; None where it cannot be had (see :data:`unavailable`) or
    ``ARUNTIME_FAST_SUBMIT=0`` switches it off."""
    global _module, _built, unavailable
    if not getenv("FAST_SUBMIT", 1, minimum=0, maximum=1):
        return None
    if not _built:
        with _lock:
            if not _built:
                try:
                    _module = _build(lib, native_type, new_cells, name_id)
                except Exception as exc:  # no headers, no compiler, a failed build or load
                    unavailable = f"the C submission path could not be built: {exc}"
                _built = True
    return _module
