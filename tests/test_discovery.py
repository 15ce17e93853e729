"""What a user finds from ``import aruntime``: the public names, the version, one spelling of a transfer, and
settings read only from ``ARUNTIME_*`` environment variables (never written)."""

from __future__ import annotations

import array
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import aruntime
from aruntime import BaseDevice, Device, dtypes
from aruntime.helpers import getenv

ROOT = Path(__file__).resolve().parent.parent


def test_the_public_names_are_exported_at_the_top() -> None:
    for name in ("Scheduler", "Graph", "GraphRun", "Param", "Batcher", "BufferScope", "SchedulerFull"):
        assert name in aruntime.__all__ and getattr(aruntime, name).__module__.startswith("aruntime.")
    for name in ("transfer", "from_dlpack"):
        assert name in aruntime.__all__
    from aruntime.batching import Batcher
    from aruntime.graph import Graph, Param
    from aruntime.scheduler import Scheduler

    assert (aruntime.Scheduler, aruntime.Graph, aruntime.Param, aruntime.Batcher) == (Scheduler, Graph, Param, Batcher)
    assert all(hasattr(aruntime, name) for name in aruntime.__all__)


def test_version_is_the_installed_one_or_the_sources() -> None:
    assert aruntime.__version__ == importlib.metadata.version("aruntime")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{aruntime.__version__}"' in pyproject


def test_version_without_installed_metadata_falls_back_to_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    from aruntime import _version

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert _version._version() == aruntime.__version__


def test_a_transfer_has_one_spelling() -> None:
    assert not hasattr(BaseDevice, "transfer")  # not a method of the source device
    assert aruntime.transfer is aruntime.device.transfer


@pytest.mark.anyio
async def test_transfer_copies_from_source_to_destination_across_devices() -> None:
    a, b = Device["CPU"], Device["CPU:1"]
    async with a.buffer(3, dtypes.int32) as src, b.buffer(3, dtypes.int32) as dst:
        await a.copyin(src, array.array("i", [4, 5, 6]))
        assert await aruntime.transfer(dst, src) is None
        assert (await b.copyout(dst)).tolist() == [4, 5, 6]
        with pytest.raises(aruntime.BufferUsageError, match="transfer: expected a Buffer source, got bytes"):
            aruntime.transfer(dst, b"abc")  # type: ignore[arg-type]


def test_getenv_reads_only_the_prefixed_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WAIT_TIMEOUT", "5")
    monkeypatch.delenv("ARUNTIME_WAIT_TIMEOUT", raising=False)
    assert getenv("WAIT_TIMEOUT", 30.0) == 30.0  # the old name is gone
    monkeypatch.setenv("ARUNTIME_WAIT_TIMEOUT", "5")
    assert getenv("WAIT_TIMEOUT", 30.0) == 5.0
    monkeypatch.setenv("ARUNTIME_WAIT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="ARUNTIME_WAIT_TIMEOUT='soon' is not a valid float"):
        getenv("WAIT_TIMEOUT", 30.0)


def test_a_device_reads_its_timeout_from_the_prefixed_variable(tmp_path: Path) -> None:
    code = "from aruntime import Device; print(Device['CPU'].timeout, Device['NULL'].timeout)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARUNTIME_")}
    env.update(ARUNTIME_WAIT_TIMEOUT="7.5", WAIT_TIMEOUT="1", ARUNTIME_CACHEDB=str(tmp_path / "cache.db"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["7.5", "7.5"]


def test_the_runtime_reads_the_environment_only_through_getenv() -> None:
    """Every setting goes through aruntime.helpers.getenv; the only direct reads are the standard CC,
    XDG_CACHE_HOME and the display variables the profile viewer checks, and nothing writes to it."""
    allowed = {'"CC"', '"XDG_CACHE_HOME"', '"CI"', '"DISPLAY"', '"WAYLAND_DISPLAY"'}
    for path in sorted((ROOT / "aruntime").rglob("*.py")):
        text = path.read_text()
        for line in text.splitlines():
            if "os.environ" not in line or path.name == "helpers.py":
                continue
            assert "os.environ[" not in line and ".setdefault(" not in line and ".update(" not in line, (path, line)
            assert any(name in line for name in allowed), (path, line)
