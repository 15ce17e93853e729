"""The driver's side of a RAY device: the device, its engines and allocator, and the ordered calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import pickle
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import anyio

from aruntime.backends.ray.host import actor_class
from aruntime.backends.ray.nodes import node_id
from aruntime.backends.ray.wire import (
    RemoteHandle,
    Result,
    decode,
    first_line,
    materialize,
    ray,
    unpack_error,
)
from aruntime.device import BaseDevice, Program, Window
from aruntime.device.args import _indices
from aruntime.dtype import DType, dtypes
from aruntime.engine import COPY, EXEC, SIGNAL, WAIT, Command, Engine, Op, Sample, check_deps, estimate_offset
from aruntime.errors import BufferUsageError, DeviceError, DeviceLost, OpError, SignalTimeout
from aruntime.events import DeviceEvent, RangeEvent, now_us, recorder
from aruntime.helpers import after_all, canonicalize, checkpoint
from aruntime.memory import Buffer, BufferSpec, LRUAllocator, host_view

MAX_CONCURRENCY = 10_000
"""Calls an actor runs at once (its ops; they wait for their turn, then for their op)."""


class RemoteProgram(Program):
    """A kernel compiled on the remote host; launches name it by id."""

    def __init__(self, device: BaseDevice, name: str, pid: int, outs: Sequence[int] | None) -> None:
        super().__init__(device, name, b"", outs)
        self.pid = pid


class RemoteAllocator(LRUAllocator[RemoteHandle]):
    """Remote memory, allocated and freed by calls of the device's actor (in order with its ops).

    Freed handles are cached for reuse like any device's, so reusing a buffer costs no call.
    """

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.remote: RemoteDevice | None = None  # set by the device right after it makes its allocator
        self._ids = itertools.count(1)
        self.pending: dict[int, concurrent.futures.Future[Result]] = {}  # allocations not yet confirmed

    def _device(self) -> RemoteDevice:
        assert self.remote is not None
        return self.remote

    def _alloc(self, size: int, spec: BufferSpec) -> RemoteHandle:
        if spec.external_ptr is not None:
            raise BufferUsageError(f"{self.device}: remote memory cannot wrap a local pointer")
        hid = next(self._ids)
        self.pending[hid] = self._device().call("alloc", (hid, size, spec))
        return RemoteHandle(hid, 0, size)

    def failed(self, hid: int) -> BaseException | None:
        """Why the remote allocation of handle ``hid`` failed, once its answer says it did."""
        answer = self.pending.get(hid)
        if answer is None or not answer.done():
            return None
        if answer.exception() is not None:
            return answer.exception()
        failure = decode(answer.result())[1]
        return None if failure is None else unpack_error(failure)

    def free(self, handle: RemoteHandle, size: int, spec: BufferSpec | None = None) -> None:
        if self.failed(handle.id) is not None:  # never allocated remotely: nothing to keep for reuse or free
            del self.pending[handle.id]
            return
        super().free(handle, size, spec)

    def _free(self, handle: RemoteHandle, size: int, spec: BufferSpec) -> None:
        self.pending.pop(handle.id, None)
        dev = self._device()
        if dev.lost is None:
            dev.call("free", (handle.id,), answered=False)

    def _offset(self, handle: RemoteHandle, size: int, offset: int) -> RemoteHandle:
        return RemoteHandle(handle.id, handle.offset + offset, size)

    def _copyin(self, dest: RemoteHandle, src: memoryview) -> None:
        name = f"copyin {src.nbytes} B"
        self._device().call_blocking("copyin", (dest, name), pickle.PickleBuffer(src.cast("B")))

    def _copyout(self, dest: memoryview, src: RemoteHandle) -> None:
        payload = self._device().call_blocking("export", (src, f"copyout {src.nbytes} B"))
        dest.cast("B")[:] = materialize(payload)


def _store_host(address: int, nbytes: int, payload: Any) -> None:
    host_view(address, nbytes)[:] = materialize(payload)


def _store_local(dev: BaseDevice, handle: Any, payload: Any) -> None:
    dev.allocator._copyin(handle, materialize(payload))


def _no_copy(dst: int, src: int, nbytes: int) -> None:
    """What a RAY device's copy commands name: its engines send them to the actor instead."""
    raise NotImplementedError("a RAY device's copies run on its host")


_LAUNCH = "launch"
_TRANSFER = "transfer"


