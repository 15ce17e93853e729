"""Read/write hazard tracking over byte ranges of a root buffer."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aruntime.engine import Engine, Op


class AccessLog:
    """The in-flight accesses to one root buffer: (start, end, is_write, op).

    A new access conflicts with an in-flight one when their byte ranges overlap
    and at least one of them writes (read-after-write, write-after-read,
    write-after-write). The log stays short: entries of finished ops are
    dropped, and so is every entry that a newer access both covers and is
    ordered after (a write after anything it conflicts with; a read after a
    read already handed to the same engine, which runs in order), since waiting
    for the newer access then implies the older one is done.
    """

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[tuple[int, int, bool, Op]] = []

    def access(self, start: int, end: int, write: bool, op: Op, engine: Engine, deps: list[Op]) -> None:
        """Record that ``op``, bound for ``engine``, accesses [start, end); add the ops it must wait for to ``deps``."""
        live = []
        for entry in self.entries:
            s, e, w, other = entry
            if other.done():
                continue
            if (write or w) and s < end and start < e and other not in deps and other is not op:
                deps.append(other)
            if not (start <= s and e <= end and (write or (not w and other.engine is engine and other.dispatched))):
                live.append(entry)
        live.append((start, end, write, op))
        self.entries = live

    def conflicts_on(self, engine: Engine, start: int, end: int, write: bool) -> bool:
        """Whether an access to [start, end) would have to wait for an in-flight op of ``engine``."""
        return any(
            other.engine is engine and (write or w) and s < end and start < e and not other.done()
            for s, e, w, other in self.entries
        )

    def pending(self) -> list[Op]:
        """The ops still in flight on this buffer."""
        self.entries = [e for e in self.entries if not e[3].done()]
        return [e[3] for e in self.entries]
