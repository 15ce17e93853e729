"""``aruntime demo``: an async data pipeline over every CPU device, streamed from a file on disk.

It writes a dataset of byte "pixels" (rows x cols), then streams it batch by
batch through every CPU device at once: a transfer from the file (the DISK
device, memory-mapped) into the device, a C kernel that standardizes each row
(float32 z-scores, ``(x - mean) / std``, as image and feature preprocessing
does) and takes the Adler-32 checksum of the batch's bytes, and a copy-out of
the result into host memory. Batch i goes to device i mod n, as in the
bound below, and ``depth`` batches are in flight on every device: the next
batch for a device reuses the buffer set of its oldest, once that is done.

Every batch is verified, off the critical path and cheaply: the reference is
computed while the dataset is written, before the clock starts (zlib's
Adler-32 of every batch, and the z-scores of a few sampled rows and columns in
plain Python). During the run a check compares the kernel's checksum, which
covers every input byte, and the sampled outputs: a few microseconds a batch.

Before and after the pipeline the demo measures the bound this machine allows
for the same work: the same kernel and copies run by a plain pool of threads,
one per device, each doing memmove / kernel / memmove through ctypes with no
runtime; the faster of the two runs is the bound.
The run is profiled: it writes ``trace.json`` (Chrome/Perfetto) and
``trace.html`` (the offline timeline) next to the dataset.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import math
import operator
import os
import random
import shutil
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from aruntime.device import BaseDevice, Device, Program
from aruntime.dtype import dtypes
from aruntime.engine import Op
from aruntime.errors import AruntimeError
from aruntime.memory import Buffer
from aruntime.profile import profile
from aruntime.profile.viewer import write_html
from aruntime.scheduler import Scheduler

KERNEL = r"""
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3") /* the demo's own compile flag: lets gcc vectorize the loops below */
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Standardize each row of x (rows x cols bytes) into out: (x - mean) / std as float32. The 4 bytes after
   the rows x cols floats get the Adler-32 of all of x, from the same pass that sums each row. */
void standardize(float *out, const uint8_t *x, int64_t rows, int64_t cols) {
  uint64_t a = 1, b = 0; /* Adler-32 state, kept mod 65521 */
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t *row = x + r * cols;
    float *o = out + r * cols;
    uint64_t s = 0, sq = 0, w = 0; /* sum of x, of x^2, and of c * x[c] */
    for (int64_t c0 = 0; c0 < cols; c0 += 256) { /* 16-bit products in 32-bit sums: no overflow in 256 */
      int n = cols - c0 < 256 ? (int)(cols - c0) : 256;
      uint32_t bs = 0, bq = 0, bw = 0;
      for (int i = 0; i < n; i++) {
        uint16_t v = row[c0 + i];
        bs += v;
        bq += (uint16_t)(v * v);
        bw += (uint16_t)(i * v);
      }
      s += bs, sq += bq, w += (uint64_t)c0 * bs + bw;
    }
    b = (b + (uint64_t)cols * a + (uint64_t)cols * s - w) % 65521; /* b adds a after every byte */
    a = (a + s) % 65521;
    double mean = (double)s / (double)cols, var = (double)sq / (double)cols - mean * mean;
    float inv = var > 0.0 ? (float)(1.0 / sqrt(var)) : 0.0f, shift = (float)-mean * inv;
    for (int64_t c = 0; c < cols; c++) o[c] = (float)row[c] * inv + shift;
  }
  uint32_t adler = (uint32_t)(b << 16 | a);
  memcpy(out + rows * cols, &adler, sizeof adler);
}
"""

MAX_BATCH_BYTES = 256 << 20
"""The largest batch (rows x cols bytes) the demo accepts."""
SAMPLES = (4, 8)
"""Sampled outputs verified per batch: this many rows, this many columns of each."""
TOLERANCE = 1e-3


class DemoOptionError(AruntimeError, ValueError):
    """The demo's options are invalid or conflict; the message names the option."""


