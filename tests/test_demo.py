"""``aruntime demo``: the main job, run for real on a small dataset, and its options refused where they conflict."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

import aruntime.demo as demo
from aruntime.cli import main
from tests.bench_rows import quick_rows


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aruntime", "demo", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_demo_runs_verifies_measures_the_bound_and_writes_trace_and_timeline(tmp_path: Path, loop: str) -> None:
    out = tmp_path / "run"
    proc = run_cli("--size-mb", "4", "--loop", loop, "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())  # rich wraps long lines
    assert text.startswith("4 batches of 1 MiB (4 MB) through ") and f"on {loop}: " in text
    assert "bound on this machine: " in text and "plain threads, no runtime" in text
    assert "queues busy at once: " in text and "compute busy / copy busy: share of the run" in text
    assert "CPU time: " in text and "s for the bound: the runtime's own work added " in text
    assert "CPU:1" in text
    assert "verified: every batch's Adler-32" in text
    assert (out / "dataset.bin").stat().st_size == 4 << 20
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"standardize", f"copyout {4 * ((1 << 20) + 1)} B"} <= names
    assert any(str(n).startswith("transfer 1048576 B DISK:") for n in names)
    assert "<canvas" in (out / "trace.html").read_text()


@pytest.mark.anyio
async def test_the_pipeline_reports_busy_queues_and_the_bound(tmp_path: Path) -> None:
    config = demo.DemoConfig(size_mb=2, batch_rows=64, cols=1024, devices=2, depth=2, out_dir=tmp_path)
    config.validate()
    seen: list[int] = []
    result = await demo.run_pipeline(config, seen.append)
    assert result.ok and result.batches == 32 and sum(seen) == 32
    assert result.bound_seconds > 0 and result.throughput_mb_s > 0 and 0 < result.bound_cpu_share <= 1
    assert result.cpu_seconds > 0 and result.bound_cpu_seconds > 0
    assert result.queues == 4  # compute and copy of CPU and CPU:1 (each reads its batches from the file)
    assert 0 < result.busy_queues <= result.queues
    rows = {name: (compute, copy, overlap) for name, compute, copy, overlap in result.device_rows()}
    assert set(rows) == {"CPU", "CPU:1"}
    for compute, copy, overlap in rows.values():
        assert 0 <= overlap <= min(compute, copy) and compute <= 100 and copy <= 100


def test_the_reference_is_independent_of_the_kernel() -> None:
    batch = bytes(range(256)) * 4  # 4 rows of 256 bytes
    samples = demo.reference_samples(batch, 0, 4, 256)
    assert len(samples) == 4 * 8
    index, value = samples[0]
    assert index == 0 and value == pytest.approx((0 - 127.5) / 73.9004, rel=1e-4)
    ref = demo.Reference(zlib.adler32(batch), samples)
    out = bytearray(4 * (len(batch) + 1))
    out[-4:] = ref.checksum.to_bytes(4, "little")
    assert demo.check_batch(3, ref, out) == "batch 3: output 0 is 0.0, the reference is " + str(value)
    out[-4:] = bytes(4)
    assert demo.check_batch(3, ref, out) == f"batch 3: checksum 0x00000000 != {ref.checksum:#010x}"


def test_a_wrong_kernel_fails_the_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = demo.KERNEL.replace("(float)row[c] * inv + shift", "(float)row[c] * inv * 1.01f + shift")
    assert wrong != demo.KERNEL
    monkeypatch.setattr(demo, "KERNEL", wrong)
    options = ["--size-mb", "2", "--batch-rows", "64", "--cols", "1024", "--devices", "2", "--no-progress"]
    assert main(["demo", *options, "--out", str(tmp_path)]) == 1


def test_batches_option_sets_the_number_of_batches(tmp_path: Path) -> None:
    proc = run_cli(
        *("--batches", "6", "--batch-rows", "16", "--cols", "250", "--devices", "2", "--no-progress"),
        *("--out", str(tmp_path)),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("6 batches of 3.91 KiB")
    assert (tmp_path / "dataset.bin").stat().st_size == 6 * 16 * 250


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--size-mb", "0"], "--size-mb must be a positive integer, got 0"),
        (["--devices", "0"], "--devices must be a positive integer, got 0"),
        (["--batches", "0"], "--batches must be a positive integer, got 0"),
        (["--devices", "-1"], "--devices must be a positive integer, got -1"),
        (["--depth", "0"], "--depth must be a positive integer, got 0"),
        (["--devices", "x"], "argument --devices: invalid int value: 'x'"),
        (["--batches", "100000", "--size-mb", "1"], "--batches 100000 of 1 MiB make 97.7 GiB, not --size-mb 1"),
        (["--size-mb", "1", "--batch-rows", "1024"], "--size-mb 1 is smaller than one batch"),
        (["--batch-rows", "100000", "--cols", "100000"], "is 9.31 GiB; at most 256 MiB"),
        (["--size-mb", str(1 << 30)], "the dataset needs 1048576 GiB but "),
        (["--devices", "64", "--depth", "1000", "--batch-rows", "65536"], "of memory; this machine has "),
        (["--devices", "65"], "--devices 65: at most 64"),
        (["--loop", "tornado"], "--loop must be asyncio, uvloop or trio, got 'tornado'"),
    ],
)
def test_bad_options_are_refused_in_one_line_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out = tmp_path / "never"
    assert main(["demo", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aruntime demo: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_an_output_directory_that_cannot_be_made_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["demo", "--size-mb", "1", "--out", str(blocker / "sub"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == f"aruntime demo: --out {blocker / 'sub'}: {blocker} is not a directory\n"


@pytest.mark.parametrize(("package", "line"), [("trio", "install 'aruntime[trio]'"), ("uvloop", "'aruntime[uvloop]'")])
def test_a_missing_event_loop_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, package: str, line: str
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == package else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert main(["demo", "--loop", package, "--out", str(tmp_path / "never")]) == 2
    assert capsys.readouterr().err == f"aruntime demo: --loop {package} needs {package}: pip {line}\n".replace(
        "pip '", "pip install '"
    )
    assert not (tmp_path / "never").exists()


def test_without_rich_the_demo_says_what_to_install(tmp_path: Path) -> None:
    code = "import sys; sys.modules['rich'] = None; from aruntime.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "demo", "--size-mb", "1", "--out", str(tmp_path / "never")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr == "aruntime demo: the demo needs rich: pip install 'aruntime[demo]'\n"


def test_the_demo_needs_nothing_beyond_the_demo_extra(tmp_path: Path) -> None:
    """numpy, trio, uvloop and the test tools are not in ``aruntime[demo]``: the demo runs with all of them gone."""
    blocked = ["numpy", "trio", "uvloop", "hypothesis", "pytest", "httpx", "uvicorn"]
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({blocked!r}));"
        " from aruntime.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "demo", "--size-mb", "2", "--no-progress", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified" in proc.stdout


def test_the_demo_benchmark_runs_in_quick_mode() -> None:
    rows = quick_rows("demo_vs_bound")
    assert {row["loop"] for row in rows} == {"asyncio", "uvloop", "trio"}
    for row in rows:
        assert row["name"] == "demo_vs_bound" and row["unit"] == "MB/s" and row["goal"] == ">= 0.85"
        assert 0 < row["bound_cpu_share"] <= 1 and row["cpu_ratio"] > 0 and row["batches"] == 16
