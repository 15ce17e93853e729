"""``aruntime demo``: an async data pipeline over every CPU device, streamed from a file on disk.

It writes a dataset of byte "pixels" (rows x cols), then streams it batch by
batch: a transfer from the file (the DISK device, memory-mapped) into a CPU
device, a C kernel that normalises each row to mean 0 and variance 1 and takes
the Adler-32 checksum of the batch, and a copy-out of the result. The run is
profiled: it writes ``trace.json`` (Chrome/Perfetto format) and
``trace.html`` (the offline timeline) next to the dataset, and prints how busy
each queue was and how much copying overlapped compute. Batches go
round-robin over the CPU devices and many are in flight at once. Every batch is
verified against a plain reference: zlib's Adler-32 of every byte for the
checksum, and the normalisation of rows sampled from each batch (16 with
numpy installed, else 3), computed independently from the file.
"""

from __future__ import annotations

import argparse
import array
import math
import os
import random
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from aruntime.buffer import Buffer
from aruntime.device import BaseDevice, Device, Program
from aruntime.dtype import dtypes
from aruntime.profile import profile
from aruntime.profile.viewer import write_html
from aruntime.scheduler import Scheduler

KERNEL = r"""
#include <math.h>
#include <stdint.h>

/* Normalise each row of x (rows x cols bytes) into out (floats); write the Adler-32 of x to sum[0]. */
void normalize(float *out, uint32_t *sum, const uint8_t *x, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t *row = x + r * cols;
    float *o = out + r * cols;
    double s = 0.0, ss = 0.0;
    for (int64_t c = 0; c < cols; c++) { double v = row[c]; s += v; ss += v * v; }
    double mean = s / (double)cols, var = ss / (double)cols - mean * mean;
    double inv = var > 0.0 ? 1.0 / sqrt(var) : 0.0;
    for (int64_t c = 0; c < cols; c++) o[c] = (float)((row[c] - mean) * inv);
  }
  uint32_t a = 1, b = 0;
  int64_t n = rows * cols, i = 0;
  while (i < n) {
    int64_t block = n - i < 5552 ? n - i : 5552; /* the largest run that cannot overflow 32 bits */
    for (int64_t k = 0; k < block; k++) { a += x[i + k]; b += a; }
    a %= 65521; b %= 65521; i += block;
  }
  sum[0] = (b << 16) | a;
}
"""


@dataclass
class DemoConfig:
    """What the demo runs: sizes, devices, event loop and where it writes."""

    size_mb: int = 256
    batches: int = 0  # 0: as many as fill size_mb
    batch_rows: int = 256
    cols: int = 4096
    devices: int = 0  # 0: one CPU device per core
    slots: int = 3  # buffer sets per device, so batches overlap
    loop: str = "asyncio"
    out_dir: Path = field(default_factory=lambda: Path("aruntime-demo"))
    progress: bool = True
    seed: int = 1234


