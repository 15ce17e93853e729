"""The CUDA device: NVIDIA GPUs through cuda-core and cuda-bindings (``pip install "aruntime[cuda]"``).

``Device["CUDA"]`` is GPU 0, ``CUDA:N`` GPU N. Only the driver (``libcuda.so.1``) comes from the
system; NVRTC comes from its wheel.

Streams: each device has a compute and a copy stream (non-blocking). Each engine has a submission
thread, which enqueues an op's commands on its stream (an op waited for on another CUDA stream
becomes ``cuStreamWaitEvent`` on that op's event; a wait on any other signal is a host wait on
that thread) and records a blocking-sync event after them, and a completion thread, which blocks
in ``cuEventSynchronize`` on that event (through ctypes, so without the GIL) and then completes
the op. No Python runs on a driver thread. The one place that waits is :func:`wait_event`.
High-priority ops (``priority=-1``) go to a compute and a copy stream of their own, created on first
use with CUDA stream priority -1 (``cuStreamCreateWithPriority``, clamped by the driver to the
device's range): the GPU's scheduler prefers their blocks over queued blocks of the normal streams.
The host side adds no ordering of its own. (Not yet run on hardware.)

Memory is ``cuMemAlloc`` device memory behind the LRU cache. Host copies from or to pinned memory
(see :meth:`CUDADevice.pinned`) are one DMA; pageable memory goes through a ring of pinned
staging buffers, :data:`CHUNK` bytes at a time with :data:`STAGING` chunks in flight
(:class:`StagingPool`). Transfers between CUDA devices are ``cuMemcpyAsync`` on unified addresses
(peer to peer where the GPUs allow it).

Kernels are CUDA C++ compiled by NVRTC for the device's architecture (through the compile cache)
and declared ``extern "C" __global__``. ``launch(prog, *bufs, vals=...)`` passes each buffer as a
pointer, then each scalar, checked against the kernel's parameter sizes: an ``int`` becomes a
signed integer of its parameter's size (range checked), a ``float`` a ``float`` (4 bytes) or a
``double`` (8 bytes). A kernel runs as ``prog.grid`` blocks of ``prog.block`` threads (default one
thread); ``prog.sized(grid, block)`` gives a copy with other sizes.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import io
from collections.abc import Sequence
from typing import Any

from aruntime.backends._driver_queue import DriverDevice, Span, StagingPool, ThreadedDriverEngine, launch_dims
from aruntime.compile import Compiler
from aruntime.device import BaseDevice, Bound, Program
from aruntime.engine import EXEC, Command, Engine
from aruntime.errors import CompileError, DeviceError
from aruntime.events import recorder
from aruntime.memory import BufferSpec, LRUAllocator

try:
    from cuda.bindings import driver, nvrtc
    from cuda.core import (
        Device as CoreDevice,
    )
    from cuda.core import (
        EventOptions,
        LaunchConfig,
        LegacyPinnedMemoryResource,
        ObjectCode,
        ProgramOptions,
        StreamOptions,
        launch,
    )
    from cuda.core import (
        Program as NVRTCProgram,
    )
except ImportError as exc:  # reported when a CUDA device is opened
    _MISSING: str | None = f"{exc}; install it with: pip install 'aruntime[cuda]'"
else:
    _MISSING = None

CHUNK = 2 << 20
"""Bytes per pinned staging buffer: a copy from or to pageable memory moves this much per DMA."""
STAGING = 4
"""Staging buffers per copy stream, so this many chunks of one copy are in flight."""


# ---- the driver -----------------------------------------------------------------------------------


def _check(result: tuple[Any, ...], what: str) -> Any:
    """The values of a cuda-bindings call's ``(error, *values)``; a DeviceError (MemoryError when out of memory)."""
    err, *values = result
    if int(err) != 0:
        message = f"{what} failed: {err!r}"
        if int(err) == 2:  # CUDA_ERROR_OUT_OF_MEMORY
            raise MemoryError(message)
        raise DeviceError(message)
    return values[0] if len(values) == 1 else tuple(values)


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuEventSynchronize.argtypes = [ctypes.c_void_p]
    lib.cuEventSynchronize.restype = ctypes.c_int
    return lib


def wait_event(event: Any) -> BaseException | None:
    """Block (without the GIL) until the blocking-sync ``event`` has completed; the error if the work before
    it failed. This is the one place a CUDA completion thread waits on the driver."""
    status = _libcuda().cuEventSynchronize(int(event.handle))
    return None if status == 0 else DeviceError(f"CUDA work failed: cuEventSynchronize returned {status}")


