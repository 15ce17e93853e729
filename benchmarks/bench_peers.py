"""Side by side with tinygrad: the pipeline, serving and launch-latency figures against tinygrad's device layer.

The same C kernel sources and sizes run, in the same run, on:

* aruntime: CPU and CPU:1 driven through a :class:`Scheduler` (pipeline,
  serving) or one awaited ``dev.launch`` at a time (latency);
* tinygrad's own device layer (``Device``, its allocator, ``ClangJITCompiler``
  and ``CPUProgram``; the pinned release from PyPI, installed into a separate
  virtual environment and driven by ``benchmarks/peers/tinygrad_worker.py`` in a
  subprocess, see that file for exactly which calls);
* a plain thread pool: the same ``memmove`` / kernel / ``memmove`` per batch
  through ``anyio.to_thread.run_sync``, two lanes (one per device);
* a bare thread wake: a worker thread waking one future on the loop
  (:class:`benchmarks.bench_engine.BareWorker`), the least that any awaited
  off-loop launch costs.

Kernels take no scalar arguments: sizes and pass counts are compiled into the
source, because tinygrad's CPU program passes scalars as 32-bit ints and has no
floats, whereas aruntime passes ``int64_t`` / ``double``. Each side compiles the
identical text with its own compiler (aruntime: ``cc -O2``; tinygrad: ``clang -O2
-march=native -ffreestanding``), so the rows also give each side's kernel time
alone (``*_kernel_us``): a faster kernel from the other compiler shows there.

The run is ``rounds`` rounds; each measures aruntime and the thread pool
(alternating, ``repeats`` times each), then runs tinygrad's worker (``repeats``
times), so both sides are sampled across the same stretch of time. Throughputs
are from the fastest repeat of each side (interference only ever slows a run
down); latencies are medians over every call.

Goals (from the issue): pipeline throughput >= 1.5x tinygrad's; awaited launch
latency <= tinygrad's synchronous launch + 1.5 x the bare wake.

When the tinygrad environment cannot be built (no network for pip, no clang) the
tinygrad rows are still emitted, with ``skipped`` saying why, and no figures.
``ARUNTIME_BENCH_PEERS=0`` skips the tinygrad side on purpose;
``ARUNTIME_BENCH_INSTALL_CLANG=1`` lets it ``apt-get install clang`` when root.
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import statistics
import tempfile
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

PASSES = 0
"""Multiply-add passes of the pipeline kernel. The pipeline benchmark calibrates them so the kernel takes as long as
one copy-in; on the machine measured its calibration mostly lands on 0 (the kernel's memory traffic alone already
takes longer than the copy), so the side-by-side fixes 0 rather than let noise change the work between runs."""

_PIPELINE_BODY = r"""
  float t[BLOCK];
  for (int64_t b = 0; b < n; b += BLOCK) {
    int64_t m = n - b < BLOCK ? n - b : BLOCK;
    for (int64_t i = 0; i < m; i++) t[i] = x[b + i];
    for (int64_t p = 0; p < passes; p++)
      for (int64_t i = 0; i < m; i++) t[i] = t[i] * 0.5f + 1.0f;
    for (int64_t i = 0; i < m; i++) y[b + i] = t[i];
  }
"""


def pipeline_kernel(n: int, passes: int = PASSES) -> str:
    """The pipeline benchmark's kernel (``bench_scheduler.PASSES``) with ``n`` and ``passes`` compiled in."""
    return (
        "#include <stdint.h>\n#define BLOCK 1024\n"
        f"void kernel(float *y, const float *x) {{\n  const int64_t n = {n}, passes = {passes};"
        + _PIPELINE_BODY
        + "}\n"
    )


def serving_kernel(n: int) -> str:
    """The serving benchmark's kernel (``out = x * 2``) over ``n`` floats."""
    return (
        "#include <stdint.h>\nvoid kernel(float *out, const float *x) {\n"
        f"  for (int64_t i = 0; i < {n}; i++) out[i] = x[i] * 2.0f;\n}}\n"
    )


TINY_KERNEL = "void kernel(unsigned char *b) { b[0] += 1; }\n"
"""The launch-latency kernel: one buffer, one byte touched."""


