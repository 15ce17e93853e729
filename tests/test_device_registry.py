"""The device registry (SPEC 3): names, opening once, the default device, processes, backends, ``aruntime check``."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

import aruntime
from aruntime import Device, DeviceError, dtypes, is_dtype_supported
from aruntime.backends.null import NullDevice
from aruntime.helpers import canonicalize

KINDS = ("CPU", "DISK", "NULL", "FAKE", "BROKEN", "CUDA", "CL")
KIND_VARS = tuple(f"ARUNTIME_{kind}" for kind in KINDS)


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a child python: no device-kind variables, a private compile cache."""
    env = {k: v for k, v in os.environ.items() if k not in KIND_VARS and k not in ("CC", "ARUNTIME_LRU")}
    env["ARUNTIME_CACHEDB"] = str(tmp_path / "cache.db")
    env.update(extra)
    return env


def run_python(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True, text=True, timeout=60
    )


def run_check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aruntime", "check"], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def fresh_default() -> Iterator[None]:
    """Let a test choose the default device in this process, then restore the environment and the choice."""
    saved_env, saved_default = dict(os.environ), Device._default
    for var in KIND_VARS:
        os.environ.pop(var, None)
    Device._default = None
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        Device._default = saved_default


# ---------------------------------------------------------------------------------------------------------
# names


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("cpu", "CPU"),
        ("CPU", "CPU"),
        ("cpu:0", "CPU"),
        ("Cpu:1", "CPU:1"),
        ("cpu:10", "CPU:10"),
        ("cpu:00", "CPU"),
        ("cpu:007", "CPU:7"),
        ("null:0", "NULL"),
        ("disk:/tmp/A", "DISK:/tmp/A"),
        ("Disk:/Data/Mixed/Case.bin", "DISK:/Data/Mixed/Case.bin"),
        ("disk:relative/File", "DISK:relative/File"),
    ],
)
def test_canonical_names(name: str, canonical: str) -> None:
    assert canonicalize(name) == canonical
    assert Device.canonicalize(name) == canonical


@pytest.mark.parametrize("name", ["", ":0", ":CPU", 3, b"CPU"])
def test_malformed_names_are_clear_errors(name: object) -> None:
    with pytest.raises(DeviceError, match=r"invalid device name .*expected KIND, KIND:N with N >= 0, or KIND:ARG"):
        Device[name]  # type: ignore[index]


def test_device_opens_once_and_is_tracked() -> None:
    cpu = Device["CPU"]
    assert Device["cpu"] is cpu and Device["cpu:0"] is cpu and Device["CPU:0"] is cpu
    assert cpu.name == "CPU" and "CPU" in Device.opened
    other = Device["cpu:3"]
    assert other is not cpu and other.name == "CPU:3" and Device["CPU:3"] is other
    assert {"CPU", "CPU:3"} <= set(Device.opened)
    assert cpu in list(Device.devices()) and other in list(Device.devices())


