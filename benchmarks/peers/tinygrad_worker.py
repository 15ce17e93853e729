"""The tinygrad side of the peer benchmark; runs INSIDE ``benchmarks/peers/.venv-tinygrad``.

Reads a JSON spec from the file named by its argument (the C sources, sizes and counts that
``benchmarks/bench_peers.py`` also runs on aruntime), drives tinygrad's device
layer directly and prints one JSON object on stdout. Nothing of aruntime is
imported here.

tinygrad 0.13's device layer, as used:

* ``Device["CPU"]``, ``Device["CPU:1"]``: ``CPUDevice`` (an ``HCQCompiled``),
  each with one worker thread fed by a ``queue.Queue``.
* ``dev.allocator.alloc(nbytes)`` -> ``HCQBuffer``; ``dev.allocator._copyin(buf, memoryview)``
  and ``._copyout(memoryview, buf)``: the CPU device has no copy queue, so each
  first runs ``dev.synchronize()`` and then a ``ctypes.memmove`` on the calling thread.
* ``dev.compiler.compile(src)``: ``ClangJITCompiler`` (clang to an ELF object,
  linked by tinygrad's ``jit_loader``); ``dev.runtime("kernel", lib)`` -> ``CPUProgram``.
* ``prog(*bufs)`` enqueues the kernel on the device's worker thread and returns;
  ``prog(*bufs, wait=True)`` also waits (``dev.synchronize()``).

The pipeline runs two ways: one call after another on ``CPU`` (nothing
overlaps: each copy synchronizes the device first), and one user thread per
device, each doing its batches one call after another (the copies run on the
user threads, GIL released in ``memmove``, the kernels on the devices' worker
threads).
"""

from __future__ import annotations

import array
import ctypes
import gc
import importlib.metadata
import json
import statistics
import sys
import threading
import time
import traceback
from typing import Any

SOURCES = 3
"""Distinct host inputs the batches cycle through: batch ``i`` reads one filled with ``base + i % 3 + 1``."""


def _filled(value: float, n: int) -> memoryview:
    return memoryview(array.array("f", [value]) * n).cast("B")


def _check(dsts: list[memoryview], batches: int, expected: list[float]) -> bool:
    """Each host destination holds the output of the last batch that used it."""
    for j, dst in enumerate(dsts):
        used = [i for i in range(batches) if i % len(dsts) == j]
        if not used:
            continue
        want = expected[used[-1] % len(expected)]
        got = dst.cast("f")
        if got[0] != want or got[len(got) - 1] != want:
            return False
    return True


