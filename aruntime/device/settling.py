"""Settling a device: waiting for the work in flight on its queues, and raising the failures nobody awaited."""

from __future__ import annotations

from aruntime.engine import Engine, first_failure


class Settling:
    """What :class:`~aruntime.device.base.BaseDevice` waits with: its engines' work in flight, held ops
    included."""

    name: str
    engines: tuple[Engine, ...]

    def _raise_failures(self) -> None:
        failed = [op for engine in self.engines for op in engine.take_failures()]
        if failed:
            raise first_failure(failed, f"on {self.name} failed unobserved")

    async def settle(self) -> None:
        """Wait for all work submitted so far (held ops included) to finish; raises nothing."""
        for engine in self.engines:
            while engine.held:  # held ops may hold up others that get held meanwhile: until none is left
                for op in tuple(engine.held):
                    await op.settled()
            await engine.signal.wait_async(engine.last)

    def settle_blocking(self, timeout: float | None = None) -> None:
        """:meth:`settle` for threads outside any event loop; each wait gives up after ``timeout`` seconds."""
        for engine in self.engines:
            while engine.held:
                for op in tuple(engine.held):
                    op.wait_done(timeout)
            engine.signal.wait(engine.last, timeout)

    async def synchronize(self) -> None:
        """Wait for all work submitted so far; raise the first failure nobody awaited."""
        await self.settle()
        self._raise_failures()

    def synchronize_blocking(self) -> None:
        """:meth:`synchronize` for threads outside any event loop."""
        self.settle_blocking()
        self._raise_failures()
