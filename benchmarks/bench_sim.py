"""Many simulated devices through one scheduler: does it keep every queue busy, at a flat cost per op?

``sim_scale``: per item, copy-in (128 KiB) -> kernel -> kernel -> copy-out; 16 items per device, submitted item
by item round the devices through one :class:`Scheduler` (its window holding them all) over 1, 8, 64 and 256
SIM devices in timing-only mode (the model's PCIe defaults for copies, no bytes moved). Each device cycles
through three buffer sets, so an item's copy-in waits for the item three before it to have read its input. The
event loop is one thread feeding every device, so kernels get longer as devices are added (``max(2 ms, D x 250
µs)``): the loop can keep up, and what is measured is whether the scheduler does. Below 16 devices the run is
repeated (``16 / D`` times), so that every device count submits at least 1024 ops with the same ops in flight
per queue.

Per device count, one row: the makespan of a run (first submission to the end of the scheduler's scope; the
median over the repeats) against the ideal from the model (the larger of the busiest queue's modelled time and
one item's dependency chain), goal at most 1.1; with ``us_per_op``, the event loop thread's CPU time
(``time.thread_time()``) around the submitting code, per op, and ``gc_us_per_op``, the part of it the garbage
collector took (it grows with the ops in flight). One more row: that cost at 256 devices against 1 device, goal
at most 1.2.
"""

from __future__ import annotations

import gc
import statistics
import time

from aruntime import Buffer, Device
from aruntime.backends.sim import SimDevice, SimModel, SimProgram
from aruntime.scheduler import Scheduler
from benchmarks.common import Result, result, settings

DEVICES = (1, 8, 64, 256)
ITEMS = 16
NBYTES = 128 << 10  # above the inline-copy limit: copies stay on the copy queue
SETS = 3
KERNEL = "#include <stdint.h>\nvoid kernel(uint8_t *out, const uint8_t *x) {}\n"
MAKESPAN_GOAL = 1.1
COST_GOAL = 1.2

Pipeline = list[tuple[SimDevice, SimProgram, list[list[Buffer]]]]


async def _open(count: int, kernel_s: float) -> Pipeline:
    """``count`` timing-only SIM devices, each with the kernel (of ``kernel_s`` seconds) and its buffer sets."""
    out = []
    for i in range(count):
        dev = Device[f"SIM:{100 + i}"]
        assert isinstance(dev, SimDevice)
        dev.model = SimModel(timing_only=True)
        prog = await dev.compile(KERNEL, outs=(0,))
        assert isinstance(prog, SimProgram)
        prog.cost = kernel_s
        out.append((dev, prog, [[await dev.allocate(NBYTES) for _ in range(3)] for _ in range(SETS)]))
    return out


class _GCTime:
    """Thread CPU seconds the garbage collector takes on this thread while it is installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._start


async def _run(devices: Pipeline, items: int) -> tuple[float, float, float]:
    """(makespan s, loop-thread CPU s while submitting, of which garbage collection) of one run of ``items``
    items per device."""
    data, into = bytes(NBYTES), bytearray(NBYTES)  # timing-only: neither is read nor written
    collector = _GCTime()
    start = time.perf_counter()
    async with Scheduler(window=4 * items * len(devices)) as sched:
        gc.callbacks.append(collector)
        cpu = time.thread_time()
        for item in range(items):
            for _, prog, sets in devices:
                x, y, z = sets[item % SETS]
                sched.copyin(x, data)
                sched.launch(prog, y, x)
                sched.launch(prog, z, y)
                sched.copyout(z, into)
        cpu = time.thread_time() - cpu
        gc.callbacks.remove(collector)
    return time.perf_counter() - start, cpu, collector.seconds


async def sim_scale() -> list[Result]:
    """Makespan against the model's ideal, and the loop's cost per op, at 1 to 256 SIM devices."""
    counts = DEVICES[:2] if settings.quick else DEVICES
    items = 4 if settings.quick else ITEMS
    rows, cost = [], {}
    for n_dev in counts:
        kernel_s = max(2e-3, n_dev * 250e-6)
        devices = await _open(n_dev, kernel_s)
        runs = [await _run(devices, items) for _ in range(1 if settings.quick else max(1, 16 // n_dev))]
        for dev, _, sets in devices:
            for bufs in sets:
                for buf in bufs:
                    await dev.free(buf)
        copy_s = devices[0][0].model.copy_time(NBYTES)
        ideal = max(2 * items * copy_s, 2 * items * kernel_s, 2 * copy_s + 2 * kernel_s)
        makespan = statistics.median(run[0] for run in runs)
        ops = 4 * items * n_dev * len(runs)
        cost[n_dev] = sum(run[1] for run in runs) / ops * 1e6
        ratio = makespan / ideal
        rows.append(
            result(
                f"sim_makespan_{n_dev}",
                round(makespan, 4),
                "s",
                round(ideal, 4),
                round(ratio, 3),
                f"<= {MAKESPAN_GOAL}",
                None if settings.quick else ratio <= MAKESPAN_GOAL,
                devices=n_dev,
                runs=len(runs),
                ops=ops,
                kernel_ms=round(kernel_s * 1e3, 3),
                us_per_op=round(cost[n_dev], 2),
                gc_us_per_op=round(sum(run[2] for run in runs) / ops * 1e6, 2),
            )
        )
    first, last = counts[0], counts[-1]
    growth = cost[last] / cost[first]
    rows.append(
        result(
            f"sim_loop_cost_{last}_vs_{first}",
            round(cost[last], 2),
            "us/op",
            round(cost[first], 2),
            round(growth, 3),
            f"<= {COST_GOAL}",
            None if settings.quick else growth <= COST_GOAL,
        )
    )
    return rows


BENCHMARKS = [sim_scale]
