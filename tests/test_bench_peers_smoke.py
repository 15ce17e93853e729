"""The side-by-side benchmark (benchmarks/bench_peers.py): aruntime and thread-pool rows in quick mode, the row
arithmetic, the skip path, and (opt-in, --run-slow: needs PyPI and clang) the real tinygrad side."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_peers
from benchmarks.bench_peers import PEERS, Case, Measured, Plan, build_rows, pipeline_expected, side_by_side
from benchmarks.common import REQUIRED_KEYS
from benchmarks.peers import setup_tinygrad

OLD, NEW = setup_tinygrad.TINYGRAD_VERSION, setup_tinygrad.TINYGRAD_CLANG_VERSION
"""The two releases compared against: 0.13.0 (all rows) and 0.10.1 (pipeline and kernel rows)."""
POOL = "peers_pipeline_1MiB_2dev_vs_threads"
PIPELINE_NAMES = {
    OLD: {
        "peers_pipeline_1MiB_1dev_vs_tinygrad",
        "peers_pipeline_1MiB_2dev_vs_tinygrad",
        "peers_kernel_1MiB_vs_tinygrad",
    },
    NEW: {
        "peers_pipeline_1MiB_1dev_vs_tinygrad_0_10_1",
        "peers_pipeline_1MiB_2dev_vs_tinygrad_0_10_1",
        "peers_kernel_1MiB_vs_tinygrad_0_10_1",
    },
}
PEER_NAMES = {
    OLD: PIPELINE_NAMES[OLD] | {"peers_serving_vs_tinygrad", "peers_launch_latency_vs_tinygrad"},
    NEW: PIPELINE_NAMES[NEW],
}
"""Each release's rows in quick mode."""
QUICK_NAMES = {POOL} | PEER_NAMES[OLD] | PEER_NAMES[NEW]


