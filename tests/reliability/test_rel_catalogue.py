"""The bad-input catalogue: every row of ``catalogue.ROWS`` is a test, on every loop, and the table in
docs/reliability.md is exactly the one the rows render."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from aruntime import Buffer, Device, dtypes
from tests.reliability.catalogue import DOC, ROWS, SCALE, Ctx, Row, documented, render


async def _make(workdir: Path) -> Ctx:
    cpu, null = Device["CPU"], Device["NULL"]
    closed = Device["CPU:29"]
    closed_buf = await closed.allocate(8)
    await closed.aclose()
    freed = await cpu.allocate(16, dtypes.float32)
    await cpu.free(freed)
    return Ctx(
        cpu=cpu,
        null=null,
        disk=Device[f"DISK:{workdir}/catalogue.bin"],
        closed=closed,
        closed_buf=closed_buf,
        prog=await cpu.compile(SCALE, outs=(0,)),
        buf=await cpu.allocate(16, dtypes.float32),
        freed=freed,
        unallocated=Buffer("CPU", 4, dtypes.float32),
        nullbuf=await null.allocate(16, dtypes.float32),
        workdir=workdir,
    )


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ctx]:
    made = anyio.run(_make, tmp_path_factory.mktemp("catalogue"))
    yield made
    Device[made.closed.name].close()


@pytest.mark.anyio
@pytest.mark.parametrize("row", ROWS, ids=[f"{r.entry}: {r.bad}" for r in ROWS])
async def test_bad_input_gives_its_error(row: Row, ctx: Ctx) -> None:
    with anyio.fail_after(30), pytest.raises(row.error, match=re.escape(row.match)):
        result = row.run(ctx)
        if inspect.isawaitable(result):
            await result
    assert bytes(await ctx.cpu.copyout(ctx.buf)) is not None  # the device still works after the refusal


def test_the_documented_catalogue_is_the_tested_one() -> None:
    assert documented() == render(), "docs/reliability.md is out of date: run python tests/reliability/catalogue.py"


def test_the_suite_table_counts_the_rows() -> None:
    assert f"every row of the table above ({len(ROWS)})" in DOC.read_text()


def test_every_row_is_distinct() -> None:
    keys = [(r.entry, r.bad) for r in ROWS]
    assert len(keys) == len(set(keys))
