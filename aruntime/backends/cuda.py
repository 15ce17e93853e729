"""The CUDA device: NVIDIA GPUs through cuda-core and cuda-bindings (``pip install "aruntime[cuda]"``).

``Device["CUDA"]`` is GPU 0, ``CUDA:N`` GPU N. Only the driver (``libcuda.so.1``) comes from the
system; NVRTC comes from its wheel.

Streams: each device has a compute and a copy stream (non-blocking). Each engine has a submission
thread, which enqueues an op's commands on its stream (an op waited for on another CUDA stream
becomes ``cuStreamWaitEvent`` on that op's event; a wait on any other signal is a host wait on
that thread) and records a blocking-sync event after them, and a completion thread, which blocks
in ``cuEventSynchronize`` on that event (through ctypes, so without the GIL) and then completes
the op. No Python runs on a driver thread. The one place that waits is :func:`wait_event`.

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

import ctypes
import functools
import io
import queue as queues
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from aruntime.compile import Compiler
from aruntime.device import BaseDevice, Bound, Program
from aruntime.engine import EXEC, SIGNAL, TIMESTAMP, WAIT, Command, Engine, Op, TimelineSignal, check_deps
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


class StagingPool:
    """A ring of ``count`` pinned host buffers of ``chunk`` bytes for copies from and to pageable memory.

    A copy moves ``chunk`` bytes per DMA through the next buffer of the ring. Before a buffer is used
    again, the completion ``event`` recorded after its last DMA is waited for (and, for a copy out, its
    bytes are copied on to their destination), so ``count`` chunks are in flight. ``alloc(n)`` gives a
    pinned host address (and what keeps it alive), ``record()`` an event after the work enqueued so far,
    ``wait(event)`` blocks until it has passed.
    """

    def __init__(
        self,
        count: int,
        chunk: int,
        alloc: Callable[[int], tuple[int, object]],
        record: Callable[[], object],
        wait: Callable[[object], None],
    ) -> None:
        self.chunk = chunk
        self.record = record
        self.wait = wait
        self._slots = [alloc(chunk) for _ in range(count)]
        self._pending: list[tuple[object, int, int] | None] = [None] * count  # (event, copy-out dest, bytes)
        self._next = 0

    def _take(self) -> int:
        i = self._next
        self._next = (i + 1) % len(self._slots)
        self._settle(i)
        return i

    def _settle(self, i: int) -> None:
        pending = self._pending[i]
        if pending is not None:
            event, dest, nbytes = pending
            self.wait(event)
            if dest:
                ctypes.memmove(dest, self._slots[i][0], nbytes)
            self._pending[i] = None

    def copy_in(self, dst: int, src: int, nbytes: int, dma: Callable[[int, int, int], object]) -> None:
        """Copy ``nbytes`` from host address ``src`` to device address ``dst`` with ``dma(dst, pinned, n)``."""
        for off in range(0, nbytes, self.chunk):
            n = min(self.chunk, nbytes - off)
            i = self._take()
            pinned = self._slots[i][0]
            ctypes.memmove(pinned, src + off, n)
            dma(dst + off, pinned, n)
            self._pending[i] = (self.record(), 0, n)

    def copy_out(self, dst: int, src: int, nbytes: int, dma: Callable[[int, int, int], object]) -> None:
        """Copy ``nbytes`` from device address ``src`` to host address ``dst``; returns once all are in ``dst``."""
        for off in range(0, nbytes, self.chunk):
            n = min(self.chunk, nbytes - off)
            i = self._take()
            dma(self._slots[i][0], src + off, n)
            self._pending[i] = (self.record(), dst + off, n)
        for k in range(len(self._slots)):  # the last chunks, oldest first
            self._settle((self._next + k) % len(self._slots))


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
        for what, dims in (("grid", grid), ("block", block)):
            if not (1 <= len(dims) <= 3 and all(type(d) is int and d > 0 for d in dims)):
                raise ValueError(f"{self.name}: {what} must be 1 to 3 positive ints, got {dims!r}")
        other = object.__new__(CUDAProgram)
        other.__dict__.update(self.__dict__)
        other.grid, other.block = tuple(grid), tuple(block)
        other._config = LaunchConfig(grid=other.grid, block=other.block)
        return other

    def bind(self, addresses: Sequence[int], vals: Sequence[int | float]) -> Bound:
        """The launch function the compute stream's thread calls, with arguments checked against the kernel."""
        args = pack_args(f"launch {self.name}", self.sizes, [h.ptr for h in addresses], vals)  # type: ignore[attr-defined]
        return _launch, (self.kernel, self._config, args)


