"""The C submission path (``aruntime/engine/native/submit.c``) and the Python path it stands in for.

An eager op on a native engine is submitted in C where the extension builds; the Python path stays the reference
and the fallback. These tests hold both to the same hazards, commands and results, check that the C path lets go
of what its ops hold, and that a process without the extension (switched off, or unable to build it) runs on the
Python path.
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import subprocess
import sys
import textwrap
from typing import Any

import anyio
import pytest

from aruntime import BaseDevice, Device, DeviceError, Op, dtypes
from aruntime.engine import NativeEngine
from aruntime.engine.native import submit
from tests.kernels import ADD_ONE, SPINS, closed_gate

pytestmark = pytest.mark.anyio


def _fast(dev: BaseDevice) -> bool:
    """Whether ``dev``'s queues submit in C; skips the test (with the reason) where they cannot."""
    if not isinstance(dev.compute, NativeEngine):
        pytest.skip("the Python engine has no C submission path")
    if dev.compute.fast_submit is None:
        pytest.skip(f"the C submission path is unavailable: {submit.unavailable}")
    return True


def _python_path(dev: BaseDevice) -> None:
    """Make ``dev``'s queues submit on the Python path from now on."""
    for engine in dev.engines:
        engine.fast_submit = None


async def _program(dev: BaseDevice, seed: int) -> tuple[list[tuple[Any, ...]], list[bytes]]:
    """Submit a seeded random program of eager copy-ins, kernels and copy-outs behind a closed gate that holds
    both queues (nothing finishes while it is submitted); return each op's shape as submitted (queue, value past
    the gate's, the indices of its dependencies and inputs, its command kinds) and the bytes the buffers end with."""
    gate, flag = await closed_gate(dev)
    add = await dev.compile(ADD_ONE, outs=(0,))
    big = dev.inline_copy_max + 4  # too big to ride on the compute queue
    started = await dev.allocate(big // 4, dtypes.int32)  # its copy-out holds the copy queue behind the gate
    bufs = [await dev.allocate(big) for _ in range(4)]
    rng = random.Random(seed)
    ops: list[Op] = [dev.launch(gate, started, vals=(flag.handle, SPINS)), dev.copyout(started)]
    base = {op.engine.kind: op.value for op in ops if op.engine is not None}  # values from the gate's on
    shapes: list[tuple[Any, ...]] = []
    for _ in range(60):
        buf = rng.choice(bufs)
        pick = rng.randrange(4)
        if pick == 0:
            op = dev.copyin(buf, bytes([rng.randrange(256)]) * big)
        elif pick == 1:
            op = dev.launch(add, buf, vals=(big,))
        elif pick == 2:
            op = dev.copyout(buf)
        else:
            op = dev.copyout(buf, into=bytearray(big))
        index = {id(o): i for i, o in enumerate(ops)}
        assert op.engine is not None
        shapes.append(
            (
                op.engine.kind,
                op.value - base[op.engine.kind],
                sorted(index[id(d)] for d in op.deps),
                sorted(index[id(d)] for d in op.inputs),
                [cmd[0] for cmd in op.cmds or ()],
            )
        )
        ops.append(op)
    assert not ops[1].done()  # the gate held everything
    ctypes.c_int32.from_address(flag.handle).value = 1
    with anyio.fail_after(30):
        for op in ops:
            await op
    return shapes, [bytes(await dev.copyout(buf)) for buf in bufs]


async def test_the_c_and_python_paths_submit_alike() -> None:
    """The same random programs on two devices, one on each path: the same queues, values, dependencies,
    inputs, commands (a wait per other queue depended on) and results."""
    fast, slow = Device["CPU:5"], Device["CPU:6"]
    _fast(fast)
    _python_path(slow)
    for seed in range(3):
        assert await _program(fast, seed) == await _program(slow, seed)


async def test_the_c_path_lets_go_of_what_its_ops_hold() -> None:
    """Sources, destinations and results are referenced while their ops run and released once they have."""
    dev = Device["CPU"]
    _fast(dev)
    buf = await dev.allocate(64)
    data, into = bytes(range(64)), bytearray(64)
    before = sys.getrefcount(data), sys.getrefcount(into)
    for _ in range(1_000):
        dev.copyin(buf, data)
        dev.copyout(buf, into=into)
    await dev.synchronize()
    await dev.copyin(buf, bytes(64))  # the hazard log's last entries now name ops that hold neither
    gc.collect()
    assert (sys.getrefcount(data), sys.getrefcount(into)) == before
    assert into == data


@pytest.mark.parametrize("path", ["c", "python"])
async def test_a_closed_queue_refuses_an_op_on_either_path(path: str) -> None:
    """An op for a queue that no longer takes work is refused before the hazard logs learn of it."""
    dev = Device["CPU:7"]
    if path == "c":
        _fast(dev)
    else:
        _python_path(dev)
    add = await dev.compile(ADD_ONE, outs=(0,))
    buf = await dev.allocate(8)
    await dev.copyin(buf, bytes(8))
    entries = list(buf.log.entries)
    dev.compute.close()
    try:
        with pytest.raises(DeviceError, match="closed"):
            dev.launch(add, buf, vals=(8,))
        assert buf.log.entries == entries
    finally:
        await dev.aclose()


def _run(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter with ``env`` added; its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


PIPELINE = """
import anyio
from aruntime import Device
from aruntime.engine.native import submit
ADD = "#include <stdint.h>\\nvoid kernel(uint8_t *b, int64_t n) { for (int64_t i = 0; i < n; i++) b[i] += 1; }"
async def main():
    dev = Device["CPU"]
    prog = await dev.compile(ADD, outs=(0,))
    buf = await dev.allocate(1 << 17)
    outs = []
    for i in range(50):
        dev.copyin(buf, bytes([i]) * (1 << 17))
        dev.launch(prog, buf, vals=(1 << 17,))
        outs.append(dev.copyout(buf))
    assert [bytes(await o) for o in outs] == [bytes([i + 1]) * (1 << 17) for i in range(50)]
    print(dev.compute.fast_submit is None, submit.unavailable)
anyio.run(main)
"""


def test_switched_off_the_python_path_serves_every_op() -> None:
    assert _run(PIPELINE, ARUNTIME_FAST_SUBMIT="0", ARUNTIME_ENGINE="native").split() == [
        "True",
        "ARUNTIME_FAST_SUBMIT=0",
    ]


def test_without_python_headers_the_python_path_serves_every_op() -> None:
    """A build that fails (no ``Python.h``) leaves the reason in ``unavailable``; ops run as before."""
    code = "import aruntime.engine.native.submit as s; s._include = lambda: '/nonexistent'\n" + PIPELINE
    out = _run(code, ARUNTIME_DISABLE_COMPILER_CACHE="1", ARUNTIME_ENGINE="native")
    assert out.startswith("True the C submission path could not be built")
    assert "Python.h" in out


def test_a_bad_switch_is_refused_with_its_name() -> None:
    code = "from aruntime import Device\ntry:\n    Device['CPU']\nexcept ValueError as e:\n    print(e)\n"
    assert "ARUNTIME_FAST_SUBMIT" in _run(code, ARUNTIME_FAST_SUBMIT="2", ARUNTIME_ENGINE="native")