def test_concurrent_first_opens_give_one_device() -> None:
    name = "NULL:7103"
    assert name not in Device.opened
    barrier = threading.Barrier(8)
    got: list[object] = []

    def open_it() -> None:
        barrier.wait()
        got.append(Device[name])

    threads = [threading.Thread(target=open_it) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(d is got[0] for d in got)
    assert Device.opened.count(name) == 1


def test_unknown_kind_lists_the_known_kinds() -> None:
    before = Device.opened
    with pytest.raises(DeviceError, match=r"unknown device kind 'NOPE'; known kinds: .*CPU, CUDA, DISK, NULL"):
        Device["nope:1"]
    assert Device.opened == before  # nothing half-opened


def test_kinds_and_backends() -> None:
    kinds = Device.kinds()
    assert {"CPU", "DISK", "NULL"} <= set(kinds)
    assert kinds["CPU"] == "aruntime.backends.cpu"
    assert Device.backend("NULL") is NullDevice
    assert Device.backend("DISK").file_backed and not Device.backend("CPU").file_backed


def test_available_lists_the_kinds_that_open() -> None:
    available = Device.available()
    assert available[0] == "CPU"  # CPU is the first kind of the priority list on a machine without GPUs
    assert {"CPU", "DISK", "NULL"} <= set(available)


def test_is_dtype_supported(fresh_default: None, tmp_path: Path) -> None:
    assert is_dtype_supported(dtypes.float32, "CPU") and is_dtype_supported(dtypes.half, "cpu")
    assert not is_dtype_supported(dtypes.bfloat16, "CPU")
    assert is_dtype_supported(dtypes.bfloat16, f"DISK:{tmp_path / 'x'}")  # a file stores any dtype
    assert aruntime.is_dtype_supported is is_dtype_supported
    assert is_dtype_supported(dtypes.int8) is Device[None].is_dtype_supported(dtypes.int8)  # the default device
    with pytest.raises(TypeError, match="expected a DType, got str"):
        is_dtype_supported("float32", "CPU")  # type: ignore[arg-type]
    with pytest.raises(DeviceError, match="unknown device kind 'NOPE'"):
        is_dtype_supported(dtypes.float32, "NOPE")


def test_default_in_process_is_cpu_and_the_environment_is_left_alone(fresh_default: None) -> None:
    before = dict(os.environ)
    assert Device.DEFAULT == "CPU"
    assert dict(os.environ) == before  # the choice is not written back: a child finds it by the same rule
    assert Device[None] is Device["CPU"]


# ---------------------------------------------------------------------------------------------------------
# the default device and child processes

DEFAULT_PROBE = """
import json, os, subprocess, sys
from aruntime import Device, DeviceError
try:
    default = Device.DEFAULT
except DeviceError as exc:
    print(json.dumps({"error": str(exc)}))
    raise SystemExit(0)
grandchild = subprocess.run([sys.executable, "-c", "from aruntime import Device; print(Device.DEFAULT)"],
                            capture_output=True, text=True, check=True).stdout.strip()
none_is_default = Device[None] is Device[default]
print(json.dumps({"default": default, "opened": list(Device.opened), "child": grandchild,
                  "none_is_default": none_is_default}))
"""


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "CPU"),  # first kind of the priority list that opens
        ({"ARUNTIME_NULL": "1"}, "NULL"),  # a kind's variable set to 1 wins
        ({"ARUNTIME_DISK": "1"}, "CPU"),  # file-backed kinds are never the default
        ({"ARUNTIME_NULL": "0"}, "CPU"),
        ({"NULL": "1"}, "CPU"),  # the old unprefixed name is gone
    ],
)
def test_default_device_selection_and_children(tmp_path: Path, env: dict[str, str], expected: str) -> None:
    proc = run_python(DEFAULT_PROBE, child_env(tmp_path, **env))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got == {"default": expected, "opened": [expected], "child": expected, "none_is_default": True}


def test_two_default_kinds_in_the_environment_is_an_error(tmp_path: Path) -> None:
    proc = run_python(DEFAULT_PROBE, child_env(tmp_path, ARUNTIME_CPU="1", ARUNTIME_NULL="1"))
    assert json.loads(proc.stdout) == {
        "error": "several device kinds are set to 1 in the environment: ARUNTIME_CPU, ARUNTIME_NULL"
    }


def _open_in_child(disk_path: str) -> dict[str, str]:
    """Runs in a spawned (non-main) process: compute devices must refuse, file-backed ones open."""
    import aruntime as rt

    result = {"process": multiprocessing.current_process().name}
    try:
        rt.Device["CPU"]
        result["cpu"] = "opened"
    except rt.DeviceError as exc:
        result["cpu"] = str(exc)
    buf = rt.Buffer(f"DISK:{disk_path}", 5, initial_value=b"child")
    result["disk"] = bytes(buf.as_buffer()).decode()
    buf.deallocate()
    result["opened"] = ",".join(rt.Device.opened)
    return result


def test_only_the_main_process_opens_compute_devices(tmp_path: Path) -> None:
    disk = tmp_path / "from-child.bin"
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = pool.submit(_open_in_child, str(disk)).result(timeout=60)
    assert got["process"] != "MainProcess"
    assert got["cpu"] == "CPU: compute devices are opened only in the main process"
    assert got["disk"] == "child" and got["opened"] == f"DISK:{disk}"
    assert disk.read_bytes() == b"child"


# ---------------------------------------------------------------------------------------------------------
# aruntime check