class _Call:
    """One op's actor calls, from being handed to its engine until it is complete."""

    __slots__ = ("done", "error", "op", "store", "target")

    def __init__(self, op: Op, target: RemoteDevice) -> None:
        self.op = op
        self.target = target  # the device whose actor's answer completes the op
        self.store: Callable[[Any], None] | None = None  # what to do with the answer's value (a copy-out)
        self.error: BaseException | None = None
        self.done = False


class RayEngine(Engine):
    """One queue (compute or copy) of a RAY device; its ops become calls of the device's actor.

    The driver's hazard tracking still decides when an op is handed over; the
    wait commands it adds are dropped, because the remote device, which gets the
    ops in the same order, orders them itself. Ops complete in order.
    """

    def __init__(self, device: RemoteDevice, kind: str, timeout: float) -> None:
        super().__init__(device.name, kind, timeout)
        self.remote = device
        self.inflight: deque[_Call] = deque()  # in value order; completed from the head

    def check_open(self, what: str) -> None:
        lost = self.remote.lost
        if lost is not None:
            raise DeviceError(f"{what}: {self.remote.name} is lost ({lost}); close it and open it again")
        super().check_open(what)

    def _enqueue(self, cmds: list[Command], op: Op) -> None:
        call = _Call(op, self.remote)
        self.inflight.append(call)
        own = [cmd for cmd in cmds if cmd[0] != WAIT]
        try:
            if len(own) != 1 or (own[0][0] == EXEC and own[0][2] not in (_LAUNCH, _TRANSFER)):
                for cmd in own:  # engines waiting on this queue's signals go on, and find the op failed
                    if cmd[0] == SIGNAL:
                        cmd[1].set(cmd[2])
                raise DeviceError(f"{op.name}: {self.remote.name} runs the ops of its own methods only (no graphs)")
            self._plan(own[0], op, call)
        except Exception as exc:  # nothing was sent for it
            self.remote.finish(call, exc)

    def _plan(self, cmd: Command, op: Op, call: _Call) -> None:
        dev = self.remote
        if cmd[0] == COPY:  # BaseDevice.copyin / copyout: between host memory and a remote buffer
            _, name, _, dst, src, nbytes = cmd
            if isinstance(dst, RemoteHandle):
                dev.call("copyin", (dst, name), call, data=pickle.PickleBuffer(host_view(src, nbytes)))
            else:
                call.store = partial(_store_host, dst, nbytes)
                dev.call("export", (src, name), call)
            return
        _, name, action, args = cmd
        if action == _LAUNCH:
            dev.call("launch", (name, *args), call)
            return
        dst_dev, dst, src_dev, src, writers = args
        if dst_dev is src_dev:
            dev.call("copy", (dst, src, name), call)
        elif isinstance(dst_dev, RemoteDevice) and isinstance(src_dev, RemoteDevice):  # host to host
            call.target = dst_dev
            dst_seq = dst_dev.reserve()  # the import's place in the destination's order is taken now

            def sent(ref: Any) -> None:
                dst_dev.call("import", (dst, name, src_dev.name, "ref"), call, dst_seq, data=[ref])

            src_dev.call("export", (src, name), on_sent=sent, answered=False)
        else:  # with a local device: through the driver, once the local bytes are ready
            remote = dst_dev if isinstance(dst_dev, RemoteDevice) else src_dev
            assert isinstance(remote, RemoteDevice)
            seq = remote.reserve()
            if remote is dst_dev:  # the driver reads the source once the ops that write it are done
                pending = [dep for dep in writers if not dep.done()]

                def send() -> None:
                    try:
                        check_deps(op)
                        data = bytearray(dst.nbytes)
                        src_dev.allocator._copyout(memoryview(data), src)
                    except Exception:
                        remote.call("skip", (), seq=seq, answered=False)  # its place in the order is passed on
                        raise
                    args = (dst, name, src_dev.name, "data")
                    remote.call("import", args, call, seq, data=pickle.PickleBuffer(data))

            else:  # the remote device orders the export after its own ops; the driver waits for the others
                own = (remote.compute, remote.copy)
                pending = [dep for dep in op.deps if not dep.done() and dep.engine not in own]
                call.store = partial(_store_local, dst_dev, dst)

                def send() -> None:
                    remote.call("export", (src, name), call, seq)

            if not pending:
                send()
                return
            one_done = after_all(len(pending), partial(_send_guarded, remote, call, send))
            for dep in pending:
                dep.when_done(one_done)


def _owner(call: _Call) -> RemoteDevice:
    """The device whose completion thread completes ``call``'s op: its engine's (a transfer between two RAY
    devices is answered by the destination but belongs to the source's copy queue)."""
    engine = call.op.engine
    assert isinstance(engine, RayEngine)
    return engine.remote


