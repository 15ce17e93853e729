"""The persistent compile cache and the cached compile of the Compiler base class."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import pickle
import queue
import sqlite3
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aruntime.compile import cc
from aruntime.compile.cache import CACHE_VERSION, cache_close, cache_get, cache_path, cache_put
from aruntime.compile.compiler import Compiler
from aruntime.errors import CacheError, CompileError

posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for var in ("ARUNTIME_CACHELEVEL", "ARUNTIME_DISABLE_COMPILER_CACHE", "ARUNTIME_ASSERT_COMPILE"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "cache" / "cache.db"
    monkeypatch.setenv("ARUNTIME_CACHEDB", str(path))
    yield path
    cache_close()


class CountingCompiler(Compiler):
    """A tiny compiler: the 'binary' is the source bytes behind a flag header."""

    def __init__(self, *flags: str) -> None:
        super().__init__(Compiler.make_cachekey("count-cc", "/usr/bin/count-cc", "count-cc 1.0", *flags))
        self.flags = flags
        self.calls = 0

    def compile(self, src: str) -> bytes:
        self.calls += 1
        if "error" in src:
            raise CompileError(f"count-cc: {src!r}: syntax error")
        return (" ".join(self.flags) + "\0").encode() + src.encode()


def _tables(path: Path) -> list[str]:
    with sqlite3.connect(path) as con:
        return [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]


# --- location ------------------------------------------------------------------


def test_location_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARUNTIME_CACHEDB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "xdg" / "aruntime" / "cache.db"
    cache_put("t", "k", b"v")
    assert cache_get("t", "k") == b"v"
    cache_close()
    for d in (tmp_path / "xdg", tmp_path / "xdg" / "aruntime"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700 or os.name != "posix"
    monkeypatch.setenv("ARUNTIME_CACHEDB", str(tmp_path / "other.db"))
    assert cache_path() == tmp_path / "other.db"
    assert cache_get("t", "k") is None


# --- basic get/put -------------------------------------------------------------


def test_hit_miss_and_missing_table(db: Path) -> None:
    assert cache_get("nosuchtable", "k") is None
    assert not db.exists() or f"nosuchtable_v{CACHE_VERSION}" not in _tables(db)  # a get creates no table
    cache_put("tbl", "k1", b"one")
    assert cache_get("tbl", "k1") == b"one"
    assert cache_get("tbl", "k2") is None
    assert cache_get("othertbl", "k1") is None
    cache_put("tbl", "k1", b"uno")
    assert cache_get("tbl", "k1") == b"uno"


def test_table_name_sanitized_and_versioned(db: Path) -> None:
    cache_put("cc-1.0/x", "k", b"a")
    cache_put("cc_1_0_x", "k", b"b")  # the sanitized spelling of the first must not collide
    cache_put("sqlite_master", "k", b"c")
    assert cache_get("cc-1.0/x", "k") == b"a"
    assert cache_get("cc_1_0_x", "k") == b"b"
    assert cache_get("sqlite_master", "k") == b"c"
    names = _tables(db)
    assert len(names) == 3
    for n in names:
        assert n.endswith(f"_v{CACHE_VERSION}")
        assert all(c.isalnum() or c == "_" for c in n)
    assert f"cc_1_0_x_v{CACHE_VERSION}" in names


def test_values_are_raw_blobs(db: Path) -> None:
    value = bytes(range(256)) + b"\0\0tail\0"
    cache_put("blobs", "key", value)
    cache_put("blobs", "ba", bytearray(b"\0x\0"))
    assert cache_get("blobs", "key") == value
    assert cache_get("blobs", "ba") == b"\0x\0"
    cache_close()
    with sqlite3.connect(db) as con:
        rows = con.execute(f'SELECT key, typeof(value), value FROM "blobs_v{CACHE_VERSION}"').fetchall()
    assert {(k, t) for k, t, _ in rows} == {("key", "blob"), ("ba", "blob")}
    stored = dict((k, v) for k, _, v in rows)
    assert stored["key"][32:] == value  # exactly the bytes behind their checksum, not a pickle of them
    assert stored["key"][:32] == hashlib.blake2b(value, digest_size=32).digest()
    assert stored["key"] != pickle.dumps(value)
    with pytest.raises(TypeError):
        cache_put("blobs", "s", "text")  # type: ignore[arg-type]


def test_wal_mode(db: Path) -> None:
    cache_put("t", "k", b"v")
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_cachelevel_0_creates_nothing(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARUNTIME_CACHELEVEL", "0")
    cache_put("t", "k", b"v")
    assert cache_get("t", "k") is None
    assert not db.parent.exists()
    monkeypatch.setenv("ARUNTIME_CACHELEVEL", "1")
    cache_put("t", "k", b"v")
    assert cache_get("t", "k") == b"v"


# --- permissions ---------------------------------------------------------------


@posix_only
def test_private_modes(db: Path) -> None:
    cache_put("t", "k", b"v")
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(db.stat().st_mode) & 0o077 == 0


@posix_only
def test_world_writable_dir_refused(db: Path) -> None:
    db.parent.mkdir(mode=0o700)
    os.chmod(db.parent, 0o777)
    with pytest.raises(CacheError, match="writable by other users") as ei:
        cache_get("t", "k")
    assert str(db.parent) in str(ei.value)
    with pytest.raises(CacheError):
        cache_put("t", "k", b"v")


@posix_only
def test_world_writable_file_refused(db: Path) -> None:
    cache_put("t", "k", b"v")  # the connection is open already: still checked
    os.chmod(db, 0o666)
    with pytest.raises(CacheError, match="writable by other users") as ei:
        cache_get("t", "k")
    assert str(db) in str(ei.value)
    os.chmod(db, 0o600)
    assert cache_get("t", "k") == b"v"


@posix_only
@pytest.mark.skipif(not hasattr(os, "getuid"), reason="needs uids")
def test_foreign_owner_refused(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_put("t", "k", b"v")
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 12345)
    with pytest.raises(CacheError, match="owned by uid"):
        cache_get("t", "k")


# --- corruption ----------------------------------------------------------------


def test_garbage_file_moved_aside(db: Path) -> None:
    db.parent.mkdir(mode=0o700)
    garbage = b"this is not an sqlite database at all\n" * 200
    db.write_bytes(garbage)
    os.chmod(db, 0o600)
    with pytest.warns(RuntimeWarning, match="corrupted"):
        assert cache_get("t", "k") is None
    moved = [p for p in db.parent.iterdir() if p.name.startswith("cache.db.corrupt-")]
    assert any(p.read_bytes() == garbage for p in moved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache_put("t", "k", b"fresh")
        assert cache_get("t", "k") == b"fresh"


def test_corrupted_existing_db_rebuilt(db: Path) -> None:
    for i in range(50):
        cache_put("t", f"k{i}", os.urandom(500))
    cache_close()  # the last close checkpoints the WAL into the file
    size = db.stat().st_size
    with open(db, "r+b") as f:  # in place: same inode
        f.write(os.urandom(size))
    with pytest.warns(RuntimeWarning, match="moved it aside"):
        assert cache_get("t", "k1") is None
    assert [p for p in db.parent.iterdir() if p.name.startswith("cache.db.corrupt-")]
    cache_put("t", "k1", b"again")
    assert cache_get("t", "k1") == b"again"


# --- the Compiler base ---------------------------------------------------------


def test_compiler_base() -> None:
    c = Compiler(None)
    assert c.cachekey is None
    with pytest.raises(NotImplementedError):
        c.compile("x")
    k1 = Compiler.make_cachekey("my cc/1", "/usr/bin/cc", "cc 12.1", "-O2")
    assert k1 == Compiler.make_cachekey("my cc/1", "/usr/bin/cc", "cc 12.1", "-O2")  # stable
    assert k1.startswith("my_cc_1_")
    assert all(ch.isalnum() or ch == "_" for ch in k1)
    assert k1 != Compiler.make_cachekey("my cc/1", "/usr/bin/cc", "cc 12.2", "-O2")  # version
    assert k1 != Compiler.make_cachekey("my cc/1", "/usr/local/bin/cc", "cc 12.1", "-O2")  # path
    assert Compiler.make_cachekey("c", "ab", "c") != Compiler.make_cachekey("c", "a", "bc")


def test_compile_cached_hit_miss(db: Path) -> None:
    cc = CountingCompiler("-O2")
    out = cc.compile_cached("kernel a")
    assert out == b"-O2\0kernel a"
    assert cc.compile_cached("kernel a") == out
    assert cc.calls == 1
    cc2 = CountingCompiler("-O2")  # another instance (or process) with the same identity shares it
    assert cc2.compile_cached("kernel a") == out
    assert cc2.calls == 0
    cc.compile_cached("kernel b")
    assert cc.calls == 2


def test_key_covers_flags(db: Path) -> None:
    o2, o3 = CountingCompiler("-O2"), CountingCompiler("-O3")
    assert o2.cachekey != o3.cachekey
    assert o2.compile_cached("k") == b"-O2\0k"
    assert o3.compile_cached("k") == b"-O3\0k"
    assert (o2.calls, o3.calls) == (1, 1)


def test_no_cachekey_never_caches(db: Path) -> None:
    class NoKey(Compiler):
        calls = 0

        def compile(self, src: str) -> bytes:
            self.calls += 1
            return src.encode()

    c = NoKey(None)
    c.compile_cached("x")
    c.compile_cached("x")
    assert c.calls == 2
    assert not db.exists()


def test_disable_compiler_cache(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARUNTIME_DISABLE_COMPILER_CACHE", "1")
    cc = CountingCompiler()
    for _ in range(3):
        assert cc.compile_cached("src") == b"\0src"
    assert cc.calls == 3
    assert not db.exists()


def test_assert_compile(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = CountingCompiler("-O1")
    monkeypatch.setenv("ARUNTIME_ASSERT_COMPILE", "1")
    with pytest.raises(CacheError, match="ARUNTIME_ASSERT_COMPILE=1") as ei:
        cc.compile_cached("cold")
    assert cc.cachekey is not None and cc.cachekey in str(ei.value)
    assert cc.calls == 0
    monkeypatch.delenv("ARUNTIME_ASSERT_COMPILE")
    cc.compile_cached("cold")  # warm it
    monkeypatch.setenv("ARUNTIME_ASSERT_COMPILE", "1")
    assert cc.compile_cached("cold") == b"-O1\0cold"
    assert cc.calls == 1


def test_compile_error_not_cached(db: Path) -> None:
    cc = CountingCompiler()
    for _ in range(2):
        with pytest.raises(CompileError, match="syntax error"):
            cc.compile_cached("an error here")
    assert cc.calls == 2


# --- concurrency ---------------------------------------------------------------

N_PROCS, N_ENTRIES = 4, 200


def _writer(path: str, wid: int, ready: Any, go: Any, errors: Any) -> None:
    os.environ["ARUNTIME_CACHEDB"] = path
    try:
        ready.put(wid)
        if not go.wait(timeout=30):
            raise TimeoutError("never told to start")
        for i in range(N_ENTRIES):
            cache_put("shared", f"{wid}-{i}", f"value {wid} {i}".encode() + b"\0" + bytes([wid, i % 256]))
            if i % 50 == 0:
                cache_put(f"own_{wid}", "k", b"x")  # new tables while others write
                assert cache_get("shared", f"{wid}-{i}") is not None
    except BaseException as e:
        errors.put(f"writer {wid}: {type(e).__name__}: {e}")
        raise


def test_concurrent_processes(db: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, errors, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_writer, args=(str(db), w, ready, go, errors)) for w in range(N_PROCS)]
    for p in procs:
        p.start()
    try:
        started = 0
        deadline = time.monotonic() + 30
        while started < N_PROCS:  # all started (imports done), so that they really write at once
            dead = [p.exitcode for p in procs if p.exitcode is not None]
            assert not dead, f"a writer process died before starting: exit codes {dead}"
            assert time.monotonic() < deadline, "writer processes did not start"
            with contextlib.suppress(queue.Empty):
                ready.get(timeout=0.1)
                started += 1
        go.set()
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, failures
    assert [p.exitcode for p in procs] == [0] * N_PROCS
    for w in range(N_PROCS):
        assert cache_get(f"own_{w}", "k") == b"x"
        for i in range(N_ENTRIES):
            assert cache_get("shared", f"{w}-{i}") == f"value {w} {i}".encode() + b"\0" + bytes([w, i % 256])
    with sqlite3.connect(db) as con:
        assert con.execute(f'SELECT count(*) FROM "shared_v{CACHE_VERSION}"').fetchone()[0] == N_PROCS * N_ENTRIES


def test_concurrent_threads(db: Path) -> None:
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(100):
                cache_put("threads", f"{t}-{i}", bytes([t, i]))
                assert cache_get("threads", f"{t}-{i}") == bytes([t, i])
        except BaseException as e:
            errors.append(e)
        finally:
            cache_close()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert all(cache_get("threads", f"{t}-{i}") == bytes([t, i]) for t in range(4) for i in range(100))


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs fork")
def test_forked_child_opens_its_own_connection(db: Path) -> None:
    cache_put("fork", "parent", b"p")
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_fork_child)
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0
    assert cache_get("fork", "child") == b"c"
    cache_put("fork", "parent2", b"p2")
    assert cache_get("fork", "parent2") == b"p2"


def _fork_child() -> None:
    assert cache_get("fork", "parent") == b"p"
    cache_put("fork", "child", b"c")


# --- a stored binary cut short behind a valid checksum ---------------------------------------------

RUN_KERNEL = """
import array
import anyio
from aruntime import Device, dtypes

