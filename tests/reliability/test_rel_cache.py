"""The compile cache under stress: processes compiling at once into one fresh cache, truncated and corrupted
database files, stored binaries with flipped bytes or a damaged header (detected, dropped, rebuilt, never
run), and an unsafe cache directory refused with a message that says how to go on."""

from __future__ import annotations

import array
import hashlib
import os
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from aruntime import Device, dtypes
from aruntime.compile.cache import _table_name, cache_close, cache_get, cache_put
from aruntime.errors import CacheError

CONST = "#include <stdint.h>\nvoid kernel(int32_t *out) {{ out[0] = {value}; }}\n"


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for var in ("ARUNTIME_CACHELEVEL", "ARUNTIME_DISABLE_COMPILER_CACHE", "ARUNTIME_ASSERT_COMPILE"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "cache" / "cache.db"
    monkeypatch.setenv("ARUNTIME_CACHEDB", str(path))
    yield path
    cache_close()


async def run_const(value: int) -> int:
    dev = Device["CPU"]
    prog = await dev.compile(CONST.format(value=value), outs=(0,))
    out = await dev.allocate(1, dtypes.int32)
    await dev.launch(prog, out)
    result = array.array("i", bytes(await dev.copyout(out)))[0]
    await dev.free(out)
    return result


def stored(value: int) -> tuple[str, str]:
    """The (table, key) the CPU compiler stores CONST(value) under."""
    dev = Device["CPU"]
    compiler = dev.compiler
    assert compiler is not None and compiler.cachekey is not None
    compiled = dev._kernel_source(CONST.format(value=value), "kernel")  # what the CPU device compiles: with its entry
    return compiler.cachekey, hashlib.sha256(compiled.encode()).hexdigest()


def rewrite(db: Path, table: str, key: str, change: bytes | None = None, flip_at: int | None = None) -> None:
    """Replace the raw stored value (checksum included) under ``key``: with ``change``, or with bytes flipped."""
    cache_close()
    with sqlite3.connect(db) as con:
        name = _table_name(table)
        (value,) = con.execute(f'SELECT value FROM "{name}" WHERE key = ?', (key,)).fetchone()
        if flip_at is not None:
            raw = bytearray(value)
            for i in range(flip_at, flip_at + 4):
                raw[i] ^= 0xFF
            value = bytes(raw)
        con.execute(f'UPDATE "{name}" SET value = ? WHERE key = ?', (change or value, key))
    cache_close()


def test_a_stored_binary_with_flipped_bytes_is_dropped_and_rebuilt(db: Path) -> None:
    assert anyio.run(run_const, 4242) == 4242
    table, key = stored(4242)
    raw = len(cache_get(table, key) or b"")
    rewrite(db, table, key, flip_at=32 + raw // 2)  # in the middle of the binary, past the checksum
    with pytest.warns(RuntimeWarning, match=rf"compile cache {db}: the value stored under .* fails its checksum"):
        assert anyio.run(run_const, 4242) == 4242  # rebuilt, not the damaged binary
    assert cache_get(table, key) is not None  # stored again, and it verifies


def test_a_stored_binary_that_fails_to_load_is_dropped_and_rebuilt(db: Path) -> None:
    assert anyio.run(run_const, 4343) == 4343
    table, key = stored(4343)
    good = cache_get(table, key)
    assert good is not None and good[:4] == b"\x7fELF"
    cache_put(table, key, b"\0\0\0\0" + good[4:])  # a damaged ELF header behind a valid checksum
    with pytest.warns(RuntimeWarning, match=rf"compile cache {db}: the binary stored for source sha256 {key}.*"):
        assert anyio.run(run_const, 4343) == 4343
    assert cache_get(table, key) == good  # the rebuilt binary replaced it


READER = textwrap.dedent(
    """
    import array
    import anyio
    from aruntime import Device, dtypes
    from aruntime.compile.cache import cache_get

    async def main():
        dev = Device["CPU"]
        prog = await dev.compile("#include <stdint.h>\\nvoid kernel(int32_t *out) { out[0] = 4444; }\\n", outs=(0,))
        out = await dev.allocate(1, dtypes.int32)
        await dev.launch(prog, out)
        print(array.array("i", bytes(await dev.copyout(out)))[0])
        print(sum(cache_get("filler", f"k{i}") is not None for i in range(40)))

    anyio.run(main)
    """
)


def fill_and_close(db: Path) -> None:
    """40 filler values and the 4444 kernel in the cache, all in the main database file (WAL checkpointed)."""
    for i in range(40):
        cache_put("filler", f"k{i}", os.urandom(2000))
    env = {**os.environ, "ARUNTIME_CACHEDB": str(db)}
    first = subprocess.run([sys.executable, "-c", READER], env=env, capture_output=True, timeout=120)
    assert first.returncode == 0 and first.stdout.split() == [b"4444", b"40"], first.stderr.decode()
    cache_close()
    with sqlite3.connect(db) as con:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def read_damaged(db: Path) -> str:
    """Run the reader on the damaged file: the kernel must still give 4444; returns its stderr."""
    env = {**os.environ, "ARUNTIME_CACHEDB": str(db)}
    proc = subprocess.run([sys.executable, "-c", READER], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split()[0] == b"4444", proc.stderr.decode()
    return proc.stderr.decode()


def test_a_truncated_database_file_is_detected_and_the_cache_works(db: Path) -> None:
    fill_and_close(db)
    with open(db, "r+b") as f:
        f.truncate(db.stat().st_size // 3)
    err = read_damaged(db)
    assert "is corrupted" in err and "moved it aside" in err
    assert any(p.name.startswith("cache.db.corrupt-") for p in db.parent.iterdir())
    read_damaged(db)  # a third run uses the fresh database: still right


def test_a_corrupted_database_file_is_detected_and_the_cache_works(db: Path) -> None:
    fill_and_close(db)
    with open(db, "r+b") as f:
        f.write(b"garbage!" * 64)  # over the sqlite header
    err = read_damaged(db)
    assert "is corrupted" in err and "moved it aside" in err


def test_a_cache_directory_writable_by_others_is_refused_with_how_to_go_on(db: Path) -> None:
    db.parent.mkdir(mode=0o700)
    os.chmod(db.parent, 0o777)
    with pytest.raises(CacheError, match="writable by other users") as info:
        anyio.run(run_const, 4646)
    message = str(info.value)
    assert f"chmod go-w {db.parent}" in message and "ARUNTIME_CACHELEVEL=0" in message and "ARUNTIME_CACHEDB" in message


WORKER = textwrap.dedent(
    """
    import array, sys
    import anyio
    from aruntime import Device, dtypes
    CONST = {const!r}

    async def main(index):
        dev = Device["CPU"]
        results = []
        for value in (777, 1000 + index, 777, 2000 + index):
            prog = await dev.compile(CONST.format(value=value), outs=(0,))
            out = await dev.allocate(1, dtypes.int32)
            await dev.launch(prog, out)
            results.append(array.array("i", bytes(await dev.copyout(out)))[0])
        assert results == [777, 1000 + index, 777, 2000 + index], results
        print("ok", index)

    anyio.run(main, int(sys.argv[1]))
    """
).format(const=CONST)


def test_four_processes_compile_the_same_and_different_kernels_into_one_fresh_cache(db: Path) -> None:
    env = {**os.environ, "ARUNTIME_CACHEDB": str(db)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for i in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for i, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and out.decode().strip() == f"ok {i}", err.decode()
        assert b"Warning" not in err, err.decode()
    warm = subprocess.run(  # every binary is now in the cache and verifies: no compile at all
        [sys.executable, "-c", WORKER, "0"],
        env={**env, "ARUNTIME_ASSERT_COMPILE": "1"},
        capture_output=True,
        timeout=120,
    )
    assert warm.returncode == 0 and warm.stdout.decode().strip() == "ok 0", warm.stderr.decode()
