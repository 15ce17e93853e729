"""The SIM device: a simulated accelerator whose copies and kernels take modelled time and no CPU.

It lets scheduling be measured at many devices on a small machine. Its queues, hazards, profiling, graphs and
scheduling are the real ones; only the work is modelled. Each op's worker *sleeps* (``clock_nanosleep`` to an
absolute deadline, in native code without the GIL, on either engine) until the op's modelled time has passed
since it started:

* a copy (copy-in, copy-out, a transfer into or out of a SIM device) costs ``latency + bytes / bandwidth``;
* a kernel costs what its program declares (:attr:`SimProgram.cost`: a fixed number of seconds, or a function
  of its launch values), by default the model's ``kernel`` time.

Its buffers are host memory and its copies really copy, so results can be checked; its kernels are C, built
and bound like CPU kernels (see :mod:`aruntime.backends.cpu`), and run before the op sleeps out the rest of
its time (an empty kernel body takes no CPU at all). In *timing-only* mode copies move no bytes and kernels do
not run: only the modelled time passes (buffers then hold whatever they held).

A SIM device presents its memory as its own, like an accelerator's: transfers between it and host-memory
devices (CPU, DISK) run on the SIM device's copy queue and take modelled time both ways; a transfer between
two SIM devices runs on the source's copy queue; transfers to other accelerator kinds are refused.

The model (:class:`SimModel`) is set per device: ``SimDevice(name, model)``, or ``dev.model = SimModel(...)``
on an opened one, else read from the environment when the device opens:

* ``ARUNTIME_SIM_LATENCY``: seconds each copy costs besides its bytes (default ``10e-6``);
* ``ARUNTIME_SIM_BANDWIDTH``: copy bandwidth in bytes per second (default ``25e9``, a PCIe 4.0 x16 link);
* ``ARUNTIME_SIM_KERNEL``: seconds of a kernel whose program declares no cost (default ``10e-6``);
* ``ARUNTIME_SIM_TIMING_ONLY``: ``1`` for timing-only mode (default ``0``).

Linux adds up to 50 µs of timer slack to every sleep; the SIM workers set theirs to 1 ns, so an op ends within
the system's wake-up latency (a few µs on an idle machine) of its modelled end, never before it.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from aruntime.backends.cpu import CCompiler, CPUDevice, CPUProgram
from aruntime.compile import cc
from aruntime.device import BaseDevice, Bound
from aruntime.engine import COPY, EXEC, Command, Engine, Entry, Op, ThreadEngine, native
from aruntime.engine.native.engine import NativeEngine
from aruntime.errors import DeviceError
from aruntime.helpers import getenv
from aruntime.memory import HostAllocator, pin

LATENCY = 10e-6
"""Default seconds each copy costs besides its bytes."""
BANDWIDTH = 25e9
"""Default copy bandwidth, bytes per second."""
KERNEL = 10e-6
"""Default seconds of a kernel whose program declares no cost."""

_SIM = "__aruntime_sim_"
_HELPERS = r"""
#line 1 "aruntime sim"
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
/* Sleep until ns nanoseconds after start (CLOCK_MONOTONIC), with the thread's timer slack at 1 ns. */
static void __aruntime_sim_until(const struct timespec *start, unsigned long long ns) {
#ifdef PR_SET_TIMERSLACK
  static __thread int slack_set;
  if (!slack_set) { prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL); slack_set = 1; }
#endif
  struct timespec end = *start;
  end.tv_sec += (time_t)(ns / 1000000000ULL);
  end.tv_nsec += (long)(ns % 1000000000ULL);
  if (end.tv_nsec >= 1000000000L) { end.tv_sec += 1; end.tv_nsec -= 1000000000L; }
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &end, NULL) == EINTR) {}
}
"""
_COPY_SOURCE = (
    _HELPERS
    + r"""
/* a: modelled ns, bytes to move (0: timing only), destination, source */
int __aruntime_sim_copy(const unsigned long long *a) {
  struct timespec start;
  clock_gettime(CLOCK_MONOTONIC, &start);
  if (a[1]) memmove((void *)(uintptr_t)a[2], (const void *)(uintptr_t)a[3], (size_t)a[1]);
  __aruntime_sim_until(&start, a[0]);
  return 0;
}
"""
)
_COPY_ARGS = struct.Struct("=QQQQ")


def _kernel_wrapper(name: str) -> str:
    """C for kernel ``name``'s SIM entry: ``a[0]`` modelled ns, ``a[1]`` whether to run the kernel, then the
    kernel's own packed arguments for its CPU entry."""
    return (
        f"int {_SIM}{name}(const unsigned long long *a) {{\n"
        "  struct timespec start;\n"
        "  clock_gettime(CLOCK_MONOTONIC, &start);\n"
        f"  int status = a[1] ? __aruntime_entry_{name}(a + 2) : 0;\n"
        "  __aruntime_sim_until(&start, a[0]);\n"
        "  return status;\n"
        "}\n"
    )


