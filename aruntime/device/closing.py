"""Closing a device: open -> closing (the work in flight settles) -> closed, or back to open if the wait fails."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from aruntime.device.settling import Settling
from aruntime.errors import DeviceError
from aruntime.helpers import check_seconds, checkpoint

if TYPE_CHECKING:
    from typing_extensions import Self


class Closing(Settling):
    """The closing state machine of a :class:`~aruntime.device.base.BaseDevice`: :meth:`close`,
    :meth:`aclose`, ``async with``, and :meth:`check_usable` for the ops refused once it is closing."""

    state: str
    """``"open"``, ``"closing"`` (a close is waiting for the work in flight) or ``"closed"``."""
    _on_closed: Callable[[], None] | None = None  # set by the registry that opened the device: it forgets it

    def __init__(self) -> None:
        self.state = "open"
        self._close_lock = threading.Lock()

    if TYPE_CHECKING:

        def flush_cache(self) -> None: ...

    def check_usable(self, what: str) -> None:
        """Raise :class:`DeviceError` naming ``what`` unless this device is open."""
        if self.state != "open":
            raise DeviceError(
                f"{what}: {self.name} is {self.state}; Device[{self.name!r}] opens a new device of that name"
            )

    def _begin_close(self) -> bool:
        """Move open -> closing; False if already closed. Refused from this device's own engine threads."""
        for engine in self.engines:
            if getattr(engine, "_thread", None) is threading.current_thread():
                raise DeviceError(
                    f"close {self.name}: called on its own {engine.signal.name} thread (from a kernel or an "
                    "op callback), which would wait for itself; close it from another thread or task"
                )
        with self._close_lock:
            if self.state == "closed":
                return False
            if self.state == "closing":
                raise DeviceError(f"close {self.name}: another close of it is already waiting")
            self.state = "closing"
            return True

    def _finish_close(self, settled: bool) -> None:
        """closing -> closed once the work in flight is done (stop the engines, free the cache, forget the
        device); closing -> open when the wait failed, so the device stays usable."""
        if not settled:
            self.state = "open"
            return
        for engine in self.engines:
            engine.close()
        self.flush_cache()
        self.state = "closed"
        if self._on_closed is not None:
            self._on_closed()

    def close(self, timeout: float | None = None) -> None:
        """Wait for the work submitted so far (held ops included), stop the engines and forget the device.

        For threads; async code uses :meth:`aclose`. Afterwards ``Device[name]`` opens a new device, and this one
        refuses new work (ops, ``allocate``, ``compile``) with a :class:`DeviceError`. If the wait does not pass
        within ``timeout`` seconds (default: the device's :attr:`timeout`), the :class:`SignalTimeout` is raised
        and the device stays open and usable. Closing a closed device does nothing; closing from one of the
        device's own engine threads (a kernel) is a :class:`DeviceError`.
        """
        if timeout is not None:
            check_seconds(f"close {self.name}: timeout", timeout)
        if not self._begin_close():
            return
        settled = False
        try:
            self.settle_blocking(timeout)
            settled = True
        finally:
            self._finish_close(settled)

    async def aclose(self) -> None:
        """:meth:`close` for async code: waits for the work in flight without blocking the loop (bounded by
        the device's :attr:`timeout`; a timeout leaves it open), then stops the engines on a worker thread.
        If the awaiting task is cancelled during the wait (a checkpoint even when the device is idle or
        closed), the device stays open; once the wait has passed, the close completes."""
        if not self._begin_close():
            await checkpoint()
            return
        settled = False
        try:
            await self.settle()
            settled = True
        finally:
            if settled:
                with anyio.CancelScope(shield=True):  # a cancellation now must not leave the device closing
                    await anyio.to_thread.run_sync(self._finish_close, True)
            else:
                self._finish_close(False)

    async def __aenter__(self) -> Self:
        await checkpoint()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