def _launch(stream: Any, kernel: Any, config: Any, args: list[Any]) -> None:
    launch(stream, config, kernel, *args)


# ---- the engine -----------------------------------------------------------------------------------

_engines: weakref.WeakValueDictionary[int, CUDAEngine] = weakref.WeakValueDictionary()  # id(signal) -> engine
_DONE = None if _MISSING else EventOptions(timing_enabled=False, blocking_sync=True)
_TIMED = None if _MISSING else EventOptions(timing_enabled=True, blocking_sync=True)


class CUDAEngine(Engine):
    """One CUDA stream, the thread that enqueues on it and the thread that completes its ops."""

    def __init__(self, device: CUDADevice, kind: str, timeout: float) -> None:
        super().__init__(device.name, kind, timeout)
        self.cu = device.cu
        self.context = device.allocator.context
        self.stream = device.cu.create_stream(options=StreamOptions(nonblocking=True))
        self._pinned = LegacyPinnedMemoryResource()
        self.staging = StagingPool(STAGING, CHUNK, self._alloc_pinned, self._record, self._wait)
        self._events: dict[int, Any] = {}  # op value -> its completion event, from recording until done
        self._recorded = 0  # the last op value whose event is recorded
        self._cond = threading.Condition()
        self._epoch = self.stream.record(options=_TIMED)  # the zero of this engine's clock
        self._epoch.sync()
        self._submissions: queues.SimpleQueue[tuple[list[Command], Op] | None] = queues.SimpleQueue()
        self._completions: queues.SimpleQueue[tuple[Op | None, list[tuple[Any, ...]], Any, list[Any], Any] | None] = (
            queues.SimpleQueue()
        )
        _engines[id(self.signal)] = self
        self._threads = [
            threading.Thread(target=self._submit_loop, name=f"{self.signal.name} submit", daemon=True),
            threading.Thread(target=self._complete_loop, name=self.signal.name, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _alloc_pinned(self, size: int) -> tuple[int, object]:
        buf = self._pinned.allocate(size)
        return int(buf.handle), buf

    def _record(self) -> Any:
        return self.stream.record(options=_DONE)

    def _wait(self, event: Any) -> None:
        error = wait_event(event)
        if error is not None:
            raise error

    def _enqueue(self, cmds: list[Command], op: Op) -> None:
        self._submissions.put((cmds, op))

    def _recorded_event(self, value: int) -> Any:
        """The completion event of this engine's op ``value`` once recorded (None if already done)."""
        with self._cond:
            self._cond.wait_for(lambda: self._recorded >= value or self.signal.value >= value)
        return self._events.get(value)

    def _device_us(self, event: Any) -> float:
        return float(event - self._epoch) * 1000.0  # ms since the epoch event, in µs

    def _submit_loop(self) -> None:
        _check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        while (item := self._submissions.get()) is not None:
            cmds, op = item
            steps: list[tuple[Any, ...]] = []
            ranges: list[Any] = []
            error: BaseException | None = None
            i = -1
            try:
                if op.inputs:
                    check_deps(op, settle=False)  # an input that already failed: nothing is submitted
                for i, cmd in enumerate(cmds):  # noqa: B007 (after a failure, i says where it stopped)
                    kind = cmd[0]
                    if kind == WAIT:
                        self._wait_for(cmd[1], cmd[2], steps)
                    elif kind in (SIGNAL, TIMESTAMP):
                        steps.append((*cmd, self.stream.record(options=_TIMED if kind == TIMESTAMP else _DONE)))
                    else:
                        start = self.stream.record(options=_TIMED) if recorder.enabled else None
                        if kind == EXEC:
                            cmd[2](self.stream, *cmd[3])
                        else:
                            self._copy(cmd[3], cmd[4], cmd[5])
                        if start is not None:
                            ranges.append((cmd[1], start, self.stream.record(options=_TIMED)))
            except BaseException as exc:  # the op fails; the signals it was to set are set when the stream gets there
                error = exc
                self._fail(op, exc)
                steps.extend((SIGNAL, c[1], c[2], None) for c in cmds[i + 1 :] if c[0] == SIGNAL)
            end = self.stream.record(options=_DONE)
            with self._cond:
                self._events[op.value] = end
                self._recorded = op.value
                self._cond.notify_all()
            self._completions.put((op, steps, end, ranges, error))
        self._completions.put(None)

    def _wait_for(self, signal: TimelineSignal, value: int, steps: list[tuple[Any, ...]]) -> None:
        """Order what follows after ``signal`` reaches ``value``; ``steps`` are the op's signals so far."""
        if signal.value >= value:
            return
        other = _engines.get(id(signal))
        event = None if other is None else other._recorded_event(value)
        if event is not None:
            self.stream.wait(event)  # ordered on the device, no host wait
        elif other is None:
            if steps:  # what this op signalled so far may be what the wait needs (graph replays): set it first
                self._completions.put((None, list(steps), None, [], None))
                steps.clear()
            signal.wait(value)  # a signal no CUDA stream sets: wait for it here (times out after its timeout)

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

    def _complete_loop(self) -> None:
        _check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        while (item := self._completions.get()) is not None:
            op, steps, end, ranges, error = item
            for step in steps:
                event = step[-1]
                if event is not None:
                    error = error or wait_event(event)
                if step[0] == SIGNAL:
                    step[1].set(step[2])
                elif error is None:
                    step[1].append(self._device_us(event))
            if op is None:  # the signals of an op whose submission waits on the host for another signal
                continue
            error = error or wait_event(end)
            if error is None and op.inputs:
                try:
                    check_deps(op)  # a producer on another queue failed after this op was enqueued
                except BaseException as exc:
                    error = exc
            if error is None:
                for name, start, stop in ranges:
                    self.ranges.add(name, int(self._device_us(start) * 1000), int(self._device_us(stop) * 1000), op.id)
            self._events.pop(op.value, None)
            self._complete(op, error)

    def close(self) -> None:
        """Stop accepting work; wait until what was submitted has completed (unless called from its threads)."""
        super().close()
        if threading.current_thread() not in self._threads:
            for t in self._threads:
                t.join()

    def _stop(self) -> None:
        self._submissions.put(None)


def _is_pinned(address: int) -> bool:
    """Whether host ``address`` is page-locked memory the driver knows (allocated or registered with it)."""
    err, kind = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
    return int(err) == 0 and int(kind) == int(driver.CUmemorytype.CU_MEMORYTYPE_HOST)


def _htod(stream: Any, dst: int, src: int, nbytes: int) -> None:
    _check(driver.cuMemcpyHtoDAsync(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


def _dtoh(stream: Any, dst: int, src: int, nbytes: int) -> None:
    _check(driver.cuMemcpyDtoHAsync(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")


def _enqueued(dst: int, src: int, nbytes: int) -> None:
    raise DeviceError("CUDA copies are enqueued by the CUDA engine; copy_fn is not called")


class CUDADevice(BaseDevice):
    """An NVIDIA GPU: device memory, CUDA C++ kernels, a compute and a copy stream."""

    copies_host = True

    kind = "CUDA"
    program_type = CUDAProgram
    allocator_type = CUDAAllocator
    compiler_type = None
    copy_fn = staticmethod(_enqueued)
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
