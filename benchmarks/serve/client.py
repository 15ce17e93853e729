"""The load generator of the HTTP serving benchmark, run in its own process by ``benchmarks/bench_serve.py``.

python -m benchmarks.serve.client --port 8000 [--connections 64] [--warmup 0.5] [--seconds 2] [--expect scaled]

Opens ``--connections`` keep-alive HTTP/1.1 connections to 127.0.0.1 and keeps
one request in flight on each: a connection sends its next request when the
answer to the previous one has arrived. The requests are built once, before
the run (:data:`VARIANTS` bodies of 1024 float32 values each, taken in turn),
and an answer is parsed only as far as its status line and ``Content-Length``;
every answer is compared with the expected bytes (the body doubled with
``--expect scaled``, the body itself with ``--expect echo``). After
``--warmup`` seconds it counts, for ``--seconds`` seconds, the answers that
arrive and each one's latency (from writing its request to its last byte);
then it stops sending, waits for the answers still in flight and prints one
JSON object: ``requests`` (answered in the window), ``seconds`` (the window),
``rps``, ``p50_ms``, ``p99_ms``, ``checked`` (every answer of the run, all
correct), ``client_cpu_s`` (this process's CPU time in the window) and
``server_cpu_s`` (that of the process ``--server-pid``, from ``/proc``; null
without it or off Linux). A wrong answer, an error status or a lost
connection exits with status 1 and says why on stderr. The event loop is
uvloop where it is installed.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import functools
import json
import os
import sys
import time
import typing
from collections.abc import Sequence
from typing import Any

FLOATS = 1024
"""Float32 values per request: 4 KiB bodies."""
VARIANTS = 16
"""Distinct request bodies; connection ``c`` sends them in turn, starting at ``c``."""


def bodies(floats: int = FLOATS) -> list[tuple[bytes, bytes]]:
    """Each request body and its doubled answer (doubling a float32 is exact)."""
    pairs = []
    for k in range(VARIANTS):
        x = array.array("f", [(k * floats + i) * 0.25 - 1000.0 for i in range(floats)])
        pairs.append((x.tobytes(), array.array("f", [2.0 * v for v in x]).tobytes()))
    return pairs


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user and system, all threads) that process ``pid`` has used, or None where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


class Run:
    """The state every connection of one run shares: the requests, the window, what was counted."""

    def __init__(self, requests: list[bytes], answers: list[bytes], connections: int, server_pid: int | None) -> None:
        self.requests = requests
        self.answers = answers
        self.connections = connections
        self.server_pid = server_pid
        self.sending = True
        self.measuring = False
        self.latencies: list[float] = []
        self.checked = 0
        self.idle = 0
        self.marks: list[tuple[float, float, float | None]] = []  # (perf_counter, own CPU, server CPU) per edge
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def mark(self, measuring: bool) -> None:
        """Open (or close) the counting window; at its end, stop sending new requests."""
        self.marks.append((time.perf_counter(), time.process_time(), self._server_cpu()))
        self.measuring = measuring
        self.sending = measuring

    def _server_cpu(self) -> float | None:
        return None if self.server_pid is None else process_cpu_s(self.server_pid)

    def fail(self, why: str) -> None:
        if not self.done.done():
            self.done.set_exception(RuntimeError(why))

    def answered(self, conn: Connection, status: int, body: bytes | bytearray) -> None:
        """Check and count the answer ``conn`` got; send its next request, or go idle once the window is over."""
        if status != 200 or body != self.answers[conn.variant]:
            return self.fail(f"connection {conn.index}: status {status}, {len(body)} bytes: not the expected answer")
        self.checked += 1
        if self.measuring:
            self.latencies.append(time.perf_counter() - conn.sent)
        if self.sending:
            return conn.send()
        self.idle += 1
        if self.idle == self.connections and not self.done.done():
            self.done.set_result(None)
        return None


class Connection(asyncio.Protocol):
    """One keep-alive connection with one request in flight at a time."""

    def __init__(self, run: Run, index: int) -> None:
        self.run = run
        self.index = index
        self.variant = index % VARIANTS
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.body_at = -1  # where the answer's body starts in buf, once its head is in
        self.end = 0  # where it ends
        self.status = 0
        self.sent = 0.0
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def send(self) -> None:
        """Write the next request (the next variant)."""
        assert self.transport is not None
        self.variant = (self.variant + 1) % VARIANTS
        self.sent = time.perf_counter()
        self.transport.write(self.run.requests[self.variant])

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.body_at < 0:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(self.buf[:head_end]).lower()
            at = head.find(b"\r\ncontent-length:")
            if not head.startswith(b"http/1.1 ") or at < 0:
                return self.run.fail(f"connection {self.index}: unexpected answer head {head[:200]!r}")
            line_end = head.find(b"\r\n", at + 2)
            self.status = int(head[9:12])
            self.body_at = head_end + 4
            self.end = self.body_at + int(head[at + 17 : line_end if line_end >= 0 else len(head)])
        if len(self.buf) < self.end:
            return
        if len(self.buf) > self.end:
            return self.run.fail(f"connection {self.index}: bytes after the answer, with one request in flight")
        body = self.buf[self.body_at :]
        self.buf = bytearray()
        self.body_at = -1
        self.run.answered(self, self.status, body)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closing:
            self.run.fail(f"connection {self.index} lost: {exc!r}")


async def drive(port: int, connections: int, warmup: float, seconds: float, expect: str, server_pid: int | None) -> Any:
    """One run against 127.0.0.1:``port``; what it measured, as a JSON-ready dict."""
    loop = asyncio.get_running_loop()
    head = f"POST /scale HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/octet-stream\r\n"
    pairs = bodies()
    requests = [f"{head}Content-Length: {len(x)}\r\n\r\n".encode() + x for x, _ in pairs]
    answers = [y if expect == "scaled" else x for x, y in pairs]
    run = Run(requests, answers, connections, server_pid)
    conns: list[Connection] = []
    try:
        for i in range(connections):
            _, conn = await loop.create_connection(functools.partial(Connection, run, i), "127.0.0.1", port)
            conns.append(conn)
        for conn in conns:
            conn.send()
        loop.call_later(warmup, run.mark, True)
        loop.call_later(warmup + seconds, run.mark, False)
        await asyncio.wait_for(run.done, warmup + seconds + 60)
    finally:
        for conn in conns:
            conn.closing = True
            if conn.transport is not None:
                conn.transport.close()
    (t0, cpu0, server0), (t1, cpu1, server1) = run.marks
    window = t1 - t0
    lat = run.latencies
    return {
        "requests": len(lat),
        "seconds": window,
        "rps": len(lat) / window,
        "p50_ms": percentile(lat, 50) * 1e3,
        "p99_ms": percentile(lat, 99) * 1e3,
        "checked": run.checked,
        "client_cpu_s": cpu1 - cpu0,
        "server_cpu_s": None if server0 is None or server1 is None else server1 - server0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds before counting")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds counted")
    parser.add_argument("--expect", choices=("scaled", "echo"), default="scaled")
    parser.add_argument("--server-pid", type=int, help="the server process, whose CPU time is reported")
    args = parser.parse_args(argv)
    coro = drive(args.port, args.connections, args.warmup, args.seconds, args.expect, args.server_pid)
    try:
        import uvloop
    except ImportError:
        measured = {**asyncio.run(coro), "loop": "asyncio"}
    else:
        measured = {**uvloop.run(coro), "loop": "uvloop"}
    print(json.dumps(measured))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, OSError, TimeoutError) as exc:
        print(f"client: {exc}", file=sys.stderr)
        sys.exit(1)
