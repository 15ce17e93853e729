"""The tinygrad side of the peer benchmark; runs INSIDE one of the environments that ``setup_tinygrad`` builds.

Reads a JSON spec from the file named by its argument (the C sources, sizes and counts that
``benchmarks/bench_peers.py`` also runs on aruntime), drives the installed
tinygrad's device layer directly and prints one JSON object on stdout. Nothing
of aruntime is imported here. Each pinned release has its own :class:`Layer`:
the same pipeline, serving and latency code runs on either.

tinygrad 0.13's device layer (:class:`HCQLayer`), as used:

* ``Device["CPU"]``, ``Device["CPU:1"]``: ``CPUDevice`` (an ``HCQCompiled``),
  each with one worker thread fed by a ``queue.Queue``.
* ``dev.allocator.alloc(nbytes)`` -> ``HCQBuffer``; ``dev.allocator._copyin(buf, memoryview)``
  and ``._copyout(memoryview, buf)``: the CPU device has no copy queue, so each
  first runs ``dev.synchronize()`` and then a ``ctypes.memmove`` on the calling thread.
* ``dev.compiler.compile(src)``: ``ClangJITCompiler`` (clang to an ELF object,
  linked by tinygrad's ``jit_loader``); ``dev.runtime("kernel", lib)`` -> ``CPUProgram``.
* ``prog(*bufs)`` enqueues the kernel on the device's worker thread and returns;
  ``prog(*bufs, wait=True)`` also waits (``dev.synchronize()``).

tinygrad 0.10.1's device layer (:class:`ClangLayer`), as used:

* ``Device["CLANG"]``, ``Device["CLANG:1"]``: ``ClangDevice`` (a ``Compiled``),
  no thread of its own; ``dev.synchronize()`` does nothing.
* ``tinygrad.device.Buffer(name, nbytes, dtypes.uint8).allocate()``, its
  ``copyin(memoryview)`` and ``copyout(memoryview)``: a ``ctypes.memmove`` on
  the calling thread (``MallocAllocator``, 16-byte-aligned memory).
* ``dev.compiler.compile(src)``: ``ClangJITCompiler`` (``clang -O2 -march=native``
  to an ELF object, linked by ``jit_loader``); ``dev.runtime("kernel", lib)`` -> ``CPUProgram``.
* ``prog(*raw)``, on each buffer's ``_buf``, calls the kernel through ctypes on
  the calling thread and returns when it is done.

The pipeline runs two ways: one call after another on the first device
(nothing overlaps: on 0.13 each copy synchronizes the device first, on 0.10.1
every call runs on this thread), and one user thread per device, each doing its
batches one call after another (the copies, and on 0.10.1 the kernels too, run
on the user threads with the GIL released in ctypes; on 0.13 the kernels run on
the devices' worker threads).
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
from abc import ABC, abstractmethod
from typing import Any, ClassVar


class Layer(ABC):
    """The calls the benchmark makes on one device of one tinygrad release."""

    DEVICE: ClassVar[str]
    """The name of the release's CPU device; the ``i``-th device used is ``DEVICE:i``."""

    def __init__(self, index: int) -> None:
        from tinygrad.device import Device

        self.name = f"{self.DEVICE}:{index}" if index else self.DEVICE
        self.dev: Any = Device[self.name]

    def program(self, source: str) -> Any:
        """``source`` compiled and loaded the release's way; its entry point is ``kernel``."""
        return self.dev.runtime("kernel", self.dev.compiler.compile(source))

    def synchronize(self) -> None:
        self.dev.synchronize()

    @abstractmethod
    def alloc(self, nbytes: int) -> Any: ...

    @abstractmethod
    def free(self, buf: Any, nbytes: int) -> None: ...

    @abstractmethod
    def copyin(self, buf: Any, src: memoryview) -> None: ...

    @abstractmethod
    def copyout(self, dst: memoryview, buf: Any) -> None: ...

    @abstractmethod
    def launch(self, prog: Any, *bufs: Any, wait: bool = False) -> None: ...

    @abstractmethod
    def raw(self, buf: Any) -> Any:
        """What the compiled function itself (``prog.fxn``) takes for ``buf``."""


class HCQLayer(Layer):
    """tinygrad 0.13: the HCQ allocator's copies, programs run on the device's worker thread."""

    DEVICE = "CPU"

    def alloc(self, nbytes: int) -> Any:
        return self.dev.allocator.alloc(nbytes)

    def free(self, buf: Any, nbytes: int) -> None:
        self.dev.allocator.free(buf, nbytes)

    def copyin(self, buf: Any, src: memoryview) -> None:
        self.dev.allocator._copyin(buf, src)

    def copyout(self, dst: memoryview, buf: Any) -> None:
        self.dev.allocator._copyout(dst, buf)

    def launch(self, prog: Any, *bufs: Any, wait: bool = False) -> None:
        prog(*bufs, wait=wait)

    def raw(self, buf: Any) -> Any:
        return ctypes.c_uint64(buf.va_addr)