def pipeline_expected(value: float, passes: int = PASSES) -> float:
    """What the pipeline kernel makes of an element ``value`` (float32 steps, as the C code does them)."""
    out = array.array("f", [value])
    for _ in range(passes):
        out[0] = out[0] * 0.5 + 1.0
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
        # 8 MiB x 32: the pipeline benchmark's own size; 256 KiB x 256: the same bytes in small batches, where the
        # cost per op rather than the copies decides. 1000 requests of 256 floats: the serving benchmark's.
        return cls((Case("8MiB", 2 << 20, 32), Case("256KiB", 1 << 16, 256)), 3, 5, 1000, 256, 1000, 100)


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
    """A kernel built by aruntime's CPU compiler and loaded with plain ctypes, for the thread-pool baseline."""

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
    """The pipeline through a Scheduler on CPU and CPU:1, alternating with the to_thread baseline."""
    n, nbytes, batches = case.elements, case.elements * 4, case.batches
    devs = [Device[name] for name in DEVICES]
    ndev = len(devs)
    source = pipeline_kernel(n)
    progs: list[Program] = [await d.compile(source, outs=(0,)) for d in devs]
    xs = [[await d.allocate(n, dtypes.float32) for _ in range(SLOTS)] for d in devs]
    ys = [[await d.allocate(n, dtypes.float32) for _ in range(SLOTS)] for d in devs]
    srcs = [array.array("f", [float(k + 1)]) * n for k in range(SOURCES)]
    check_srcs = [array.array("f", [CHECK_BASE + k + 1]) * n for k in range(SOURCES)]
    dsts = [bytearray(nbytes) for _ in range(SLOTS * ndev)]
    expected = [pipeline_expected(CHECK_BASE + k + 1) for k in range(SOURCES)]

    async def pipelined(sources: Sequence[array.array[float]] = srcs) -> None:
        async with Scheduler(window=3 * SLOTS * ndev) as sched:
            for i in range(batches):
                d, s = i % ndev, (i // ndev) % SLOTS
                x, y = xs[d][s], ys[d][s]
                sched.copyin(x, sources[i % SOURCES])
                sched.launch(progs[d], y, x)
                sched.copyout(y, dsts[i % len(dsts)])
                await sched.room()  # backpressure: at most the window in flight

    host = HostKernel(source)
    lane_x = [(ctypes.c_char * nbytes)() for _ in range(ndev)]
    lane_y = [(ctypes.c_char * nbytes)() for _ in range(ndev)]
    src_addr = [s.buffer_info()[0] for s in srcs]
    dst_addr = [_address(d) for d in dsts]
    memmove, kernel = ctypes.memmove, host.fn

    def batch(i: int) -> None:
        lane = i % ndev
        x, y = ctypes.addressof(lane_x[lane]), ctypes.addressof(lane_y[lane])
        memmove(x, src_addr[i % SOURCES], nbytes)
        kernel(y, x)
        memmove(dst_addr[i % len(dsts)], y, nbytes)

    async def threaded() -> None:
        async def lane(first: int) -> None:
            for i in range(first, batches, ndev):
                await anyio.to_thread.run_sync(batch, i)

        async with anyio.create_task_group() as tg:
            for first in range(ndev):
                tg.start_soon(lane, first)

    await pipelined()  # warm-up: every page touched, engine threads awake
    await threaded()
    ours_s: list[float] = []
    base_s: list[float] = []
    for _ in range(repeats):
        ours_s.append(await timed(pipelined))
        base_s.append(await timed(threaded))
    await pipelined(check_srcs)
    verified = _verify(dsts, batches, expected)
    kernel_us = host.median_us(ctypes.addressof(lane_y[0]), ctypes.addressof(lane_x[0]))
    for dev, xb, yb in zip(devs, xs, ys, strict=True):
        for buf in (*xb, *yb):
            await dev.free(buf)
    return {
        "source": source,
        "expected": expected,
        "aruntime_s": ours_s,
        "to_thread_s": base_s,
        "verified": verified,
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

PIPELINE_GOAL = 1.5
LATENCY_WAKES = 1.5


def _skip_row(name: str, value: float, unit: str, goal: str, reason: str, **extra: Any) -> Result:
    row = result(name, value, unit, 0.0, 0.0, goal, None, skipped=reason, **extra)
    row["baseline"] = row["ratio"] = None
    return row


def _concat(rounds: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [v for r in rounds for v in r[key]]


def build_rows(plan: Plan, m: Measured) -> list[Result]:
    """The result rows of one run (tinygrad's rows carry ``skipped`` when it did not run)."""
    rows: list[Result] = []
    tg = m.tinygrad
    version = tg[0]["tinygrad_version"] if tg else setup_tinygrad.TINYGRAD_VERSION
    reason = m.skipped or "no tinygrad figures"
    runs = {"rounds": plan.rounds, "repeats": plan.repeats}
    for case in plan.cases:
        ours = m.pipeline[case.label]
        rate = case.batches / min(_concat(ours, "aruntime_s"))
        base_rate = case.batches / min(_concat(ours, "to_thread_s"))
        common = {
            "batches": case.batches,
            "batch_mib": case.elements * 4 / (1 << 20),
            "passes": PASSES,
            "verified": all(r["verified"] for r in ours),
            "aruntime_kernel_us": statistics.median(r["kernel_us"] for r in ours),
            **runs,
        }
        name = f"peers_pipeline_{case.label}_vs_to_thread"
        rows.append(result(name, rate, "batches/s", base_rate, rate / base_rate, "report only", None, **common))
        name, goal = f"peers_pipeline_{case.label}_vs_tinygrad", f">= {PIPELINE_GOAL}x tinygrad {version}"
        theirs = [p for out in tg for p in out["pipeline"] if p["label"] == case.label]
        if not theirs:
            rows.append(_skip_row(name, rate, "batches/s", goal, reason, **common))
            continue
        tg_rate = case.batches / min(_concat(theirs, "seconds"))
        ratio = rate / tg_rate
        extra = {
            "tinygrad_kernel_us": statistics.median(p["kernel_us"] for p in theirs),
            "tinygrad_verified": all(p["verified"] for p in theirs),
        }
        rows.append(result(name, rate, "batches/s", tg_rate, ratio, goal, ratio >= PIPELINE_GOAL, **extra, **common))

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
