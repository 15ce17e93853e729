"""Kernels that engines call without Python: a C entry point taking one array of packed 64-bit arguments.

A backend that compiles C (the CPU device) gives each kernel an *entry*, ``int entry(const uint64_t *args)``,
that unpacks the words into the kernel's own parameters (pointers, integers, doubles) and returns the kernel's
status (0: success). :meth:`Program.bind <aruntime.device.Program.bind>` then returns ``(entry, (packed,
address))``: the native engine calls the entry's address directly with ``address``; the Python engine calls
the :class:`Entry` object, which does the same through ctypes (the GIL released).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from aruntime.errors import OpError

_ENTRY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class KernelError(OpError):
    """A kernel reported failure: its entry returned a non-zero status (``status``)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[type[KernelError], tuple[str, int]]:
        """Pickled with its status (a remote device's failure reaches the caller as it was raised)."""
        return (KernelError, (str(self), self.status))


class Entry:
    """A kernel's entry point at ``address`` (``int entry(const uint64_t *args)``), named ``name``."""

    __slots__ = ("_address", "_call", "name")

    def __init__(self, name: str, address: int) -> None:
        self.name = name
        self._address = address
        self._call = _ENTRY(address)

    @property
    def address(self) -> int:
        """Where the entry point is; fixed: a native engine calls it there."""
        return self._address

    def __repr__(self) -> str:
        return f"<Entry {self.name} at {self.address:#x}>"

    def __call__(self, packed: bytes, address: int) -> None:
        """Run the kernel on the packed arguments at ``address`` (``packed`` keeps them alive)."""
        status = self._call(address)
        if status:
            raise KernelError(f"kernel {self.name} returned status {status}", status)


_NATIVE_COPIES: dict[int, Callable[..., object]] = {id(ctypes.memmove): ctypes.memmove}
"""Copy functions (by ``id``) a native engine runs as its own ``memmove`` (on host addresses)."""
_NOTHING: dict[int, Callable[..., object]] = {}
"""Copy functions and programs (by ``id``) that do nothing: a native engine records their range and runs nothing."""


def register_native(fn: Callable[..., object], kind: str) -> None:
    """Declare what a device's ``copy_fn`` or a bound program is, so native engines run it without Python:
    ``"memmove"`` (a copy between host addresses) or ``"nothing"``. Anything else runs on the engine's
    Python thread."""
    if kind not in ("memmove", "nothing"):
        raise ValueError(f"register_native: kind must be 'memmove' or 'nothing', got {kind!r}")
    (_NATIVE_COPIES if kind == "memmove" else _NOTHING)[id(fn)] = fn