def _open(name: str) -> Any:
    """The cuda-core device of ``CUDA`` / ``CUDA:N``, made current on this thread."""
    if _MISSING is not None:
        raise DeviceError(f"{name} needs cuda-core: {_MISSING}")
    try:
        devices = CoreDevice.get_all_devices()
    except Exception as exc:  # no libcuda (cuda-pathfinder's error), or the driver refused to start
        raise DeviceError(f"{name}: no usable NVIDIA driver: {exc}") from exc
    index = int(name.partition(":")[2] or 0)
    if index >= len(devices):
        raise DeviceError(f"{name}: this machine has {len(devices)} CUDA device(s)")
    dev = CoreDevice(index)
    dev.set_current()
    return dev


# ---- memory ---------------------------------------------------------------------------------------


class CUDAMem:
    """A device pointer (a root allocation, or a view's place in one) and its size."""

    __slots__ = ("nbytes", "ptr")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"<CUDAMem {self.nbytes} B at {self.ptr:#x}>"


class CUDAAllocator(LRUAllocator[CUDAMem]):
    """``cuMemAlloc`` device memory, cached for reuse; ``external_ptr`` wraps a caller's device pointer."""

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.context = _open(device).context.handle

    def _current(self) -> None:
        _check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def _alloc(self, size: int, spec: BufferSpec) -> CUDAMem:
        if spec.external_ptr is not None:
            return CUDAMem(spec.external_ptr, size)
        self._current()
        return CUDAMem(int(_check(driver.cuMemAlloc(size), f"{self.device}: cuMemAlloc of {size} bytes")), size)

    def _free(self, handle: CUDAMem, size: int, spec: BufferSpec) -> None:
        if spec.external_ptr is None:
            self._current()
            _check(driver.cuMemFree(handle.ptr), f"{self.device}: cuMemFree")

    def _copyin(self, dest: CUDAMem, src: memoryview) -> None:
        self._current()
        holder = (ctypes.c_char * src.nbytes).from_buffer_copy(src) if src.readonly else None
        address = ctypes.addressof(holder) if holder is not None else _address(src)
        _check(driver.cuMemcpyHtoD(dest.ptr, address, src.nbytes), f"{self.device}: cuMemcpyHtoD")

    def _copyout(self, dest: memoryview, src: CUDAMem) -> None:
        self._current()
        _check(driver.cuMemcpyDtoH(_address(dest), src.ptr, dest.nbytes), f"{self.device}: cuMemcpyDtoH")

    def _offset(self, handle: CUDAMem, size: int, offset: int) -> CUDAMem:
        return CUDAMem(handle.ptr + offset, size)


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B")))


# ---- kernels --------------------------------------------------------------------------------------


def pack_args(what: str, sizes: Sequence[int], pointers: Sequence[int], vals: Sequence[int | float]) -> list[Any]:
    """The ctypes values of a launch: ``pointers`` for the first parameters, then ``vals``, each checked
    against its parameter's size (an int: a signed integer of that size; a float: float or double)."""
    if len(pointers) + len(vals) != len(sizes):
        got = f"{len(pointers)} buffer(s) and {len(vals)} scalar(s)"
        raise TypeError(f"{what}: the kernel takes {len(sizes)} parameter(s), got {got}")
    args: list[Any] = []
    for i, ptr in enumerate(pointers):
        if sizes[i] != 8:
            raise TypeError(f"{what}: parameter {i} is {sizes[i]} bytes, not a pointer for buffer {i}")
        args.append(ctypes.c_uint64(ptr))
    ints = {1: ctypes.c_int8, 2: ctypes.c_int16, 4: ctypes.c_int32, 8: ctypes.c_int64}
    floats = {4: ctypes.c_float, 8: ctypes.c_double}
    for i, val in enumerate(vals):
        size = sizes[len(pointers) + i]
        if isinstance(val, float):
            if size not in floats:
                raise TypeError(f"{what}: scalar {i} is a float, but its parameter is {size} bytes")
            args.append(floats[size](val))
            continue
        if size not in ints:
            raise TypeError(f"{what}: scalar {i} is an int, but its parameter is {size} bytes")
        bits = size * 8
        if not -(1 << (bits - 1)) <= val < 1 << (bits - 1):
            raise ValueError(f"{what}: scalar {i} = {val} does not fit in its {size}-byte parameter")
        args.append(ints[size](val))
    return args


