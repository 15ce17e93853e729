"""The demo against the bound of its own work: ``aruntime demo``'s pipeline and the plain-thread pool.

``demo_vs_bound``: :func:`aruntime.demo.run_pipeline` at the demo's default
size (256 MiB in 1 MiB batches over one CPU device per core; 16 MiB in quick
mode), run ``repeats`` times. Each run measures the pipeline's throughput and,
in the same run, the bound: the same kernel and copies on one plain thread per
device with no runtime (the faster of a run before and one after the
pipeline). The figure is the median of the per-run ratios (pipeline / bound);
the goal is at least 0.85. Each row also carries the median throughput and the
share of the time the bound's threads had a CPU (``bound_cpu_share``): well
below 1, other programs were using the CPUs and the ratio says little; then
``cpu_ratio`` (the bound's CPU seconds over the pipeline's, for the same work)
still says what the runtime's own work costs.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from aruntime.demo import DemoConfig, run_pipeline
from benchmarks.common import Result, result, settings

GOAL = 0.85


async def demo_vs_bound(repeats: int = 3) -> list[Result]:
    """The demo's throughput over the bound measured in the same run (median of ``repeats`` runs)."""
    ratios, rates, bounds, shares, cpu = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="aruntime-bench-demo-") as tmp:
        config = DemoConfig(size_mb=16 if settings.quick else 256, out_dir=Path(tmp), progress=False)
        config.validate()
        for _ in range(1 if settings.quick else repeats):
            run = await run_pipeline(config)
            assert run.ok, run.mismatches[:3]
            ratios.append(run.throughput_mb_s / run.bound_mb_s)
            rates.append(run.throughput_mb_s)
            bounds.append(run.bound_mb_s)
            shares.append(run.bound_cpu_share)
            cpu.append(run.bound_cpu_seconds / run.cpu_seconds)
    ratio = statistics.median(ratios)
    return [
        result(
            "demo_vs_bound",
            round(statistics.median(rates), 1),
            "MB/s",
            round(statistics.median(bounds), 1),
            round(ratio, 3),
            f">= {GOAL}",
            None if settings.quick else ratio >= GOAL,
            bound_cpu_share=round(statistics.median(shares), 2),
            cpu_ratio=round(statistics.median(cpu), 3),
            batches=config.n_batches,
            devices=config.n_devices,
        )
    ]


BENCHMARKS = [demo_vs_bound]
