"""The side-by-side benchmark (benchmarks/bench_peers.py): aruntime and thread-pool rows in quick mode, the row
arithmetic, the skip path, and (opt-in, --run-slow: needs PyPI and clang) the real tinygrad side."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_peers
from benchmarks.bench_peers import Case, Measured, Plan, build_rows, pipeline_expected, side_by_side
from benchmarks.common import REQUIRED_KEYS
from benchmarks.peers import setup_tinygrad

QUICK_NAMES = {
    "peers_pipeline_1MiB_vs_to_thread",
    "peers_pipeline_1MiB_vs_tinygrad",
    "peers_serving_vs_tinygrad",
    "peers_launch_latency_vs_tinygrad",
}


def _by_name(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    assert len({r["name"] for r in rows}) == len(rows), "duplicate row names"
    return {r["name"]: r for r in rows}


def _check_local_rows(rows: dict[str, dict[str, Any]]) -> None:
    """The rows measured without tinygrad: aruntime's figures and the to_thread baseline."""
    base = rows["peers_pipeline_1MiB_vs_to_thread"]
    assert base["verified"] is True
    assert base["value"] > 0 and base["baseline"] > 0
    assert base["ratio"] == pytest.approx(base["value"] / base["baseline"])
    assert base["unit"] == "batches/s" and base["batches"] == 4 and base["batch_mib"] == 1.0
    assert base["aruntime_kernel_us"] > 0
    serving = rows["peers_serving_vs_tinygrad"]
    assert serving["verified"] is True and serving["value"] > 0 and serving["tasks"] == 64
    assert 0 < serving["p50_ms"] <= serving["p99_ms"]
    latency = rows["peers_launch_latency_vs_tinygrad"]
    assert latency["value"] > 0 and latency["wake_us"] > 0 and latency["calls"] == 100


@pytest.mark.anyio
async def test_quick_run_without_tinygrad_reports_local_rows_and_skips_peer() -> None:
    rows = await side_by_side(quick=True, with_tinygrad=False)
    json.dumps(rows)  # what run.py --json prints
    by_name = _by_name(rows)
    assert set(by_name) == QUICK_NAMES
    for row in rows:
        assert set(REQUIRED_KEYS) <= set(row)
        assert row["tinygrad"] == setup_tinygrad.TINYGRAD_VERSION
    _check_local_rows(by_name)
    for name in QUICK_NAMES - {"peers_pipeline_1MiB_vs_to_thread"}:
        row = by_name[name]
        assert "not requested" in row["skipped"]
        assert row["baseline"] is None and row["ratio"] is None and row["pass"] is None


@pytest.mark.anyio
async def test_unbuildable_tinygrad_env_becomes_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(install_clang: bool = False) -> Path:
        raise setup_tinygrad.PeerUnavailable("pip could not install tinygrad==0.13.0: no network")

    monkeypatch.setattr(setup_tinygrad, "ensure", no_network)
    rows = _by_name(await side_by_side(quick=True, with_tinygrad=True))
    for name in ("peers_pipeline_1MiB_vs_tinygrad", "peers_serving_vs_tinygrad", "peers_launch_latency_vs_tinygrad"):
        assert rows[name]["skipped"] == "pip could not install tinygrad==0.13.0: no network"
        assert rows[name]["pass"] is None
    assert "skipped" not in rows["peers_pipeline_1MiB_vs_to_thread"]


@pytest.mark.anyio
async def test_worker_error_is_reported_with_its_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text('import json\nprint(json.dumps({"tinygrad_version": "9.9", "error": "OSError: no clang"}))\n')
    monkeypatch.setattr(setup_tinygrad, "ensure", lambda install_clang=False: Path(sys.executable))
    monkeypatch.setattr(setup_tinygrad, "WORKER", worker)
    with pytest.raises(setup_tinygrad.PeerUnavailable, match=r"tinygrad 9\.9 failed: OSError: no clang"):
        await bench_peers.measure_tinygrad({})


PLAN = Plan((Case("1MiB", 1 << 18, 10),), 2, 2, 100, 256, 2, 1)


def _measured(tinygrad: list[dict[str, Any]]) -> Measured:
    """Two rounds of made-up raw figures, as side_by_side collects them."""
    return Measured(
        pipeline={
            "1MiB": [
                {"aruntime_s": [0.6, 0.5], "to_thread_s": [1.0, 1.1], "verified": True, "kernel_us": 9.0},
                {"aruntime_s": [0.7, 0.55], "to_thread_s": [1.2, 1.0], "verified": True, "kernel_us": 11.0},
            ]
        },
        serving=[
            {"seconds": [0.02, 0.01], "p50_ms": 1.0, "p99_ms": 2.0, "verified": True},
            {"seconds": [0.03, 0.02], "p50_ms": 3.0, "p99_ms": 4.0, "verified": True},
        ],
        latency=[
            {"launch_us": [30.0, 31.0], "wake_us": [20.0, 19.0]},
            {"launch_us": [29.0, 50.0], "wake_us": [21.0, 20.0]},
        ],
        tinygrad=tinygrad,
    )


def _tinygrad_round(pipeline_s: list[float], latency_us: list[float]) -> dict[str, Any]:
    def variant(seconds: list[float]) -> dict[str, Any]:
        return {"seconds": seconds, "p50_ms": 1.5, "p99_ms": 1.9, "verified": True}

    return {
        "tinygrad_version": "0.13.0",
        "pipeline": [{"label": "1MiB", "seconds": pipeline_s, "verified": True, "kernel_us": 5.0}],
        "serving": {"sequential": variant([0.05, 0.04]), "batched": variant([0.03, 0.02])},
        "latency": {"us": latency_us},
    }


