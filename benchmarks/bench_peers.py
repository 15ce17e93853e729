"""Side by side with tinygrad: the pipeline, kernel, serving and launch-latency figures against tinygrad's device layer.

The same C kernel sources and sizes run, in the same run, on:

* aruntime: ``CPU`` alone, and ``CPU`` with ``CPU:1``, each driven through one
  :class:`Scheduler` with default settings (pipeline, serving), or one awaited
  ``dev.launch`` at a time (latency);
* tinygrad's own device layer, two pinned releases from PyPI (``PEERS``), each
  installed into its own virtual environment and driven by
  ``benchmarks/peers/tinygrad_worker.py`` in a subprocess (see that file for
  exactly which calls): 0.13.0 (``Device["CPU"]``, its allocator,
  ``ClangJITCompiler`` and ``CPUProgram``, programs run on a worker thread per
  device) and 0.10.1 (``Device["CLANG"]``, ``Buffer`` copies, programs called
  on the caller's thread); one call after another on one device, and two user
  threads, one per device;
* a runtime-free pool: two plain Python threads, each doing ``memmove`` /
  kernel / ``memmove`` per batch through ctypes on its own buffers, the kernel
  built the way aruntime builds it (the limit of this machine);
* a bare thread wake: a worker thread waking one future on the loop
  (:class:`benchmarks.common.BareWorker`), the least that any awaited
  off-loop launch costs.

The pipeline kernel is ``out[i] = (in[i] - 0.484375f) * 4.375f`` over float32.
Kernels take no scalar arguments: sizes are compiled into the source, because
tinygrad's CPU program passes scalars as 32-bit ints and has no floats. Each
side compiles the identical text the way its runtime does (aruntime's CPU
device: ``cc -O3 -march=native``; tinygrad: ``clang -O2 -march=native
-ffreestanding``), and the kernel row compares the two builds called directly,
µs per launch.

The run is ``rounds`` rounds; each measures aruntime on one device, on two, and
the thread pool (alternating, ``repeats`` times each), then runs each tinygrad
release's worker (``repeats`` times each), so all sides are sampled across the
same stretch of time. Threads are left unpinned, as users run them. Throughputs
are from the fastest repeat of each side (interference only ever slows a run
down); latencies are medians over every call.

Goals, per 4 MiB batch: one device >= 1.1x tinygrad one call after another;
two devices >= 1.0x tinygrad 0.13.0 with two user threads (issue 11), >= 1.1x
tinygrad 0.10.1 with two user threads (issue 18), and >= 0.95x the two-thread
pool; per 256 KiB batch (per-op cost decides): >= 1.2x tinygrad, on one and on
two devices; aruntime's build of the kernel no slower than tinygrad's. Against
0.13.0 also: awaited launch latency <= tinygrad's synchronous launch + 1.5 x
the bare wake, and serving (reported). Rows against 0.13.0 end in
``_vs_tinygrad``, those against 0.10.1 in ``_vs_tinygrad_0_10_1``.

When a tinygrad environment cannot be built (no network for pip, no clang) its
rows are still emitted, with ``skipped`` saying why, and no figures.
``ARUNTIME_BENCH_PEERS=0`` skips the tinygrad side on purpose;
``ARUNTIME_BENCH_INSTALL_CLANG=1`` lets it ``apt-get install clang`` when root.
"""

from __future__ import annotations

import array
import ctypes
import json
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from aruntime import Buffer, Device, Program, dtypes
from aruntime.scheduler import Scheduler
from benchmarks.common import SLOTS, BareWorker, Result, address, alternated, burst, percentile, result, settings
from benchmarks.peers import setup_tinygrad

# ---- the kernels ----------------------------------------------------------------------------------------------------

SUB, MUL = 0.484375, 4.375
"""The pipeline kernel's constants (both exact in float32)."""


def pipeline_kernel(n: int) -> str:
    """The pipeline kernel, ``out[i] = (in[i] - 0.484375f) * 4.375f``, over ``n`` floats."""
    return (
        "#include <stdint.h>\nvoid kernel(float *out, const float *in) {\n"
        f"  for (int64_t i = 0; i < {n}; i++) out[i] = (in[i] - {SUB}f) * {MUL}f;\n}}\n"
    )


