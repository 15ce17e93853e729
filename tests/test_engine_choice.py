"""Choosing the engine: the native core through the compile cache (damaged, unusable or disabled), a warning
whenever the Python engine is chosen but not asked for, ``ARUNTIME_ENGINE`` checked and read once.

Each case runs in a fresh interpreter: the engine is chosen once per process.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from aruntime.compile.cache import CACHE_VERSION, cache_close, cache_put
from aruntime.engine import native

needs_native = pytest.mark.skipif(
    native.engine_name() != "native", reason=f"the native core does not build here: {native.unavailable}"
)

CHOSEN = "from aruntime import Device; Device['NULL']; Device['CPU']; print(Device['CPU'].engine_kind)"
FALLBACK = "aruntime runs on the Python engine"


def choose(env: dict[str, str], code: str = CHOSEN) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def environment(db: Path, **changes: str) -> dict[str, str]:
    """This process's environment with the cache at ``db``, nothing forcing an engine or the cache, and
    ``changes``."""
    forcing = ("ARUNTIME_ENGINE", "ARUNTIME_DISABLE_COMPILER_CACHE", "ARUNTIME_ASSERT_COMPILE", "ARUNTIME_CACHELEVEL")
    env = {k: v for k, v in os.environ.items() if k not in forcing}
    return {**env, "ARUNTIME_CACHEDB": str(db), **changes}


def stored_core(db: Path) -> tuple[str, str, bytes]:
    """(table, key, binary) of the native core in the cache; ``table`` as :func:`cache_put` names it."""
    with sqlite3.connect(db) as con:
        tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        [table] = [t for t in tables if t.startswith("NATIVE_core")]
        [(key, value)] = con.execute(f'SELECT key, value FROM "{table}"').fetchall()
    return table.removesuffix(f"_v{CACHE_VERSION}"), key, value[32:]  # the binary behind its checksum


@needs_native
@pytest.mark.parametrize("damage", ["truncated", "bad header"])
def test_a_damaged_core_in_the_cache_is_dropped_and_rebuilt(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "cache.db"
    env = environment(db)
    first = choose(env)
    assert first.returncode == 0 and first.stdout.split() == ["native"], first.stderr
    table, key, good = stored_core(db)
    monkeypatch.setenv("ARUNTIME_CACHEDB", str(db))
    cache_put(table, key, good[: len(good) // 2] if damage == "truncated" else b"\0\0\0\0" + good[4:])
    cache_close()
    second = choose(env)
    assert second.returncode == 0, f"exit {second.returncode}: {second.stderr}"
    assert second.stdout.split() == ["native"] and FALLBACK not in second.stderr
    assert f"the binary stored for source sha256 {key}" in second.stderr and "dropped it" in second.stderr
    assert stored_core(db) == (table, key, good)  # rebuilt and stored whole again
    third = choose(env)
    assert third.stdout.split() == ["native"] and not third.stderr


@needs_native
def test_an_unusable_cache_still_gives_the_native_engine_and_says_why(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = choose(environment(blocker / "cache.db"))  # the cache's directory is a file
    assert proc.returncode == 0 and proc.stdout.split() == ["native"], proc.stderr
    assert "RuntimeWarning: the native core is built without the compile cache" in proc.stderr
    assert f"compile cache {blocker / 'cache.db'} is not usable" in proc.stderr
    assert FALLBACK not in proc.stderr


@needs_native
def test_disable_compiler_cache_builds_the_core_without_the_cache(tmp_path: Path) -> None:
    db = tmp_path / "cache.db"
    proc = choose(environment(db, ARUNTIME_DISABLE_COMPILER_CACHE="1"))
    assert proc.returncode == 0 and proc.stdout.split() == ["native"], proc.stderr
    assert not db.exists(), "the cache was opened for the core"
    assert not proc.stderr


def test_the_python_engine_chosen_but_not_asked_for_is_a_warning_once(tmp_path: Path) -> None:
    env = environment(tmp_path / "cache.db", CC=str(tmp_path / "no-such-cc"))
    proc = choose(env)
    assert proc.returncode == 0 and proc.stdout.split() == ["python"], proc.stderr
    assert proc.stderr.count(FALLBACK) == 1 and "RuntimeWarning" in proc.stderr
    assert "the native core could not be built: C compiler" in proc.stderr and "no-such-cc" in proc.stderr
    asked = choose({**env, "ARUNTIME_ENGINE": "python"})
    assert asked.returncode == 0 and asked.stdout.split() == ["python"] and not asked.stderr


def test_a_bad_engine_name_is_a_value_error_like_every_bad_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARUNTIME_ENGINE", "warp")
    with pytest.raises(ValueError, match=r"ARUNTIME_ENGINE='warp': expected 'native' or 'python'") as info:
        native.mode()
    assert type(info.value) is ValueError
    proc = choose({**os.environ, "ARUNTIME_ENGINE": "warp"})
    assert proc.returncode != 0
    assert "ValueError: environment variable ARUNTIME_ENGINE='warp'" in proc.stderr


CHANGED = """
import os
import warnings
from aruntime import Device
from aruntime.engine import engine_name

first = engine_name()
os.environ["ARUNTIME_ENGINE"] = "python" if first == "native" else "native"
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    Device["NULL"]
    Device["CPU:3"]
    now = engine_name()
print(first, now, sum("ARUNTIME_ENGINE changed" in str(w.message) for w in seen))
print(*{str(w.message) for w in seen})
"""


def test_a_changed_engine_variable_is_ignored_with_one_warning(tmp_path: Path) -> None:
    proc = choose(environment(tmp_path / "cache.db"), CHANGED)
    assert proc.returncode == 0, proc.stderr
    counts, message = proc.stdout.splitlines()
    first, now, warned = counts.split()
    assert now == first and warned == "1"
    assert message.startswith(f"ARUNTIME_ENGINE changed to {('python' if first == 'native' else 'native')!r} after")
    assert f"the {first} engine was chosen with ''" in message and "the change is ignored" in message