class NVRTCCompiler(Compiler):
    """NVRTC (from its wheel) compiling CUDA C++ to a cubin for one architecture."""

    def __init__(self, arch: str) -> None:
        super().__init__(None)
        self.arch = arch
        version = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
        self._key = self.make_cachekey("CUDA", f"nvrtc {version}", arch)

    @property
    def cachekey(self) -> str:
        """``CUDA_<hash of the NVRTC version and the architecture>``."""
        return self._key

    def compile(self, src: str) -> bytes:
        log = io.StringIO()
        try:
            code = NVRTCProgram(src, "c++", ProgramOptions(arch=self.arch)).compile("cubin", logs=log)
        except Exception as exc:
            raise CompileError(f"NVRTC failed for {self.arch}:\n{log.getvalue().strip() or exc}") from None
        return bytes(code.code)


class CUDAProgram(Program):
    """A kernel loaded from the cubin; runs as ``grid`` blocks of ``block`` threads."""

    def __init__(self, device: BaseDevice, name: str, lib: bytes, outs: Sequence[int] | None = None) -> None:
        super().__init__(device, name, lib, outs)
        assert isinstance(device, CUDADevice)
        device.allocator._current()  # loading a module needs the context on this (worker) thread
        try:
            self.kernel = ObjectCode.from_cubin(lib).get_kernel(name)
        except Exception as exc:
            raise CompileError(f"the compiled module has no kernel {name!r}: {exc}") from None
        self.sizes = tuple(size for _, size in self.kernel.arguments_info)
        self.grid: tuple[int, ...] = (1,)
        self.block: tuple[int, ...] = (1,)
        self._config = LaunchConfig(grid=self.grid, block=self.block)

    def sized(self, grid: Sequence[int], block: Sequence[int]) -> CUDAProgram:
        """This kernel as ``grid`` blocks of ``block`` threads (1 to 3 positive ints each)."""
        other = copy.copy(self)
        other.grid, other.block = launch_dims(self.name, "grid", grid), launch_dims(self.name, "block", block)
        other._config = LaunchConfig(grid=other.grid, block=other.block)
        return other

    def bind(self, addresses: Sequence[int], vals: Sequence[int | float]) -> Bound:
        """The launch function the compute stream's thread calls, with arguments checked against the kernel."""
        args = pack_args(f"launch {self.name}", self.sizes, [h.ptr for h in addresses], vals)  # type: ignore[attr-defined]
        return _launch, (self.kernel, self._config, args)


def _launch(stream: Any, kernel: Any, config: Any, args: list[Any]) -> None:
    launch(stream, config, kernel, *args)


# ---- the engine -----------------------------------------------------------------------------------

_DONE = None if _MISSING else EventOptions(timing_enabled=False, blocking_sync=True)
_TIMED = None if _MISSING else EventOptions(timing_enabled=True, blocking_sync=True)