def serving_kernel(n: int) -> str:
    """The serving benchmark's kernel (``out = x * 2``) over ``n`` floats."""
    return (
        "#include <stdint.h>\nvoid kernel(float *out, const float *x) {\n"
        f"  for (int64_t i = 0; i < {n}; i++) out[i] = x[i] * 2.0f;\n}}\n"
    )


TINY_KERNEL = "void kernel(unsigned char *b) { b[0] += 1; }\n"
"""The launch-latency kernel: one buffer, one byte touched."""


def pipeline_expected(value: float) -> float:
    """What the pipeline kernel makes of an element ``value`` (float32 steps, as the C code does them)."""
    out = array.array("f", [value])
    out[0] = out[0] - SUB
    out[0] = out[0] * MUL
    return out[0]


# ---- the plan -------------------------------------------------------------------------------------------------------

DEVICES = ("CPU", "CPU:1")
SOURCES = 3
"""Distinct host inputs the batches cycle through (batch ``i`` of a timed pass reads one filled with ``i % 3 + 1``)."""
CHECK_BASE = 10.0
"""The checked pass reads inputs filled with ``CHECK_BASE + i % 3 + 1`` instead, values no timed pass wrote: an
output left over from a timed pass, or a kernel that never ran, fails the check."""


@dataclass(frozen=True)
class Case:
    """One pipeline size: ``batches`` batches of ``elements`` float32."""

    label: str
    elements: int
    batches: int


@dataclass(frozen=True)
class Plan:
    """Sizes and counts of one run."""

    cases: tuple[Case, ...]
    rounds: int
    repeats: int
    serving_tasks: int
    serving_elements: int
    latency_calls: int
    latency_warmup: int

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls((Case("1MiB", 1 << 18, 4),), 1, 1, 64, 256, 100, 20)
        # 4 MiB x 64 (issue 11's size) and 256 KiB x 1024: the same 256 MiB in small batches, where the cost per op
        # rather than the copies decides. 1000 requests of 256 floats: the serving benchmark's.
        return cls((Case("4MiB", 1 << 20, 64), Case("256KiB", 1 << 16, 1024)), 3, 5, 1000, 256, 1000, 100)


@dataclass
class Measured:
    """Every round's raw figures: aruntime's and the thread pool's, and each tinygrad release's worker output
    (``tinygrad``, by version; a release in ``skipped`` has none, and the reason)."""

    pipeline: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    serving: list[dict[str, Any]] = field(default_factory=list)
    latency: list[dict[str, Any]] = field(default_factory=list)
    tinygrad: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def figures(self, version: str) -> list[dict[str, Any]]:
        """Every round's output of tinygrad ``version``'s worker (none when it was skipped, in any round)."""
        return [] if version in self.skipped else self.tinygrad.get(version, [])

    def reason(self, version: str) -> str:
        """Why tinygrad ``version`` has no figures."""
        return self.skipped.get(version, "no tinygrad figures")


def _verify(dsts: Sequence[bytearray], batches: int, expected: Sequence[float]) -> bool:
    """Each host destination holds the output of the last batch that used it."""
    for j, dst in enumerate(dsts):
        used = [i for i in range(batches) if i % len(dsts) == j]
        if not used:
            continue
        got = memoryview(dst).cast("f")
        want = expected[used[-1] % len(expected)]
        if got[0] != want or got[len(got) - 1] != want:
            return False
    return True


class HostKernel:
    """A kernel built by aruntime's CPU compiler (its flags, its cache) and loaded with plain ctypes."""

    def __init__(self, source: str) -> None:
        compiler = Device["CPU"].compiler
        assert compiler is not None
        lib = compiler.compile_cached(source)
        fd, path = tempfile.mkstemp(prefix="aruntime-peers-", suffix=".so")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(lib)
            self._lib = ctypes.CDLL(path)
        finally:
            os.unlink(path)
        self.fn = self._lib.kernel
        self.fn.restype = None
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    def median_us(self, out: int, inp: int, calls: int = 15) -> float:
        """Median µs of the kernel called directly on this thread (after two warm-up calls)."""
        times = []
        for _ in range(calls + 2):
            start = time.perf_counter_ns()
            self.fn(out, inp)
            times.append((time.perf_counter_ns() - start) / 1e3)
        return statistics.median(times[2:])


