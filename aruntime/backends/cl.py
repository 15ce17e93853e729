"""The CL device: OpenCL through pyopencl (``pip install "aruntime[opencl]"``, which brings PoCL's CPU driver).

``Device["CL"]`` is the first device of the first OpenCL platform that has one, ``CL:N`` its Nth
device; all devices of that platform share one context, so a transfer between two CL devices is a
device-side copy. ``POCL_DEVICES="pthread pthread"`` makes PoCL offer two CPU devices.

Queues: each device has two in-order command queues with profiling (compute and copy). An op's
commands are enqueued when it is submitted; a dependency on another CL queue (of this device or
another) is an OpenCL event wait list, and only a wait on a non-CL signal is a host wait, done by a
user event that the waiting queue's completion thread sets once the signal passes.
High-priority ops (``priority=-1``) go to a compute and a copy queue of their own, created on first
use: OpenCL queues have no priorities, so all they gain is not waiting behind the normal queues'
commands (the driver runs the queues side by side); the host adds no ordering of its own.

Completion: one thread per queue blocks in ``clWaitForEvents`` (called through ctypes on the ICD
loader pyopencl links, so the GIL is released while it blocks) on each op's last event, in order,
then completes the op. That wait is :func:`wait_event`; the rest is the driver-queue engine's
(:mod:`aruntime.backends._driver_queue`), which :class:`CLEngine` gives its OpenCL calls.

Kernels are OpenCL C. ``launch(prog, *bufs, vals=...)`` passes each buffer as a ``__global``
pointer, then each scalar, checked against the kernel's declared parameter types before anything
is enqueued (an ``int`` for an integer parameter, in its range; a ``float`` for ``float`` or
``double``). ``compile(src)`` without a name loads the source's only kernel. A kernel runs over
``prog.global_size`` work items (default ``(1,)``); ``prog.sized`` gives a copy with other sizes.
A buffer view passed to a kernel becomes a sub-buffer, so its offset must be a multiple of
``dev.view_alignment`` (the device's base address alignment).

Memory is allocated with ``CL_MEM_ALLOC_HOST_PTR``: PoCL's CPU device keeps it in host memory, so
a host copy is one ``memcpy`` by the driver straight between the caller's memory and the buffer
(no staging copy).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import glob
import json
import os
import struct
from collections.abc import Sequence
from typing import Any

from aruntime.backends._driver_queue import DriverDevice, DriverEngine, Span, launch_dims
from aruntime.compile import Compiler
from aruntime.device import BaseDevice, Bound, Program
from aruntime.dtype import DType, dtypes
from aruntime.engine import EXEC, Command, Engine
from aruntime.errors import BufferUsageError, CompileError, DeviceError
from aruntime.memory import BufferSpec, LRUAllocator

try:
    import numpy as np
    import pyopencl as cl
except ImportError as exc:  # reported when a CL device is opened
    _MISSING: str | None = f"{exc}; install it with: pip install 'aruntime[opencl]'"
else:
    _MISSING = None

OPTIONS = ("-cl-kernel-arg-info",)
"""Build options of every CL program (the argument info is what launch checks scalars against)."""

SCALARS: dict[str, str] = {
    "char": "b",
    "uchar": "B",
    "short": "h",
    "ushort": "H",
    "int": "i",
    "uint": "I",
    "long": "q",
    "ulong": "Q",
    "float": "f",
    "double": "d",
}
"""OpenCL C scalar parameter types a launch can pass, and their struct format."""

_OOM = (-4, -5, -6, -61)  # MEM_OBJECT_ALLOCATION_FAILURE, OUT_OF_RESOURCES, OUT_OF_HOST_MEMORY, INVALID_BUFFER_SIZE


# ---- the platform ---------------------------------------------------------------------------------


@functools.cache
def _platform() -> tuple[Any, tuple[Any, ...]]:
    """The shared context and the devices of the first OpenCL platform that has any."""
    if _MISSING is not None:
        raise DeviceError(f"CL needs pyopencl: {_MISSING}")
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:
        raise DeviceError(f"CL: no OpenCL platform found ({exc})") from exc
    for platform in platforms:
        try:
            devices = platform.get_devices()
        except cl.Error:
            continue
        if devices:
            return cl.Context(devices), tuple(devices)
    raise DeviceError("CL: no OpenCL platform has a device")


@functools.cache
def _icd() -> ctypes.CDLL:
    """The OpenCL ICD loader pyopencl is linked with (the one it ships, else the system's)."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(cl.__file__), ".libs", "libOpenCL*")))
    lib = ctypes.CDLL(found[0] if found else "libOpenCL.so.1")
    lib.clWaitForEvents.argtypes = [ctypes.c_uint32, ctypes.POINTER(ctypes.c_void_p)]
    lib.clWaitForEvents.restype = ctypes.c_int32
    return lib


def wait_event(event: Any) -> BaseException | None:
    """Block (without the GIL) until ``event`` is complete; the error if it or what it waited for failed.

    This is the one place a CL completion thread waits on the driver.
    """
    handle = ctypes.c_void_p(event.int_ptr)
    status = _icd().clWaitForEvents(1, ctypes.byref(handle))
    if status == 0:
        return None
    return DeviceError(f"OpenCL command failed: clWaitForEvents returned {status}")


# ---- memory ---------------------------------------------------------------------------------------


class CLHandle:
    """An OpenCL buffer and a byte range of it (a root buffer, or a view's part of its root)."""

    __slots__ = ("_arg", "mem", "nbytes", "offset")

    def __init__(self, mem: Any, offset: int, nbytes: int) -> None:
        self.mem = mem
        self.offset = offset
        self.nbytes = nbytes
        self._arg: Any = mem if offset == 0 else None

    def __repr__(self) -> str:
        return f"<CLHandle {self.nbytes} B at {self.offset} of {self.mem.int_ptr:#x}>"

    def kernel_arg(self, align: int) -> Any:
        """The memory object a kernel gets: the buffer itself, or a sub-buffer for a view (made once)."""
        if self._arg is None:
            if self.offset % align:
                raise BufferUsageError(
                    f"a view at byte offset {self.offset} cannot be a kernel argument: OpenCL sub-buffers "
                    f"must start at a multiple of {align} bytes on this device"
                )
            self._arg = self.mem.get_sub_region(self.offset, self.nbytes)
        return self._arg


def _host(address: int, nbytes: int) -> ctypes.Array[ctypes.c_char]:
    return (ctypes.c_char * nbytes).from_address(address)


def _cl_device(name: str) -> Any:
    """The OpenCL device of ``CL`` / ``CL:N``."""
    _, devices = _platform()
    index = int(name.partition(":")[2] or 0)
    if index >= len(devices):
        raise DeviceError(
            f"{name}: the OpenCL platform has {len(devices)} device(s) (PoCL: POCL_DEVICES='pthread pthread' gives 2)"
        )
    return devices[index]


class CLAllocator(LRUAllocator[CLHandle]):
    """OpenCL buffers (``CL_MEM_ALLOC_HOST_PTR``; ``external_ptr`` wraps host memory with
    ``CL_MEM_USE_HOST_PTR``), cached for reuse; a handle is a :class:`CLHandle`."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.context, _ = _platform()
        self._queue = cl.CommandQueue(self.context, _cl_device(device))  # for the blocking Buffer.copyin/out

    def _alloc(self, size: int, spec: BufferSpec) -> CLHandle:
        flags = cl.mem_flags.READ_WRITE
        try:
            if spec.external_ptr is not None:
                mem = cl.Buffer(self.context, flags | cl.mem_flags.USE_HOST_PTR, size, _host(spec.external_ptr, size))
            else:
                mem = cl.Buffer(self.context, flags | cl.mem_flags.ALLOC_HOST_PTR, size)
        except cl.Error as exc:
            if exc.code in _OOM:
                raise MemoryError(f"{self.device}: allocating {size} bytes failed: {exc}") from exc
            raise DeviceError(f"{self.device}: allocating {size} bytes failed: {exc}") from exc
        return CLHandle(mem, 0, size)

    def _free(self, handle: CLHandle, size: int, spec: BufferSpec) -> None:
        handle.mem.release()

    def _copyin(self, dest: CLHandle, src: memoryview) -> None:
        cl.enqueue_copy(self._queue, dest.mem, src.cast("B"), dst_offset=dest.offset, is_blocking=True)

    def _copyout(self, dest: memoryview, src: CLHandle) -> None:
        cl.enqueue_copy(self._queue, dest.cast("B"), src.mem, src_offset=src.offset, is_blocking=True)

    def _offset(self, handle: CLHandle, size: int, offset: int) -> CLHandle:
        return CLHandle(handle.mem, handle.offset + offset, size)


# ---- kernels --------------------------------------------------------------------------------------

_MAGIC = b"ARCL1\0"


def _pack(signatures: dict[str, list[str]], binary: bytes) -> bytes:
    meta = json.dumps(signatures, sort_keys=True).encode()
    return _MAGIC + struct.pack("<I", len(meta)) + meta + binary


def _unpack(lib: bytes) -> tuple[dict[str, list[str]], bytes]:
    if not lib.startswith(_MAGIC):
        raise CompileError("not a CL program binary (built by another compiler?)")
    (size,) = struct.unpack_from("<I", lib, len(_MAGIC))
    start = len(_MAGIC) + 4
    signatures: dict[str, list[str]] = json.loads(lib[start : start + size])
    return signatures, lib[start + size :]


def _param_kind(kernel: Any, index: int) -> str:
    """``"buffer"`` for a ``__global``/``__constant`` pointer, else the scalar's OpenCL C type name."""
    qualifier = kernel.get_arg_info(index, cl.kernel_arg_info.ADDRESS_QUALIFIER)
    if qualifier in (cl.kernel_arg_address_qualifier.GLOBAL, cl.kernel_arg_address_qualifier.CONSTANT):
        return "buffer"
    if qualifier == cl.kernel_arg_address_qualifier.LOCAL:
        return "__local pointer"
    return str(kernel.get_arg_info(index, cl.kernel_arg_info.TYPE_NAME)).strip().rstrip("\0")


class CLCompiler(Compiler):
    """Builds OpenCL C for one device; the cached binary carries every kernel's parameter kinds."""

    def __init__(self, device: Any) -> None:
        super().__init__(None)
        self.cl_device = device
        platform = device.platform
        self._key = self.make_cachekey(
            "CL", platform.name, platform.version, device.name, device.version, device.driver_version, *OPTIONS
        )

    @property
    def cachekey(self) -> str:
        """``CL_<hash of the platform, the device, its driver version and the build options>``."""
        return self._key

    def compile(self, src: str) -> bytes:
        context, _ = _platform()
        program: Any = cl.Program(context, src)
        try:
            program.build(options=list(OPTIONS), devices=[self.cl_device])
        except cl.Error as exc:
            try:
                log = program.get_build_info(self.cl_device, cl.program_build_info.LOG)
            except cl.Error:
                log = str(exc)
            raise CompileError(f"OpenCL build failed on {self.cl_device.name}:\n{str(log).strip()}") from None
        signatures = {k.function_name: [_param_kind(k, i) for i in range(k.num_args)] for k in program.all_kernels()}
        binaries: Any = program.get_info(cl.program_info.BINARIES)
        return _pack(signatures, bytes(binaries[0]))


class CLProgram(Program):
    """An OpenCL kernel loaded from the compiled binary; ``global_size``/``local_size`` are its NDRange."""

    device: CLDevice

    def __init__(self, device: BaseDevice, name: str, lib: bytes, outs: Sequence[int] | None = None) -> None:
        super().__init__(device, name, lib, outs)
        signatures, binary = _unpack(lib)
        if name == "kernel" and len(signatures) == 1:  # compile's default name (an OpenCL C keyword): the only one
            self.name = name = next(iter(signatures))
        if name not in signatures:
            raise CompileError(f"the OpenCL program has no kernel {name!r} (it has: {', '.join(sorted(signatures))})")
        self.params = tuple(signatures[name])
        unsupported = [p for p in self.params if p != "buffer" and p not in SCALARS]
        if unsupported:
            raise CompileError(f"kernel {name}: parameters of type {', '.join(unsupported)} cannot be passed")
        assert isinstance(device, CLDevice)
        context, _ = _platform()
        program = cl.Program(context, [device.cl_device], [binary]).build()
        self.kernel = cl.Kernel(program, name)
        # a generated argument setter that packs Python numbers itself (much faster than per-call conversions)
        self.kernel.set_arg_types([None if p == "buffer" else np.dtype(SCALARS[p]) for p in self.params])
        self.global_size: tuple[int, ...] = (1,)
        self.local_size: tuple[int, ...] | None = None

    def sized(self, global_size: Sequence[int], local_size: Sequence[int] | None = None) -> CLProgram:
        """This kernel over ``global_size`` work items (in work groups of ``local_size``; None: the driver's)."""
        other = copy.copy(self)
        other.global_size = launch_dims(self.name, "global_size", global_size)
        other.local_size = None if local_size is None else launch_dims(self.name, "local_size", local_size)
        return other

    def bind(self, addresses: Sequence[int], vals: Sequence[int | float]) -> Bound:
        """The enqueue function the CL compute queue calls, with buffers and scalars checked against the kernel."""
        what = f"launch {self.name}"
        if len(addresses) + len(vals) != len(self.params) or any(p != "buffer" for p in self.params[: len(addresses)]):
            raise TypeError(
                f"{what}: the kernel takes ({', '.join(self.params)}), got {len(addresses)} buffer(s) "
                f"then {len(vals)} scalar(s)"
            )
        for i, (val, kind) in enumerate(zip(vals, self.params[len(addresses) :], strict=True)):
            fmt = SCALARS[kind]
            if fmt in "fd":
                if not isinstance(val, float):
                    raise TypeError(f"{what}: scalar {i} is for a {kind} parameter; pass a float, got {val!r}")
            else:
                if not isinstance(val, int) or isinstance(val, bool):
                    raise TypeError(f"{what}: scalar {i} is for a {kind} parameter; pass an int, got {val!r}")
                bits = struct.calcsize(fmt) * 8
                low, high = (0, 1 << bits) if fmt.isupper() else (-(1 << (bits - 1)), 1 << (bits - 1))
                if not low <= val < high:
                    raise ValueError(f"{what}: scalar {i} = {val} does not fit in the {kind} parameter")
        align = self.device.view_alignment
        args = [*(h.kernel_arg(align) for h in addresses), *vals]  # type: ignore[attr-defined]
        return self._run, (self.kernel, self.global_size, self.local_size, args)

    @staticmethod
    def _run(queue: Any, wait_for: list[Any], kernel: Any, gsize: Any, lsize: Any, args: list[Any]) -> Any:
        kernel.set_args(*args)  # the kernel object is used by this device's compute queue only, under its lock
        return cl.enqueue_nd_range_kernel(queue, kernel, gsize, lsize, wait_for=wait_for or None)


# ---- the engine -----------------------------------------------------------------------------------


class CLEngine(DriverEngine):
    """One in-order OpenCL command queue (with profiling) and the thread that completes its ops."""

    def __init__(self, device: str, kind: str, timeout: float, queue: Any) -> None:
        super().__init__(device, kind, timeout)
        self.queue = queue
        self.context = queue.context
        self._start()

    def _marker(self, timed: bool, wait_for: list[Any]) -> Any:
        return cl.enqueue_marker(self.queue, wait_for=wait_for or None)  # every event of the queue is timed

    def _command(self, cmd: Command, wait_for: list[Any]) -> tuple[Any, Span]:
        if cmd[0] == EXEC:
            event = cmd[2](self.queue, wait_for, *cmd[3])
        else:
            event = self._copy(cmd[3], cmd[4], cmd[5], wait_for)
        return event, (cmd[1], event, event)

    def _order_after(self, event: Any, wait_for: list[Any]) -> None:
        wait_for.append(event)

    def _host_event(self) -> Any:
        return cl.UserEvent(self.context)

    def _set_host_event(self, event: Any) -> None:
        event.set_status(cl.command_execution_status.COMPLETE)

    def _wait_event(self, event: Any) -> BaseException | None:
        return wait_event(event)

    def _clock_us(self, event: Any) -> float:
        return float(event.profile.end / 1000.0)  # the device clock, in µs

    def _span_ns(self, start: Any, end: Any) -> tuple[int, int]:
        return start.profile.start, end.profile.end

    def _driver_error(self, exc: BaseException) -> BaseException:
        if not isinstance(exc, cl.Error):
            return exc
        error = DeviceError(f"OpenCL refused it: {exc}")  # a cl.Error's repr says nothing: keep the driver's message
        error.__cause__ = exc
        return error

    def _copy(self, dst: Any, src: Any, nbytes: int, wait_for: list[Any]) -> Any:
        queue, waits = self.queue, wait_for or None
        if isinstance(dst, CLHandle) and isinstance(src, CLHandle):
            if dst.mem is src.mem and abs(dst.offset - src.offset) < nbytes:  # overlapping: OpenCL refuses it
                if dst.offset == src.offset:
                    return cl.enqueue_marker(queue, wait_for=waits)
                staging = CLHandle(cl.Buffer(self.context, cl.mem_flags.READ_WRITE, nbytes), 0, nbytes)
                self._copy(staging, src, nbytes, wait_for)  # freed by the driver once the commands are done
                return self._copy(dst, staging, nbytes, [])
            return cl.enqueue_copy(
                queue, dst.mem, src.mem, byte_count=nbytes, src_offset=src.offset, dst_offset=dst.offset, wait_for=waits
            )
        if isinstance(dst, CLHandle):
            host = _host(src, nbytes)
            return cl.enqueue_copy(queue, dst.mem, host, dst_offset=dst.offset, is_blocking=False, wait_for=waits)
        if isinstance(src, CLHandle):
            host = _host(dst, nbytes)
            return cl.enqueue_copy(queue, host, src.mem, src_offset=src.offset, is_blocking=False, wait_for=waits)
        raise DeviceError(f"{self.signal.name}: a copy with no CL memory at either end")


class CLDevice(DriverDevice):
    """An OpenCL device: buffers, OpenCL C kernels, a compute and a copy command queue."""

    kind = "CL"
    program_type = CLProgram
    allocator_type = CLAllocator
    allocator: CLAllocator

    def __init__(self, name: str) -> None:
        self.cl_device = _cl_device(name)
        self.context, _ = _platform()
        super().__init__(name)
        self.compiler = CLCompiler(self.cl_device)
        self.view_alignment: int = max(1, self.cl_device.mem_base_addr_align // 8)
        """The byte alignment a view's offset needs to be a kernel argument (a sub-buffer)."""

    def _make_engine(self, kind: str, timeout: float) -> Engine:
        props = cl.command_queue_properties.PROFILING_ENABLE
        return CLEngine(self.name, kind, timeout, cl.CommandQueue(self.context, self.cl_device, properties=props))

    def is_dtype_supported(self, dtype: DType) -> bool:
        """Every dtype but bfloat16; float64 where the device has doubles, float16 where it has cl_khr_fp16."""
        scalar = dtype.scalar()
        if scalar == dtypes.float64:
            return bool(self.cl_device.double_fp_config)
        if scalar == dtypes.float16:
            return "cl_khr_fp16" in self.cl_device.extensions
        return super().is_dtype_supported(dtype)


device_class = CLDevice
"""The class the registry opens for this kind."""