def run_pipeline(
    devs: list[Any], progs: list[Any], n: int, batches: int, slots: int, dsts: list[memoryview], base: float = 0.0
) -> float:
    """``batches`` rounds of copyin -> kernel -> copyout, one call after another from this thread; the seconds.

    On one device (``devs`` of one) this is the layer used as written: a copy-in
    or copy-out synchronizes the device first, so each batch's calls run in turn.
    With more devices, batches alternate between them and a batch's copy-out is
    done after the next batch's kernel has been enqueued, so that kernel runs on
    its device's worker thread while this thread copies.
    """
    nbytes = n * 4
    srcs = [_filled(base + k + 1, n) for k in range(SOURCES)]
    xs = [d.allocator.alloc(nbytes) for d in devs]
    ys = [[d.allocator.alloc(nbytes) for _ in range(slots)] for d in devs]
    ndev = len(devs)
    gc.collect()  # as aruntime's side does before each timed run
    start = time.perf_counter()
    pending: tuple[int, Any, int] | None = None  # (device index, output buffer, batch) still to copy out
    for i in range(batches):
        d = i % ndev
        y = ys[d][(i // ndev) % slots]
        devs[d].allocator._copyin(xs[d], srcs[i % SOURCES])  # synchronizes device d first
        progs[d](y, xs[d])  # enqueued on d's worker thread
        if pending is not None:
            pd, py, pi = pending
            devs[pd].allocator._copyout(dsts[pi % len(dsts)], py)  # synchronizes device pd first
        pending = (d, y, i)
    if pending is not None:
        pd, py, pi = pending
        devs[pd].allocator._copyout(dsts[pi % len(dsts)], py)
    for dev in devs:
        dev.synchronize()
    elapsed = time.perf_counter() - start
    for dev, x, outs in zip(devs, xs, ys, strict=True):
        for buf in (x, *outs):
            dev.allocator.free(buf, nbytes)
    return elapsed


def run_threads(
    devs: list[Any], progs: list[Any], n: int, batches: int, dsts: list[memoryview], base: float = 0.0
) -> float:
    """The pipeline driven by one user thread per device: thread ``d`` does batches ``d, d + len(devs), ...``,
    each copy-in, kernel, copy-out one call after another on its device; the seconds until both are done."""
    nbytes = n * 4
    srcs = [_filled(base + k + 1, n) for k in range(SOURCES)]
    xs = [d.allocator.alloc(nbytes) for d in devs]
    ys = [d.allocator.alloc(nbytes) for d in devs]
    ndev = len(devs)

    def lane(d: int) -> None:
        alloc, prog, x, y = devs[d].allocator, progs[d], xs[d], ys[d]
        for i in range(d, batches, ndev):
            alloc._copyin(x, srcs[i % SOURCES])
            prog(y, x)
            alloc._copyout(dsts[i % len(dsts)], y)

    pool = [threading.Thread(target=lane, args=(d,)) for d in range(ndev)]
    gc.collect()
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    for dev, x, y in zip(devs, xs, ys, strict=True):
        dev.allocator.free(x, nbytes)
        dev.allocator.free(y, nbytes)
    return elapsed


def measure_pipeline(devs: list[Any], case: dict[str, Any], slots: int, repeats: int) -> dict[str, Any]:
    """One pipeline case, one call after another on the first device and with one user thread per device,
    alternating, ``repeats`` times each after a warm-up; then each checked on new inputs."""
    n, batches = case["elements"], case["batches"]
    progs = [d.runtime("kernel", d.compiler.compile(case["source"])) for d in devs]
    dsts = [memoryview(bytearray(n * 4)) for _ in range(slots * len(devs))]

    def one(base: float = 0.0) -> float:
        return run_pipeline(devs[:1], progs[:1], n, batches, slots, dsts, base)

    def two(base: float = 0.0) -> float:
        return run_threads(devs, progs, n, batches, dsts, base)

    one()  # warm-up
    two()
    one_s: list[float] = []
    two_s: list[float] = []
    for _ in range(repeats):
        one_s.append(one())
        two_s.append(two())
    verified = True
    for run in (one, two):  # outputs cleared first, so a run that wrote nothing fails
        for dst in dsts:
            dst[:] = bytes(len(dst))
        run(case["check_base"])
        verified = verified and _check(dsts, batches, case["expected"])
    return {
        "label": case["label"],
        "one_s": one_s,
        "two_threads_s": two_s,
        "verified": verified,
        "kernel_us": kernel_only_us(devs[0], progs[0], n),
    }


def run_serving(dev: Any, prog: Any, n: int, tasks: int, variant: str) -> tuple[float, list[float], bool]:
    """``tasks`` requests (copy-in, kernel, copy-out) all waiting at the start; seconds, each one's latency, check.

    ``sequential`` serves them one after another; ``batched`` copies every
    request in, enqueues every kernel, then copies every result out (one
    synchronization instead of one per request).
    """
    nbytes = n * 4
    xs = [dev.allocator.alloc(nbytes) for _ in range(tasks)]
    ys = [dev.allocator.alloc(nbytes) for _ in range(tasks)]
    requests = [_filled(float(i), n) for i in range(tasks)]
    outs = [memoryview(bytearray(nbytes)) for _ in range(tasks)]
    done_at = [0.0] * tasks
    alloc = dev.allocator
    gc.collect()  # as aruntime's side does before each timed run
    start = time.perf_counter()
    if variant == "sequential":
        for i in range(tasks):
            alloc._copyin(xs[i], requests[i])
            prog(ys[i], xs[i])
            alloc._copyout(outs[i], ys[i])
            done_at[i] = time.perf_counter()
    else:
        for i in range(tasks):
            alloc._copyin(xs[i], requests[i])
        for i in range(tasks):
            prog(ys[i], xs[i])
        for i in range(tasks):
            alloc._copyout(outs[i], ys[i])
            done_at[i] = time.perf_counter()
    elapsed = time.perf_counter() - start
    ok = all(outs[i].cast("f")[n - 1] == 2.0 * i for i in range(tasks))
    for buf in (*xs, *ys):
        alloc.free(buf, nbytes)
    return elapsed, [t - start for t in done_at], ok


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


def measure_serving(dev: Any, spec: dict[str, Any], repeats: int) -> dict[str, dict[str, Any]]:
    """Both serving variants, ``repeats`` times each after a warm-up: seconds of each, latency percentiles."""
    prog = dev.runtime("kernel", dev.compiler.compile(spec["source"]))
    n, tasks = spec["elements"], spec["tasks"]
    out: dict[str, dict[str, Any]] = {}
    for variant in ("sequential", "batched"):
        run_serving(dev, prog, n, tasks, variant)  # warm-up
        seconds: list[float] = []
        latencies: list[float] = []
        verified = True
        for _ in range(repeats):
            took, lat, ok = run_serving(dev, prog, n, tasks, variant)
            seconds.append(took)
            latencies.extend(lat)
            verified = verified and ok
        out[variant] = {
            "seconds": seconds,
            "p50_ms": _percentile(latencies, 50) * 1e3,
            "p99_ms": _percentile(latencies, 99) * 1e3,
            "verified": verified,
        }
    return out


def kernel_only_us(dev: Any, prog: Any, n: int, calls: int = 15) -> float:
    """Median µs of the compiled kernel called directly (``prog.fxn``), for comparing codegen."""
    nbytes = n * 4
    x, y = dev.allocator.alloc(nbytes), dev.allocator.alloc(nbytes)
    dev.allocator._copyin(x, _filled(1.0, n))
    args = (ctypes.c_uint64(y.va_addr), ctypes.c_uint64(x.va_addr))
    times = []
    for _ in range(calls + 2):
        t0 = time.perf_counter_ns()
        prog.fxn(*args)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    dev.allocator.free(x, nbytes)
    dev.allocator.free(y, nbytes)
    return statistics.median(times[2:])


def run_latency(dev: Any, source: str, calls: int, warmup: int) -> dict[str, Any]:
    """µs of each synchronous launch, ``prog(buf, wait=True)``, of a tiny kernel."""
    prog = dev.runtime("kernel", dev.compiler.compile(source))
    buf = dev.allocator.alloc(64)
    for _ in range(warmup):
        prog(buf, wait=True)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        prog(buf, wait=True)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    dev.allocator.free(buf, 64)
    return {"us": times}


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out: dict[str, Any] = {"tinygrad_version": importlib.metadata.version("tinygrad")}
    try:
        from tinygrad.device import Device

        devs = [Device[name] for name in spec["devices"]]
        out["device_class"] = f"{type(devs[0]).__module__}.{type(devs[0]).__name__}"
        out["compiler_class"] = f"{type(devs[0].compiler).__module__}.{type(devs[0].compiler).__name__}"
        out["pipeline"] = [measure_pipeline(devs, case, spec["slots"], spec["repeats"]) for case in spec["cases"]]
        out["serving"] = measure_serving(devs[0], spec["serving"], spec["repeats"])
        lat = spec["latency"]
        out["latency"] = run_latency(devs[0], lat["source"], lat["calls"], lat["warmup"])
    except Exception as exc:  # reported to the benchmark as a reason, not a crash
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc(limit=8)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