class ClangLayer(Layer):
    """tinygrad 0.10.1: ``Buffer`` copies, programs called on the caller's thread."""

    DEVICE = "CLANG"

    def alloc(self, nbytes: int) -> Any:
        from tinygrad.device import Buffer
        from tinygrad.dtype import dtypes

        return Buffer(self.name, nbytes, dtypes.uint8).allocate()

    def free(self, buf: Any, nbytes: int) -> None:
        buf.deallocate()

    def copyin(self, buf: Any, src: memoryview) -> None:
        buf.copyin(src)

    def copyout(self, dst: memoryview, buf: Any) -> None:
        buf.copyout(dst)

    def launch(self, prog: Any, *bufs: Any, wait: bool = False) -> None:
        prog(*[b._buf for b in bufs], wait=wait)

    def raw(self, buf: Any) -> Any:
        return buf._buf


LAYERS: dict[str, type[Layer]] = {"0.13.0": HCQLayer, "0.10.1": ClangLayer}
"""The layer of each pinned release, by version."""

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
    layers: list[Layer], progs: list[Any], n: int, batches: int, slots: int, dsts: list[memoryview], base: float = 0.0
) -> float:
    """``batches`` rounds of copyin -> kernel -> copyout, one call after another from this thread; the seconds.

    On one device (``layers`` of one) this is the layer used as written: on 0.13
    a copy-in or copy-out synchronizes the device first, and on 0.10.1 every call
    runs on this thread, so each batch's calls run in turn. With more devices,
    batches alternate between them and a batch's copy-out is done after the next
    batch's kernel has been launched, so that on 0.13 that kernel runs on its
    device's worker thread while this thread copies.
    """
    nbytes = n * 4
    srcs = [_filled(base + k + 1, n) for k in range(SOURCES)]
    xs = [layer.alloc(nbytes) for layer in layers]
    ys = [[layer.alloc(nbytes) for _ in range(slots)] for layer in layers]
    ndev = len(layers)
    gc.collect()  # as aruntime's side does before each timed run
    start = time.perf_counter()
    pending: tuple[int, Any, int] | None = None  # (device index, output buffer, batch) still to copy out
    for i in range(batches):
        d = i % ndev
        y = ys[d][(i // ndev) % slots]
        layers[d].copyin(xs[d], srcs[i % SOURCES])  # 0.13: synchronizes device d first
        layers[d].launch(progs[d], y, xs[d])  # 0.13: enqueued on d's worker thread
        if pending is not None:
            pd, py, pi = pending
            layers[pd].copyout(dsts[pi % len(dsts)], py)  # 0.13: synchronizes device pd first
        pending = (d, y, i)
    if pending is not None:
        pd, py, pi = pending
        layers[pd].copyout(dsts[pi % len(dsts)], py)
    for layer in layers:
        layer.synchronize()
    elapsed = time.perf_counter() - start
    for layer, x, outs in zip(layers, xs, ys, strict=True):
        for buf in (x, *outs):
            layer.free(buf, nbytes)
    return elapsed


def run_threads(
    layers: list[Layer], progs: list[Any], n: int, batches: int, dsts: list[memoryview], base: float = 0.0
) -> float:
    """The pipeline driven by one user thread per device: thread ``d`` does batches ``d, d + len(layers), ...``,
    each copy-in, kernel, copy-out one call after another on its device; the seconds until both are done."""
    nbytes = n * 4
    srcs = [_filled(base + k + 1, n) for k in range(SOURCES)]
    xs = [layer.alloc(nbytes) for layer in layers]
    ys = [layer.alloc(nbytes) for layer in layers]
    ndev = len(layers)

    def lane(d: int) -> None:
        layer, prog, x, y = layers[d], progs[d], xs[d], ys[d]
        for i in range(d, batches, ndev):
            layer.copyin(x, srcs[i % SOURCES])
            layer.launch(prog, y, x)
            layer.copyout(dsts[i % len(dsts)], y)

    pool = [threading.Thread(target=lane, args=(d,)) for d in range(ndev)]
    gc.collect()
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    for layer, x, y in zip(layers, xs, ys, strict=True):
        layer.free(x, nbytes)
        layer.free(y, nbytes)
    return elapsed


def measure_pipeline(layers: list[Layer], case: dict[str, Any], slots: int, repeats: int) -> dict[str, Any]:
    """One pipeline case, one call after another on the first device and with one user thread per device,
    alternating, ``repeats`` times each after a warm-up; then each checked on new inputs."""
    n, batches = case["elements"], case["batches"]
    progs = [layer.program(case["source"]) for layer in layers]
    dsts = [memoryview(bytearray(n * 4)) for _ in range(slots * len(layers))]

    def one(base: float = 0.0) -> float:
        return run_pipeline(layers[:1], progs[:1], n, batches, slots, dsts, base)

    def two(base: float = 0.0) -> float:
        return run_threads(layers, progs, n, batches, dsts, base)

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
        "kernel_us": kernel_only_us(layers[0], progs[0], n),
    }


def run_serving(layer: Layer, prog: Any, n: int, tasks: int, variant: str) -> tuple[float, list[float], bool]:
    """``tasks`` requests (copy-in, kernel, copy-out) all waiting at the start; seconds, each one's latency, check.

    ``sequential`` serves them one after another; ``batched`` copies every
    request in, launches every kernel, then copies every result out (on 0.13,
    one synchronization instead of one per request).
    """
    nbytes = n * 4
    xs = [layer.alloc(nbytes) for _ in range(tasks)]
    ys = [layer.alloc(nbytes) for _ in range(tasks)]
    requests = [_filled(float(i), n) for i in range(tasks)]
    outs = [memoryview(bytearray(nbytes)) for _ in range(tasks)]
    done_at = [0.0] * tasks
    gc.collect()  # as aruntime's side does before each timed run
    start = time.perf_counter()
    if variant == "sequential":
        for i in range(tasks):
            layer.copyin(xs[i], requests[i])
            layer.launch(prog, ys[i], xs[i])
            layer.copyout(outs[i], ys[i])
            done_at[i] = time.perf_counter()
    else:
        for i in range(tasks):
            layer.copyin(xs[i], requests[i])
        for i in range(tasks):
            layer.launch(prog, ys[i], xs[i])
        for i in range(tasks):
            layer.copyout(outs[i], ys[i])
            done_at[i] = time.perf_counter()
    elapsed = time.perf_counter() - start
    ok = all(outs[i].cast("f")[n - 1] == 2.0 * i for i in range(tasks))
    for buf in (*xs, *ys):
        layer.free(buf, nbytes)
    return elapsed, [t - start for t in done_at], ok


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))]