# ---- aruntime and the thread pool -----------------------------------------------------------------------------------


async def measure_pipeline(case: Case, repeats: int) -> dict[str, Any]:
    """The pipeline through a Scheduler on CPU, and on CPU and CPU:1, alternating with the two-thread pool."""
    n, nbytes, batches = case.elements, case.elements * 4, case.batches
    devs = [Device[name] for name in DEVICES]
    source = pipeline_kernel(n)
    progs: list[Program] = [await d.compile(source, outs=(0,)) for d in devs]
    xs = [[await d.allocate(n, dtypes.float32) for _ in range(SLOTS)] for d in devs]
    ys = [[await d.allocate(n, dtypes.float32) for _ in range(SLOTS)] for d in devs]
    srcs = [array.array("f", [float(k + 1)]) * n for k in range(SOURCES)]
    check_srcs = [array.array("f", [CHECK_BASE + k + 1]) * n for k in range(SOURCES)]
    dsts = [bytearray(nbytes) for _ in range(SLOTS * len(devs))]
    expected = [pipeline_expected(CHECK_BASE + k + 1) for k in range(SOURCES)]

    async def pipelined(ndev: int, sources: Sequence[array.array[float]] = srcs) -> None:
        async with Scheduler() as sched:
            for i in range(batches):
                d, s = i % ndev, (i // ndev) % SLOTS
                x, y = xs[d][s], ys[d][s]
                sched.copyin(x, sources[i % SOURCES])
                sched.launch(progs[d], y, x)
                sched.copyout(y, dsts[i % len(dsts)])
                await sched.room()  # backpressure: at most the window in flight

    async def one() -> None:
        await pipelined(1)

    async def two() -> None:
        await pipelined(2)

    host = HostKernel(source)
    lanes = len(devs)
    # page-aligned, as aruntime's (64-byte) and tinygrad's buffers are aligned: a 64-byte vector loop slows down on
    # memory that is only 16-byte aligned
    lane_x = [mmap.mmap(-1, nbytes) for _ in range(lanes)]
    lane_y = [mmap.mmap(-1, nbytes) for _ in range(lanes)]
    src_addr = [s.buffer_info()[0] for s in srcs]
    dst_addr = [address(d) for d in dsts]
    memmove, kernel = ctypes.memmove, host.fn

    def lane(first: int) -> None:
        x, y = address(lane_x[first]), address(lane_y[first])
        for i in range(first, batches, lanes):
            memmove(x, src_addr[i % SOURCES], nbytes)
            kernel(y, x)
            memmove(dst_addr[i % len(dsts)], y, nbytes)

    async def threads() -> None:
        # runtime-free: plain threads, joined on the loop's own thread (nothing else runs meanwhile)
        pool = [threading.Thread(target=lane, args=(first,)) for first in range(lanes)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()

    for fn in (one, two, threads):  # warm-up: every page touched, engine threads awake
        await fn()
    seconds = await alternated({"one": one, "two": two, "threads": threads}, repeats)
    verified: dict[int, bool] = {}
    for ndev in (1, 2):
        for dst in dsts:
            dst[:] = bytes(nbytes)
        await pipelined(ndev, check_srcs)
        verified[ndev] = _verify(dsts, batches, expected)
    kernel_us = host.median_us(ys[0][0].handle, xs[0][0].handle)  # on aruntime's own device memory
    for dev, xb, yb in zip(devs, xs, ys, strict=True):
        for buf in (*xb, *yb):
            await dev.free(buf)
    return {
        "source": source,
        "expected": expected,
        "one_s": seconds["one"],
        "two_s": seconds["two"],
        "threads_s": seconds["threads"],
        "verified": verified[1] and verified[2],
        "kernel_us": kernel_us,
    }


async def measure_serving(tasks: int, n: int, repeats: int) -> dict[str, Any]:
    """``tasks`` concurrent requests (copy-in, kernel, awaited copy-out) through a Scheduler on CPU."""
    source = serving_kernel(n)
    dev = Device["CPU"]
    prog = await dev.compile(source, outs=(0,))
    xs = [await dev.allocate(n, dtypes.float32) for _ in range(tasks)]
    ys = [await dev.allocate(n, dtypes.float32) for _ in range(tasks)]
    requests = [array.array("f", [float(i)]) * n for i in range(tasks)]
    outs = [bytearray(n * 4) for _ in range(tasks)]
    sched: Scheduler | None = None

    async def scheduled(i: int) -> None:
        assert sched is not None
        sched.copyin(xs[i], requests[i])
        sched.launch(prog, ys[i], xs[i])
        await sched.copyout(ys[i], outs[i])

    async def scheduled_burst() -> tuple[float, list[float]]:
        nonlocal sched
        async with Scheduler() as sched:
            return await burst(tasks, scheduled)

    await scheduled_burst()  # warm-up
    seconds: list[float] = []
    latencies: list[float] = []
    for _ in range(repeats):
        took, lat = await scheduled_burst()
        seconds.append(took)
        latencies.extend(lat)
    verified = all(memoryview(outs[i]).cast("f")[n - 1] == 2.0 * i for i in range(tasks))
    for buf in (*xs, *ys):
        await dev.free(buf)
    return {
        "source": source,
        "seconds": seconds,
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "verified": verified,
    }


async def measure_latency(calls: int, warmup: int) -> dict[str, list[float]]:
    """µs of each awaited ``dev.launch`` of the tiny kernel, and of each bare thread wake, taken alternately."""
    dev = Device["CPU"]
    prog = await dev.compile(TINY_KERNEL)
    buf: Buffer = await dev.allocate(64)
    worker = BareWorker()
    launch_us: list[float] = []
    wake_us: list[float] = []
    try:
        for _ in range(warmup):
            await dev.launch(prog, buf)
            await worker.submit()
        perf = time.perf_counter_ns
        for _ in range(calls):
            start = perf()
            await dev.launch(prog, buf)
            mid = perf()
            await worker.submit()
            end = perf()
            launch_us.append((mid - start) / 1e3)
            wake_us.append((end - mid) / 1e3)
    finally:
        worker.close()
        await dev.free(buf)
    return {"launch_us": launch_us, "wake_us": wake_us}


# ---- tinygrad -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goals:
    """Minimum ratios of one case's pipeline rows against one tinygrad release."""

    one_vs_tinygrad: float
    two_vs_tinygrad_threads: float


@dataclass(frozen=True)
class Peer:
    """A pinned tinygrad release that rows compare against."""

    version: str
    tag: str
    """Row names end in ``_vs_<tag>``."""
    large: Goals
    """The goals of the copy-bound batches (the 4 MiB case)."""
    small: Goals
    """The goals of the per-op batches (the 256 KiB case)."""
    serving_and_latency: bool
    """Also the serving and launch-latency rows (else the pipeline and kernel rows only)."""


PEERS = (
    Peer(setup_tinygrad.TINYGRAD_VERSION, "tinygrad", Goals(1.1, 1.0), Goals(1.2, 1.2), True),
    Peer(setup_tinygrad.TINYGRAD_CLANG_VERSION, "tinygrad_0_10_1", Goals(1.1, 1.1), Goals(1.2, 1.2), False),
)
"""The releases compared against, in row order: 0.13.0 with issue 11's goals, 0.10.1 with issue 18's."""

WORKER_LIMIT_S = 600.0
"""How long one run of the tinygrad worker may take before its rows are reported as skipped."""


def _worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    clang = setup_tinygrad.find_clang()
    if clang is not None:
        env["CC"] = clang  # never the system cc: tinygrad passes clang-only flags
    return env


async def measure_tinygrad(version: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Build (or reuse) the environment of tinygrad ``version`` and run its worker on ``spec``; PeerUnavailable says
    why not."""
    install = os.environ.get("ARUNTIME_BENCH_INSTALL_CLANG") == "1"
    python = await anyio.to_thread.run_sync(setup_tinygrad.ensure, version, install)
    with tempfile.TemporaryDirectory(prefix="aruntime-peers-") as tmp:
        spec_path = anyio.Path(tmp) / "spec.json"
        await spec_path.write_text(json.dumps(spec))
        with anyio.fail_after(WORKER_LIMIT_S):
            command = [str(python), str(setup_tinygrad.WORKER), str(spec_path)]
            proc = await anyio.run_process(command, env=_worker_env(), check=False)
    text = proc.stdout.decode(errors="replace").strip()
    try:
        out: dict[str, Any] = json.loads(text.splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        err = proc.stderr.decode(errors="replace").strip()
        raise setup_tinygrad.PeerUnavailable(
            f"tinygrad worker exited {proc.returncode} without a result: {err[-800:]}"
        ) from None
    if "error" in out:
        raise setup_tinygrad.PeerUnavailable(f"tinygrad {out.get('tinygrad_version')} failed: {out['error']}")
    return out


# ---- rows -----------------------------------------------------------------------------------------------------------

SMALL_BATCH = 1 << 20
"""Batches below this many bytes are the per-op regime (the 256 KiB case), with its own goals."""
POOL_GOAL = 0.95
"""Two devices against the two-thread pool, copy-bound batches only (small ones: reported)."""
KERNEL_GOAL = 1.0
"""aruntime's build of the pipeline kernel: at most this many times tinygrad's µs per launch."""
LATENCY_WAKES = 1.5


def per_op(case: Case) -> bool:
    """Whether ``case``'s batches are small enough that the cost per op, not the copies, decides."""
    return case.elements * 4 < SMALL_BATCH


def _skip_row(name: str, value: float, unit: str, goal: str, reason: str, **extra: Any) -> Result:
    row = result(name, value, unit, 0.0, 0.0, goal, None, skipped=reason, **extra)
    row["baseline"] = row["ratio"] = None
    return row


def _concat(rounds: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [v for r in rounds for v in r[key]]


def _ratio_row(name: str, value: float, baseline: float, goal: float | None, what: str, **extra: Any) -> Result:
    ratio = value / baseline
    text = "report only" if goal is None else f">= {goal}x {what}"
    return result(name, value, "batches/s", baseline, ratio, text, None if goal is None else ratio >= goal, **extra)


def _pipeline_common(case: Case, m: Measured, runs: dict[str, int]) -> dict[str, Any]:
    """What every pipeline row of ``case`` carries."""
    return {
        "batches": case.batches,
        "batch_mib": case.elements * 4 / (1 << 20),
        "verified": all(r["verified"] for r in m.pipeline[case.label]),
        **runs,
    }


def _rate(case: Case, rounds: Sequence[dict[str, Any]], key: str) -> float:
    """Batches per second of the fastest repeat under ``key`` over ``rounds``."""
    return case.batches / min(_concat(rounds, key))


def _pool_row(case: Case, m: Measured, runs: dict[str, int]) -> Result:
    """aruntime on two devices against the two-thread pool (no tinygrad involved)."""
    ours = m.pipeline[case.label]
    two, pool = _rate(case, ours, "two_s"), _rate(case, ours, "threads_s")
    common = _pipeline_common(case, m, runs)
    goal = None if per_op(case) else POOL_GOAL
    name = f"peers_pipeline_{case.label}_2dev_vs_threads"
    gb_s = two * case.elements * 4 / 1e9
    return _ratio_row(name, two, pool, goal, "the two-thread pool", gb_s=gb_s, **common)


def _pipeline_rows(case: Case, peer: Peer, m: Measured, version: str, runs: dict[str, int]) -> list[Result]:
    """aruntime on one and on two devices, and its build of the kernel, against tinygrad release ``peer``."""
    ours = m.pipeline[case.label]
    goals = peer.small if per_op(case) else peer.large
    nbytes = case.elements * 4
    common = _pipeline_common(case, m, runs)
    prefix = f"peers_pipeline_{case.label}"
    names = (
        (f"{prefix}_1dev_vs_{peer.tag}", "one_s", goals.one_vs_tinygrad, "one_s", "tinygrad one call after another"),
        (f"{prefix}_2dev_vs_{peer.tag}", "two_s", goals.two_vs_tinygrad_threads, "two_threads_s", "tinygrad 2 threads"),
    )
    ours_us = statistics.median(r["kernel_us"] for r in ours)
    kernel_name, kernel_goal = f"peers_kernel_{case.label}_vs_{peer.tag}", f"<= {KERNEL_GOAL}x tinygrad's build"
    theirs = [p for out in m.figures(peer.version) for p in out["pipeline"] if p["label"] == case.label]
    rows: list[Result] = []
    if not theirs:
        reason = m.reason(peer.version)
        for name, key, goal, _, what in names:
            rate = _rate(case, ours, key)
            rows.append(_skip_row(name, rate, "batches/s", f">= {goal}x {what} {version}", reason, **common))
        rows.append(_skip_row(kernel_name, ours_us, "us", kernel_goal, reason, **runs))
        return rows
    tg_verified = all(p["verified"] for p in theirs)
    for name, key, goal, tg_key, what in names:
        rate, tg_rate = _rate(case, ours, key), _rate(case, theirs, tg_key)
        rows.append(
            _ratio_row(
                name,
                rate,
                tg_rate,
                goal,
                f"{what} {version}",
                gb_s=rate * nbytes / 1e9,
                tinygrad_gb_s=tg_rate * nbytes / 1e9,
                tinygrad_verified=tg_verified,
                **common,
            )
        )
    tg_us = statistics.median(p["kernel_us"] for p in theirs)
    ratio = ours_us / tg_us
    rows.append(
        result(
            kernel_name,
            ours_us,
            "us",
            tg_us,
            ratio,
            kernel_goal,
            ratio <= KERNEL_GOAL,
            batch_mib=common["batch_mib"],
            **runs,
        )
    )
    return rows


def _serving_row(plan: Plan, peer: Peer, m: Measured, runs: dict[str, int]) -> Result:
    """aruntime's serving throughput against the faster of tinygrad ``peer``'s two ways (reported)."""
    tg = m.figures(peer.version)
    rps = plan.serving_tasks / min(_concat(m.serving, "seconds"))
    common = {
        "tasks": plan.serving_tasks,
        "request_bytes": plan.serving_elements * 4,
        "verified": all(r["verified"] for r in m.serving),
        "p50_ms": statistics.median(r["p50_ms"] for r in m.serving),
        "p99_ms": statistics.median(r["p99_ms"] for r in m.serving),
        **runs,
    }
    name = f"peers_serving_vs_{peer.tag}"
    if not tg:
        return _skip_row(name, rps, "req/s", "report only", m.reason(peer.version), **common)
    variants = {v: [out["serving"][v] for out in tg] for v in tg[0]["serving"]}
    variant_rps = {v: plan.serving_tasks / min(_concat(rs, "seconds")) for v, rs in variants.items()}
    best = max(variant_rps, key=lambda v: variant_rps[v])
    extra = {
        "tinygrad_variant": best,
        "tinygrad_variant_req_s": variant_rps,
        "tinygrad_p50_ms": statistics.median(r["p50_ms"] for r in variants[best]),
        "tinygrad_p99_ms": statistics.median(r["p99_ms"] for r in variants[best]),
        "tinygrad_verified": all(r["verified"] for rs in variants.values() for r in rs),
    }
    tg_rps = variant_rps[best]
    return result(name, rps, "req/s", tg_rps, rps / tg_rps, "report only", None, **extra, **common)


def _latency_row(peer: Peer, m: Measured) -> Result:
    """aruntime's awaited launch against tinygrad ``peer``'s synchronous one plus 1.5 bare wakes."""
    tg = m.figures(peer.version)
    launch_us, wake_us = _concat(m.latency, "launch_us"), _concat(m.latency, "wake_us")
    ours_us, wake = statistics.median(launch_us), statistics.median(wake_us)
    name, goal = f"peers_launch_latency_vs_{peer.tag}", f"<= tinygrad sync launch + {LATENCY_WAKES} x bare wake"
    common = {"wake_us": wake, "calls": len(launch_us), "aruntime_p90_us": percentile(launch_us, 90)}
    if not tg:
        return _skip_row(name, ours_us, "us", goal, m.reason(peer.version), **common)
    tg_calls = [v for out in tg for v in out["latency"]["us"]]
    tg_us = statistics.median(tg_calls)
    budget = tg_us + LATENCY_WAKES * wake
    ratio = ours_us / budget
    extra = {"tinygrad_sync_us": tg_us, "tinygrad_p90_us": percentile(tg_calls, 90)}
    return result(name, ours_us, "us", budget, ratio, goal, ratio <= 1.0, **extra, **common)


def build_rows(plan: Plan, m: Measured) -> list[Result]:
    """The result rows of one run: per case the pool row, then each release's pipeline and kernel rows; then the
    serving and latency rows of the releases that have them. A release's rows carry its version (``tinygrad``),
    and ``skipped`` when it did not run."""
    runs = {"rounds": plan.rounds, "repeats": plan.repeats}
    versions = {p.version: next((out["tinygrad_version"] for out in m.figures(p.version)), p.version) for p in PEERS}
    rows: list[Result] = []

    def add(peer: Peer, new: Sequence[Result]) -> None:
        for row in new:
            row["tinygrad"] = versions[peer.version]
        rows.extend(new)

    for case in plan.cases:
        rows.append(_pool_row(case, m, runs))
        for peer in PEERS:
            add(peer, _pipeline_rows(case, peer, m, versions[peer.version], runs))
    for peer in PEERS:
        if peer.serving_and_latency:
            add(peer, [_serving_row(plan, peer, m, runs), _latency_row(peer, m)])
    return rows


async def side_by_side(quick: bool, with_tinygrad: bool = True) -> list[Result]:
    """Measure aruntime, the thread pool and each tinygrad release, round by round, on the same sources and sizes;
    the rows."""
    plan = Plan.make(quick)
    m = Measured(pipeline={case.label: [] for case in plan.cases}, tinygrad={peer.version: [] for peer in PEERS})
    if not with_tinygrad:
        m.skipped = {peer.version: "tinygrad side not requested (ARUNTIME_BENCH_PEERS=0)" for peer in PEERS}
    for _ in range(plan.rounds):
        cases: list[dict[str, Any]] = []
        for case in plan.cases:
            got = await measure_pipeline(case, plan.repeats)
            m.pipeline[case.label].append(got)
            cases.append(
                {
                    "label": case.label,
                    "elements": case.elements,
                    "batches": case.batches,
                    "source": got["source"],
                    "expected": got["expected"],
                    "check_base": CHECK_BASE,
                }
            )
        m.serving.append(await measure_serving(plan.serving_tasks, plan.serving_elements, plan.repeats))
        m.latency.append(await measure_latency(plan.latency_calls, plan.latency_warmup))
        for peer in PEERS:
            if peer.version in m.skipped:
                continue
            spec: dict[str, Any] = {"devices": len(DEVICES), "repeats": plan.repeats, "slots": SLOTS, "cases": cases}
            if peer.serving_and_latency:
                spec["serving"] = {
                    "source": m.serving[-1]["source"],
                    "tasks": plan.serving_tasks,
                    "elements": plan.serving_elements,
                }
                spec["latency"] = {"source": TINY_KERNEL, "calls": plan.latency_calls, "warmup": plan.latency_warmup}
            try:
                m.tinygrad[peer.version].append(await measure_tinygrad(peer.version, spec))
            except setup_tinygrad.PeerUnavailable as exc:
                m.skipped[peer.version] = str(exc)
            except TimeoutError:
                m.skipped[peer.version] = f"tinygrad {peer.version} worker ran past {WORKER_LIMIT_S:g} s"
    return build_rows(plan, m)


async def peers_tinygrad() -> list[Result]:
    """Pipeline, serving and launch latency: aruntime against tinygrad's device layer (two releases) and a plain
    thread pool."""
    return await side_by_side(settings.quick, with_tinygrad=os.environ.get("ARUNTIME_BENCH_PEERS", "1") != "0")


BENCHMARKS = [peers_tinygrad]
