"""HTTP serving with a real ASGI server: uvicorn serving a plain ASGI app, driven from another process.

* ``serve_http``: the app of ``benchmarks/serve/app.py`` (4 KiB of float32 in
  a POST body, the doubled values as the answer) under uvicorn, with four
  handlers, each in its own server process: aruntime (one shared
  ``Scheduler``, per request two ``dev.buffer`` scopes, copy-in, launch,
  awaited copy-out, as in the cookbook's ``serve.py``), numpy on the event
  loop's thread, the same numpy work through ``anyio.to_thread.run_sync``, and
  an echo that answers with the body at once (the ceiling: what uvicorn and
  the load generator cost without any work). The load generator
  (``benchmarks/serve/client.py``) runs in its own process: 64 keep-alive
  connections, each sending its next request when the answer arrives, every
  answer checked. Each round drives each server in turn (aruntime, numpy,
  to_thread, echo) for a warm-up and a counted window; the rows give the
  medians over the rounds, the ratios being medians of the per-round ratios.

The runner's loop is uvicorn's ``--loop`` (asyncio or uvloop). uvicorn does not
run on trio, so on trio the rows are reported as skipped, with no figures. The
load generator always uses uvloop where it is installed. uvicorn picks its HTTP
parser itself (httptools where installed, else h11); the rows say which.
Without uvicorn, every loop's rows are skipped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import anyio
from anyio.abc import Process

from benchmarks.common import Result, result, settings

ROOT = Path(__file__).resolve().parent.parent
HANDLERS = ("aruntime", "numpy", "to_thread", "echo")
"""The servers, in the order each round drives them (``benchmarks/serve/app.py`` says what each does)."""
CONNECTIONS = 64
"""Requests in flight: one per keep-alive connection."""
REQUEST_BYTES = 4096
"""Each request's body: 1024 float32 values (``benchmarks/serve/client.py``'s ``FLOATS``)."""
START_TIMEOUT_S = 60.0
"""How long a server may take to answer its first request."""
STOP_TIMEOUT_S = 15.0
"""How long a server may take to shut down after SIGINT before it is killed."""
GOALS = {"numpy": 0.85, "to_thread": 1.5}
"""aruntime's req/s against each baseline handler's, at least."""


def http_parser() -> str:
    """The HTTP implementation uvicorn's ``--http auto`` picks here."""
    return "httptools" if importlib.util.find_spec("httptools") else "h11"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(handler: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "BENCH_SERVE_HANDLER": handler}


