"""Side by side with tinygrad: the pipeline, kernel, serving and launch-latency figures against tinygrad's device layer.

The same C kernel sources and sizes run, in the same run, on:

* aruntime: ``CPU`` alone, and ``CPU`` with ``CPU:1``, each driven through one
  :class:`Scheduler` with default settings (pipeline, serving), or one awaited
  ``dev.launch`` at a time (latency);
* tinygrad's own device layer (``Device``, its allocator, ``ClangJITCompiler``
  and ``CPUProgram``; the pinned release from PyPI, installed into a separate
  virtual environment and driven by ``benchmarks/peers/tinygrad_worker.py`` in a
  subprocess, see that file for exactly which calls): one call after another on
  one device, and two user threads, one per device;
* a runtime-free pool: two plain Python threads, each doing ``memmove`` /
  kernel / ``memmove`` per batch through ctypes on its own buffers, the kernel
  built the way aruntime builds it (the limit of this machine);
* a bare thread wake: a worker thread waking one future on the loop
  (:class:`benchmarks.bench_engine.BareWorker`), the least that any awaited
  off-loop launch costs.

The pipeline kernel is ``out[i] = (in[i] - 0.484375f) * 4.375f`` over float32.
Kernels take no scalar arguments: sizes are compiled into the source, because
tinygrad's CPU program passes scalars as 32-bit ints and has no floats. Each
side compiles the identical text the way its runtime does (aruntime's CPU
device: ``cc -O3 -march=native``; tinygrad: ``clang -O2 -march=native
-ffreestanding``), and the kernel row compares the two builds called directly,
µs per launch.

The run is ``rounds`` rounds; each measures aruntime on one device, on two, and
the thread pool (alternating, ``repeats`` times each), then runs tinygrad's
worker (``repeats`` times each), so both sides are sampled across the same
stretch of time. Threads are left unpinned, as users run them. Throughputs are
from the fastest repeat of each side (interference only ever slows a run down);
latencies are medians over every call.

Goals (issue 11), per 4 MiB batch: one device >= 1.1x tinygrad one call after
another; two devices >= 1.0x tinygrad with two user threads, and >= 0.95x the
two-thread pool; per 256 KiB batch (per-op cost decides): >= 1.2x tinygrad, on
one and on two devices; aruntime's build of the kernel no slower than
tinygrad's. Awaited launch latency <= tinygrad's synchronous launch + 1.5 x the
bare wake.

When the tinygrad environment cannot be built (no network for pip, no clang) the
tinygrad rows are still emitted, with ``skipped`` saying why, and no figures.
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
from benchmarks.bench_engine import BareWorker
from benchmarks.common import Result, burst, result, settings, timed
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
SLOTS = 2
"""Device buffers per device that the pipeline batches rotate through (double buffering), as in bench_scheduler."""
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
    """Every round's raw figures: aruntime's and the thread pool's, and tinygrad's worker output."""

    pipeline: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    serving: list[dict[str, Any]] = field(default_factory=list)
    latency: list[dict[str, Any]] = field(default_factory=list)
    tinygrad: list[dict[str, Any]] = field(default_factory=list)
    skipped: str | None = None


def _address(obj: Any) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(obj))


def _percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


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
    dst_addr = [_address(d) for d in dsts]
    memmove, kernel = ctypes.memmove, host.fn

    def lane(first: int) -> None:
        x, y = _address(lane_x[first]), _address(lane_y[first])
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
    one_s: list[float] = []
    two_s: list[float] = []
    threads_s: list[float] = []
    for _ in range(repeats):
        one_s.append(await timed(one))
        two_s.append(await timed(two))
        threads_s.append(await timed(threads))
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
        "one_s": one_s,
        "two_s": two_s,
        "threads_s": threads_s,
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
        "p50_ms": _percentile(latencies, 50) * 1e3,
        "p99_ms": _percentile(latencies, 99) * 1e3,
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

WORKER_LIMIT_S = 600.0
"""How long one run of the tinygrad worker may take before its rows are reported as skipped."""


def _worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    clang = setup_tinygrad.find_clang()
    if clang is not None:
        env["CC"] = clang  # never the system cc: tinygrad passes clang-only flags
    return env


async def measure_tinygrad(spec: dict[str, Any]) -> dict[str, Any]:
    """Build (or reuse) tinygrad's environment and run its worker on ``spec``; PeerUnavailable says why not."""
    install = os.environ.get("ARUNTIME_BENCH_INSTALL_CLANG") == "1"
    python = await anyio.to_thread.run_sync(setup_tinygrad.ensure, install)
    with tempfile.TemporaryDirectory(prefix="aruntime-peers-") as tmp:
        spec_path = anyio.Path(tmp) / "spec.json"
        await spec_path.write_text(json.dumps(spec))
        with anyio.fail_after(WORKER_LIMIT_S):
            command = [str(python), str(setup_tinygrad.WORKER), spec_path]
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


