"""The NULL device: engines complete every command at once; for measuring the runtime's own overhead."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from aruntime.compile import Compiler
from aruntime.device import BaseDevice, Bound, Program
from aruntime.engine.kernel import register_native
from aruntime.memory import BufferSpec, LRUAllocator


class NullAllocator(LRUAllocator[int]):
    """Hands out distinct fake addresses; no memory behind them."""

    _next = itertools.count(1 << 20, 1 << 20)

    def _alloc(self, size: int, spec: BufferSpec) -> int:
        return next(self._next)

    def _free(self, handle: int, size: int, spec: BufferSpec) -> None:
        pass

    def _copyin(self, dest: int, src: memoryview) -> None:
        pass

    def _copyout(self, dest: memoryview, src: int) -> None:
        pass

    def _offset(self, handle: int, size: int, offset: int) -> int:
        return handle + offset


class NullCompiler(Compiler):
    """Accepts any source; produces an empty binary."""

    def compile(self, src: str) -> bytes:
        return b""


def _nothing(*args: object) -> None:
    pass


register_native(_nothing, "nothing")


class NullProgram(Program):
    """Runs nothing."""

    def __init__(self, device: BaseDevice, name: str, lib: bytes, outs: Sequence[int] | None = None) -> None:
        super().__init__(device, name, lib, outs)
        self._plan = (_nothing, None)

    def bind(self, addresses: Sequence[int], vals: Sequence[int | float]) -> Bound:
        """A function that does nothing, with no arguments."""
        return _nothing, ()


class NullDevice(BaseDevice):
    """Every op is accepted, tracked and completed, and does nothing."""

    kind = "NULL"
    program_type = NullProgram
    allocator_type = NullAllocator
    compiler_type = NullCompiler
    copy_fn = staticmethod(_nothing)

    def _shares_workers(self) -> bool:
        return True


device_class = NullDevice
"""The class the registry opens for this kind."""