def _send_guarded(dev: RemoteDevice, call: _Call, send: Callable[[], None]) -> None:
    try:
        send()
    except Exception as exc:
        dev.finish(call, exc)


class RemoteDevice(BaseDevice):
    """A device of any kind on a Ray node, driven through an actor that owns it (see the module docstring)."""

    kind = "RAY"
    routes_transfers = True
    program_type = RemoteProgram
    allocator_type = RemoteAllocator
    allocator: RemoteAllocator
    copy_fn = staticmethod(_no_copy)
    holds_ops = False  # an op waiting for another queue waits on the remote host, not in the driver
    has_priorities = False  # the remote host runs a device's calls in one order

    @classmethod
    def check_name(cls, name: str) -> None:
        """A RAY device is named ``RAY:<host>/<device>``."""
        _, _, rest = name.partition(":")
        host, sep, inner = rest.partition("/")
        if not (sep and host and inner):
            raise DeviceError(
                f"{name}: a RAY device is named RAY:<host>/<device>, e.g. RAY:any/CPU:1 "
                "(host: any, or a live node's name, id (or a prefix of 8+ hex digits), IP address or host name)"
            )

    def __init__(self, name: str) -> None:
        self.check_name(name)
        host, _, inner = name.partition(":")[2].partition("/")
        if ray is None:
            raise DeviceError(f"{name}: RAY devices need Ray: pip install 'aruntime[ray]'")
        inner = canonicalize(inner)
        if inner.partition(":")[0] == "RAY":
            raise DeviceError(f"{name}: the remote device cannot itself be a RAY device")
        self.inner = inner
        """The name of the device the actor opened on its host."""
        self.lost: str | None = None
        """Why the device is lost (its actor died), or None."""
        self._seq = itertools.count()
        self._next_send = 0
        self._ready: dict[int, Callable[[], None]] = {}
        self._send_lock = threading.Lock()
        self._sending = False
        self._answers: queue.SimpleQueue[tuple[_Call, Any] | None] = queue.SimpleQueue()
        if not ray.is_initialized():
            ray.init()
        options: dict[str, Any] = {"max_concurrency": MAX_CONCURRENCY, "num_cpus": 0}
        if host != "any":
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id(name, host), soft=False)
        self.actor = actor_class().options(**options).remote(inner, name)
        self._run = self.actor.run
        try:
            info, failure = ray.get(self.actor.host.remote(), timeout=60)
        except Exception as exc:
            ray.kill(self.actor)
            raise DeviceError(f"{name}: its Ray actor did not start: {first_line(exc)}") from exc
        if failure is not None:
            ray.kill(self.actor)
            raise DeviceError(f"{name}: {inner} could not be opened on its host: {unpack_error(failure)}")
        self.host: dict[str, Any] = info
        """Where the remote device is: the Ray node id, its IP address, host name and the actor's pid."""
        super().__init__(name)
        self.allocator.remote = self
        self._completer = threading.Thread(target=self._complete_calls, name=f"{name} completions", daemon=True)
        self._completer.start()

    def _make_engine(self, kind: str, timeout: float) -> Engine:
        return RayEngine(self, kind, timeout)

    # ---- calls --------------------------------------------------------------------------------------

    def reserve(self) -> int:
        """The next place in this device's call order."""
        return next(self._seq)

    def call(
        self,
        step: str,
        args: tuple[Any, ...],
        call: _Call | None = None,
        seq: int | None = None,
        on_sent: Callable[[Any], None] | None = None,
        answered: bool = True,
        data: Any = None,
    ) -> concurrent.futures.Future[Result]:
        """Send the actor call ``step(*args)`` in its place ``seq`` of the order (default: the next), once
        every earlier call is sent; ``call``'s op completes with its answer. Without a ``call``, returns the
        answer's future (left pending when not ``answered``: the answer is then never fetched to the driver).
        ``data`` (bytes to copy in, or an export's ObjectRef in a list) travels as its own argument; the rest
        is pickled into one bytes header, the cheapest argument Ray passes."""
        if seq is None:
            seq = next(self._seq)
        answer: concurrent.futures.Future[Result] = concurrent.futures.Future()

        def send() -> None:
            try:
                header = pickle.dumps((seq, step, args, recorder.enabled), protocol=pickle.HIGHEST_PROTOCOL)
                ref = self._run.remote(header) if data is None else self._run.remote(header, data)
            except Exception as exc:
                answer.set_exception(exc)
                if call is not None:
                    self.finish(call, exc)
                return
            if on_sent is not None:
                on_sent(ref)
            if call is not None:
                ref.future().add_done_callback(partial(RemoteDevice._answer, call))
            elif answered:
                ref.future().add_done_callback(partial(_relay, answer))

        with self._send_lock:
            self._ready[seq] = send
            if self._sending:  # the thread that is sending sends this one too, in its turn
                return answer
            self._sending = True
        while True:  # send what is ready, in order, without holding the lock (a send may post to another device)
            with self._send_lock:
                ready = self._ready.pop(self._next_send, None)
                if ready is None:
                    self._sending = False
                    return answer
                self._next_send += 1
            ready()

    def call_blocking(self, step: str, args: tuple[Any, ...], data: Any = None) -> Any:
        """:meth:`call`, waiting on this thread for the value; raises the remote error."""
        value, failure, _ = decode(self.call(step, args, data=data).result(self.timeout))
        if failure is not None:
            raise unpack_error(failure)
        return value

    async def _wait(self, answer: concurrent.futures.Future[Any], what: str) -> Any:
        """Wait for ``answer`` on any event loop; an actor that died raises :class:`DeviceError`."""
        limit = self.timeout
        with anyio.move_on_after(limit):
            await settled(answer)
        if not answer.done():
            raise SignalTimeout(f"{what} on {self.name}: no answer from its actor within {limit:g} s")
        try:
            return answer.result()
        except ray.exceptions.RayActorError as exc:
            self._mark_lost(exc)
            raise DeviceError(f"{what}: {self.name} is lost ({self.lost})") from exc

    def _mark_lost(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = f"its Ray actor died: {first_line(exc)}"

    @staticmethod
    def _answer(call: _Call, answer: concurrent.futures.Future[Any]) -> None:
        _owner(call)._answers.put((call, answer))  # on Ray's thread: nothing more

    @staticmethod
    def finish(call: _Call, error: BaseException) -> None:
        """Complete ``call``'s op with ``error`` (in order with the other ops of its engine)."""
        _owner(call)._answers.put((call, error))

    def _complete_calls(self) -> None:
        while (item := self._answers.get()) is not None:
            call, outcome = item
            call.error = self._outcome(call, outcome)
            call.done = True
            engine = call.op.engine
            assert isinstance(engine, RayEngine)
            inflight = engine.inflight
            while inflight and inflight[0].done:
                done = inflight.popleft()
                engine._complete(done.op, done.error)

    def _outcome(self, call: _Call, outcome: Any) -> BaseException | None:
        """The error ``call``'s op fails with, or None once its answer's value is stored."""
        op = call.op
        queue_name = op.engine.signal.name if op.engine is not None else self.name
        if isinstance(outcome, BaseException):
            return outcome
        try:
            value, failure, ranges = decode(outcome.result())
        except ray.exceptions.RayActorError as exc:
            call.target._mark_lost(exc)
            return DeviceLost(f"{op.name} failed on {queue_name}: {call.target.name} is lost ({call.target.lost})")
        except Exception as exc:
            return exc
        if ranges and recorder.enabled:
            device = call.target.name
            recorder.add(RangeEvent(device, name, s, e, copy, op.id) for name, s, e, copy in ranges)
        if failure is not None:
            error = unpack_error(failure)
            if isinstance(error, DeviceError) and not isinstance(error, OpError):
                return DeviceLost(f"{op.name} failed on {queue_name}: {error}")
            return error
        if call.store is not None:
            try:
                call.store(value)
            except Exception as exc:
                return exc
        return None

    # ---- the device API -----------------------------------------------------------------------------

    def _refuse_if_lost(self, what: str) -> None:
        self.compute.check_open(what)

    async def allocate(self, size: int, dtype: DType = dtypes.uint8, spec: BufferSpec | None = None) -> Buffer:
        """A new buffer of ``size`` elements of ``dtype``, allocated on the remote host (waits for it there).
        A checkpoint first, also when the allocator has the memory cached: a cancelled call allocates nothing."""
        await checkpoint()
        self._refuse_if_lost("allocate")
        buf = Buffer(self.name, size, dtype, spec, preallocate=True)
        hid = buf.handle.id
        answer = self.allocator.pending.get(hid)
        if answer is not None:  # a new remote allocation, not a cached one
            await self._wait(answer, "allocate")
            error = self.allocator.failed(hid)
            if error is not None:
                buf.deallocate()  # drops the handle
                raise error
            del self.allocator.pending[hid]
        return buf

    async def compile(self, src: str, name: str = "kernel", outs: Sequence[int] | None = None) -> Program:
        """Send ``src`` to the remote host, which compiles it (its compiler and compile cache) and loads
        kernel ``name``; launches then name the program, the source is not sent again."""
        if not isinstance(src, str) or not isinstance(name, str):
            raise TypeError("compile: src and name must be str")
        if outs is not None:
            outs = _indices(f"compile {name}", outs)
        self._refuse_if_lost(f"compile {name}")
        pid, failure = await self._wait(self.actor.compile.remote(src, name, outs).future(), f"compile {name}")
        if failure is not None:
            raise unpack_error(failure)
        return RemoteProgram(self, name, pid, outs)

    def _launch_command(
        self, prog: Program, bufs: Sequence[Buffer], vals: Sequence[int | float], writes: Sequence[Buffer]
    ) -> Command:
        """A launch names the remote program and says which buffers it writes (see :meth:`BaseDevice.launch`)."""
        assert isinstance(prog, RemoteProgram)
        written = tuple(i for i, buf in enumerate(bufs) if any(buf is w for w in writes))
        return (EXEC, prog.name, _LAUNCH, (prog.pid, tuple(b._handle for b in bufs), tuple(vals), written))

    def _transfer(self, dst: Buffer, src: Buffer, hold: bool, window: Window | None, priority: int = 0) -> Op:
        """Copy ``src`` to ``dst`` where either is on this device and the other on any device.

        Between two RAY devices the bytes go host to host through Ray's object
        store; with a local device, through the driver. Runs on the source's copy
        queue (on this device's when the source is local).
        """
        for buf in (src, dst):
            if not isinstance(buf, Buffer):
                raise BufferUsageError(f"transfer: expected a Buffer, got {type(buf).__name__}")
        src_dev, dst_dev = src.owner, dst.owner
        if self is not src_dev and self is not dst_dev:
            raise BufferUsageError(f"transfer: neither {src!r} nor {dst!r} belongs to {self.name}")
        src_handle = src_dev._check(src, "transfer")
        dst_handle = dst_dev._check(dst, "transfer")
        if dst.nbytes != src.nbytes:
            raise BufferUsageError(f"transfer: {src!r} has {src.nbytes} bytes, {dst!r} has {dst.nbytes}")
        name = f"transfer {src.nbytes} B {src_dev.name}->{dst_dev.name}"
        engine = (src_dev if isinstance(src_dev, RemoteDevice) else self).queue("copy", priority)
        writers: tuple[Op, ...] = ()  # a local source is read in the driver: after the ops writing it now
        if not isinstance(src_dev, RemoteDevice):
            start, end = src.offset, src.offset + src.nbytes
            writers = tuple(o for s, e, w, o in src.log.entries if w and s < end and start < e and not o.done())
        body: list[Command] = [(EXEC, name, _TRANSFER, (dst_dev, dst_handle, src_dev, src_handle, writers))]
        return self._submit(engine, name, body, (src,), (dst,), (src, dst), window=window)

    def finalize_profile(self) -> DeviceEvent:
        """The offset of the remote host's clock against the driver's, from paired samples of the actor's clock."""

        def sample() -> Sample:
            before = now_us()
            stamp = ray.get(self.actor.clock.remote(), timeout=5)
            return (before, stamp, now_us())

        offset = estimate_offset(sample)
        return DeviceEvent(self.name, offset, offset)

    def _finish_close(self, settled: bool) -> None:
        """Once the work in flight is done: stop the engines, forget the device and end its actor (the remote
        memory goes with it); see :meth:`BaseDevice.close`."""
        super()._finish_close(settled)
        if self.state != "closed":
            return
        self._answers.put(None)
        self._completer.join()
        self.lost = self.lost or "it was closed"
        ray.kill(self.actor)


async def settled(future: concurrent.futures.Future[Any]) -> None:
    """Wait, on asyncio or trio, until ``future`` (completed on any thread, e.g. Ray's) is done.

    The thread that completes it only schedules a wake-up of the waiting loop; cancelling the wait leaves
    the future alone.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: trio
        import trio

        token = trio.lowlevel.current_trio_token()
        event = trio.Event()
        future.add_done_callback(lambda _: token.run_sync_soon(event.set))
        await event.wait()
        return
    waiter: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not waiter.done():
            waiter.set_result(None)

    future.add_done_callback(lambda _: loop.call_soon_threadsafe(wake))
    await waiter


def _relay(answer: concurrent.futures.Future[Result], future: concurrent.futures.Future[Result]) -> None:
    """Pass an ObjectRef's outcome on (on Ray's thread)."""
    exc = future.exception()
    if exc is not None:
        answer.set_exception(exc)
    else:
        answer.set_result(future.result())