@dataclass(frozen=True)
class Goals:
    """Minimum ratios of one case's pipeline rows (None: reported only)."""

    one_vs_tinygrad: float
    two_vs_tinygrad_threads: float
    two_vs_threads: float | None


LARGE_GOALS = Goals(1.1, 1.0, 0.95)
SMALL_GOALS = Goals(1.2, 1.2, None)
KERNEL_GOAL = 1.0
"""aruntime's build of the pipeline kernel: at most this many times tinygrad's µs per launch."""
LATENCY_WAKES = 1.5


def goals_for(case: Case) -> Goals:
    """The goals of ``case``: per-op ones for small batches, the copy-bound ones otherwise."""
    return SMALL_GOALS if case.elements * 4 < SMALL_BATCH else LARGE_GOALS


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


def _pipeline_rows(case: Case, m: Measured, version: str, reason: str, runs: dict[str, int]) -> list[Result]:
    ours = m.pipeline[case.label]
    goals = goals_for(case)
    one = case.batches / min(_concat(ours, "one_s"))
    two = case.batches / min(_concat(ours, "two_s"))
    pool = case.batches / min(_concat(ours, "threads_s"))
    mib = case.elements * 4 / (1 << 20)
    common = {
        "batches": case.batches,
        "batch_mib": mib,
        "verified": all(r["verified"] for r in ours),
        **runs,
    }
    prefix = f"peers_pipeline_{case.label}"
    rows = [
        _ratio_row(
            f"{prefix}_2dev_vs_threads",
            two,
            pool,
            goals.two_vs_threads,
            "the two-thread pool",
            gb_s=two * mib * (1 << 20) / 1e9,
            **common,
        )
    ]
    ours_us = statistics.median(r["kernel_us"] for r in ours)
    theirs = [p for out in m.tinygrad for p in out["pipeline"] if p["label"] == case.label]
    names = (
        (f"{prefix}_1dev_vs_tinygrad", one, goals.one_vs_tinygrad, "one_s", "tinygrad one call after another"),
        (f"{prefix}_2dev_vs_tinygrad", two, goals.two_vs_tinygrad_threads, "two_threads_s", "tinygrad 2 threads"),
    )
    kernel_name, kernel_goal = f"peers_kernel_{case.label}_vs_tinygrad", f"<= {KERNEL_GOAL}x tinygrad's build"
    if not theirs:
        for name, rate, goal, _, what in names:
            rows.append(_skip_row(name, rate, "batches/s", f">= {goal}x {what} {version}", reason, **common))
        rows.append(_skip_row(kernel_name, ours_us, "us", kernel_goal, reason, **runs))
        return rows
    tg_verified = all(p["verified"] for p in theirs)
    for name, rate, goal, key, what in names:
        tg_rate = case.batches / min(_concat(theirs, key))
        rows.append(
            _ratio_row(
                name,
                rate,
                tg_rate,
                goal,
                f"{what} {version}",
                gb_s=rate * mib * (1 << 20) / 1e9,
                tinygrad_gb_s=tg_rate * mib * (1 << 20) / 1e9,
                tinygrad_verified=tg_verified,
                **common,
            )
        )
    tg_us = statistics.median(p["kernel_us"] for p in theirs)
    ratio = ours_us / tg_us
    rows.append(
        result(kernel_name, ours_us, "us", tg_us, ratio, kernel_goal, ratio <= KERNEL_GOAL, batch_mib=mib, **runs)
    )
    return rows


