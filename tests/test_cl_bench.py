"""The CL benchmarks (benchmarks/bench_cl.py) run end to end in quick mode and print well-formed rows."""

from __future__ import annotations

import pytest

from aruntime import Device, DeviceError
from tests.bench_rows import quick_rows

try:
    Device["CL:1"]
except DeviceError as exc:
    pytest.skip(f"the CL benchmarks need CL and CL:1: {exc}", allow_module_level=True)


def test_cl_benchmarks_quick_json() -> None:
    rows = quick_rows("cl_roundtrip", "cl_copies", "cl_pipeline")
    names = {row["name"] for row in rows}
    assert {"cl_roundtrip", "cl_copyin_1MiB", "cl_copyout_8MiB", "cl_pipeline_speedup"} <= names
    assert {row["loop"] for row in rows} == {"asyncio", "uvloop", "trio"}
