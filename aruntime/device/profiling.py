"""The device's profile hook: its clock offsets against the host clock, when profiling finishes."""

from __future__ import annotations

from aruntime.engine import Engine, engine_offset
from aruntime.events import DeviceEvent


class ProfileHooks:
    """What profiling asks of a :class:`~aruntime.device.base.BaseDevice` (a backend with its own clocks
    overrides it)."""

    name: str

    @property
    def compute(self) -> Engine:
        """The device's compute queue (the device defines it)."""
        raise NotImplementedError

    @property
    def copy(self) -> Engine:
        """The device's copy queue (the device defines it)."""
        raise NotImplementedError

    def finalize_profile(self) -> DeviceEvent:
        """Called when profiling finishes: this device's clock offsets against the host clock.

        Each engine's offset is the median of several paired host/engine
        timestamps (see :mod:`aruntime.engine.clock`); call it while the device is idle.
        """
        return DeviceEvent(self.name, engine_offset(self.compute), engine_offset(self.copy))
