"""Exceptions raised by aruntime. Every error names what failed."""

from __future__ import annotations


class AruntimeError(Exception):
    """Base class of every aruntime error."""


class DeviceError(AruntimeError):
    """A device could not be opened, or a device name is malformed or unknown."""


class CompileError(AruntimeError):
    """A compiler rejected a source; the message carries the compiler's output."""


class CacheError(AruntimeError):
    """The persistent compile cache is unusable (e.g. unsafe permissions) or missed under ARUNTIME_ASSERT_COMPILE."""


class AllocationError(AruntimeError, MemoryError):
    """An allocation failed even after the allocator's cache was freed."""


class BufferUsageError(AruntimeError, ValueError):
    """A buffer was used wrongly: unallocated, freed, out of range, wrong size, wrong device."""


class SignalTimeout(AruntimeError, TimeoutError):
    """A wait on a timeline signal did not pass within its timeout."""


class OpError(AruntimeError):
    """An op failed. Every op failure is one: the runtime's own kinds (:class:`DependencyError`,
    :class:`~aruntime.engine.KernelError`) are subclasses raised as they are; any other exception is wrapped in
    an ``OpError`` naming the op and its queue, with the original in ``__cause__``."""


class DependencyError(OpError):
    """An op was not run because an op it depends on failed; ``first`` names the op that failed first."""

    def __init__(self, message: str, first: str) -> None:
        super().__init__(message)
        self.first = first


class DeviceLost(OpError, DeviceError):
    """An op failed because the device it ran on (or read from) is gone: for a RAY device, its Ray actor died
    (its node failed or left the cluster, or a kernel crashed it)."""


class FileTruncated(OpError, DeviceError):
    """A copy into or out of a file-backed buffer (DISK) met bytes past the end of the buffer's file: the file was
    truncated (or shrank) under the buffer's mapping, by another process or another open of it. An op that copies
    fails with it; a blocking copy (:meth:`Buffer.copyin <aruntime.memory.buffer.Buffer.copyin>`, ``copyout``) raises
    it. The device stays usable: its buffers still inside the file copy as before."""


class OpSkipped(OpError):
    """An op did not run: the request (or scheduler) it was submitted in was cancelled before the op started
    (see :meth:`~aruntime.scheduler.Scheduler.request`)."""


class DeadlineExceeded(OpSkipped, SignalTimeout):
    """A request's deadline passed: its ops that had not started by then were skipped (each with this error),
    and awaiting inside the request raises it."""


class SchedulerFull(AruntimeError):
    """A :class:`~aruntime.scheduler.Scheduler`'s queue of ops waiting for its window is full."""
