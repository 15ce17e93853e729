"""The ``aruntime`` command line: user errors are one line on stderr with exit status 2, never a traceback."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import aruntime.compile.cache as compile_cache
from aruntime import Device
from aruntime.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aruntime", *args], capture_output=True, text=True, timeout=60)


def test_version_comes_from_the_package_metadata() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout == f"aruntime {importlib.metadata.version('aruntime')}\n"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ([], "aruntime: the following arguments are required: command (see aruntime --help)"),
        (["nope"], "aruntime: argument command: invalid choice: 'nope'"),
        (["demo", "--frobnicate"], "aruntime: unrecognized arguments: --frobnicate"),
        (["profile"], "aruntime profile: the following arguments are required: profile_command"),
        (["cache", "wipe"], "aruntime cache: argument action: invalid choice: 'wipe'"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(args: list[str], line: str) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr


def test_profile_summary_names_the_file_it_could_not_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "garbage.json"
    garbage.write_text("this is not json")
    assert main(["profile", "summary", str(garbage)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aruntime profile summary: {garbage}: not a JSON trace (") and err.count("\n") == 1

    missing = tmp_path / "missing.json"
    assert main(["profile", "summary", str(missing)]) == 2
    assert capsys.readouterr().err == f"aruntime profile summary: {missing}: No such file or directory\n"

    assert main(["profile", "view", str(tmp_path), "--no-open"]) == 2
    assert capsys.readouterr().err.startswith(f"aruntime profile view: {tmp_path}: ")


def test_cache_info_and_clear(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "cache.db"
    monkeypatch.setattr(compile_cache, "cache_path", lambda: path)
    assert main(["cache", "info"]) == 0
    assert capsys.readouterr().out == (f"compile cache: {path}\nnot created yet\nclear it with: aruntime cache clear\n")
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out == f"compile cache {path}: nothing to clear\n"
    assert not path.exists()

    compile_cache.cache_put("CPU_test", "a", b"x" * 5000)
    compile_cache.cache_put("CPU_test", "b", b"y")
    compile_cache.cache_put("CL_test", "c", b"z")
    info = compile_cache.cache_info()
    assert (info.path, info.entries, info.enabled) == (path, 3, True) and info.nbytes > 5000
    assert main(["cache", "info"]) == 0
    assert f"{info.nbytes} B on disk, 3 entries\n" in capsys.readouterr().out

    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.startswith(f"compile cache {path}: cleared 3 entries, ")
    assert compile_cache.cache_get("CPU_test", "a") is None
    assert compile_cache.cache_info().entries == 0
    compile_cache.cache_put("CPU_test", "a", b"again")  # the cache works on after a clear
    assert compile_cache.cache_get("CPU_test", "a") == b"again"


def test_clearing_the_cache_makes_the_next_compile_miss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compile_cache, "cache_path", lambda: tmp_path / "cache.db")
    source = "void kernel(float *out) { out[0] = 42.0f; }\n"

    async def build() -> None:
        await Device["CPU"].compile(source, outs=(0,))

    anyio.run(build)
    before = compile_cache.cache_info().entries
    assert before >= 1  # the kernel (and the compiler's version)
    assert main(["cache", "clear"]) == 0
    assert compile_cache.cache_info().entries == 0
    anyio.run(build)
    assert compile_cache.cache_info().entries >= 1  # compiled again, and stored again
