"""Devices: the base class with the awaitable API, programs, the registry and the transfer rule.

:mod:`~aruntime.device.base` holds the op methods and what a backend overrides; closing, settling and the
profile hook are in :mod:`~aruntime.device.closing`, :mod:`~aruntime.device.settling` and
:mod:`~aruntime.device.profiling`; the registry (``Device[name]``) in :mod:`~aruntime.device.registry`; which
device copies a buffer to another device's in :mod:`~aruntime.device.transfers`.
"""

from aruntime.device.args import check_scalar, check_scalars
from aruntime.device.base import BaseDevice
from aruntime.device.program import Bound, Program
from aruntime.device.registry import BUILTIN, PRIORITY, Device, is_dtype_supported
from aruntime.device.shutdown import EXIT_NOTICE, finish_at_exit
from aruntime.device.transfers import transfer, transfer_device
from aruntime.engine import Window, dispatch_when_ready  # their home before 0.2: kept importable from here

__all__ = [
    "BUILTIN",
    "EXIT_NOTICE",
    "PRIORITY",
    "BaseDevice",
    "Bound",
    "Device",
    "Program",
    "Window",
    "check_scalar",
    "check_scalars",
    "dispatch_when_ready",
    "finish_at_exit",
    "is_dtype_supported",
    "transfer",
    "transfer_device",
]