class CUDAEngine(ThreadedDriverEngine):
    """One CUDA stream, the thread that enqueues on it and the thread that completes its ops."""

    def __init__(self, device: CUDADevice, kind: str, timeout: float) -> None:
        super().__init__(device.name, kind, timeout)
        self.cu = device.cu
        self.context = device.allocator.context
        self.stream = device.cu.create_stream(options=StreamOptions(nonblocking=True, priority=self.priority or None))
        self._pinned = LegacyPinnedMemoryResource()
        self.staging = StagingPool(STAGING, CHUNK, self._alloc_pinned, self._record, self._sync)
        self._epoch = self.stream.record(options=_TIMED)  # the zero of this engine's clock
        self._epoch.sync()
        self._start()

    def _alloc_pinned(self, size: int) -> tuple[int, object]:
        buf = self._pinned.allocate(size)
        return int(buf.handle), buf

    def _record(self) -> Any:
        return self.stream.record(options=_DONE)

    def _sync(self, event: Any) -> None:
        error = wait_event(event)
        if error is not None:
            raise error

    def _on_thread(self) -> None:
        _check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def _marker(self, timed: bool, wait_for: list[Any]) -> Any:
        return self.stream.record(options=_TIMED if timed else _DONE)

    def _command(self, cmd: Command, wait_for: list[Any]) -> tuple[Any, Span | None]:
        start = self.stream.record(options=_TIMED) if recorder.enabled else None
        if cmd[0] == EXEC:
            cmd[2](self.stream, *cmd[3])
        else:
            self._copy(cmd[3], cmd[4], cmd[5])
        if start is None:
            return None, None
        return None, (cmd[1], start, self.stream.record(options=_TIMED))

    def _order_after(self, event: Any, wait_for: list[Any]) -> None:
        self.stream.wait(event)

    def _end(self, last: Any) -> Any:
        return self.stream.record(options=_DONE)

    def _wait_event(self, event: Any) -> BaseException | None:
        return wait_event(event)

    def _clock_us(self, event: Any) -> float:
        return float(event - self._epoch) * 1000.0  # ms since the epoch event, in µs

    def _span_ns(self, start: Any, end: Any) -> tuple[int, int]:
        return int(self._clock_us(start) * 1000), int(self._clock_us(end) * 1000)

    def _copy(self, dst: Any, src: Any, nbytes: int) -> None:
        stream = self.stream.handle
        if isinstance(dst, CUDAMem) and isinstance(src, CUDAMem):
            if abs(dst.ptr - src.ptr) < nbytes and dst.ptr != src.ptr:  # overlapping: through a temporary
                tmp = _check(driver.cuMemAllocAsync(nbytes, stream), "cuMemAllocAsync")
                _check(driver.cuMemcpyAsync(tmp, src.ptr, nbytes, stream), "cuMemcpyAsync")
                _check(driver.cuMemcpyAsync(dst.ptr, tmp, nbytes, stream), "cuMemcpyAsync")
                _check(driver.cuMemFreeAsync(tmp, stream), "cuMemFreeAsync")
            elif dst.ptr != src.ptr:
                _check(driver.cuMemcpyAsync(dst.ptr, src.ptr, nbytes, stream), "cuMemcpyAsync")  # unified addressing
        elif isinstance(dst, CUDAMem):
            if _is_pinned(src):
                _check(driver.cuMemcpyHtoDAsync(dst.ptr, src, nbytes, stream), "cuMemcpyHtoDAsync")
            else:
                self.staging.copy_in(dst.ptr, src, nbytes, functools.partial(_htod, stream))
        elif isinstance(src, CUDAMem):
            if _is_pinned(dst):
                _check(driver.cuMemcpyDtoHAsync(dst, src.ptr, nbytes, stream), "cuMemcpyDtoHAsync")
            else:
                self.staging.copy_out(dst, src.ptr, nbytes, functools.partial(_dtoh, stream))
        else:
            raise DeviceError(f"{self.signal.name}: a copy with no CUDA memory at either end")


def _is_pinned(address: int) -> bool:
    """Whether host ``address`` is page-locked memory the driver knows (allocated or registered with it)."""
    err, kind = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
    return int(err) == 0 and int(kind) == int(driver.CUmemorytype.CU_MEMORYTYPE_HOST)


def _htod(stream: Any, dst: int, src: int, nbytes: int) -> None:
    _check(driver.cuMemcpyHtoDAsync(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


def _dtoh(stream: Any, dst: int, src: int, nbytes: int) -> None:
    _check(driver.cuMemcpyDtoHAsync(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")


class CUDADevice(DriverDevice):
    """An NVIDIA GPU: device memory, CUDA C++ kernels, a compute and a copy stream."""

    kind = "CUDA"
    program_type = CUDAProgram
    allocator_type = CUDAAllocator
    allocator: CUDAAllocator

    def __init__(self, name: str) -> None:
        self.cu = _open(name)
        super().__init__(name)
        major, minor = self.cu.compute_capability
        self.compiler = NVRTCCompiler(f"sm_{major}{minor}")

    def _make_engine(self, kind: str, timeout: float) -> Engine:
        return CUDAEngine(self, kind, timeout)

    def pinned(self, nbytes: int) -> memoryview:
        """``nbytes`` of page-locked host memory: a copy from or to it is one DMA, with no staging."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"{self.name}: pinned memory size must be a positive int, got {nbytes!r}")
        buf = LegacyPinnedMemoryResource().allocate(nbytes)
        array = (ctypes.c_char * nbytes).from_address(int(buf.handle))
        array.keep = buf  # type: ignore[attr-defined]  # freed with the last view of it
        return memoryview(array).cast("B")


device_class = CUDADevice
"""The class the registry opens for this kind."""
