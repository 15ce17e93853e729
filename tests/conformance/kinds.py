"""The device kinds the conformance suite runs on, how to open two devices of each, and their kernels.

``ARUNTIME_KINDS`` (comma-separated, e.g. ``ARUNTIME_KINDS=MYKIND``) names the kinds to test; by default
every built-in kind. A third-party backend gives the suite its kernels as a dict ``conformance_kernels``
(name -> source, see :data:`KERNELS` for the names and what each does) in the module that defines its
device class.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass

import pytest

from aruntime import BaseDevice, Device

BUILTIN = ("CPU", "NULL", "SIM", "DISK", "CL", "CUDA")
KINDS = tuple(k.strip().upper() for k in os.environ.get("ARUNTIME_KINDS", ",".join(BUILTIN)).split(",") if k.strip())

_C = "#include <stdint.h>\n"
_CL_FP64 = "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n"
_CU = 'extern "C" __global__ '

KERNELS: dict[str, dict[str, str]] = {
    "CPU": {
        "add_one": _C + "void add_one(uint8_t *b, int64_t n) { for (int64_t i = 0; i < n; i++) b[i] += 1; }",
        "scale": _C + "void scale(float *out, const float *x, int64_t n, double s) {"
        " for (int64_t i = 0; i < n; i++) out[i] = x[i] * (float)s; }",
        "scalars": _C + "void scalars(int64_t *ints, double *floats, int64_t a, double b, int64_t c) {"
        " ints[0] = a; ints[1] = c; floats[0] = b; }",
        "affine": _C + "void affine(uint8_t *b, int64_t n, int64_t a, int64_t c) {"
        " for (int64_t i = 0; i < n; i++) b[i] = (uint8_t)(b[i] * a + c); }",
        "accumulate": _C + "void accumulate(uint8_t *o, const uint8_t *x, int64_t n) {"
        " for (int64_t i = 0; i < n; i++) o[i] = (uint8_t)(o[i] + x[i]); }",
    },
    "CL": {
        "add_one": "__kernel void add_one(__global uchar *b, long n) { for (long i = 0; i < n; i++) b[i] += 1; }",
        "scale": _CL_FP64 + "__kernel void scale(__global float *out, __global const float *x, long n, double s) {"
        " for (long i = 0; i < n; i++) out[i] = x[i] * (float)s; }",
        "scalars": _CL_FP64 + "__kernel void scalars(__global long *ints, __global double *floats, long a,"
        " double b, long c) { ints[0] = a; ints[1] = c; floats[0] = b; }",
        "affine": "__kernel void affine(__global uchar *b, long n, long a, long c) {"
        " for (long i = 0; i < n; i++) b[i] = (uchar)(b[i] * a + c); }",
        "accumulate": "__kernel void accumulate(__global uchar *o, __global const uchar *x, long n) {"
        " for (long i = 0; i < n; i++) o[i] = (uchar)(o[i] + x[i]); }",
    },
    "CUDA": {
        "add_one": _CU + "void add_one(unsigned char *b, long long n) { for (long long i = 0; i < n; i++) b[i] += 1; }",
        "scale": _CU + "void scale(float *out, const float *x, long long n, double s) {"
        " for (long long i = 0; i < n; i++) out[i] = x[i] * (float)s; }",
        "scalars": _CU + "void scalars(long long *ints, double *floats, long long a, double b, long long c) {"
        " ints[0] = a; ints[1] = c; floats[0] = b; }",
        "affine": _CU + "void affine(unsigned char *b, long long n, long long a, long long c) {"
        " for (long long i = 0; i < n; i++) b[i] = (unsigned char)(b[i] * a + c); }",
        "accumulate": _CU + "void accumulate(unsigned char *o, const unsigned char *x, long long n) {"
        " for (long long i = 0; i < n; i++) o[i] = (unsigned char)(o[i] + x[i]); }",
    },
}
"""Equivalent kernels per kind, each named like its entry and run as one thread (scalars: ints, then floats):

* ``add_one(uint8 *b, int n)``: ``b[i] += 1``
* ``scale(float *out, const float *x, int n, float s)``: ``out[i] = x[i] * s``
* ``scalars(int64 *ints, double *floats, int a, float b, int c)``: ``ints = {a, c}; floats = {b}``
* ``affine(uint8 *b, int n, int a, int c)``: ``b[i] = b[i] * a + c``
* ``accumulate(uint8 *o, const uint8 *x, int n)``: ``o[i] += x[i]`` in index order
"""
KERNELS["NULL"] = KERNELS["CPU"]  # NULL accepts any source and runs nothing
KERNELS["SIM"] = KERNELS["CPU"]  # SIM kernels are CPU kernels that take modelled time


@dataclass(frozen=True)
class Kind:
    """Two opened devices of one kind, and what the kind can do."""

    name: str
    dev: BaseDevice
    other: BaseDevice | None  # a second device of the kind, when one opens
    other_reason: str  # why there is none
    moves_data: bool  # False for NULL: its ops do nothing
    kernels: dict[str, str] | None  # None: it runs no kernels
    unit: int  # the byte alignment of a view passed to a kernel

    def need_kernels(self) -> dict[str, str]:
        """The kernel table, or a skip naming why the kind has none."""
        if not self.moves_data:
            pytest.skip(f"{self.name} runs kernels as no-ops: nothing to check")
        if self.kernels is None:
            pytest.skip(f"{self.name} runs no kernels")
        return self.kernels

    def need_data(self) -> None:
        """Skip unless the kind's ops really move data."""
        if not self.moves_data:
            pytest.skip(f"{self.name} moves no data: its copies and kernels do nothing")

    def need_other(self) -> BaseDevice:
        """The second device, or a skip naming why it did not open."""
        if self.other is None:
            pytest.skip(f"no second {self.name} device: {self.other_reason}")
        return self.other


_DISK_DIR = tempfile.mkdtemp(prefix="aruntime-conformance-")
atexit.register(shutil.rmtree, _DISK_DIR, ignore_errors=True)  # the DISK files go with the test process
NAMES = {
    "CPU": ("CPU:30", "CPU:31"),  # devices no other test uses: their counters are the suite's alone
    "NULL": ("NULL:30", "NULL:31"),
    "SIM": ("SIM:30", "SIM:31"),
    "DISK": (f"DISK:{_DISK_DIR}/a.bin", f"DISK:{_DISK_DIR}/b.bin"),
}


def _kernels(dev: BaseDevice) -> dict[str, str] | None:
    if dev.file_backed or dev.compiler is None:
        return None
    table = KERNELS.get(dev.kind) or getattr(sys.modules[type(dev).__module__], "conformance_kernels", None)
    if table is None:
        pytest.skip(f"{dev.kind} runs kernels, but neither the suite nor its backend module has conformance_kernels")
    return table


_opened: dict[str, Kind | str] = {}


def open_kind(name: str) -> Kind:
    """The :class:`Kind` of ``name``, opened once per session; a skip with the reason when it does not open."""
    if name not in _opened:
        first, second = NAMES.get(name, (name, f"{name}:1"))
        try:
            dev = Device[first]
        except Exception as exc:
            _opened[name] = f"{name} does not open here: {exc}"
        else:
            try:
                other: BaseDevice | None = Device[second]
                reason = ""
            except Exception as exc:
                other, reason = None, f"{second} does not open: {exc}"
            unit = int(getattr(dev, "view_alignment", 1))
            _opened[name] = Kind(name, dev, other, reason, name != "NULL", _kernels(dev), unit)
    found = _opened[name]
    if isinstance(found, str):
        pytest.skip(found)
    return found