def _seconds(what: str, value: object, positive: bool = False, finite: bool = True) -> float:
    """``value`` as a float if it is a real number >= 0 (> 0 with ``positive``; not infinite with ``finite``),
    else a ValueError naming ``what`` and the value (NaN is refused)."""
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (value > 0 if positive else value >= 0)
        and (not finite or math.isfinite(value))
    ):
        return float(value)
    kind = "a finite number" if finite else "a number"
    raise ValueError(f"SIM model: {what} must be {kind} {'> 0' if positive else '>= 0'}, got {value!r}")


@dataclass(frozen=True)
class SimModel:
    """What a SIM device's ops cost: a copy ``latency + bytes / bandwidth`` seconds, a kernel whose program
    declares nothing ``kernel`` seconds; ``timing_only``: copies move no bytes and kernels do not run.

    Values are checked when the model is made: a bad one is a :class:`ValueError` naming it.
    """

    latency: float = LATENCY
    """Seconds each copy costs besides its bytes (finite, >= 0)."""
    bandwidth: float = BANDWIDTH
    """Copy bandwidth in bytes per second (> 0; ``math.inf``: bytes cost nothing)."""
    kernel: float = KERNEL
    """Seconds of a kernel whose program declares no :attr:`SimProgram.cost` (finite, >= 0)."""
    timing_only: bool = False
    """Skip the bytes of copies and the bodies of kernels: only the modelled time passes."""

    def __post_init__(self) -> None:
        _seconds("latency", self.latency)
        _seconds("kernel", self.kernel)
        _seconds("bandwidth", self.bandwidth, positive=True, finite=False)
        if not isinstance(self.timing_only, bool):
            raise ValueError(f"SIM model: timing_only must be a bool, got {self.timing_only!r}")

    @classmethod
    def from_env(cls) -> SimModel:
        """The model the ``ARUNTIME_SIM_*`` environment variables set (see the module docstring)."""
        return cls(
            latency=getenv("SIM_LATENCY", LATENCY, minimum=0.0),
            bandwidth=getenv("SIM_BANDWIDTH", BANDWIDTH, minimum=1e-300),
            kernel=getenv("SIM_KERNEL", KERNEL, minimum=0.0),
            timing_only=bool(getenv("SIM_TIMING_ONLY", 0, minimum=0, maximum=1)),
        )

    def copy_time(self, nbytes: int) -> float:
        """Seconds a copy of ``nbytes`` takes: ``latency + nbytes / bandwidth``."""
        return self.latency + nbytes / self.bandwidth


_MAX_NS = (1 << 64) - 1


def _ns(seconds: float) -> int:
    """``seconds`` in whole nanoseconds, rounded up (an op never takes less than its model); at most what the
    entry's word holds (some 585 years)."""
    return _MAX_NS if seconds * 1e9 >= _MAX_NS else math.ceil(seconds * 1e9)


@functools.cache
def _copy_entry() -> Entry:
    """The SIM copy entry, built once per process (through the compile cache)."""
    lib = CCompiler().compile_cached(_COPY_SOURCE, load=cc.load)
    return Entry("sim copy", ctypes.cast(lib[_SIM + "copy"], ctypes.c_void_p).value or 0)


def _modelled(dst: int, src: int, nbytes: int) -> NoReturn:
    """SIM's ``copy_fn``: a marker. Its engines turn each copy into a modelled one, never calling it."""
    raise DeviceError("SIM copies are run by the SIM engines; copy_fn is not called")


class _SimEngine(Engine):
    """An engine that turns each SIM copy command into a call of the SIM copy entry with its modelled time."""

    model: SimModel

    def _model_copies(self, cmds: list[Command]) -> None:
        model = self.model
        for i, cmd in enumerate(cmds):
            if cmd[0] == COPY and cmd[2] is _modelled:
                _, name, _, dst, src, nbytes = cmd
                ns = _ns(model.copy_time(nbytes))
                holder, address, _ = pin(_COPY_ARGS.pack(ns, 0 if model.timing_only else nbytes, dst, src))
                cmds[i] = (EXEC, name, _copy_entry(), (holder, address))

    def push(self, cmds: list[Command], op: Op) -> Op:
        self._model_copies(cmds)
        return super().push(cmds, op)

    def pend(self, cmds: list[Command], op: Op, blockers: Sequence[tuple[bool, Op]]) -> None:
        self._model_copies(cmds)
        super().pend(cmds, op, blockers)