@dataclass
class DemoConfig:
    """What the demo runs: sizes, devices, event loop and where it writes."""

    size_mb: int | None = None  # None: 256 MiB, or what --batches makes
    batches: int | None = None  # None: as many as fill size_mb
    batch_rows: int = 256
    cols: int = 4096
    devices: int | None = None  # None: one CPU device per core
    depth: int = 3  # buffer sets per device: batches in flight on each
    loop: str = "asyncio"
    out_dir: Path = field(default_factory=lambda: Path("aruntime-demo"))
    progress: bool = True
    seed: int = 1234

    @property
    def batch_bytes(self) -> int:
        """Input bytes per batch."""
        return self.batch_rows * self.cols

    @property
    def n_batches(self) -> int:
        """The number of batches: ``batches``, else as many whole batches as fit in ``size_mb``."""
        if self.batches is not None:
            return self.batches
        return ((256 if self.size_mb is None else self.size_mb) << 20) // self.batch_bytes

    @property
    def n_devices(self) -> int:
        """The number of CPU devices used."""
        return self.devices if self.devices is not None else (os.cpu_count() or 1)

    @property
    def dataset_bytes(self) -> int:
        """The size of the dataset file."""
        return self.n_batches * self.batch_bytes

    def validate(self) -> None:
        """Raise :class:`DemoOptionError` naming the option (or the free disk space), before anything is written."""
        for name in ("size_mb", "batches", "batch_rows", "cols", "devices", "depth"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise DemoOptionError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
        if self.batch_bytes > MAX_BATCH_BYTES:
            raise DemoOptionError(
                f"a batch of --batch-rows {self.batch_rows} x --cols {self.cols} is {_size(self.batch_bytes)};"
                f" at most {_size(MAX_BATCH_BYTES)}"
            )
        if self.size_mb is not None and self.batches is not None and self.dataset_bytes != self.size_mb << 20:
            raise DemoOptionError(
                f"--batches {self.batches} of {_size(self.batch_bytes)} make {_size(self.dataset_bytes)},"
                f" not --size-mb {self.size_mb}: give one of them"
            )
        if self.n_batches < 1:
            raise DemoOptionError(
                f"--size-mb {self.size_mb} is smaller than one batch"
                f" (--batch-rows {self.batch_rows} x --cols {self.cols} = {_size(self.batch_bytes)})"
            )
        if self.n_devices > 64:
            raise DemoOptionError(f"--devices {self.n_devices}: at most 64")
        if self.loop not in ("asyncio", "uvloop", "trio"):
            raise DemoOptionError(f"--loop must be asyncio, uvloop or trio, got {self.loop!r}")
        if self.loop != "asyncio" and importlib.util.find_spec(self.loop) is None:
            raise DemoOptionError(f"--loop {self.loop} needs {self.loop}: pip install 'aruntime[{self.loop}]'")
        memory = self.n_devices * self.depth * self.batch_bytes * 9  # x, then y and its host copy: 4 bytes a byte
        physical = _physical_memory()
        if physical is not None and memory > physical:
            raise DemoOptionError(
                f"{self.n_devices} devices x --depth {self.depth} buffer sets for {_size(self.batch_bytes)} batches"
                f" need {_size(memory)} of memory; this machine has {_size(physical)}"
            )
        self._check_disk()

    def _check_disk(self) -> None:
        existing = self.out_dir.absolute()
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing.exists() and not existing.is_dir():
            raise DemoOptionError(f"--out {self.out_dir}: {existing} is not a directory")
        dataset = self.out_dir / "dataset.bin"
        reusable = dataset.stat().st_size if dataset.is_file() else 0  # overwritten in place
        free = shutil.disk_usage(existing).free + reusable
        if self.dataset_bytes + (64 << 20) > free:  # and room for the trace
            raise DemoOptionError(
                f"the dataset needs {_size(self.dataset_bytes)} but {existing} has {_size(free)} free:"
                " use a smaller --size-mb or another --out"
            )

    def prepare_output(self) -> Path:
        """Create the output directory; returns the dataset's path. Raises :class:`DemoOptionError`."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DemoOptionError(f"--out {self.out_dir}: cannot create it: {exc.strerror or exc}") from None
        if not os.access(self.out_dir, os.W_OK | os.X_OK):
            raise DemoOptionError(f"--out {self.out_dir}: not a writable directory")
        return (self.out_dir / "dataset.bin").resolve()


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            value = nbytes / (1 << shift)
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{nbytes} B"


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


# ---- the dataset and its reference -----------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """What one batch must give: the Adler-32 of its bytes and a few outputs (flat index, value)."""

    checksum: int
    samples: tuple[tuple[int, float], ...]


def reference_samples(batch: bytes, index: int, rows: int, cols: int) -> tuple[tuple[int, float], ...]:
    """Z-scores of a few rows and columns of one batch, in plain Python (the rows shift from batch to batch)."""
    n_rows, n_cols = SAMPLES
    samples = []
    for r in sorted({(index + k * max(1, rows // n_rows)) % rows for k in range(n_rows)}):
        row = batch[r * cols : (r + 1) * cols]
        mean = sum(row) / cols
        var = sum(map(operator.mul, row, row)) / cols - mean * mean
        std = math.sqrt(var) if var > 0 else 0.0
        for c in sorted({(index * 7 + k * max(1, cols // n_cols)) % cols for k in range(n_cols)}):
            samples.append((r * cols + c, (row[c] - mean) / std if std else 0.0))
    return tuple(samples)


def write_dataset(path: Path, config: DemoConfig) -> list[Reference]:
    """Write the seeded pseudo-random dataset, batch by batch, and return each batch's reference."""
    rng = random.Random(config.seed)
    refs = []
    with open(path, "wb") as f:
        for index in range(config.n_batches):
            batch = rng.randbytes(config.batch_bytes)
            f.write(batch)
            refs.append(Reference(zlib.adler32(batch), reference_samples(batch, index, config.batch_rows, config.cols)))
    return refs


def check_batch(index: int, ref: Reference, out: bytearray) -> str | None:
    """Compare one batch's output (float32 z-scores, then the checksum) with its reference; a description of a
    mismatch, or None."""
    checksum = int.from_bytes(out[-4:], "little")
    if checksum != ref.checksum:
        return f"batch {index}: checksum {checksum:#010x} != {ref.checksum:#010x}"
    values = memoryview(out).cast("f")
    for i, want in ref.samples:
        if not abs(values[i] - want) <= TOLERANCE:
            return f"batch {index}: output {i} is {values[i]}, the reference is {want}"
    return None


# ---- the pipeline and the bound ---------------------------------------------------------------------


@dataclass
class Slot:
    """One buffer set of one device: the input and the output on the device, and the output's host copy."""

    device: int
    x: Buffer
    y: Buffer
    out: bytearray

    @property
    def out_address(self) -> int:
        """The host address of ``out``."""
        return ctypes.addressof(ctypes.c_char.from_buffer(self.out))

    def touch(self) -> None:
        """Write every page of the set once, so neither the bound nor the pipeline pays the first-touch faults."""
        for address, nbytes in ((self.x.handle, self.x.nbytes), (self.y.handle, self.y.nbytes)):
            ctypes.memset(address, 0, nbytes)
        ctypes.memset(self.out_address, 0, len(self.out))


@dataclass
class DemoResult:
    """What the demo measured and whether every batch verified."""

    batches: int
    batch_bytes: int
    devices: int
    seconds: float
    cpu_seconds: float
    bound_seconds: float
    bound_cpu_seconds: float
    bound_cpu_share: float
    mismatches: list[str]
    dataset: Path
    trace: Path
    timeline: Path
    summary: dict[str, Any]

    @property
    def bytes_in(self) -> int:
        """Input bytes processed."""
        return self.batches * self.batch_bytes

    @property
    def ok(self) -> bool:
        """True when every batch matched the reference."""
        return not self.mismatches

    @property
    def throughput_mb_s(self) -> float:
        """Input megabytes processed per second by the pipeline."""
        return self.bytes_in / self.seconds / 1e6

    @property
    def bound_mb_s(self) -> float:
        """Input megabytes per second of the same work on plain threads, no runtime."""
        return self.bytes_in / self.bound_seconds / 1e6

    @property
    def queues(self) -> int:
        """The queues that ran something: compute and copy of each device that did."""
        return sum((d["compute_busy_us"] > 0) + (d["copy_busy_us"] > 0) for d in self.summary["devices"])

    @property
    def busy_queues(self) -> float:
        """How many queues were busy at once, on average over the run."""
        busy: float = sum(d["compute_busy_us"] + d["copy_busy_us"] for d in self.summary["devices"])
        return busy / (self.seconds * 1e6)

    def device_rows(self) -> list[tuple[str, float, float, float]]:
        """Per device: its name and the percentage of the run its compute queue, its copy queue, and both at once
        were busy."""
        run_us = self.seconds * 1e6
        return [
            (
                d["device"],
                100 * d["compute_busy_us"] / run_us,
                100 * d["copy_busy_us"] / run_us,
                100 * d["overlap_us"] / run_us,
            )
            for d in self.summary["devices"]
        ]


def measure_bound(
    config: DemoConfig, disk: BaseDevice, progs: list[Program], slots: list[Slot]
) -> tuple[float, float, float]:
    """Seconds the same work takes on plain threads, one per device, with no runtime (memmove each batch in from
    a fresh mapping of the file, run the kernel, memmove the output out, through the same buffers), the CPU
    seconds it took, and the share of the time the threads had a CPU (below 1 when other programs kept the
    CPUs busy)."""
    source = Buffer(disk.name, config.dataset_bytes, dtypes.uint8).allocate()  # its own mapping: faults afresh
    n_dev, nbytes, memmove = config.n_devices, config.batch_bytes, ctypes.memmove

    def work(d: int) -> None:
        calls = [
            (*progs[d].bind([s.y.handle, s.x.handle], (config.batch_rows, config.cols)), s)
            for s in slots
            if s.device == d
        ]
        for k, index in enumerate(range(d, config.n_batches, n_dev)):
            fn, args, s = calls[k % len(calls)]
            memmove(s.x.handle, source.handle + index * nbytes, nbytes)
            fn(*args)
            memmove(s.out_address, s.y.handle, s.y.nbytes)

    threads = [threading.Thread(target=work, args=(d,), name=f"bound {d}") for d in range(n_dev)]
    start, cpu = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    source.deallocate()
    return seconds, cpu, min(cpu / seconds / min(n_dev, os.cpu_count() or 1), 1.0)


async def run_pipeline(config: DemoConfig, on_batch: Callable[[int], Any] | None = None) -> DemoResult:
    """Write the dataset, measure the bound, stream the dataset through every CPU device and verify each batch;
    ``on_batch(n)`` reports progress. Call :meth:`DemoConfig.validate` first."""
    dataset = config.prepare_output()
    refs = await anyio.to_thread.run_sync(write_dataset, dataset, config)
    n_dev, rows, cols, nbytes = config.n_devices, config.batch_rows, config.cols, config.batch_bytes
    devices = [Device["CPU" if i == 0 else f"CPU:{i}"] for i in range(n_dev)]
    progs = [await dev.compile(KERNEL, "standardize", outs=(0,)) for dev in devices]
    disk = Device[f"DISK:{dataset}"]
    slots = [
        Slot(
            d,
            await devices[d].allocate(nbytes, dtypes.uint8),
            await devices[d].allocate(nbytes + 1, dtypes.float32),  # z-scores, then the checksum
            bytearray(4 * (nbytes + 1)),
        )
        for _ in range(config.depth)
        for d in range(n_dev)  # interleaved: the first batches go to every device in turn
    ]
    for slot in slots:
        slot.touch()
    bound = await anyio.to_thread.run_sync(measure_bound, config, disk, progs, slots)
    source = Buffer(disk.name, config.dataset_bytes, dtypes.uint8).allocate()
    mismatches: list[str] = []

    async with profile() as prof:
        start, cpu = time.perf_counter(), time.process_time()
        spare = [[slot for slot in slots if slot.device == d] for d in range(n_dev)]
        in_flight: list[deque[tuple[int, Slot, Op]]] = [deque() for _ in devices]  # each device's, oldest first

        async def finish_oldest(d: int) -> Slot:
            """Await device ``d``'s oldest batch, check it and hand its buffer set back."""
            index, slot, out_op = in_flight[d].popleft()
            await out_op
            problem = check_batch(index, refs[index], slot.out)
            if problem:
                mismatches.append(problem)
            if on_batch is not None:
                on_batch(1)
            return slot

        async with Scheduler(window=4 * len(slots)) as sched:
            for index in range(config.n_batches):
                d = index % n_dev  # batch i on device i mod n, as in the bound
                slot = spare[d].pop() if spare[d] else await finish_oldest(d)
                sched.transfer(slot.x, source.view(nbytes, dtypes.uint8, index * nbytes))
                sched.launch(progs[d], slot.y, slot.x, vals=(rows, cols))
                in_flight[d].append((index, slot, sched.copyout(slot.y, into=slot.out)))
            for index in range(max(0, config.n_batches - len(slots)), config.n_batches):  # those still in flight
                await finish_oldest(index % n_dev)  # the oldest of its device's
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    # once more after the pipeline, keeping the faster: load from other programs then lowers the bound less
    bound_seconds, bound_cpu, cpu_share = min(
        bound, await anyio.to_thread.run_sync(measure_bound, config, disk, progs, slots)
    )

    trace = await anyio.to_thread.run_sync(prof.save, config.out_dir / "trace.json")  # file writes: off the loop
    timeline = await anyio.to_thread.run_sync(write_html, trace)
    summary = await anyio.to_thread.run_sync(prof.summary)
    for slot in slots:
        await devices[slot.device].free(slot.x)
        await devices[slot.device].free(slot.y)
    source.deallocate()
    return DemoResult(
        config.n_batches,
        nbytes,
        n_dev,
        seconds,
        cpu,
        bound_seconds,
        bound_cpu,
        cpu_share,
        mismatches,
        dataset,
        trace,
        timeline,
        summary,
    )


# ---- the command line -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options."""
    parser.add_argument("--size-mb", type=int, help="dataset size in MiB, in whole batches (default 256)")
    parser.add_argument("--batches", type=int, help="number of batches (default: enough for --size-mb)")
    parser.add_argument("--batch-rows", type=int, default=256, help="rows per batch (default 256)")
    parser.add_argument("--cols", type=int, default=4096, help="bytes per row (default 4096)")
    parser.add_argument("--devices", type=int, help="CPU devices to use (default: one per core)")
    parser.add_argument("--depth", type=int, default=3, help="batches in flight per device (default 3)")
    parser.add_argument("--loop", default="asyncio", help="event loop: asyncio, uvloop or trio (default asyncio)")
    parser.add_argument("--out", type=Path, default=Path("aruntime-demo"), help="output directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from(args: argparse.Namespace) -> DemoConfig:
    """The validated configuration for parsed options (raises :class:`DemoOptionError`)."""
    config = DemoConfig(
        size_mb=args.size_mb,
        batches=args.batches,
        batch_rows=args.batch_rows,
        cols=args.cols,
        devices=args.devices,
        depth=args.depth,
        loop=args.loop,
        out_dir=args.out,
        progress=not args.no_progress,
    )
    config.validate()
    return config


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo from parsed options; the exit status is 1 on any wrong result.

    Invalid options raise :class:`DemoOptionError` before anything is written.
    """
    config = config_from(args)
    if importlib.util.find_spec("rich") is None:
        raise DemoOptionError("the demo needs rich: pip install 'aruntime[demo]'")
    config.prepare_output()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    backend, options = ("asyncio", {"use_uvloop": True}) if config.loop == "uvloop" else (config.loop, {})
    console = Console(highlight=False)
    with Progress(
        TextColumn("[bold]pipeline"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not config.progress,
    ) as progress:
        task = progress.add_task("batches", total=config.n_batches)

        async def main() -> DemoResult:
            return await run_pipeline(config, lambda n: progress.advance(task, n))

        result = anyio.run(main, backend=backend, backend_options=options)
    console.print(
        f"{result.batches} batches of {_size(result.batch_bytes)} ({result.bytes_in / 1e6:.0f} MB) through"
        f" {result.devices} CPU devices in {result.seconds:.2f} s on {config.loop}:"
        f" [bold]{result.throughput_mb_s:.0f} MB/s[/bold]"
    )
    console.print(
        f"bound on this machine: {result.bound_mb_s:.0f} MB/s (the same kernel and copies on {result.devices}"
        f" plain threads, no runtime, the faster of a run before and one after); the pipeline ran at"
        f" {result.throughput_mb_s / result.bound_mb_s:.0%} of it"
    )
    if result.bound_cpu_share < 0.8:
        console.print(
            f"[yellow]note[/yellow]: the bound's threads had a CPU only {result.bound_cpu_share:.0%} of the time:"
            " other programs are using the CPUs, so both figures are low and the runtime, with more threads,"
            " gets a larger share of the CPUs than the bound"
        )
    console.print(
        f"CPU time: {result.cpu_seconds:.2f} s for the pipeline, {result.bound_cpu_seconds:.2f} s for the bound:"
        f" the runtime's own work added {result.cpu_seconds / result.bound_cpu_seconds - 1:.0%}"
    )
    console.print(f"queues busy at once: {result.busy_queues:.1f} of {result.queues} on average")
    table = Table("device", "compute busy", "copy busy", "overlap")
    for name, compute, copy, overlap in result.device_rows():
        table.add_row(name, f"{compute:.0f}%", f"{copy:.0f}%", f"{overlap:.0f}%")
    console.print(table)
    console.print(
        "compute busy / copy busy: share of the run the device's kernel / copy queue was running;"
        " overlap: share of the run both were running at once"
    )
    console.print(f"trace: {result.trace}\ntimeline: {result.timeline}")
    if not result.ok:
        for line in result.mismatches[:10]:
            console.print(f"[red]mismatch[/red] {line}")
        console.print(f"[red]FAILED[/red]: {len(result.mismatches)} mismatches")
        return 1
    console.print(
        "[green]verified[/green]: every batch's Adler-32 (of all its bytes) and up to"
        f" {SAMPLES[0] * SAMPLES[1]} sampled outputs per batch match a reference computed when the dataset was written"
    )
    return 0