async def main():
    dev = Device["CPU"]
    prog = await dev.compile("#include <stdint.h>\\nvoid kernel(int32_t *out) { out[0] = 5151; }\\n", outs=(0,))
    out = await dev.allocate(1, dtypes.int32)
    await dev.launch(prog, out)
    print(array.array("i", bytes(await dev.copyout(out)))[0])

anyio.run(main)
"""


def _stored_kernels(db: Path) -> list[tuple[str, str, bytes]]:
    """(table, key, binary) of every CPU kernel in the cache; ``table`` as :func:`cache_put` names it."""
    cache_close()
    suffix = f"_v{CACHE_VERSION}"
    found = []
    with sqlite3.connect(db) as con:
        for table in _tables(db):
            if table.startswith("CPU_") and not table.startswith("CPU_compiler_versions"):
                for key, value in con.execute(f'SELECT key, value FROM "{table}"'):
                    found.append((table.removesuffix(suffix), key, value[32:]))  # the binary behind its checksum
    return found


@pytest.mark.skipif(cc.compiler_path() is None, reason="no C compiler")
def test_a_truncated_kernel_binary_with_a_valid_checksum_is_rebuilt_in_a_new_process(db: Path) -> None:
    env = {**os.environ, "ARUNTIME_CACHEDB": str(db)}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(  # a fresh process each time: a truncated binary loaded there is a SIGBUS
            [sys.executable, "-c", textwrap.dedent(RUN_KERNEL)], env=env, capture_output=True, text=True, timeout=120
        )

    first = run()
    assert first.returncode == 0 and first.stdout.split() == ["5151"], first.stderr
    [(table, key, good)] = _stored_kernels(db)
    cache_put(table, key, good[: len(good) // 2])  # cut short, stored behind a checksum of what is left
    cache_close()
    second = run()
    assert second.returncode == 0, f"exit {second.returncode}: {second.stderr}"
    assert second.stdout.split() == ["5151"]
    assert f"the binary stored for source sha256 {key}" in second.stderr
    assert "a damaged shared library" in second.stderr and "dropped it and compiling again" in second.stderr
    assert _stored_kernels(db) == [(table, key, good)]  # rebuilt and stored whole again