@dataclass
class Server:
    """One uvicorn process serving one handler; its stderr goes to ``log``."""

    handler: str
    port: int
    process: Process
    log: IO[bytes]

    def errors(self) -> str:
        """What the server wrote on stderr (its last 2000 characters)."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]


async def _answers(port: int) -> bool:
    """Whether a server on ``port`` answers a request with 200."""
    request = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 4\r\nConnection: close\r\n\r\n\0\0\0\0"
    try:
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(request)
            head = await stream.receive()
    except (OSError, anyio.EndOfStream, anyio.BrokenResourceError):
        return False
    return head.startswith(b"HTTP/1.1 200")


async def _start(handler: str, loop: str, stack: contextlib.AsyncExitStack) -> Server:
    """Start uvicorn serving ``handler`` on ``loop`` on a free port; return once it answers.

    ``stack`` stops it (and closes its log) when it closes, also when the server did not start.
    """
    port = _free_port()
    command = [
        sys.executable,
        *("-m", "uvicorn", "benchmarks.serve.app:app", "--host", "127.0.0.1", "--port", str(port)),
        *("--loop", loop, "--lifespan", "on", "--no-access-log", "--log-level", "warning"),
    ]
    log = stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115 (the stack closes it)
    process = await anyio.open_process(command, cwd=ROOT, env=_env(handler), stdout=log, stderr=log)
    server = Server(handler, port, process, log)
    stack.push_async_callback(_stop, server)
    with anyio.move_on_after(START_TIMEOUT_S):
        while process.returncode is None:
            if await _answers(port):
                return server
            await anyio.sleep(0.05)
    raise RuntimeError(f"uvicorn serving {handler} did not start: {server.errors()}")


async def _stop(server: Server) -> None:
    """Stop ``server`` with SIGINT (uvicorn's graceful shutdown), killing it if it does not exit in time."""
    process = server.process
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            with anyio.move_on_after(STOP_TIMEOUT_S):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
        await process.aclose()


@contextlib.asynccontextmanager
async def _servers(loop: str) -> AsyncIterator[list[Server]]:
    """Every handler's server, started one after another, all stopped on leaving (also on an error)."""
    servers: list[Server] = []
    async with contextlib.AsyncExitStack() as stack:
        for handler in HANDLERS:
            servers.append(await _start(handler, loop, stack))
        yield servers
        await stack.aclose()
        for server in servers:
            if server.process.returncode != 0:
                raise RuntimeError(f"uvicorn serving {server.handler} exited with {server.process.returncode}")


async def _drive(server: Server, warmup: float, seconds: float) -> dict[str, Any]:
    """One run of the load generator against ``server``: what it printed, parsed."""
    command = [
        sys.executable,
        *("-m", "benchmarks.serve.client", "--port", str(server.port), "--connections", str(CONNECTIONS)),
        *("--warmup", str(warmup), "--seconds", str(seconds), "--server-pid", str(server.process.pid)),
        *("--expect", "echo" if server.handler == "echo" else "scaled"),
    ]
    done = await anyio.run_process(command, cwd=ROOT, env=_env(server.handler), check=False)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace")[-2000:]
        raise RuntimeError(f"load generator against {server.handler}: {why}\nserver: {server.errors()}")
    measured: dict[str, Any] = json.loads(done.stdout)
    return measured


def _per_request_us(runs: list[dict[str, Any]], key: str) -> float | None:
    """Median microseconds of CPU per answered request that ``key`` (a process's CPU seconds) gives."""
    values = [r[key] / r["requests"] * 1e6 for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def _rows(runs: dict[str, list[dict[str, Any]]], loop: str, rounds: int, warmup: float, seconds: float) -> list[Result]:
    """The rows of one measurement: aruntime against each baseline handler, and the echo ceiling."""

    def rps(handler: str) -> float:
        return statistics.median(r["rps"] for r in runs[handler])

    def latency(handler: str, prefix: str = "") -> dict[str, float]:
        return {f"{prefix}{q}_ms": statistics.median(r[f"{q}_ms"] for r in runs[handler]) for q in ("p50", "p99")}

    common = {
        "connections": CONNECTIONS,
        "request_bytes": REQUEST_BYTES,
        "rounds": rounds,
        "warmup_s": warmup,
        "seconds": seconds,
        "server_loop": loop,
        "http": http_parser(),
        "client_loop": runs["echo"][0]["loop"],
        "checked": {handler: sum(r["checked"] for r in handler_runs) for handler, handler_runs in runs.items()},
        "rps_per_round": {handler: [round(r["rps"]) for r in handler_runs] for handler, handler_runs in runs.items()},
        "server_cpu_us_per_req": {
            handler: _per_request_us(handler_runs, "server_cpu_s") for handler, handler_runs in runs.items()
        },
        "client_cpu_us_per_req": {
            handler: _per_request_us(handler_runs, "client_cpu_s") for handler, handler_runs in runs.items()
        },
    }
    rows = []
    for base, goal in GOALS.items():
        ratio = statistics.median(a["rps"] / b["rps"] for a, b in zip(runs["aruntime"], runs[base], strict=True))
        what = "numpy on the loop" if base == "numpy" else "to_thread"
        rows.append(
            result(
                f"serve_http_vs_{base}",
                rps("aruntime"),
                "req/s",
                rps(base),
                ratio,
                f">= {goal}x {what}",
                ratio >= goal,
                **latency("aruntime"),
                **latency(base, "baseline_"),
                **common,
            )
        )
    fastest = max(HANDLERS[:-1], key=rps)
    ceiling = statistics.median(e["rps"] / f["rps"] for e, f in zip(runs["echo"], runs[fastest], strict=True))
    rows.append(
        result(
            "serve_http_ceiling",
            rps("echo"),
            "req/s",
            rps(fastest),
            ceiling,
            "report only",
            None,
            fastest=fastest,
            **latency("echo"),
            **latency(fastest, "baseline_"),
            **common,
        )
    )
    return rows


def _skipped(reason: str) -> list[Result]:
    """The rows, with no figures and ``skipped`` saying why."""
    names = [f"serve_http_vs_{base}" for base in GOALS] + ["serve_http_ceiling"]
    return [result(name, 0.0, "req/s", 0.0, 0.0, "report only", None, skipped=reason) for name in names]


async def serve_http() -> list[Result]:
    """uvicorn serving 4 KiB requests: aruntime's handler against numpy on the loop and to_thread, and the ceiling."""
    if settings.loop == "trio":
        return _skipped("uvicorn does not run on trio")
    if importlib.util.find_spec("uvicorn") is None:
        return _skipped("uvicorn is not installed (the serve extra)")
    quick = settings.quick
    rounds, warmup, seconds = (1, 0.2, 0.3) if quick else (5, 0.5, 2.0)
    runs: dict[str, list[dict[str, Any]]] = {handler: [] for handler in HANDLERS}
    async with _servers(settings.loop) as servers:
        for _ in range(rounds):
            for server in servers:
                runs[server.handler].append(await _drive(server, warmup, seconds))
    return _rows(runs, settings.loop, rounds, warmup, seconds)


BENCHMARKS = [serve_http]
