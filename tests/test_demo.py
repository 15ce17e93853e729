"""``aruntime demo``: the main job, run for real on a small dataset."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import aruntime.demo as demo


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_demo_runs_verifies_and_writes_trace_and_timeline(tmp_path: Path, loop: str) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aruntime",
            "demo",
            "--size-mb",
            "4",
            "--loop",
            loop,
            "--out",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified: every batch matches the reference" in proc.stdout
    assert f"on {loop}" in proc.stdout and "CPU" in proc.stdout
    assert (out / "dataset.bin").stat().st_size == 4 << 20
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"normalize", "copyout 4194304 B"} <= names and any(str(n).startswith("transfer 1048576 B") for n in names)
    assert "<canvas" in (out / "trace.html").read_text()


def test_a_wrong_kernel_fails_the_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = demo.KERNEL.replace(
        "o[c] = (float)((row[c] - mean) * inv);", "o[c] = (float)((row[c] - mean) * inv * 1.01);"
    )
    assert wrong != demo.KERNEL
    monkeypatch.setattr(demo, "KERNEL", wrong)
    args = argparse.Namespace(
        size_mb=2, batches=0, batch_rows=64, cols=1024, devices=2, loop="asyncio", out=tmp_path, no_progress=True
    )
    assert demo.run_demo(args) == 1


def test_batches_option_sets_the_number_of_batches(tmp_path: Path) -> None:
    options = ["--batches", "6", "--batch-rows", "16", "--cols", "256", "--devices", "2", "--no-progress"]
    proc = subprocess.run(
        [sys.executable, "-m", "aruntime", "demo", *options, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("6 batches")
    assert (tmp_path / "dataset.bin").stat().st_size == 6 * 16 * 256


def test_bad_options_are_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aruntime", "demo", "--size-mb", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "--size-mb must be positive" in proc.stderr