def test_check_passes_on_the_default_and_lists_every_kind(tmp_path: Path) -> None:
    proc = run_check(child_env(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert (
        "CPU (default): open PASS, kernel PASS [native engine]" in lines
        or "CPU (default): open PASS, kernel PASS [python engine]" in lines
    )
    assert any(line.startswith("DISK: open PASS, kernel n/a - ") for line in lines)
    assert any(line.startswith("NULL: open PASS, kernel n/a - ") and "no check kernel" in line for line in lines)
    assert any(line.startswith("RAY: open n/a, kernel n/a - opens only with an argument") for line in lines)
    # CUDA does not open without a GPU and cuda-core
    assert not any("FAIL" in line for line in lines if not line.startswith("CUDA:"))
    assert sum("(default)" in line for line in lines) == 1


def test_check_fails_when_the_default_kernel_fails(tmp_path: Path) -> None:
    proc = run_check(child_env(tmp_path, CC=str(tmp_path / "no-such-cc")))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    cpu = next(line for line in proc.stdout.splitlines() if line.startswith("CPU"))
    assert cpu.startswith("CPU (default): open PASS, kernel FAIL - CompileError: ")
    assert "no-such-cc" in cpu and "not found" in cpu


def test_check_fails_when_the_default_does_not_open(tmp_path: Path) -> None:
    proc = run_check(child_env(tmp_path, ARUNTIME_NOPE="1", ARUNTIME_CPU="1", ARUNTIME_NULL="1"))
    assert proc.returncode == 1
    assert "no default device: several device kinds are set to 1" in proc.stdout
    assert any(
        line.startswith("CPU: open PASS, kernel PASS [") for line in proc.stdout.splitlines()
    )  # the other kinds are still checked


def test_console_script_runs_check(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("aruntime")
    if not script.exists():
        pytest.skip("the aruntime console script is not installed next to this python")
    proc = subprocess.run([str(script), "check"], env=child_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "CPU (default): open PASS, kernel PASS" in proc.stdout


# ---------------------------------------------------------------------------------------------------------
# third-party backends through the entry-point group "aruntime.backends"

FAKE_BACKEND = '''
"""A third-party device kind for aruntime."""
from aruntime.backends.null import NullDevice


class FakeDevice(NullDevice):
    """A NULL device under another name."""

    kind = "FAKE"
    opened_by_fake_backend = True
'''

FAKE_PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fake-backend"
version = "1.0"

[project.entry-points."aruntime.backends"]
FAKE = "fake_backend:FakeDevice"
broken = "fake_backend:NoSuchDevice"

[tool.hatch.build.targets.wheel]
include = ["fake_backend.py"]
"""


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real installed distribution (dist-info with entry points) in its own site directory."""
    root = tmp_path_factory.mktemp("fake-backend")
    src = root / "src"
    src.mkdir()
    (src / "fake_backend.py").write_text(FAKE_BACKEND)
    (src / "pyproject.toml").write_text(FAKE_PYPROJECT)
    site = root / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation"]
    proc = subprocess.run([*cmd, "--target", str(site), str(src)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(site.glob("fake_backend-1.0.dist-info/entry_points.txt"))
    return site


def test_an_installed_package_adds_a_device_kind(fake_site: Path, tmp_path: Path) -> None:
    code = """
    import json
    from aruntime import Device, DeviceError
    dev = Device["fake:0"]
    try:
        Device["BROKEN"]
        broken = "opened"
    except DeviceError as exc:
        broken = str(exc)
    print(json.dumps({"kinds": Device.kinds(), "name": dev.name, "cls": type(dev).__name__,
                      "third_party": getattr(dev, "opened_by_fake_backend", False),
                      "same": Device["FAKE"] is dev, "broken": broken}))
    """
    env = child_env(tmp_path, PYTHONPATH=str(fake_site))
    proc = run_python(code, env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["kinds"]["FAKE"] == "fake_backend:FakeDevice" and got["kinds"]["CPU"] == "aruntime.backends.cpu"
    assert (got["name"], got["cls"], got["third_party"], got["same"]) == ("FAKE", "FakeDevice", True, True)
    assert got["broken"].startswith("backend fake_backend:NoSuchDevice for BROKEN could not be loaded: ")
    assert "NoSuchDevice" in got["broken"].split("could not be loaded: ")[1]

    check = run_check(env)
    assert check.returncode == 0, check.stdout + check.stderr
    lines = check.stdout.splitlines()
    assert any(line.startswith("FAKE: open PASS, kernel n/a - ") for line in lines)
    broken = next(line for line in lines if line.startswith("BROKEN:"))
    assert broken.startswith("BROKEN: open FAIL, kernel FAIL - open failed: backend fake_backend:NoSuchDevice")
    assert (
        "CPU (default): open PASS, kernel PASS [native engine]" in lines
        or "CPU (default): open PASS, kernel PASS [python engine]" in lines
    )

    # the installed kind can be chosen as the default like a built-in one
    proc = run_python(DEFAULT_PROBE, {**env, "ARUNTIME_FAKE": "1"})
    assert json.loads(proc.stdout)["default"] == "FAKE"


def test_without_the_package_the_kind_is_unknown(tmp_path: Path) -> None:
    proc = run_python("from aruntime import Device; Device['FAKE']", child_env(tmp_path))
    assert (
        proc.returncode == 1
        and "DeviceError: unknown device kind 'FAKE'; known kinds: CL, CPU, CUDA, DISK, NULL" in proc.stderr
    )