def _batch_count(config: DemoConfig) -> int:
    return config.batches or max(1, (config.size_mb << 20) // (config.batch_rows * config.cols))


@dataclass
class DemoResult:
    """What the demo measured and whether every batch verified."""

    batches: int
    bytes_in: int
    seconds: float
    mismatches: list[str]
    dataset: Path
    trace: Path
    timeline: Path
    summary: dict[str, Any]

    @property
    def ok(self) -> bool:
        """True when every batch matched the reference."""
        return not self.mismatches

    @property
    def throughput_mb_s(self) -> float:
        """Input megabytes processed per second."""
        return self.bytes_in / self.seconds / 1e6


def write_dataset(path: Path, nbytes: int, seed: int) -> None:
    """Write ``nbytes`` of seeded pseudo-random bytes to ``path`` (in 8 MiB pieces)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, 8 << 20)
            f.write(rng.randbytes(n))
            left -= n


def read_batch(path: Path, offset: int, nbytes: int) -> bytes:
    """Read one batch straight from the dataset file, independently of the pipeline."""
    with open(path, "rb") as f:
        return os.pread(f.fileno(), nbytes, offset)


def reference_rows(batch: bytes, out: bytes | bytearray, rows: list[int], cols: int) -> str | None:
    """Check the normalisation of the given rows of one batch; returns a description of a mismatch."""
    try:
        import numpy as np
    except ImportError:
        return _reference_rows_python(batch, out, rows, cols)
    x = np.frombuffer(batch, dtype=np.uint8).reshape(-1, cols).astype(np.float64)[rows]
    mean = x.mean(axis=1, keepdims=True)
    std = x.std(axis=1, keepdims=True)
    want = np.where(std > 0, (x - mean) / np.where(std > 0, std, 1), 0.0)
    got = np.frombuffer(out, dtype=np.float32).reshape(-1, cols)[rows]
    bad = np.argwhere(np.abs(got - want) > 1e-3)
    if len(bad):
        r, c = bad[0]
        return f"row {rows[r]} col {c}: {got[r, c]} != {want[r, c]}"
    return None


def _reference_rows_python(batch: bytes, out: bytes | bytearray, rows: list[int], cols: int) -> str | None:
    got = array.array("f", bytes(out))
    for r in rows:
        row = batch[r * cols : (r + 1) * cols]
        mean = sum(row) / cols
        std = math.sqrt(max(sum(v * v for v in row) / cols - mean * mean, 0.0))
        for c in range(0, cols, 97):
            want = (row[c] - mean) / std if std else 0.0
            if abs(got[r * cols + c] - want) > 1e-3:
                return f"row {r} col {c}: {got[r * cols + c]} != {want}"
    return None


def _check_rows(n_rows: int, index: int, count: int) -> list[int]:
    """``count`` rows spread over the batch, shifted per batch so every row position gets checked."""
    step = max(1, n_rows // count)
    return sorted({(index + i * step) % n_rows for i in range(count)})


async def run_pipeline(config: DemoConfig, on_batch: Any = None) -> DemoResult:
    """Write the dataset, stream it through every CPU device, verify it; ``on_batch(n)`` reports progress."""
    batch_bytes = config.batch_rows * config.cols
    n_batches = _batch_count(config)
    dataset = (config.out_dir / "dataset.bin").resolve()
    await anyio.to_thread.run_sync(write_dataset, dataset, n_batches * batch_bytes, config.seed)
    try:
        import numpy  # noqa: F401

        sample = 16
    except ImportError:
        sample = 3

    n_dev = config.devices or (os.cpu_count() or 1)
    devices: list[BaseDevice] = [Device["CPU" if i == 0 else f"CPU:{i}"] for i in range(n_dev)]
    progs: list[Program] = []
    for dev in devices:
        progs.append(await dev.compile(KERNEL, "normalize", outs=(0, 1)))
    disk = Device[f"DISK:{dataset}"]
    source = Buffer(disk.name, n_batches * batch_bytes, dtypes.uint8).allocate()
    slots = [
        [
            (
                await dev.allocate(batch_bytes, dtypes.uint8),
                await dev.allocate(batch_bytes, dtypes.float32),
                await dev.allocate(1, dtypes.uint32),
            )
            for _ in range(config.slots)
        ]
        for dev in devices
    ]
    mismatches: list[str] = []
    start = time.perf_counter()
    async with profile() as prof, Scheduler(window=n_dev * config.slots * 4) as sched, anyio.create_task_group() as tg:
        send, receive = anyio.create_memory_object_stream[tuple[int, Any, Any]](n_dev * config.slots)

        async def verify() -> None:
            async with receive:
                async for index, out_op, sum_op in receive:
                    out = await out_op
                    checksum = array.array("I", bytes(await sum_op))[0]
                    batch = await anyio.to_thread.run_sync(read_batch, dataset, index * batch_bytes, batch_bytes)
                    want = zlib.adler32(batch)
                    if checksum != want:
                        mismatches.append(f"batch {index}: checksum {checksum:#x} != {want:#x}")
                    rows = _check_rows(config.batch_rows, index, sample)
                    problem = await anyio.to_thread.run_sync(reference_rows, batch, out, rows, config.cols)
                    if problem:
                        mismatches.append(f"batch {index}: {problem}")
                    if on_batch is not None:
                        on_batch(1)

        tg.start_soon(verify)
        async with send:
            for index in range(n_batches):
                d = index % n_dev
                x, y, s = slots[d][(index // n_dev) % config.slots]
                piece = source.view(batch_bytes, dtypes.uint8, index * batch_bytes)
                sched.transfer(x, piece)
                sched.launch(progs[d], y, s, x, vals=(config.batch_rows, config.cols))
                out_op = sched.copyout(y)
                sum_op = sched.copyout(s)
                await send.send((index, out_op, sum_op))
                await sched.room()
    seconds = time.perf_counter() - start
    trace = await anyio.to_thread.run_sync(prof.save, config.out_dir / "trace.json")  # file writes: off the loop
    timeline = await anyio.to_thread.run_sync(write_html, trace)
    summary = await anyio.to_thread.run_sync(prof.summary)
    for dev, dev_slots in zip(devices, slots, strict=True):
        for bufs in dev_slots:
            for buf in bufs:
                await dev.free(buf)
    source.deallocate()
    return DemoResult(n_batches, n_batches * batch_bytes, seconds, mismatches, dataset, trace, timeline, summary)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's command-line options."""
    parser.add_argument("--size-mb", type=int, default=256, help="dataset size in MiB (default 256)")
    parser.add_argument("--batches", type=int, default=0, help="number of batches (default: enough for --size-mb)")
    parser.add_argument("--batch-rows", type=int, default=256, help="rows per batch (default 256)")
    parser.add_argument("--cols", type=int, default=4096, help="bytes per row (default 4096)")
    parser.add_argument("--devices", type=int, default=0, help="CPU devices to use (default: one per core)")
    parser.add_argument("--loop", choices=("asyncio", "uvloop", "trio"), default="asyncio", help="event loop")
    parser.add_argument("--out", type=Path, default=Path("aruntime-demo"), help="output directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo from parsed options; the exit status is 1 on any wrong result."""
    for name in ("size_mb", "batch_rows", "cols"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.devices < 0 or args.batches < 0:
        raise SystemExit("--devices and --batches must be >= 0")
    config = DemoConfig(
        size_mb=args.size_mb,
        batches=args.batches,
        batch_rows=args.batch_rows,
        cols=args.cols,
        devices=args.devices,
        loop=args.loop,
        out_dir=args.out,
        progress=not args.no_progress,
    )
    backend, options = ("asyncio", {"use_uvloop": True}) if config.loop == "uvloop" else (config.loop, {})
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    total = _batch_count(config)
    with Progress(
        TextColumn("[bold]pipeline"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not config.progress,
    ) as progress:
        task = progress.add_task("batches", total=total)

        async def main() -> DemoResult:
            return await run_pipeline(config, lambda n: progress.advance(task, n))

        result = anyio.run(main, backend=backend, backend_options=options)
    console.print(
        f"{result.batches} batches, {result.bytes_in / 1e6:.0f} MB in {result.seconds:.2f} s: "
        f"[bold]{result.throughput_mb_s:.0f} MB/s[/bold] on {config.loop}"
    )
    table = Table("device", "compute busy", "copy busy", "overlap", "waits across queues")
    for dev in result.summary["devices"]:
        table.add_row(
            dev["device"],
            f"{dev['compute_busy_pct']:.0f}%",
            f"{dev['copy_busy_pct']:.0f}%",
            f"{dev['overlap_pct']:.0f}%",
            str(dev["waits"]["total"]),
        )
    console.print(table)
    console.print(f"trace: {result.trace}\ntimeline: {result.timeline}")
    if not result.ok:
        for line in result.mismatches[:10]:
            console.print(f"[red]mismatch[/red] {line}")
        console.print(f"[red]FAILED[/red]: {len(result.mismatches)} mismatches")
        return 1
    console.print("[green]verified[/green]: every batch matches the reference")
    return 0
