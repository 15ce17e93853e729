"""The host's side of a RAY device: the actor that owns a real device and runs the driver's calls in order."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import pickle
import socket
from collections.abc import Callable, Sequence
from typing import Any

from aruntime.backends.ray.wire import (
    DONE,
    INLINE_MAX,
    Failure,
    RemoteHandle,
    Result,
    decode,
    first_line,
    materialize,
    pack_error,
    ray,
    unpack_error,
)
from aruntime.device import Device, Program
from aruntime.dtype import dtypes
from aruntime.engine import COPY, EXEC, Command, Op
from aruntime.errors import AllocationError, BufferUsageError, DeviceError
from aruntime.events import RangeEvent, now_us, recorder
from aruntime.memory import Buffer, BufferSpec


class HostActor:
    """Runs on the remote host: owns a real device and submits the driver's ops to it in the driver's order."""

    def __init__(self, inner: str, remote: str) -> None:
        self.remote = remote
        self.error: Failure | None = None
        try:
            self.dev = Device[inner]
        except Exception as exc:
            self.error = pack_error(exc)
        self.bufs: dict[int, Buffer] = {}
        self.views: dict[RemoteHandle, Buffer] = {}
        self.bad: dict[int, BaseException] = {}
        self.progs: dict[int, Program] = {}
        self.prog_ids = itertools.count()
        self.turn = 0
        self.waiting: dict[int, asyncio.Future[None]] = {}
        self.recorded: dict[int, list[tuple[str, float, float, bool]]] = {}

    async def host(self) -> tuple[dict[str, Any], Failure | None]:
        """Where this actor runs, and the error that kept its device from opening."""
        context = ray.get_runtime_context()
        info = {
            "node": context.get_node_id(),
            "address": ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }
        return info, self.error

    async def clock(self) -> float:
        """This host's clock, in µs (what its ranges are stamped with)."""
        return now_us()

    async def compile(self, src: str, name: str, outs: Sequence[int] | None) -> tuple[int | None, Failure | None]:
        """Compile and load a kernel; its id for launches."""
        try:
            prog = await self.dev.compile(src, name, outs)
        except Exception as exc:
            return None, pack_error(exc)
        pid = next(self.prog_ids)
        self.progs[pid] = prog
        return pid, None

    async def run(self, header: bytes, data: Any = None) -> Any:
        """Submit call number ``seq`` to the device once every earlier one is, and answer when it is done.

        The answer is None when there is nothing to say, else pickled into bytes (cheaper for Ray than a
        tuple) unless it holds an ObjectRef.
        """
        seq, step, args, profiling = pickle.loads(header)
        if data is not None:
            args = (*args, data)
        answer = await self._run(seq, step, args, profiling)
        if answer == DONE:
            return None
        return answer if isinstance(answer[0], list) else pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)

    async def _run(self, seq: int, step: str, args: tuple[Any, ...], profiling: bool) -> Result:
        if seq != self.turn:
            turn = asyncio.get_running_loop().create_future()
            self.waiting[seq] = turn
            await turn
        op: Op | None = None
        try:
            recorder.enabled = profiling
            try:
                op, finish = getattr(self, f"_{step}")(*args)
            finally:
                self.turn += 1
                following = self.waiting.pop(self.turn, None)
                if following is not None:
                    following.set_result(None)
            if op is not None:
                await op
            return (None if finish is None else finish(), None, self._ranges(op, profiling))
        except Exception as exc:
            return (None, pack_error(exc), self._ranges(op, profiling))

    def _ranges(self, op: Op | None, profiling: bool) -> Sequence[tuple[str, float, float, bool]]:
        if not profiling or op is None:
            return ()
        events = recorder.events
        for ev in events:
            if isinstance(ev, RangeEvent):
                self.recorded.setdefault(ev.op, []).append((ev.name, ev.start, ev.end, ev.is_copy))
        events.clear()  # this process records only for the driver
        return self.recorded.pop(op.id, ())

    def _view(self, h: RemoteHandle) -> Buffer:
        root = self.bufs.get(h.id)
        if root is None:
            raise self.bad.get(h.id) or BufferUsageError(f"{self.remote}: no remote buffer {h.id}")
        if h.offset == 0 and h.nbytes == root.nbytes:
            return root
        view = self.views.get(h)
        if view is None:
            view = self.views[h] = root.view(h.nbytes, dtypes.uint8, h.offset)
            view.handle  # noqa: B018  # its handle now, on this thread
        return view

    Step = tuple[Op | None, Callable[[], Any] | None]

    def _alloc(self, hid: int, nbytes: int, spec: BufferSpec) -> Step:
        try:
            self.bufs[hid] = Buffer(self.dev.name, nbytes, dtypes.uint8, spec, preallocate=True)
        except AllocationError:
            error = AllocationError(f"{self.remote}: out of memory allocating {nbytes} bytes")
            self.bad[hid] = error
            raise error from None
        return None, None

    def _skip(self) -> Step:
        return None, None

    def _free(self, hid: int) -> Step:
        self.bad.pop(hid, None)
        for h in [h for h in self.views if h.id == hid]:
            del self.views[h]
        root = self.bufs.pop(hid, None)
        if root is not None:
            root.deallocate()  # the remote device releases it once its own ops on it are done
        return None, None

    def _copyin(self, h: RemoteHandle, name: str, data: Any) -> Step:
        return self.dev.copyin(self._view(h), data), None

    def _launch(self, name: str, pid: int, handles: tuple[RemoteHandle, ...], vals: tuple[Any, ...], outs: Any) -> Step:
        prog = self.progs[pid]
        return self.dev.launch(prog, *map(self._view, handles), vals=vals, outs=outs), None

    def _copy(self, dst: RemoteHandle, src: RemoteHandle, name: str) -> Step:
        d, s = self._view(dst), self._view(src)
        body: list[Command] = [(COPY, name, self.dev.copy_fn, d.handle, s.handle, s.nbytes)]
        return self.dev._submit(self.dev.copy, name, body, (s,), (d,), (s, d)), None

    def _export(self, h: RemoteHandle, name: str) -> Step:
        view = self._view(h)
        box: list[Any] = []
        zero_copy = not self.dev.file_backed  # a file's bytes go through its guarded copy (see aruntime.backends.disk)
        body: list[Command] = [(EXEC, name, _export, (view.allocator, view.handle, view.nbytes, box, zero_copy))]
        return self.dev._submit(self.dev.copy, name, body, (view,), (), (view, box)), lambda: box[0]

    def _import(self, h: RemoteHandle, name: str, source: str, kind: str, data: Any) -> Step:
        view = self._view(h)
        src = (kind, data)
        body: list[Command] = [(EXEC, name, _import, (view.allocator, view.handle, source, src))]
        return self.dev._submit(self.dev.copy, name, body, (), (view,), (view, src)), None


