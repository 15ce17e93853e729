"""Persistent on-disk compile cache: an sqlite database of raw-byte values.

The database lives at ``$ARUNTIME_CACHEDB`` when that is set (a full file path), else at
``$XDG_CACHE_HOME/aruntime/cache.db`` (``XDG_CACHE_HOME`` defaulting to
``~/.cache``). The environment is read on every call.

* One table per compiler key; the table name carries :data:`CACHE_VERSION`, so a
  format change simply starts new tables. A table that does not exist reads as a
  miss.
* Keys are text, values are raw bytes stored as BLOBs. Nothing is ever pickled:
  unpickling a file's contents would run code chosen by whoever could write it.
* Every value is stored behind its BLAKE2b checksum (32 bytes); a value whose
  checksum does not match is deleted with a warning naming the cache file and
  reads as a miss, so it is rebuilt, never used.
* The journal is in WAL mode, and writers wait (busy timeout, then retries) on
  each other, so several threads and processes may use one file at once.
* The directory is created private to the user (0700) and the file 0600. A
  directory or file that other users could write, or that another user owns, is
  refused with a :class:`~aruntime.errors.CacheError` that says how to go on
  (fix the mode, point ``ARUNTIME_CACHEDB`` elsewhere, or ``ARUNTIME_CACHELEVEL=0``).
* A corrupted file is moved aside to ``<path>.corrupt-<timestamp>`` (with its
  ``-wal``/``-shm`` files) with a warning, and a fresh database is started.
* ``ARUNTIME_CACHELEVEL=0`` disables the cache: lookups miss and stores do nothing, and no
  file is created.

Connections are kept one per (process, thread, path): sqlite connections never
cross threads, and a forked child never touches a connection of its parent.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from aruntime.errors import CacheError
from aruntime.helpers import getenv

__all__ = [
    "CACHE_VERSION",
    "CacheInfo",
    "cache_clear",
    "cache_close",
    "cache_delete",
    "cache_get",
    "cache_info",
    "cache_path",
    "cache_put",
]

CACHE_VERSION = 2
"""Format version of the stored tables; it is part of every table name (2: values carry a checksum)."""
_DIGEST = 32  # bytes of the BLAKE2b checksum in front of every value


def _checksum(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


_BUSY_TIMEOUT_S = 30.0  # sqlite's own wait on a lock held by another connection
_LOCK_DEADLINE_S = 120.0  # total time a call keeps retrying "database is locked"
_MAX_REBUILDS = 3  # a file found corrupted this many times in one call is an error

_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26

T = TypeVar("T")


def cache_path() -> Path:
    """The cache database file in use now: ``$ARUNTIME_CACHEDB``, else ``$XDG_CACHE_HOME/aruntime/cache.db``."""
    override = getenv("CACHEDB", "")
    if override:
        return Path(os.path.abspath(os.path.expanduser(override)))
    base = os.environ.get("XDG_CACHE_HOME", "") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.path.abspath(os.path.join(base, "aruntime", "cache.db")))


def _enabled() -> bool:
    return getenv("CACHELEVEL", 2, minimum=0) > 0


_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_]")


def _table_name(table: str) -> str:
    """Sanitize ``table`` to ``[A-Za-z0-9_]`` and add the format version.

    A name that had to be changed gets a short hash of the original appended, so
    two different names never collide after sanitizing.
    """
    if not isinstance(table, str) or not table:
        raise ValueError(f"compile cache table name must be a non-empty str, got {table!r}")
    safe = _UNSAFE_CHARS.sub("_", table)
    if safe.lower().startswith("sqlite_"):  # reserved for sqlite's own tables
        safe = "t_" + safe
    if safe != table:
        safe += "_" + hashlib.sha256(table.encode()).hexdigest()[:8]
    return f"{safe}_v{CACHE_VERSION}"


# ---------------------------------------------------------------------------
# Connections: one per (process, thread, path)


@dataclass
class _Conn:
    db: sqlite3.Connection
    ident: tuple[int, int]  # (st_dev, st_ino) of the file it opened


class _ThreadConns(threading.local):
    """Per-thread connections; ``pid`` tells a forked child that they are its parent's."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.conns: dict[Path, _Conn] = {}


_local = _ThreadConns()
# Connections inherited over fork() are never used nor closed in the child (closing
# one could disturb the parent's locks); they are parked here instead.
_inherited: list[_Conn] = []


def _thread_conns() -> dict[Path, _Conn]:
    pid = os.getpid()
    if _local.pid != pid:
        _inherited.extend(_local.conns.values())
        _local.conns = {}
        _local.pid = pid
    return _local.conns


def cache_close() -> None:
    """Close this thread's cache connections (they reopen on the next use)."""
    conns = _thread_conns()
    for conn in conns.values():
        _close_quietly(conn.db)
    conns.clear()


def _close_quietly(db: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):
        db.close()


