"""Programs: a compiled kernel of one device, and what a launch of it hands to the compute engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aruntime.device.base import BaseDevice

Bound = tuple[Callable[..., object], tuple[Any, ...]]
"""What :meth:`Program.bind` returns: the callable an engine runs for one launch, and its arguments."""


class Program:
    """A compiled kernel of one device; :meth:`bind` says what the compute engine calls for a launch."""

    __slots__ = ("__dict__", "__weakref__", "_device", "_outs", "_plan", "lib", "name")  # read in place when submitting

    def __init__(self, device: BaseDevice, name: str, lib: bytes, outs: Sequence[int] | None = None) -> None:
        self._device = device
        self.name = name
        self.lib = lib
        self._outs = None if outs is None else tuple(outs)
        self._plan: tuple[Callable[..., object], bytes | None] | None = None
        """How the native submission path binds a launch as :meth:`bind` does, or None where only :meth:`bind`
        can: the callable, and the parameters as a byte pair each (``p``, ``f``, ``i`` or ``u``, and the bits),
        each pointer taking the next buffer's address and each other the next scalar, packed as 8-byte words; or
        None for a callable that takes no arguments, any buffers and no scalars. A backend sets it in its
        ``__init__``."""

    @property
    def device(self) -> BaseDevice:
        """The device it was compiled for, the only one that launches it."""
        return self._device

    @property
    def outs(self) -> tuple[int, ...] | None:
        """The indices of the buffers a launch writes (None: all of them), as given to ``compile``."""
        return self._outs

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device.name}>"

    def bind(self, addresses: Sequence[int], vals: Sequence[int | float]) -> Bound:
        """What the compute engine calls for a launch on these buffer handles and scalars, and the arguments.

        By default the program itself, with the handles and then the scalars. A
        backend may return the kernel itself instead (no Python frame per
        launch). A submitted launch holds the callable, not the program, until
        it has run, so the callable must keep alive whatever the kernel needs.
        """
        return self, (*addresses, *vals)

    def __call__(self, *args: Any) -> None:
        """Run the kernel with :meth:`bind`'s arguments (on an engine thread); a backend that binds to
        something else need not define it."""
        raise NotImplementedError(f"{self!r}: launch it on its device, or call what bind() returns")