def build_rows(plan: Plan, m: Measured) -> list[Result]:
    """The result rows of one run (tinygrad's rows carry ``skipped`` when it did not run)."""
    rows: list[Result] = []
    tg = m.tinygrad
    version = tg[0]["tinygrad_version"] if tg else setup_tinygrad.TINYGRAD_VERSION
    reason = m.skipped or "no tinygrad figures"
    runs = {"rounds": plan.rounds, "repeats": plan.repeats}
    for case in plan.cases:
        rows.extend(_pipeline_rows(case, m, version, reason, runs))

    rps = plan.serving_tasks / min(_concat(m.serving, "seconds"))
    common = {
        "tasks": plan.serving_tasks,
        "request_bytes": plan.serving_elements * 4,
        "verified": all(r["verified"] for r in m.serving),
        "p50_ms": statistics.median(r["p50_ms"] for r in m.serving),
        "p99_ms": statistics.median(r["p99_ms"] for r in m.serving),
        **runs,
    }
    name = "peers_serving_vs_tinygrad"
    if not tg:
        rows.append(_skip_row(name, rps, "req/s", "report only", reason, **common))
    else:
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
        rows.append(result(name, rps, "req/s", tg_rps, rps / tg_rps, "report only", None, **extra, **common))

    launch_us, wake_us = _concat(m.latency, "launch_us"), _concat(m.latency, "wake_us")
    ours_us, wake = statistics.median(launch_us), statistics.median(wake_us)
    name, goal = "peers_launch_latency_vs_tinygrad", f"<= tinygrad sync launch + {LATENCY_WAKES} x bare wake"
    common = {"wake_us": wake, "calls": len(launch_us), "aruntime_p90_us": _percentile(launch_us, 90)}
    if not tg:
        rows.append(_skip_row(name, ours_us, "us", goal, reason, **common))
    else:
        tg_calls = [v for out in tg for v in out["latency"]["us"]]
        tg_us = statistics.median(tg_calls)
        budget = tg_us + LATENCY_WAKES * wake
        ratio = ours_us / budget
        extra = {"tinygrad_sync_us": tg_us, "tinygrad_p90_us": _percentile(tg_calls, 90)}
        rows.append(result(name, ours_us, "us", budget, ratio, goal, ratio <= 1.0, **extra, **common))
    for row in rows:
        row["tinygrad"] = version
    return rows


async def side_by_side(quick: bool, with_tinygrad: bool = True) -> list[Result]:
    """Measure aruntime, the thread pool and tinygrad, round by round, on the same sources and sizes; the rows."""
    plan = Plan.make(quick)
    m = Measured(pipeline={case.label: [] for case in plan.cases})
    if not with_tinygrad:
        m.skipped = "tinygrad side not requested (ARUNTIME_BENCH_PEERS=0)"
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
        if m.skipped is not None:
            continue
        spec = {
            "devices": list(DEVICES),
            "repeats": plan.repeats,
            "slots": SLOTS,
            "cases": cases,
            "serving": {
                "source": m.serving[-1]["source"],
                "tasks": plan.serving_tasks,
                "elements": plan.serving_elements,
            },
            "latency": {"source": TINY_KERNEL, "calls": plan.latency_calls, "warmup": plan.latency_warmup},
        }
        try:
            m.tinygrad.append(await measure_tinygrad(spec))
        except setup_tinygrad.PeerUnavailable as exc:
            m.skipped = str(exc)
        except TimeoutError:
            m.skipped = f"tinygrad worker ran past {WORKER_LIMIT_S:g} s"
    if m.skipped is not None:
        m.tinygrad = []
    return build_rows(plan, m)


async def peers_tinygrad() -> list[Result]:
    """Pipeline, serving and launch latency: aruntime against tinygrad's device layer and a plain thread pool."""
    return await side_by_side(settings.quick, with_tinygrad=os.environ.get("ARUNTIME_BENCH_PEERS", "1") != "0")


BENCHMARKS = [peers_tinygrad]