def _check_private(p: Path, what: str) -> os.stat_result:
    """Stat ``p`` and refuse it if another user owns it or could write it."""
    st = os.stat(p)
    if os.name != "posix":
        return st
    uid = os.getuid()
    if st.st_uid != uid:
        raise CacheError(
            f"compile cache {what} {p} is owned by uid {st.st_uid}, not by the current user "
            f"(uid {uid}); refusing to use it. Set ARUNTIME_CACHEDB to a file in a directory you own, or disable "
            "the compile cache with ARUNTIME_CACHELEVEL=0."
        )
    if st.st_mode & 0o022:
        raise CacheError(
            f"compile cache {what} {p} is writable by other users (mode {oct(st.st_mode & 0o777)}); "
            f"refusing to use it. Run `chmod go-w {p}`, set ARUNTIME_CACHEDB to a private path, or disable the "
            "compile cache with ARUNTIME_CACHELEVEL=0."
        )
    return st


def _make_private_dirs(d: Path) -> None:
    """Create ``d`` and any missing parents with mode 0700."""
    missing: list[Path] = []
    p = d
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            continue  # another process made it first; it is checked below
        os.chmod(p, 0o700)  # the umask may have taken bits away


def _connection(path: Path) -> _Conn:
    """This thread's connection to ``path``, (re)opened when the file changed under it."""
    d = path.parent
    if not d.is_dir():
        _make_private_dirs(d)
    _check_private(d, "directory")
    try:
        st = _check_private(path, "file")
    except FileNotFoundError:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))  # an empty file is an empty database
        st = _check_private(path, "file")
    ident = (st.st_dev, st.st_ino)

    conns = _thread_conns()
    conn = conns.get(path)
    if conn is not None:
        if conn.ident == ident:
            return conn
        # The file was replaced (e.g. moved aside as corrupt by someone else).
        _close_quietly(conn.db)
        del conns[path]

    for suffix in ("-wal", "-shm"):
        side = Path(str(path) + suffix)
        if side.exists():
            _check_private(side, "file")
    db = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
    conn = _Conn(db, ident)
    try:
        db.execute("PRAGMA journal_mode=WAL").fetchall()
        db.execute("PRAGMA synchronous=NORMAL")
    except sqlite3.Error:
        _close_quietly(db)
        raise _OpenFailed(conn) from None
    conns[path] = conn
    return conn


class _OpenFailed(Exception):
    """Internal: the initial pragmas failed; the sqlite error is in ``__context__``."""

    def __init__(self, conn: _Conn) -> None:
        super().__init__()
        self.conn = conn


# ---------------------------------------------------------------------------
# Error handling: corruption, contention


def _is_corrupt(e: sqlite3.Error) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return True
    msg = str(e).lower()
    return "not a database" in msg or "malformed" in msg or "corrupt" in msg


def _is_locked(e: sqlite3.Error) -> bool:
    msg = str(e).lower()
    return "locked" in msg or "busy" in msg


def _move_aside(path: Path, conn: _Conn, err: sqlite3.Error) -> None:
    """Rename a corrupted database (and its -wal/-shm) out of the way, with a warning.

    Nothing is renamed when ``path`` is no longer the file ``conn`` opened: then
    another thread or process has already moved it aside and made a new one.
    """
    _close_quietly(conn.db)
    conns = _thread_conns()
    if conns.get(path) is conn:
        del conns[path]
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) != conn.ident:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}-{time.time_ns() % 1_000_000_000:09d}"
    dest = Path(f"{path}.corrupt-{stamp}")
    try:
        os.rename(path, dest)
    except FileNotFoundError:
        return
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.rename(f"{path}{suffix}", f"{dest}{suffix}")
    warnings.warn(
        f"compile cache {path} is corrupted ({err}); moved it aside to {dest} and started a new one",
        RuntimeWarning,
        stacklevel=4,
    )


def _run(op: Callable[[sqlite3.Connection], T]) -> T:
    """Run ``op`` on this thread's connection: retry while locked, rebuild when corrupted."""
    path = cache_path()
    deadline = time.monotonic() + _LOCK_DEADLINE_S
    rebuilds = 0
    delay = 0.001
    while True:
        conn: _Conn | None = None
        try:
            conn = _connection(path)
            return op(conn.db)
        except (sqlite3.Error, _OpenFailed) as exc:
            if isinstance(exc, _OpenFailed):
                conn = exc.conn
                err = exc.__context__
                assert isinstance(err, sqlite3.Error)
            else:
                err = exc
            if conn is not None and _is_corrupt(err) and rebuilds < _MAX_REBUILDS:
                rebuilds += 1
                _move_aside(path, conn, err)
                continue
            if _is_locked(err) and time.monotonic() < deadline:
                time.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 0.1)
                continue
            raise CacheError(f"compile cache {path} failed: {err}") from err
        except OSError as err:
            raise CacheError(f"compile cache {path} is not usable: {err}") from err


