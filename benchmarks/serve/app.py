"""The plain ASGI app that ``benchmarks/bench_serve.py`` runs under uvicorn: POST float32s, get them back doubled.

The request body is raw float32 values (any multiple of 4 bytes); the answer is
``out[i] = x[i] * 2.0f`` as raw float32 bytes. The environment variable
``BENCH_SERVE_HANDLER`` picks how the answer is computed:

* ``aruntime``: the way of the ``serve.py`` example in docs/cookbook.md. The
  lifespan opens ``Device["CPU"]``, compiles :data:`KERNEL` and opens one
  shared ``Scheduler(window=256)``; each request takes two ``dev.buffer(...)``
  scopes and submits ``sched.copyin``, ``sched.launch`` and an awaited
  ``sched.copyout`` into its answer.
* ``numpy``: ``numpy.frombuffer(body, float32) * 2`` on the event loop's thread.
* ``to_thread``: the same numpy work in ``anyio.to_thread.run_sync``.
* ``echo``: the body itself, at once: what uvicorn and the load generator cost
  without any work (the benchmark's ceiling).

Run it with ``BENCH_SERVE_HANDLER=numpy python -m uvicorn benchmarks.serve.app:app``.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio.to_thread
import numpy

from aruntime import Device, Scheduler, dtypes

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[bytes], Awaitable[bytes]]

KERNEL = r"""
#include <stdint.h>
void kernel(float *out, const float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = x[i] * 2.0f;
}
"""
"""The aruntime handler's kernel: the same arithmetic as the numpy handlers (exact in float32)."""
WINDOW = 256
"""The shared scheduler's window, as in the cookbook: room for 85 requests' three ops."""
HANDLERS = ("aruntime", "numpy", "to_thread", "echo")
HANDLER = os.environ.get("BENCH_SERVE_HANDLER", "aruntime")
if HANDLER not in HANDLERS:
    raise SystemExit(f"BENCH_SERVE_HANDLER={HANDLER!r}: choose one of {', '.join(HANDLERS)}")

state: dict[str, Any] = {}
"""What the lifespan opened for the aruntime handler: ``device``, ``kernel``, ``scheduler``."""


async def aruntime_scale(body: bytes) -> bytes:
    """Copy the body in, launch the kernel, await the copy-out into the answer; the buffers freed on leaving."""
    dev, kernel, sched = state["device"], state["kernel"], state["scheduler"]
    n = len(body) // 4
    answer = bytearray(len(body))
    async with dev.buffer(n, dtypes.float32) as x, dev.buffer(n, dtypes.float32) as y:
        sched.copyin(x, body)
        sched.launch(kernel, y, x, vals=(n,))
        await sched.copyout(y, answer)
    return bytes(answer)


def numpy_work(body: bytes) -> bytes:
    """The answer computed by numpy on the calling thread."""
    return (numpy.frombuffer(body, numpy.float32) * numpy.float32(2.0)).tobytes()


async def numpy_scale(body: bytes) -> bytes:
    """:func:`numpy_work` on the event loop's thread."""
    return numpy_work(body)


async def to_thread_scale(body: bytes) -> bytes:
    """:func:`numpy_work` on a worker thread of anyio's default limiter."""
    return await anyio.to_thread.run_sync(numpy_work, body)


async def echo(body: bytes) -> bytes:
    """The body itself: no work at all."""
    return body


HANDLE: Handler = {"aruntime": aruntime_scale, "numpy": numpy_scale, "to_thread": to_thread_scale, "echo": echo}[
    HANDLER
]


async def lifespan(receive: Receive, send: Send) -> None:
    """Open the device, compile the kernel and open the scheduler (aruntime handler only) for the server's life."""
    await receive()  # lifespan.startup
    if HANDLER != "aruntime":  # nothing to open
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})
        return
    try:
        dev = Device["CPU"]
        state["device"], state["kernel"] = dev, await dev.compile(KERNEL, outs=(0,))
    except Exception as exc:  # uvicorn reports it and exits instead of serving errors
        await send({"type": "lifespan.startup.failed", "message": repr(exc)})
        return
    async with Scheduler(window=WINDOW) as sched:
        state["scheduler"] = sched
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown, once the requests are done
    await send({"type": "lifespan.shutdown.complete"})


async def read_body(receive: Receive) -> bytes | None:
    """The request's whole body, or None if the client went away first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def respond(send: Send, status: int, body: bytes, content_type: bytes = b"application/octet-stream") -> None:
    """Send a whole response."""
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def app(scope: Message, receive: Receive, send: Send) -> None:
    """The ASGI entry point: the lifespan, and POST (any path) answered by :data:`HANDLE`."""
    if scope["type"] == "lifespan":
        return await lifespan(receive, send)
    if scope["type"] != "http":
        return None
    if scope["method"] != "POST":
        return await respond(send, 405, b"use POST\n", b"text/plain")
    body = await read_body(receive)
    if body is None:
        return None
    if not body or len(body) % 4:
        return await respond(send, 400, b"the body must be float32 values\n", b"text/plain")
    return await respond(send, 200, await HANDLE(body))