def measure_serving(layer: Layer, spec: dict[str, Any], repeats: int) -> dict[str, dict[str, Any]]:
    """Both serving variants, ``repeats`` times each after a warm-up: seconds of each, latency percentiles."""
    prog = layer.program(spec["source"])
    n, tasks = spec["elements"], spec["tasks"]
    out: dict[str, dict[str, Any]] = {}
    for variant in ("sequential", "batched"):
        run_serving(layer, prog, n, tasks, variant)  # warm-up
        seconds: list[float] = []
        latencies: list[float] = []
        verified = True
        for _ in range(repeats):
            took, lat, ok = run_serving(layer, prog, n, tasks, variant)
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


def kernel_only_us(layer: Layer, prog: Any, n: int, calls: int = 15) -> float:
    """Median µs of the compiled kernel called directly (``prog.fxn``), for comparing codegen."""
    nbytes = n * 4
    x, y = layer.alloc(nbytes), layer.alloc(nbytes)
    layer.copyin(x, _filled(1.0, n))
    args = (layer.raw(y), layer.raw(x))
    times = []
    for _ in range(calls + 2):
        t0 = time.perf_counter_ns()
        prog.fxn(*args)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    layer.free(x, nbytes)
    layer.free(y, nbytes)
    return statistics.median(times[2:])


def run_latency(layer: Layer, source: str, calls: int, warmup: int) -> dict[str, Any]:
    """µs of each synchronous launch, ``prog(buf, wait=True)``, of a tiny kernel."""
    prog = layer.program(source)
    buf = layer.alloc(64)
    for _ in range(warmup):
        layer.launch(prog, buf, wait=True)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        layer.launch(prog, buf, wait=True)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    layer.free(buf, 64)
    return {"us": times}


def main() -> int:
    """Run what the spec asks for: the pipeline cases always, serving and latency when the spec has them."""
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    version = importlib.metadata.version("tinygrad")
    out: dict[str, Any] = {"tinygrad_version": version}
    try:
        if version not in LAYERS:
            raise RuntimeError(f"no layer for tinygrad {version} (known: {', '.join(LAYERS)})")
        layers = [LAYERS[version](i) for i in range(spec["devices"])]
        dev = layers[0].dev
        out["device_class"] = f"{type(dev).__module__}.{type(dev).__name__}"
        out["compiler_class"] = f"{type(dev.compiler).__module__}.{type(dev.compiler).__name__}"
        out["pipeline"] = [measure_pipeline(layers, case, spec["slots"], spec["repeats"]) for case in spec["cases"]]
        if "serving" in spec:
            out["serving"] = measure_serving(layers[0], spec["serving"], spec["repeats"])
        if "latency" in spec:
            lat = spec["latency"]
            out["latency"] = run_latency(layers[0], lat["source"], lat["calls"], lat["warmup"])
    except Exception as exc:  # reported to the benchmark as a reason, not a crash
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc(limit=8)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
