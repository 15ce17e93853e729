"""The device registry: ``Device[name]`` opens a device of a kind once, from its backend, and returns it after."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import multiprocessing
import pkgutil
import threading
from collections.abc import Iterator

from aruntime.device.base import BaseDevice
from aruntime.dtype import DType
from aruntime.errors import DeviceError
from aruntime.helpers import canonicalize, getenv
from aruntime.memory import open_devices_with

BUILTIN = "aruntime.backends"
"""The package of the backends that come with aruntime, one module per kind, loaded by name when first opened
(as a third party's are, through the entry-point group of the same name): the device layer imports no backend."""

PRIORITY = ("CUDA", "CPU", "CL")
"""Kinds tried in order for the default device (other kinds, NULL included, are the default only through
``ARUNTIME_<KIND>=1``, file-backed kinds never; CPU goes before CL, whose usual driver, PoCL, runs on the same CPU:
set ARUNTIME_CL=1 to make CL the default)."""


class _Registry:
    """``Device[name]`` opens a device once and returns the same object after."""

    def __init__(self) -> None:
        self._opened: dict[str, BaseDevice] = {}
        self._lock = threading.RLock()
        self._default: str | None = None

    canonicalize = staticmethod(canonicalize)

    def kinds(self) -> dict[str, str]:
        """Every known kind -> where its backend comes from (a module or an entry point)."""
        spec = importlib.util.find_spec(BUILTIN)
        where = spec.submodule_search_locations if spec is not None else None
        modules = [m.name for m in pkgutil.iter_modules(where or []) if not m.name.startswith("_")]  # _: shared code
        found = {name.upper(): f"{BUILTIN}.{name}" for name in modules}
        for ep in importlib.metadata.entry_points(group="aruntime.backends"):
            found.setdefault(ep.name.upper(), ep.value)
        return found

    def backend(self, kind: str) -> type[BaseDevice]:
        """The device class of ``kind``."""
        where = self.kinds().get(kind)
        if where is None:
            raise DeviceError(f"unknown device kind {kind!r}; known kinds: {', '.join(sorted(self.kinds()))}")
        module, _, attr = where.partition(":")
        try:
            obj = getattr(importlib.import_module(module), attr or "device_class")
        except Exception as exc:  # an import error, a missing class, or the module's own failure
            raise DeviceError(f"backend {where} for {kind} could not be loaded: {exc}") from exc
        if not (isinstance(obj, type) and issubclass(obj, BaseDevice)):
            raise DeviceError(f"backend {where} for {kind} is not a BaseDevice subclass")
        return obj

    def __getitem__(self, name: str | None) -> BaseDevice:
        name = self.DEFAULT if name is None else canonicalize(name)
        dev = self._opened.get(name)
        if dev is not None:
            return dev
        with self._lock:
            if name in self._opened:
                return self._opened[name]
            cls = self.backend(name.partition(":")[0])
            if not cls.file_backed and multiprocessing.current_process().name != "MainProcess":
                raise DeviceError(f"{name}: compute devices are opened only in the main process")
            dev = self._opened[name] = cls(name)
            dev._on_closed = functools.partial(self.forget, dev)
            return dev

    def forget(self, dev: BaseDevice) -> None:
        """Drop a closed device from the opened set."""
        with self._lock:
            if self._opened.get(dev.name) is dev:
                del self._opened[dev.name]

    @property
    def opened(self) -> tuple[str, ...]:
        """Names of the devices opened so far."""
        return tuple(self._opened)

    def devices(self) -> Iterator[BaseDevice]:
        """The devices opened so far."""
        return iter(tuple(self._opened.values()))

    def available(self) -> list[str]:
        """Kinds that open on this machine (file-backed ones need only load), default priority first."""
        kinds = sorted(self.kinds(), key=lambda k: (PRIORITY.index(k) if k in PRIORITY else len(PRIORITY), k))
        ok = []
        for kind in kinds:
            try:
                if not self.backend(kind).file_backed:
                    self[kind]
            except Exception:
                continue
            ok.append(kind)
        return ok

    @property
    def DEFAULT(self) -> str:
        """The default device: the kind whose ``ARUNTIME_<KIND>`` is 1, else the first of :data:`PRIORITY`
        that opens (a child process finds it by the same rule; nothing is written to the environment)."""
        if self._default is not None:
            return self._default
        kinds = self.kinds()
        chosen = [k for k in kinds if getenv(k, "") == "1" and not self.backend(k).file_backed]
        if len(chosen) > 1:
            names = ", ".join(f"ARUNTIME_{k}" for k in sorted(chosen))
            raise DeviceError(f"several device kinds are set to 1 in the environment: {names}")
        if not chosen:
            errors = []
            for kind in PRIORITY:
                if kind not in kinds:
                    continue
                try:
                    self[kind]
                except Exception as exc:
                    errors.append(f"{kind}: {exc}")
                    continue
                chosen = [kind]
                break
            if not chosen:
                raise DeviceError("no device could be opened: " + ("; ".join(errors) or "no backends found"))
        self._default = chosen[0]
        return self._default


Device = _Registry()
"""The device registry: ``Device["CPU:1"]``, ``Device.DEFAULT``, ``Device.opened``."""
open_devices_with(Device.__getitem__)  # a buffer opens its device here


def is_dtype_supported(dtype: DType, device: str | None = None) -> bool:
    """Whether ``device`` (default: the default device) supports ``dtype``; opens the device if needed."""
    if not isinstance(dtype, DType):
        raise TypeError(f"is_dtype_supported: expected a DType, got {type(dtype).__name__}")
    return Device[device].is_dtype_supported(dtype)
