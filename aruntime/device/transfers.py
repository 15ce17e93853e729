"""The transfer rule: which device's copy engine copies a buffer into a buffer of another device."""

from __future__ import annotations

from aruntime.device.base import BaseDevice
from aruntime.engine import Op, Window
from aruntime.errors import BufferUsageError
from aruntime.memory import Buffer


def transfer_device(src: BaseDevice, dst: BaseDevice) -> BaseDevice:
    """The device whose copy engine runs a transfer from ``src`` to ``dst``.

    The source's when both are one kind or both are :attr:`~BaseDevice.host_mapped` (``copy_fn`` is a memmove),
    except out of a file (a :attr:`~BaseDevice.file_backed` device, DISK) into another kind: the destination reads
    it, so that loads into several devices run side by side, as several readers of a file do; the one that
    :attr:`~BaseDevice.copies_host` when the other is host-mapped (a device with memory of its own copies between
    it and host addresses); otherwise no copy engine reaches both memories: a :class:`BufferUsageError` (a NULL
    buffer, for one, is not host memory).
    """
    if src.file_backed and not dst.file_backed and src.host_mapped and (dst.host_mapped or dst.copies_host):
        return dst
    if type(src) is type(dst) or (src.host_mapped and dst.host_mapped):
        return src
    if src.host_mapped and dst.copies_host:
        return dst
    if dst.host_mapped and src.copies_host:
        return src
    lacking = ", ".join(d.name for d in (src, dst) if not d.host_mapped)
    raise BufferUsageError(
        f"transfer {src.name}->{dst.name}: no copy engine reaches both memories ({lacking} buffers are not host "
        "memory); a transfer runs between host-mapped devices (CPU, DISK), between one of them and a device that "
        "copies to host memory (CL, CUDA), or within one kind; copy out to the host and in"
    )


def transfer(dst: Buffer, src: Buffer, hold: bool = False, window: Window | None = None, priority: int = 0) -> Op:
    """Copy ``src`` into ``dst``, a buffer of another device (or the same), on the copy queue of the device
    :func:`transfer_device` picks (the source's between host-memory devices, the destination's out of a file);
    ``await`` the op for the copy to be done.

    Both must be allocated and of the same size; the destination device's later
    work on ``dst`` waits for it. ``hold``, ``window``, ``priority``: see :meth:`BaseDevice.copyin`.
    """
    if not isinstance(src, Buffer):
        raise BufferUsageError(f"transfer: expected a Buffer source, got {type(src).__name__}")
    if not isinstance(dst, Buffer):
        raise BufferUsageError(f"transfer: expected a Buffer destination, got {type(dst).__name__}")
    src_dev, dst_dev = src.owner, dst.owner
    for dev in (dst_dev, src_dev):
        if dev.routes_transfers:
            return dev._transfer(dst, src, hold, window, priority)
    return transfer_device(src_dev, dst_dev)._transfer(dst, src, hold, window, priority)