def _by_name(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    assert len({r["name"] for r in rows}) == len(rows), "duplicate row names"
    return {r["name"]: r for r in rows}


def _check_local_rows(rows: dict[str, dict[str, Any]]) -> None:
    """The rows measured without tinygrad: aruntime's figures and the two-thread pool baseline."""
    base = rows[POOL]
    assert base["verified"] is True
    assert base["value"] > 0 and base["baseline"] > 0
    assert base["ratio"] == pytest.approx(base["value"] / base["baseline"])
    assert base["unit"] == "batches/s" and base["batches"] == 4 and base["batch_mib"] == 1.0
    assert base["goal"] == ">= 0.95x the two-thread pool"
    for suffix in ("tinygrad", "tinygrad_0_10_1"):
        for name in (f"peers_pipeline_1MiB_1dev_vs_{suffix}", f"peers_pipeline_1MiB_2dev_vs_{suffix}"):
            assert rows[name]["value"] > 0 and rows[name]["verified"] is True
        assert rows[f"peers_kernel_1MiB_vs_{suffix}"]["value"] > 0  # aruntime's build, µs per launch
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
    assert "tinygrad" not in by_name[POOL] and "skipped" not in by_name[POOL]
    _check_local_rows(by_name)
    for version, names in PEER_NAMES.items():
        for name in names:
            row = by_name[name]
            assert row["tinygrad"] == version
            assert "not requested" in row["skipped"]
            assert row["baseline"] is None and row["ratio"] is None and row["pass"] is None


@pytest.mark.anyio
async def test_unbuildable_tinygrad_env_becomes_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def no_network(version: str = OLD, install_clang: bool = False) -> Path:
        asked.append(version)
        raise setup_tinygrad.PeerUnavailable(f"pip could not install tinygrad=={version}: no network")

    monkeypatch.setattr(setup_tinygrad, "ensure", no_network)
    rows = _by_name(await side_by_side(quick=True, with_tinygrad=True))
    assert asked == [OLD, NEW]  # each release once, not again after it failed
    for version, names in PEER_NAMES.items():
        for name in names:
            assert rows[name]["skipped"] == f"pip could not install tinygrad=={version}: no network"
            assert rows[name]["pass"] is None and rows[name]["tinygrad"] == version
    assert "skipped" not in rows[POOL]


@pytest.mark.anyio
async def test_worker_error_is_reported_with_its_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text('import json\nprint(json.dumps({"tinygrad_version": "9.9", "error": "OSError: no clang"}))\n')
    monkeypatch.setattr(setup_tinygrad, "ensure", lambda version=OLD, install_clang=False: Path(sys.executable))
    monkeypatch.setattr(setup_tinygrad, "WORKER", worker)
    with pytest.raises(setup_tinygrad.PeerUnavailable, match=r"tinygrad 9\.9 failed: OSError: no clang"):
        await bench_peers.measure_tinygrad(NEW, {})


PLAN = Plan((Case("1MiB", 1 << 18, 10),), 2, 2, 100, 256, 2, 1)


def _measured(tinygrad: dict[str, list[dict[str, Any]]]) -> Measured:
    """Two rounds of made-up raw figures, as side_by_side collects them."""
    return Measured(
        pipeline={
            "1MiB": [
                {
                    "one_s": [0.6, 0.5],
                    "two_s": [0.4, 0.45],
                    "threads_s": [0.5, 0.6],
                    "verified": True,
                    "kernel_us": 9.0,
                },
                {
                    "one_s": [0.7, 0.55],
                    "two_s": [0.5, 0.42],
                    "threads_s": [0.45, 0.7],
                    "verified": True,
                    "kernel_us": 11.0,
                },
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


def _tinygrad_round(one_s: list[float], two_s: list[float], latency_us: list[float]) -> dict[str, Any]:
    """One round of 0.13.0's worker output: the pipeline, serving and latency."""

    def variant(seconds: list[float]) -> dict[str, Any]:
        return {"seconds": seconds, "p50_ms": 1.5, "p99_ms": 1.9, "verified": True}

    return {
        **_clang_round(one_s, two_s),
        "tinygrad_version": OLD,
        "serving": {"sequential": variant([0.05, 0.04]), "batched": variant([0.03, 0.02])},
        "latency": {"us": latency_us},
    }


def _clang_round(one_s: list[float], two_s: list[float], kernel_us: float = 5.0) -> dict[str, Any]:
    """One round of 0.10.1's worker output: the pipeline only (its spec asks for no serving or latency)."""
    pipeline = {"label": "1MiB", "one_s": one_s, "two_threads_s": two_s, "verified": True, "kernel_us": kernel_us}
    return {"tinygrad_version": NEW, "pipeline": [pipeline]}


def test_rows_compare_against_tinygrad_with_the_issue_goals() -> None:
    tinygrad = {
        OLD: [
            _tinygrad_round([1.6, 1.4], [0.5, 0.6], [10.0, 11.0]),
            _tinygrad_round([1.5, 1.8], [0.55], [9.0, 10.0]),
        ],
        NEW: [_clang_round([1.2, 1.0], [0.48, 0.5], 8.0), _clang_round([1.1], [0.46], 6.0)],
    }
    rows = _by_name(build_rows(PLAN, _measured(tinygrad)))
    assert set(rows) == QUICK_NAMES  # 0.10.1 has no serving or latency row
    one = rows["peers_pipeline_1MiB_1dev_vs_tinygrad"]  # fastest repeats: 0.5 s against 1.4 s for 10 batches
    assert one["value"] == pytest.approx(20.0) and one["baseline"] == pytest.approx(10 / 1.4)
    assert one["ratio"] == pytest.approx(2.8) and one["pass"] is True and one["goal"].startswith(">= 1.1x")
    assert one["rounds"] == 2 and one["repeats"] == 2 and one["verified"] and one["tinygrad_verified"]
    assert one["gb_s"] == pytest.approx(20.0 * (1 << 20) / 1e9)
    two = rows["peers_pipeline_1MiB_2dev_vs_tinygrad"]  # 0.4 s against tinygrad's two threads' 0.5 s
    assert two["value"] == pytest.approx(25.0) and two["baseline"] == pytest.approx(20.0)
    assert two["ratio"] == pytest.approx(1.25) and two["pass"] is True and two["goal"].startswith(">= 1.0x")
    pool = rows[POOL]  # 0.4 s against the pool's 0.45 s
    assert pool["ratio"] == pytest.approx(0.45 / 0.4) and pool["pass"] is True
    kernel = rows["peers_kernel_1MiB_vs_tinygrad"]  # medians: 10 us against 5 us
    assert kernel["value"] == 10.0 and kernel["baseline"] == 5.0 and kernel["ratio"] == 2.0
    assert kernel["pass"] is False
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
    for version, names in PEER_NAMES.items():
        assert {rows[name]["tinygrad"] for name in names} == {version}
    one = rows["peers_pipeline_1MiB_1dev_vs_tinygrad_0_10_1"]  # 0.5 s against 1.0 s
    assert one["ratio"] == pytest.approx(2.0) and one["pass"] is True
    assert one["goal"] == ">= 1.1x tinygrad one call after another 0.10.1"
    assert one["tinygrad_gb_s"] == pytest.approx(10.0 * (1 << 20) / 1e9) and one["tinygrad_verified"] is True
    two = rows["peers_pipeline_1MiB_2dev_vs_tinygrad_0_10_1"]  # 0.4 s against the two threads' 0.46 s
    assert two["ratio"] == pytest.approx(0.46 / 0.4) and two["pass"] is True
    assert two["goal"] == ">= 1.1x tinygrad 2 threads 0.10.1"
    kernel = rows["peers_kernel_1MiB_vs_tinygrad_0_10_1"]  # medians: 10 us against 7 us
    assert kernel["baseline"] == 7.0 and kernel["ratio"] == pytest.approx(10 / 7) and kernel["pass"] is False


def test_rows_fail_the_goals_when_tinygrad_is_faster() -> None:
    # 25 batches/s against aruntime's 20 on one device, 33 against 25 on two; a launch budget of 1 + 1.5 x 20 = 31 us
    # against aruntime's 30.5: still met
    tinygrad = {OLD: [_tinygrad_round([0.4], [0.3], [1.0])], NEW: [_clang_round([0.4], [0.3])]}
    rows = _by_name(build_rows(PLAN, _measured(tinygrad)))
    for suffix in ("tinygrad", "tinygrad_0_10_1"):
        assert rows[f"peers_pipeline_1MiB_1dev_vs_{suffix}"]["pass"] is False
        assert rows[f"peers_pipeline_1MiB_2dev_vs_{suffix}"]["pass"] is False
    assert rows["peers_launch_latency_vs_tinygrad"]["pass"] is True
    m = _measured({OLD: [_tinygrad_round([0.4], [0.3], [0.5])]})  # budget 30.5 us; make aruntime's median 31
    m.latency = [{"launch_us": [31.0], "wake_us": [20.0]}]
    assert _by_name(build_rows(PLAN, m))["peers_launch_latency_vs_tinygrad"]["pass"] is False
    m.pipeline["1MiB"][0]["threads_s"] = [0.3]  # the pool at 33 batches/s against aruntime's 25: 0.75
    assert _by_name(build_rows(PLAN, m))[POOL]["pass"] is False


def test_two_devices_need_more_against_0_10_1() -> None:
    # aruntime's 25 batches/s against both releases' two threads at 0.42 s (23.8 batches/s): 1.05x, which meets
    # 0.13.0's 1.0x and misses 0.10.1's 1.1x
    tinygrad = {OLD: [_tinygrad_round([1.0], [0.42], [10.0])], NEW: [_clang_round([1.0], [0.42])]}
    rows = _by_name(build_rows(PLAN, _measured(tinygrad)))
    old, new = rows["peers_pipeline_1MiB_2dev_vs_tinygrad"], rows["peers_pipeline_1MiB_2dev_vs_tinygrad_0_10_1"]
    assert old["ratio"] == pytest.approx(1.05) and new["ratio"] == pytest.approx(1.05)
    assert old["pass"] is True and new["pass"] is False
    assert {p.version: p.large.two_vs_tinygrad_threads for p in PEERS} == {OLD: 1.0, NEW: 1.1}


def test_small_batches_have_the_per_op_goals() -> None:
    plan = Plan((Case("256KiB", 1 << 16, 10),), 2, 2, 100, 256, 2, 1)
    m = _measured({OLD: [_tinygrad_round([1.6, 1.4], [0.5, 0.6], [10.0])], NEW: [_clang_round([1.6], [0.5])]})
    m.pipeline = {"256KiB": m.pipeline["1MiB"]}
    for rounds in m.tinygrad.values():
        for r in rounds:
            r["pipeline"][0]["label"] = "256KiB"
    rows = _by_name(build_rows(plan, m))
    for suffix, version in (("tinygrad", OLD), ("tinygrad_0_10_1", NEW)):
        one, two = rows[f"peers_pipeline_256KiB_1dev_vs_{suffix}"], rows[f"peers_pipeline_256KiB_2dev_vs_{suffix}"]
        assert one["goal"] == f">= 1.2x tinygrad one call after another {version}"
        assert two["goal"] == f">= 1.2x tinygrad 2 threads {version}"
        assert two["pass"] is True  # 1.25x
    pool = rows["peers_pipeline_256KiB_2dev_vs_threads"]
    assert pool["goal"] == "report only" and pool["pass"] is None


def test_rows_without_tinygrad_carry_the_reason() -> None:
    m = _measured({})
    m.skipped = {OLD: "no clang", NEW: "no clang"}
    rows = _by_name(build_rows(PLAN, m))
    for name in QUICK_NAMES - {POOL}:
        assert rows[name]["skipped"] == "no clang" and rows[name]["baseline"] is None and rows[name]["ratio"] is None
        assert rows[name]["value"] > 0 and rows[name]["pass"] is None
    assert rows[POOL]["ratio"] == pytest.approx(0.45 / 0.4)


def test_each_release_is_skipped_on_its_own() -> None:
    # 0.10.1 ran in the first round and then ran past its limit: none of its figures count, 0.13.0's all do
    m = _measured({OLD: [_tinygrad_round([1.4], [0.5], [10.0])], NEW: [_clang_round([1.0], [0.46])]})
    m.skipped = {NEW: "tinygrad 0.10.1 worker ran past 600 s"}
    rows = _by_name(build_rows(PLAN, m))
    for name in PEER_NAMES[OLD]:
        assert "skipped" not in rows[name] and rows[name]["baseline"] > 0
    for name in PEER_NAMES[NEW]:
        assert rows[name]["skipped"] == "tinygrad 0.10.1 worker ran past 600 s" and rows[name]["baseline"] is None
        assert rows[name]["tinygrad"] == NEW


def test_pipeline_expected_follows_float32_steps() -> None:
    assert pipeline_expected(1.0) == (1.0 - 0.484375) * 4.375  # 2.255859375: exact in float32
    assert pipeline_expected(11.0) == (11.0 - 0.484375) * 4.375
    assert pipeline_expected(1 / 3) == pytest.approx((1 / 3 - 0.484375) * 4.375, rel=1e-6)
    assert pipeline_expected(1 / 3) != (1 / 3 - 0.484375) * 4.375  # float32 rounding, not float64


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
    """Builds both tinygrad environments under benchmarks/peers/ from PyPI if needed, and needs clang: opt-in."""
    if anyio_backend[0] != "asyncio" or anyio_backend[1]:
        pytest.skip("the tinygrad side does not depend on the loop: once is enough")
    if setup_tinygrad.find_clang() is None and os.environ.get("ARUNTIME_BENCH_INSTALL_CLANG") != "1":
        pytest.skip("no clang (apt-get install -y clang, or set ARUNTIME_BENCH_INSTALL_CLANG=1)")
    rows = _by_name(await side_by_side(quick=True, with_tinygrad=True))
    assert set(rows) == QUICK_NAMES
    _check_local_rows(rows)
    for version, names in PIPELINE_NAMES.items():
        for name in names:
            row = rows[name]
            assert "skipped" not in row, row.get("skipped")
            assert row["tinygrad"] == version and row["baseline"] > 0
            assert row["ratio"] == pytest.approx(row["value"] / row["baseline"])
            if "_pipeline_" in name:
                assert row["tinygrad_verified"] is True
    serving = rows["peers_serving_vs_tinygrad"]
    assert serving["tinygrad_verified"] is True and serving["tinygrad_variant"] in ("sequential", "batched")
    latency = rows["peers_launch_latency_vs_tinygrad"]
    assert latency["tinygrad_sync_us"] > 0
    assert latency["baseline"] == pytest.approx(latency["tinygrad_sync_us"] + 1.5 * latency["wake_us"])