# ---------------------------------------------------------------------------
# Public API


def cache_get(table: str, key: str) -> bytes | None:
    """The bytes stored under ``key`` in ``table``, or None on a miss.

    A missing table is a miss; with ``ARUNTIME_CACHELEVEL=0`` everything is a miss. Raises
    :class:`~aruntime.errors.CacheError` when the cache file is unsafe or unusable.
    """
    if not _enabled():
        return None
    name = _table_name(table)

    def op(db: sqlite3.Connection) -> bytes | None:
        try:
            row = db.execute(f'SELECT value FROM "{name}" WHERE key = ?', (key,)).fetchone()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return None
            raise
        if row is None:
            return None
        value = row[0]
        if isinstance(value, bytes) and len(value) >= _DIGEST and _checksum(value[_DIGEST:]) == value[:_DIGEST]:
            return value[_DIGEST:]
        db.execute(f'DELETE FROM "{name}" WHERE key = ?', (key,))
        warnings.warn(
            f"compile cache {cache_path()}: the value stored under {key!r} in table {name} fails its checksum; "
            "dropped it (it is rebuilt)",
            RuntimeWarning,
            stacklevel=4,
        )
        return None

    return _run(op)


def cache_delete(table: str, key: str) -> None:
    """Drop whatever is stored under ``key`` in ``table`` (e.g. a binary that failed to load)."""
    if not _enabled():
        return
    name = _table_name(table)

    def op(db: sqlite3.Connection) -> None:
        try:
            db.execute(f'DELETE FROM "{name}" WHERE key = ?', (key,))
        except sqlite3.OperationalError as e:
            if "no such table" not in str(e):
                raise

    _run(op)


def cache_put(table: str, key: str, value: bytes) -> None:
    """Store the raw bytes ``value`` under ``key`` in ``table`` (replacing an old value).

    ``value`` must be a bytes-like object; it is stored as a BLOB, never pickled.
    Does nothing with ``ARUNTIME_CACHELEVEL=0``. Raises :class:`~aruntime.errors.CacheError`
    when the cache file is unsafe or unusable.
    """
    data = memoryview(value).tobytes()  # TypeError for anything that is not bytes-like
    if not _enabled():
        return
    name = _table_name(table)

    def op(db: sqlite3.Connection) -> None:
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(f'CREATE TABLE IF NOT EXISTS "{name}" (key TEXT PRIMARY KEY, value BLOB NOT NULL)')
            db.execute(f'INSERT OR REPLACE INTO "{name}" (key, value) VALUES (?, ?)', (key, _checksum(data) + data))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

    _run(op)


@dataclass(frozen=True)
class CacheInfo:
    """What :func:`cache_info` found: the database's path, its size on disk and how many entries it holds."""

    path: Path
    nbytes: int
    entries: int
    enabled: bool

    def __str__(self) -> str:
        where = f"compile cache: {self.path}" + ("" if self.enabled else " (off: ARUNTIME_CACHELEVEL=0)")
        size = f"{self.nbytes / (1 << 20):.1f} MiB" if self.nbytes >= 1 << 20 else f"{self.nbytes} B"
        held = f"{size} on disk, {self.entries} entries" if self.nbytes else "not created yet"
        return f"{where}\n{held}\nclear it with: aruntime cache clear"


def _files(path: Path) -> list[Path]:
    return [p for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists()]


def _tables(db: sqlite3.Connection) -> list[str]:
    return [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]


def cache_info() -> CacheInfo:
    """Where the compile cache is, its size on disk (with its journal files) and its entry count; creates nothing."""
    path = cache_path()
    nbytes = sum(p.stat().st_size for p in _files(path))
    entries = 0
    if path.exists():

        def op(db: sqlite3.Connection) -> int:
            return sum(int(db.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0]) for t in _tables(db))

        entries = _run(op)
    return CacheInfo(path, nbytes, entries, _enabled())


def cache_clear() -> str:
    """Delete every entry of the compile cache and shrink its file; returns a line saying what was freed.

    Safe while other threads and processes use the cache: it drops the tables in
    a transaction, so they just miss and compile again.
    """
    path = cache_path()
    if not path.exists():
        return f"compile cache {path}: nothing to clear"
    before = sum(p.stat().st_size for p in _files(path))

    def op(db: sqlite3.Connection) -> int:
        db.execute("BEGIN IMMEDIATE")
        try:
            tables = _tables(db)
            count: int = sum(db.execute(f'SELECT COUNT(*) FROM "{t}"').fetchone()[0] for t in tables)
            for t in tables:
                db.execute(f'DROP TABLE "{t}"')
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise
        db.execute("VACUUM")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return count

    count = _run(op)
    after = sum(p.stat().st_size for p in _files(path))
    return f"compile cache {path}: cleared {count} entries, {max(before - after, 0)} bytes freed"
