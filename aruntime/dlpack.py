"""Re-exports :mod:`aruntime.memory.dlpack`, its new home, until the next release (see docs/migration.md)."""

import warnings

from aruntime.memory.buffer import from_dlpack
from aruntime.memory.dlpack import (
    CPU,
    DLDataType,
    DLDevice,
    DLManagedTensor,
    DLManagedTensorVersioned,
    DLPackVersion,
    DLTensor,
    export,
    host_address,
)

warnings.warn(
    "aruntime.dlpack moved to aruntime.memory.dlpack; the old path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "CPU",
    "DLDataType",
    "DLDevice",
    "DLManagedTensor",
    "DLManagedTensorVersioned",
    "DLPackVersion",
    "DLTensor",
    "export",
    "from_dlpack",
    "host_address",
]
