"""``aruntime check``: open every known device kind and run ``[1, 2, 3] * 2`` on it."""

from __future__ import annotations

import array
import os
import tempfile
from dataclasses import dataclass

import anyio

from aruntime.device import Device
from aruntime.dtype import dtypes
from aruntime.engine import native
from aruntime.errors import DeviceError
from aruntime.memory import Buffer

DOUBLE_SOURCES = {
    "CPU": "#include <stdint.h>\n"
    "void kernel(int32_t *out, const int32_t *x) { for (int i = 0; i < 3; i++) out[i] = x[i] * 2; }\n",
    "CL": "__kernel void twice(__global int *out, __global const int *x) {"
    " for (int i = 0; i < 3; i++) out[i] = x[i] * 2; }",
    "CUDA": 'extern "C" __global__ void kernel(int *out, const int *x) {'
    " for (int i = 0; i < 3; i++) out[i] = x[i] * 2; }",
}
"""The kernel ``out = x * 2`` over three int32s, in each kind's kernel language."""
DOUBLE_SOURCES["SIM"] = DOUBLE_SOURCES["CPU"]  # SIM kernels are CPU kernels


@dataclass(frozen=True)
class KindResult:
    """What ``check`` found for one device kind; ``kernel`` is None where the kind runs no check kernel."""

    kind: str
    is_default: bool
    opened: bool | None
    """Whether the kind opened (None: not tried, it opens only with an argument)."""
    kernel: bool | None
    reason: str = ""
    engine: str = ""
    """Which engine runs the kind's queues (``native``, ``python`` or the backend's own), when it opened."""

    @property
    def open_mark(self) -> str:
        """``PASS``, ``FAIL``, or ``n/a`` for a kind that opens only with an argument."""
        return "n/a" if self.opened is None else "PASS" if self.opened else "FAIL"

    @property
    def kernel_mark(self) -> str:
        """``PASS``, ``FAIL``, or ``n/a`` for a kind that runs no kernels (or none ``check`` knows)."""
        return "n/a" if self.kernel is None else "PASS" if self.kernel else "FAIL"


async def _double(kind: str) -> list[int]:
    dev = Device[kind]
    prog = await dev.compile(DOUBLE_SOURCES[kind], outs=(0,))
    x = await dev.allocate(3, dtypes.int32)
    out = await dev.allocate(3, dtypes.int32)
    try:
        dev.copyin(x, array.array("i", [1, 2, 3]))
        dev.launch(prog, out, x)
        return list(array.array("i", bytes(await dev.copyout(out))))
    finally:
        await dev.free(x)
        await dev.free(out)


def _open_file_backed(kind: str) -> str:
    """Open a file-backed kind on a temporary file and store a few bytes in it; the engine it runs on."""
    with tempfile.TemporaryDirectory(prefix="aruntime-check-") as tmp:
        dev = Device[f"{kind}:{os.path.join(tmp, 'check.bin')}"]
        try:
            buf = Buffer(dev.name, 16).allocate()
            buf.copyin(memoryview(bytes(range(16))))
            if bytes(buf.as_buffer()) != bytes(range(16)):
                raise RuntimeError("the bytes stored did not read back")
            buf.deallocate()
            return dev.engine_kind
        finally:
            dev.close()


def check_kind(kind: str, default: str | None) -> KindResult:
    """Open ``kind`` and run the doubling kernel on it."""
    is_default = kind == default
    try:
        cls = Device.backend(kind)
        if cls.file_backed:
            engine = _open_file_backed(kind)
            return KindResult(kind, is_default, True, None, "file-backed: stores data, runs no kernels", engine)
        try:
            cls.check_name(kind)
        except DeviceError as exc:  # a kind opened only with an argument (RAY:<host>/<device>): nothing to try
            return KindResult(kind, is_default, None, None, f"opens only with an argument: {exc}")
        dev = Device[kind]
    except Exception as exc:
        return KindResult(kind, is_default, False, False, f"open failed: {exc}")
    if kind not in DOUBLE_SOURCES:
        what = (type(dev).__doc__ or "").strip().splitlines()[0:1]
        reason = " ".join(["no check kernel for this kind.", *what])
        return KindResult(kind, is_default, True, None, reason, dev.engine_kind)
    try:
        got = anyio.run(_double, kind)
    except Exception as exc:
        return KindResult(kind, is_default, True, False, f"{type(exc).__name__}: {exc}", dev.engine_kind)
    if got != [2, 4, 6]:
        return KindResult(kind, is_default, True, False, f"[1, 2, 3] * 2 gave {got}", dev.engine_kind)
    return KindResult(kind, is_default, True, True, engine=dev.engine_kind)


def run_check() -> int:
    """Print PASS, FAIL or n/a for every kind; exit status 1 when the default device fails."""
    try:
        default: str | None = Device.DEFAULT
    except Exception as exc:
        print(f"no default device: {exc}")
        default = None
    results = [check_kind(kind, default) for kind in sorted(Device.kinds())]
    why = "" if native.unavailable is None else f" ({native.unavailable})"
    print(f"engine: {native.engine_name()}{why}")
    for r in results:
        mark = " (default)" if r.is_default else ""
        print(
            f"{r.kind}{mark}: open {r.open_mark}, kernel {r.kernel_mark}"
            + (f" - {r.reason}" if r.reason else "")
            + (f" [{r.engine} engine]" if r.engine else "")
        )
    ok = default is not None and any(r.is_default and r.kernel for r in results)
    return 0 if ok else 1