def _export(allocator: Any, handle: Any, nbytes: int, box: list[Any], zero_copy: bool) -> None:
    """(On the remote device's copy queue) the bytes of a buffer: inline if small, else put in the object store
    (straight from a zero-copy view of host memory where ``zero_copy`` allows it)."""
    as_buffer = getattr(allocator, "_as_buffer", None)
    if nbytes > INLINE_MAX and as_buffer is not None and zero_copy:
        box.append([ray.put(pickle.PickleBuffer(as_buffer(handle, nbytes)))])  # one copy, into the store
        return
    data = bytearray(nbytes)
    allocator._copyout(memoryview(data), handle)
    box.append(data if nbytes <= INLINE_MAX else [ray.put(pickle.PickleBuffer(data))])


def _import(allocator: Any, handle: Any, source: str, src: tuple[str, Any]) -> None:
    """(On the remote device's copy queue) write what an export or the driver sent into a buffer."""
    kind, payload = src
    if kind == "ref":
        try:
            value, failure, _ = decode(ray.get(payload[0]))
        except ray.exceptions.RayError as exc:
            raise DeviceError(f"{source} is lost ({first_line(exc)})") from None
        if failure is not None:
            raise unpack_error(failure)
        payload = value
    try:
        data = materialize(payload)
    except ray.exceptions.RayError as exc:  # the bytes were put by the source's actor, which died since
        raise DeviceError(f"{source} is lost ({first_line(exc)})") from None
    allocator._copyin(handle, data)


@functools.cache
def actor_class() -> Any:
    """The Ray actor class of :class:`HostActor` (made once)."""
    return ray.remote(HostActor)