class _SimNativeEngine(_SimEngine, NativeEngine):
    """The native engine with modelled copies."""


class _SimThreadEngine(_SimEngine, ThreadEngine):
    """The Python engine with modelled copies."""


class SimAllocator(HostAllocator):
    """Host memory that other devices' copy engines do not reach: a transfer between a SIM device and another
    device runs on the SIM device's copy queue (see the module docstring)."""

    host_mapped = False


Cost = float | Callable[..., float]
"""A kernel's declared time: seconds, or a function of its launch values returning seconds."""


class SimProgram(CPUProgram):
    """A C kernel of a SIM device, run like a CPU kernel, whose op takes :attr:`cost` (modelled) seconds."""

    def __init__(self, device: BaseDevice, name: str, lib: bytes, outs: Sequence[int] | None = None) -> None:
        super().__init__(device, name, lib, outs)
        assert isinstance(device, SimDevice)
        self._sim = device
        self._entry = Entry(name, ctypes.cast(self._lib[_SIM + name], ctypes.c_void_p).value or 0)
        self._args = struct.Struct("=QQ" + self._format.lstrip("="))
        self._cost: Cost | None = None

    @property
    def cost(self) -> Cost | None:
        """The kernel's modelled time: seconds (a number >= 0), or a function called with the launch's values
        (``vals``, in order) that returns seconds; None (the default): the device model's ``kernel`` time.

        ``prog.cost = 2e-3``; ``prog.cost = lambda n, scale: 1e-6 + n * 1e-9``. A bad number is a
        :class:`ValueError`; so is a launch whose function returns one. A launch's time is fixed when it is
        bound: at the launch, or, in a graph, at its first replay with those values.
        """
        return self._cost

    @cost.setter
    def cost(self, cost: Cost | None) -> None:
        if cost is not None and not callable(cost):
            _seconds(f"the cost of {self.name}", cost)
        self._cost = cost

    def time(self, vals: Sequence[int | float]) -> float:
        """Seconds a launch with ``vals`` takes (see :attr:`cost`)."""
        cost = self._cost
        if cost is None:
            return self._sim.model.kernel
        if not callable(cost):
            return cost
        return _seconds(f"the cost of {self.name} for vals {tuple(vals)!r}", cost(*vals))

    def bind(self, addresses: Sequence[int], vals: Sequence[int | float]) -> Bound:
        """The kernel's SIM entry and its arguments: its modelled time, whether it runs (not in timing-only
        mode), then the CPU kernel's arguments (checked as :meth:`CPUProgram.bind` checks them)."""
        words = self._words(addresses, vals)
        run = not self._sim.model.timing_only
        holder, address, _ = pin(self._args.pack(_ns(self.time(vals)), run, *words))
        return self._entry, (holder, address)


class SimDevice(CPUDevice):
    """A simulated accelerator (see the module docstring): host memory, C kernels, modelled time."""

    kind = "SIM"
    program_type = SimProgram
    allocator_type = SimAllocator
    copies_host = True
    copy_fn = staticmethod(_modelled)

    def __init__(self, name: str, model: SimModel | None = None) -> None:
        self._model = self._checked(name, SimModel.from_env() if model is None else model)
        _copy_entry()  # builds the copy entry before any op needs it
        super().__init__(name)

    @staticmethod
    def _checked(name: str, model: object) -> SimModel:
        if not isinstance(model, SimModel):
            raise TypeError(f"{name}: model must be a SimModel, got {type(model).__name__}")
        return model

    @property
    def model(self) -> SimModel:
        """The device's :class:`SimModel`; setting it applies to ops submitted from then on."""
        return self._model

    @model.setter
    def model(self, model: SimModel) -> None:
        self._model = self._checked(self.name, model)
        for engine in self.engines:
            assert isinstance(engine, _SimEngine)
            engine.model = self._model

    def _make_engine(self, kind: str, timeout: float) -> Engine:
        engine_type = _SimNativeEngine if native.lib() is not None else _SimThreadEngine  # as make_engine picks
        engine = engine_type(self.name, kind, timeout)
        engine.model = self._model
        return engine

    def _kernel_source(self, src: str, name: str) -> str:
        """The CPU kernel source with the SIM entry around the kernel's CPU entry."""
        return super()._kernel_source(src, name) + _HELPERS + _kernel_wrapper(name)


device_class = SimDevice
"""The class the registry opens for this kind."""

__all__ = ["BANDWIDTH", "KERNEL", "LATENCY", "Cost", "SimAllocator", "SimDevice", "SimModel", "SimProgram"]
