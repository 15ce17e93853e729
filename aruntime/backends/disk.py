"""The DISK device (``DISK:/path/to/file``): buffers are memory-mapped bytes of one file.

A buffer of ``n`` bytes on ``DISK:/f`` *is* the first ``n`` bytes of ``/f``: allocating it
reserves the file system's blocks for that region (``posix_fallocate``, which grows a shorter file
with zeros and never shrinks it; a file system without room is an :class:`AllocationError` then,
not a crash at the first write) and maps it, and whatever the file held is the buffer's contents.
Views reach the rest of the file at byte offsets, so ``Buffer("DISK:/f", size).view(n, dtype,
offset)`` reads a tensor stored at ``offset``. Two root buffers on the same file therefore share
bytes, just as two opens of the file would.

A handle is the host address of the mapping, so :data:`ctypes.memmove` copies between DISK and
any host-memory device (CPU) in both directions. The device is file-backed: it may be opened in
any process, and its bytes are not counted in the allocator's ``in_use``. It runs no kernels.

A file truncated (or shrunk) by another process under a live buffer takes the pages past its new end
away. A copy aruntime makes into or out of them fails with :class:`~aruntime.errors.FileTruncated`
instead of killing the process with SIGBUS: ops on the engines' guarded copies, blocking copies
(``Buffer.copyin``, ``copyout``) on :func:`~aruntime.engine.host_copy`. Bytes read or written through a
zero-copy view of the mapping (``as_buffer(allow_zero_copy=True)``) are not guarded.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Sequence

from aruntime.device import BaseDevice, Program
from aruntime.dtype import DType
from aruntime.engine import CopyFault, host_copy
from aruntime.errors import AllocationError, DeviceError, FileTruncated
from aruntime.memory import Allocator, Buffer, BufferSpec, HostAddressed, Mappings, pin


def _reserve(fd: int, size: int, length: int) -> None:
    """Have the file system back the first ``size`` bytes of the file ``fd`` (now ``length`` bytes long) with
    blocks, growing it with zeros.

    Without that, writing through a mapping into a part of a sparse file the file system has no room for kills
    the process (SIGBUS). Growth beyond the file system's free blocks is refused before asking, as C libraries
    that emulate ``posix_fallocate`` write one byte per block. Where the platform has no ``posix_fallocate``
    the file is only grown (sparse).
    """
    grow = size - length
    if not hasattr(os, "posix_fallocate"):
        if grow > 0:
            os.ftruncate(fd, size)
        return
    fs = os.fstatvfs(fd)
    if fs.f_blocks and grow > fs.f_bfree * fs.f_frsize:  # a file system that reports no size is not checked
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({fs.f_bfree * fs.f_frsize} bytes free)")
    os.posix_fallocate(fd, 0, size)


class DiskAllocator(HostAddressed, Allocator[int]):
    """Maps regions of the device's file; a handle is the mapping's host address.

    Not an LRU allocator: freeing closes the mapping at once (a mapping still exported through a
    zero-copy :meth:`_as_buffer` view is unmapped when the last such view is released). The file is
    opened, read-write and created if missing, on the first allocation.
    """

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.path = device.partition(":")[2]
        self._fd: int | None = None
        self._maps = Mappings()
        self._lock = threading.Lock()  # the file descriptor

    def _open(self) -> int:
        if self._fd is None:
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
            try:
                self._fd = os.open(self.path, flags, 0o666)
            except OSError as exc:
                raise DeviceError(
                    f"{self.device}: cannot open {self.path!r} for reading and writing: {exc.strerror or exc}"
                ) from exc
        return self._fd

    def _alloc(self, size: int, spec: BufferSpec) -> int:
        if spec.external_ptr is not None:
            raise DeviceError(f"{self.device}: DISK buffers are bytes of the file; external_ptr is not supported")
        with self._lock:
            fd = self._open()
            before = os.fstat(fd).st_size
            try:
                _reserve(fd, size, before)
                mapping = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
            except (OSError, OverflowError, ValueError) as exc:
                with contextlib.suppress(OSError):  # a reservation that failed part way: the file as it was
                    if os.fstat(fd).st_size > before:
                        os.ftruncate(fd, before)
                reason = getattr(exc, "strerror", None) or exc
                raise AllocationError(
                    f"{self.device}: cannot reserve and map {size} bytes of {self.path!r}: {reason}"
                ) from exc
            return self._maps.add(mapping)

    def _free(self, handle: int, size: int, spec: BufferSpec) -> None:
        if not self._maps.release(handle):
            raise DeviceError(f"{self.device}: {handle:#x} is not a live mapping of {self.path!r}")

    def _copyin(self, dest: int, src: memoryview) -> None:
        _held, address, nbytes = pin(src)  # held while it copies
        self._copy(dest, address, nbytes, "into")

    def _copyout(self, dest: memoryview, src: int) -> None:
        _held, address, nbytes = pin(dest, writable=True)
        self._copy(address, src, nbytes, "out of")

    def _copy(self, dst: int, src: int, nbytes: int, way: str) -> None:
        """A blocking copy of ``nbytes`` ``way`` ("into", "out of") a mapping, guarded (see :func:`host_copy`)."""
        try:
            host_copy(dst, src, nbytes)
        except CopyFault:
            raise FileTruncated(
                f"{self.device}: a copy of {nbytes} bytes {way} a buffer reaches past the end of {self.path!r}, "
                "which was truncated (or shrank) under the buffer; the copy stopped there"
            ) from None

    def _as_buffer(self, handle: int, size: int) -> memoryview:
        """A zero-copy view of the file's bytes; it keeps the mapping alive while it exists (and is not guarded:
        an access past the end of a file truncated under it is a SIGBUS)."""
        view = self._maps.view(handle, size)
        if view is None:
            raise DeviceError(f"{self.device}: {size} bytes at {handle:#x} are not inside a live mapping")
        return view

    def flush(self) -> None:
        """Write every live mapping back to the file (``msync``)."""
        for mapping in self._maps.live():
            mapping.flush()

    def close(self) -> None:
        """Close the file descriptor; live mappings stay valid, and the next allocation reopens it."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class DiskDevice(BaseDevice):
    """A file as a device: memory-mapped storage with copy and transfer, and no kernels."""

    kind = "DISK"
    file_backed = True
    allocator_type = DiskAllocator
    compiler_type = None
    copy_fn = staticmethod(ctypes.memmove)
    allocator: DiskAllocator

    @classmethod
    def check_name(cls, name: str) -> None:
        """A DISK device is named ``DISK:PATH``: the path of its file."""
        kind, _, path = name.partition(":")
        if not path:
            raise DeviceError(f"{name}: a {kind} device needs a file path, e.g. {kind}:/path/to/file")

    @property
    def path(self) -> str:
        """The file this device stores into."""
        return self.allocator.path

    def is_dtype_supported(self, dtype: DType) -> bool:
        """A file stores any dtype that has a size."""
        return dtype.itemsize > 0

    async def compile(self, src: str, name: str = "kernel", outs: Sequence[int] | None = None) -> Program:
        """Always a :class:`DeviceError`: a DISK device has no compiler."""
        raise DeviceError(f"{self.name} stores data and has no compiler; compile for a compute device such as CPU")

    def _launch_access(
        self, prog: Program, bufs: Sequence[Buffer], outs: Sequence[int] | None
    ) -> tuple[tuple[Buffer, ...], tuple[Buffer, ...]]:
        """Always a :class:`DeviceError`: a DISK device runs no kernels (``launch`` raises it)."""
        raise DeviceError(
            f"{self.name} stores data and runs no kernels; transfer the data to a compute device such as CPU"
        )

    def _finish_close(self, settled: bool) -> None:
        """Once closed: flush the mappings (``msync``) and close the file."""
        super()._finish_close(settled)
        if settled:
            self.allocator.flush()
            self.allocator.close()


device_class = DiskDevice
"""The class the registry opens for this kind."""