def test_rows_compare_against_tinygrad_with_the_issue_goals() -> None:
    tinygrad = [_tinygrad_round([1.6, 1.4], [10.0, 11.0]), _tinygrad_round([1.5, 1.8], [9.0, 10.0])]
    rows = _by_name(build_rows(PLAN, _measured(tinygrad)))
    pipe = rows["peers_pipeline_1MiB_vs_tinygrad"]  # fastest repeats: 0.5 s against 1.4 s for 10 batches
    assert pipe["value"] == pytest.approx(20.0) and pipe["baseline"] == pytest.approx(10 / 1.4)
    assert pipe["ratio"] == pytest.approx(2.8) and pipe["pass"] is True
    assert pipe["tinygrad_kernel_us"] == 5.0 and pipe["aruntime_kernel_us"] == 10.0
    assert pipe["rounds"] == 2 and pipe["repeats"] == 2 and pipe["verified"] and pipe["tinygrad_verified"]
    assert rows["peers_pipeline_1MiB_vs_to_thread"]["ratio"] == pytest.approx(2.0)
    serving = rows["peers_serving_vs_tinygrad"]
    assert serving["value"] == pytest.approx(10_000) and serving["baseline"] == pytest.approx(5_000)
    assert serving["tinygrad_variant"] == "batched" and serving["pass"] is None
    assert serving["tinygrad_variant_req_s"] == {"sequential": pytest.approx(2500), "batched": pytest.approx(5000)}
    assert serving["p50_ms"] == 2.0 and serving["p99_ms"] == 3.0  # medians over the rounds
    latency = rows["peers_launch_latency_vs_tinygrad"]
    assert latency["value"] == 30.5 and latency["wake_us"] == 20.0 and latency["tinygrad_sync_us"] == 10.0
    assert latency["baseline"] == pytest.approx(10.0 + 1.5 * 20.0)  # tinygrad sync + 1.5 bare wakes
    assert latency["ratio"] == pytest.approx(30.5 / 40.0) and latency["pass"] is True
    assert latency["calls"] == 4


def test_rows_fail_the_goals_when_tinygrad_is_faster() -> None:
    # 25 batches/s against aruntime's 20; a launch budget of 1 + 1.5 x 20 = 31 us against aruntime's 30.5: still met
    rows = _by_name(build_rows(PLAN, _measured([_tinygrad_round([0.4], [1.0])])))
    assert rows["peers_pipeline_1MiB_vs_tinygrad"]["pass"] is False
    assert rows["peers_launch_latency_vs_tinygrad"]["pass"] is True
    m = _measured([_tinygrad_round([0.4], [0.5])])  # budget 30.5 us; make aruntime's median 31
    m.latency = [{"launch_us": [31.0], "wake_us": [20.0]}]
    assert _by_name(build_rows(PLAN, m))["peers_launch_latency_vs_tinygrad"]["pass"] is False


def test_rows_without_tinygrad_carry_the_reason() -> None:
    m = _measured([])
    m.skipped = "no clang"
    rows = _by_name(build_rows(PLAN, m))
    for name in ("peers_pipeline_1MiB_vs_tinygrad", "peers_serving_vs_tinygrad", "peers_launch_latency_vs_tinygrad"):
        assert rows[name]["skipped"] == "no clang" and rows[name]["baseline"] is None and rows[name]["ratio"] is None
        assert rows[name]["value"] > 0 and rows[name]["pass"] is None
    assert rows["peers_pipeline_1MiB_vs_to_thread"]["ratio"] == pytest.approx(2.0)


def test_pipeline_expected_follows_float32_steps() -> None:
    assert pipeline_expected(1.0) == pipeline_expected(1.0, 0) == 1.0
    assert pipeline_expected(1.0, 2) == 1.75  # 1 -> 1.5 -> 1.75
    assert math.isclose(pipeline_expected(3.0, 40), 2.0)


def test_missing_clang_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert setup_tinygrad.find_clang() is None
    with pytest.raises(setup_tinygrad.PeerUnavailable, match="apt-get install -y clang"):
        setup_tinygrad.ensure_clang(install=False)
    assert setup_tinygrad.installed_version(tmp_path / "no-venv") is None


@pytest.mark.slow
@pytest.mark.anyio
async def test_quick_run_with_tinygrad(anyio_backend: Any) -> None:
    """Builds benchmarks/peers/.venv-tinygrad from PyPI if needed, and needs clang: opt-in."""
    if anyio_backend[0] != "asyncio" or anyio_backend[1]:
        pytest.skip("the tinygrad side does not depend on the loop: once is enough")
    if setup_tinygrad.find_clang() is None and os.environ.get("ARUNTIME_BENCH_INSTALL_CLANG") != "1":
        pytest.skip("no clang (apt-get install -y clang, or set ARUNTIME_BENCH_INSTALL_CLANG=1)")
    rows = _by_name(await side_by_side(quick=True, with_tinygrad=True))
    _check_local_rows(rows)
    pipe = rows["peers_pipeline_1MiB_vs_tinygrad"]
    assert "skipped" not in pipe, pipe.get("skipped")
    assert pipe["tinygrad_verified"] is True and pipe["baseline"] > 0 and pipe["tinygrad_kernel_us"] > 0
    assert pipe["ratio"] == pytest.approx(pipe["value"] / pipe["baseline"])
    serving = rows["peers_serving_vs_tinygrad"]
    assert serving["tinygrad_verified"] is True and serving["tinygrad_variant"] in ("sequential", "batched")
    latency = rows["peers_launch_latency_vs_tinygrad"]
    assert latency["tinygrad_sync_us"] > 0
    assert latency["baseline"] == pytest.approx(latency["tinygrad_sync_us"] + 1.5 * latency["wake_us"])
    assert pipe["tinygrad"] == setup_tinygrad.TINYGRAD_VERSION
