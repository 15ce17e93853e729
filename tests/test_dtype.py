"""Tests of aruntime.dtype: interning, vectors, pointers, images, promotion, truncation."""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import itertools
import math
import os
import pickle
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aruntime.dtype import (
    DType,
    ImageDType,
    PtrDType,
    _default_float_from_env,
    _round_float,
    dtypes,
    least_upper_dtype,
    least_upper_float,
    sum_acc_dtype,
    to_dtype,
    truncate,
)

REPO = Path(__file__).resolve().parents[1]

SCALARS = {
    "void": (-1, 0, "void", None),
    "bool": (0, 1, "bool", "?"),
    "int8": (1, 1, "signed char", "b"),
    "uint8": (2, 1, "unsigned char", "B"),
    "int16": (3, 2, "short", "h"),
    "uint16": (4, 2, "unsigned short", "H"),
    "int32": (5, 4, "int", "i"),
    "uint32": (6, 4, "unsigned int", "I"),
    "int64": (7, 8, "long", "q"),
    "uint64": (8, 8, "unsigned long", "Q"),
    "float16": (9, 2, "half", "e"),
    "bfloat16": (10, 2, "__bf16", None),
    "float32": (11, 4, "float", "f"),
    "float64": (12, 8, "double", "d"),
}
ALIASES = {
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "uchar": "uint8",
    "ushort": "uint16",
    "uint": "uint32",
    "ulong": "uint64",
    "char": "int8",
    "short": "int16",
    "int": "int32",
    "long": "int64",
}
LATTICE_SCALARS = [getattr(dtypes, n) for n in SCALARS if n != "void"]
INTS = [dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64, dtypes.uint8, dtypes.uint16, dtypes.uint32]
INTS.append(dtypes.uint64)
CTYPES_INT = {
    dtypes.int8: ctypes.c_int8,
    dtypes.int16: ctypes.c_int16,
    dtypes.int32: ctypes.c_int32,
    dtypes.int64: ctypes.c_int64,
    dtypes.uint8: ctypes.c_uint8,
    dtypes.uint16: ctypes.c_uint16,
    dtypes.uint32: ctypes.c_uint32,
    dtypes.uint64: ctypes.c_uint64,
}

scalar_dtypes = st.sampled_from(LATTICE_SCALARS)


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **env}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=60, check=False
    )


# -------------------- scalars


@pytest.mark.parametrize("name", list(SCALARS))
def test_scalar_fields(name: str) -> None:
    dt = getattr(dtypes, name)
    assert (dt.priority, dt.itemsize, dt.name, dt.fmt) == SCALARS[name]
    assert dt.count == 1 and dt.vcount == 1
    assert dt.scalar() is dt
    if dt.fmt is not None:
        assert struct.calcsize(dt.fmt) == dt.itemsize


@pytest.mark.parametrize(("alias", "name"), list(ALIASES.items()))
def test_aliases_are_the_same_object(alias: str, name: str) -> None:
    assert getattr(dtypes, alias) is getattr(dtypes, name)


def test_groups_and_defaults() -> None:
    assert dtypes.floats == (dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)
    assert dtypes.uints == (dtypes.uint8, dtypes.uint16, dtypes.uint32, dtypes.uint64)
    assert dtypes.sints == (dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64)
    assert set(dtypes.ints) == set(dtypes.uints) | set(dtypes.sints)
    assert len(dtypes.ints) == 8
    assert dtypes.default_int is dtypes.int32
    if not os.environ.get("ARUNTIME_DEFAULT_FLOAT"):
        assert dtypes.default_float is dtypes.float32


@pytest.mark.parametrize(
    ("dt", "text"),
    [
        (dtypes.float32, "dtypes.float"),
        (dtypes.float16, "dtypes.half"),
        (dtypes.float64, "dtypes.double"),
        (dtypes.bfloat16, "dtypes.bfloat16"),
        (dtypes.bool, "dtypes.bool"),
        (dtypes.void, "dtypes.void"),
        (dtypes.int8, "dtypes.char"),
        (dtypes.uint64, "dtypes.ulong"),
        (dtypes.float.vec(4), "dtypes.float.vec(4)"),
        (dtypes.float.ptr(), "dtypes.float.ptr(-1)"),
        (dtypes.float.ptr(16), "dtypes.float.ptr(16)"),
        (dtypes.float.ptr(-1, local=True).vec(4), "dtypes.float.ptr(-1, local=True).vec(4)"),
        (dtypes.half.vec(2).ptr(8), "dtypes.half.vec(2).ptr(8)"),
        (dtypes.imageh((2, 3, 4)), "dtypes.imageh((2, 3, 4))"),
        (dtypes.imagef((8, 4)).vec(4), "dtypes.imagef((8, 4)).vec(4)"),
    ],
)
def test_repr_is_exact_and_evaluates_back(dt: DType, text: str) -> None:
    assert repr(dt) == text
    assert str(dt) == text
    assert eval(text, {"dtypes": dtypes}) is dt


def test_repr_of_unnamed_dtype_shows_fields() -> None:
    odd = DType(50, 3, "odd", None, 1, None)
    assert "odd" in repr(odd) and "priority=50" in repr(odd)


# -------------------- interning


def test_construction_is_interned() -> None:
    assert DType(11, 4, "float", "f", 1, None) is dtypes.float32
    assert DType(priority=11, itemsize=4, name="float", fmt="f", count=1, _scalar=None) is dtypes.float32
    assert DType(50, 3, "odd", None, 1, None) is DType(50, 3, "odd", None, 1, None)
    assert DType(50, 3, "odd", None, 1, None) is not DType(51, 3, "odd", None, 1, None)
    assert dtypes.float.vec(4) is dtypes.float.vec(4)
    assert DType(11, 16, "float4", None, 4, dtypes.float) is dtypes.float.vec(4)
    assert dtypes.int.ptr(8, local=True) is dtypes.int.ptr(8, local=True)
    assert dtypes.int.ptr(8) is not dtypes.int.ptr(9)
    assert dtypes.int.ptr(8) is not dtypes.int.ptr(8, local=True)
    assert dtypes.imageh((2, 3)) is dtypes.imageh([2, 3])
    assert dtypes.imageh((2, 3)) is not dtypes.imagef((2, 3))
    assert dataclasses.replace(dtypes.float.ptr(), v=4) is dtypes.float.ptr().vec(4)


def test_interning_under_threads() -> None:
    results: list[DType] = []

    def build() -> None:
        results.extend(DType(77, 5, "threaded", None, 1, None).vec(3) for _ in range(200))

    threads = [threading.Thread(target=build) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1


ALL_KINDS = [
    dtypes.void,
    dtypes.bool,
    dtypes.bfloat16,
    dtypes.float.vec(4),
    dtypes.uchar.vec(16),
    dtypes.float.ptr(),
    dtypes.int.ptr(32, local=True),
    dtypes.float.ptr(-1, local=True).vec(4),
    dtypes.half.vec(2).ptr(8),
    dtypes.imageh((2, 3, 4)),
    dtypes.imagef((8, 4)).vec(4),
    DType(50, 3, "odd", None, 1, None),
]


@pytest.mark.parametrize("dt", ALL_KINDS, ids=repr)
@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip_keeps_identity(dt: DType, protocol: int) -> None:
    assert pickle.loads(pickle.dumps(dt, protocol=protocol)) is dt
    assert pickle.loads(pickle.dumps({dt: [dt]}, protocol=protocol)) == {dt: [dt]}


@pytest.mark.parametrize("dt", ALL_KINDS, ids=repr)
def test_copy_keeps_identity(dt: DType) -> None:
    assert copy.copy(dt) is dt
    assert copy.deepcopy(dt) is dt


def test_pickle_from_another_process_resolves_to_interned_object() -> None:
    code = (
        "import pickle, sys; from aruntime.dtype import dtypes; "
        "kinds = [dtypes.float.vec(4), dtypes.imageh((2, 2)), dtypes.int.ptr(4)]; "
        "sys.stdout.write(pickle.dumps(kinds).hex())"
    )
    proc = _run_python(code)
    assert proc.returncode == 0, proc.stderr
    got = pickle.loads(bytes.fromhex(proc.stdout))
    assert got[0] is dtypes.float.vec(4)
    assert got[1] is dtypes.imageh((2, 2))
    assert got[2] is dtypes.int.ptr(4)


def test_dtypes_are_frozen_and_hashable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        dtypes.float.itemsize = 8  # type: ignore[misc]
    table = {dt: i for i, dt in enumerate(ALL_KINDS)}
    assert table[DType(11, 16, "float4", None, 4, dtypes.float)] == 3
    assert dtypes.float != dtypes.double
    not_a_dtype: object = "float"
    assert dtypes.float != not_a_dtype


def test_ordering_follows_priority_and_is_total() -> None:
    shuffled = list(reversed(LATTICE_SCALARS))
    assert sorted(shuffled) == LATTICE_SCALARS
    assert dtypes.int8 < dtypes.uint8 <= dtypes.uint8 < dtypes.float64
    assert dtypes.float64 > dtypes.float32 >= dtypes.float32
    kinds = [*ALL_KINDS, *LATTICE_SCALARS]
    for a, b in itertools.product(kinds, repeat=2):
        assert sum([a < b, a is b, b < a]) == 1, (a, b)
    with pytest.raises(TypeError):
        _ = dtypes.float < 3


@pytest.mark.parametrize(
    "bad",
    [
        lambda: DType(1, -1, "x", None, 1, None),
        lambda: DType(1, 1, "", None, 1, None),
        lambda: DType(1, 1, "x", "ff", 1, None),
        lambda: DType(1, 1, "x", None, 0, None),
        lambda: DType(1.5, 1, "x", None, 1, None),  # type: ignore[arg-type]
        lambda: DType(1, 1, "x", None, 1, "float"),  # type: ignore[arg-type]
    ],
)
def test_bad_fields_are_rejected(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        bad()  # type: ignore[operator]


# -------------------- vectors


@pytest.mark.parametrize("dt", LATTICE_SCALARS, ids=repr)
@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_vec_fields(dt: DType, n: int) -> None:
    v = dt.vec(n)
    assert type(v) is DType
    assert (v.priority, v.itemsize, v.name, v.fmt, v.count, v.vcount) == (
        dt.priority,
        dt.itemsize * n,
        f"{dt.name}{n}",
        None,
        n,
        n,
    )
    assert v.scalar() is dt
    assert repr(v) == f"{dt!r}.vec({n})"


def test_vec_special_cases() -> None:
    assert dtypes.float.vec(1) is dtypes.float
    assert dtypes.void.vec(4) is dtypes.void
    assert dtypes.uchar.vec(4).name == "unsigned char4"


def test_vec_errors() -> None:
    with pytest.raises(ValueError, match=r"dtypes\.float\.vec\(4\)"):
        dtypes.float.vec(4).vec(2)
    with pytest.raises(ValueError, match="vector width"):
        dtypes.float.vec(0)
    with pytest.raises(TypeError, match="vector width"):
        dtypes.float.vec(2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="vector width"):
        dtypes.float.vec(True)


# -------------------- pointers


def test_ptr_fields() -> None:
    p = dtypes.float.ptr()
    assert isinstance(p, PtrDType)
    assert (p.base, p.local, p.v, p.size, p.vcount) == (dtypes.float, False, 1, -1, 1)
    assert (p.priority, p.itemsize, p.name, p.fmt, p.count) == (11, 4, "float", "f", 1)
    lp = dtypes.half.ptr(64, local=True)
    assert (lp.base, lp.local, lp.size) == (dtypes.half, True, 64)
    vp = lp.vec(4)
    assert (vp.v, vp.vcount, vp.count, vp.size, vp.local) == (4, 4, 1, 64, True)
    assert vp.scalar() is lp
    assert lp.scalar() is lp
    assert lp.vec(1) is lp
    pv = dtypes.float.vec(4).ptr()
    assert (pv.base, pv.count, pv.vcount) == (dtypes.float.vec(4), 4, 1)
    assert dtypes.void.ptr().base is dtypes.void


def test_ptr_errors() -> None:
    with pytest.raises(TypeError, match=r"pointer to the pointer type dtypes\.float\.ptr\(-1\)"):
        dtypes.float.ptr().ptr()
    with pytest.raises(TypeError, match="pointer"):
        PtrDType(11, 4, "float", "f", 1, None, dtypes.float.ptr())
    with pytest.raises(ValueError, match="already vectorized"):
        dtypes.float.ptr().vec(4).vec(2)
    with pytest.raises(ValueError, match="pointer size"):
        dtypes.float.ptr(-2)
    with pytest.raises(TypeError, match="local"):
        dtypes.float.ptr(local=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="base"):
        PtrDType(11, 4, "float", "f", 1, None, "float")  # type: ignore[arg-type]


# -------------------- images


@pytest.mark.parametrize(("make", "name", "itemsize"), [(dtypes.imageh, "imageh", 2), (dtypes.imagef, "imagef", 4)])
def test_image_types(make: object, name: str, itemsize: int) -> None:
    img = make((4, 8, 4))  # type: ignore[operator]
    assert isinstance(img, ImageDType) and isinstance(img, PtrDType)
    assert (img.name, img.itemsize, img.shape, img.size, img.local, img.v) == (
        name,
        itemsize,
        (4, 8, 4),
        128,
        False,
        1,
    )
    assert img.base is dtypes.float32
    assert img.ptr() is img
    assert img.ptr(16) is img
    assert dtypes.is_float(img) and not dtypes.is_int(img)
    assert img.vec(4).vcount == 4 and img.vec(4).scalar() is img


def test_image_errors() -> None:
    img = dtypes.imagef((2, 2))
    with pytest.raises(ValueError, match="can't be local"):
        img.ptr(local=True)
    with pytest.raises(ValueError, match="can't be local"):
        ImageDType(100, 4, "imagef", "f", 1, None, dtypes.float, True, 1, 4, (2, 2))
    with pytest.raises(ValueError, match="product of its shape"):
        ImageDType(100, 4, "imagef", "f", 1, None, dtypes.float, False, 1, 5, (2, 2))
    with pytest.raises(ValueError, match="empty"):
        dtypes.imageh(())
    with pytest.raises(ValueError, match="dimension"):
        dtypes.imageh((2, 0))
    with pytest.raises(TypeError, match="shape"):
        dtypes.imageh("22")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shape"):
        dtypes.imageh(3)  # type: ignore[arg-type]


# -------------------- predicates / helpers


def test_predicates() -> None:
    for dt in LATTICE_SCALARS:
        for probe in (dt, dt.vec(4)):
            assert dtypes.is_float(probe) == (dt in dtypes.floats)
            assert dtypes.is_int(probe) == (dt in dtypes.ints)
            assert dtypes.is_unsigned(probe) == (dt in dtypes.uints)
    assert not dtypes.is_int(dtypes.bool) and not dtypes.is_float(dtypes.bool)
    assert not dtypes.is_float(dtypes.void)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1.5, dtypes.default_float),
        (True, dtypes.bool),
        (False, dtypes.bool),
        (3, dtypes.default_int),
        ([1, 2], dtypes.default_int),
        ([True, False], dtypes.bool),
        ([True, 2], dtypes.default_int),
        ((1, 2.0), dtypes.default_float),
        ([[1], [2.0, True]], dtypes.default_float),
        ([], dtypes.default_float),
        ((), dtypes.default_float),
    ],
)
def test_from_py(value: object, expected: DType) -> None:
    assert dtypes.from_py(value) is expected


@pytest.mark.parametrize("bad", [{}, {"a": 1}, "1.0", None, 1j, b"x", {1, 2}, [1, "x"]])
def test_from_py_rejects_other_values(bad: object) -> None:
    with pytest.raises(TypeError, match=type(bad if not isinstance(bad, list) else bad[1]).__name__):
        dtypes.from_py(bad)


def test_as_const() -> None:
    assert dtypes.as_const(2.7, dtypes.int32) == 2 and type(dtypes.as_const(2.7, dtypes.int32)) is int
    assert dtypes.as_const(3, dtypes.float16) == 3.0 and type(dtypes.as_const(3, dtypes.float16)) is float
    assert dtypes.as_const(2, dtypes.bool) is True
    assert dtypes.as_const(0.0, dtypes.bool) is False
    assert dtypes.as_const((1.5, 2.5), dtypes.int.vec(2)) == (1, 2)
    assert dtypes.as_const((1, 0, 2), dtypes.bool.vec(3)) == (True, False, True)
    with pytest.raises(ValueError, match="2 elements"):
        dtypes.as_const((1, 2), dtypes.float.vec(4))


@pytest.mark.parametrize(
    ("dt", "lo", "hi"),
    [
        (dtypes.bool, False, True),
        (dtypes.int8, -128, 127),
        (dtypes.uint8, 0, 255),
        (dtypes.int16, -32768, 32767),
        (dtypes.uint16, 0, 65535),
        (dtypes.int32, -(2**31), 2**31 - 1),
        (dtypes.uint32, 0, 2**32 - 1),
        (dtypes.int64, -(2**63), 2**63 - 1),
        (dtypes.uint64, 0, 2**64 - 1),
        (dtypes.float16, -math.inf, math.inf),
        (dtypes.bfloat16, -math.inf, math.inf),
        (dtypes.float32, -math.inf, math.inf),
        (dtypes.float64, -math.inf, math.inf),
        (dtypes.int8.vec(4), -128, 127),
    ],
)
def test_min_max(dt: DType, lo: object, hi: object) -> None:
    assert dtypes.min(dt) == lo and type(dtypes.min(dt)) is type(lo)
    assert dtypes.max(dt) == hi and type(dtypes.max(dt)) is type(hi)
    if dtypes.is_int(dt):
        assert truncate[dt.scalar()](hi) == hi and truncate[dt.scalar()](hi + 1) == lo


@pytest.mark.parametrize("bad", [dtypes.void, dtypes.float.ptr(), dtypes.imagef((2, 2))], ids=repr)
def test_min_max_reject_non_numeric(bad: DType) -> None:
    with pytest.raises(TypeError, match=r"needs a bool, int or float dtype"):
        dtypes.min(bad)
    with pytest.raises(TypeError, match=repr(bad).replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        dtypes.max(bad)


@pytest.mark.parametrize(
    ("dt", "bits", "max_finite", "fmt"),
    [
        (dtypes.float16, (5, 10), 65504.0, "e"),
        (dtypes.bfloat16, (8, 7), 3.3895313892515355e38, None),
        (dtypes.float32, (8, 23), 3.4028234663852886e38, "f"),
        (dtypes.float64, (11, 52), sys.float_info.max, "d"),
    ],
)
def test_finfo(dt: DType, bits: tuple[int, int], max_finite: float, fmt: str | None) -> None:
    assert dtypes.finfo(dt) == bits
    exp, mant = bits
    assert (2 - 2.0**-mant) * 2.0 ** (2 ** (exp - 1) - 1) == max_finite
    assert 1 + exp + mant == 8 * dt.itemsize
    assert truncate[dt](max_finite) == max_finite
    assert truncate[dt](-max_finite) == -max_finite
    if fmt is not None:
        assert struct.unpack(fmt, struct.pack(fmt, max_finite))[0] == max_finite
    assert dtypes.finfo(dt.vec(2)) == bits


@pytest.mark.parametrize("bad", [dtypes.int32, dtypes.bool, dtypes.void, dtypes.imageh((2, 2))], ids=repr)
def test_finfo_rejects_non_floats(bad: DType) -> None:
    with pytest.raises(ValueError, match=r"finfo needs a float dtype, got dtypes\."):
        dtypes.finfo(bad)


def test_fields_table() -> None:
    table = dtypes.fields()
    assert set(table) == set(SCALARS) - {"void"} | set(ALIASES)
    for name, dt in table.items():
        assert getattr(dtypes, name) is dt
    public = {k for k, v in vars(dtypes).items() if isinstance(v, DType)}
    assert public - set(table) == {"void", "default_float", "default_int"}
    table["bogus"] = dtypes.float
    assert "bogus" not in dtypes.fields()


@pytest.mark.parametrize("name", [*SCALARS, *ALIASES])
def test_to_dtype_names(name: str) -> None:
    dt = getattr(dtypes, name)
    assert to_dtype(name) is dt
    assert to_dtype(name.upper()) is dt
    assert to_dtype(dt) is dt


def test_to_dtype_errors() -> None:
    with pytest.raises(ValueError, match="'floaty'"):
        to_dtype("floaty")
    with pytest.raises(ValueError, match="'default_float'"):
        to_dtype("default_float")
    with pytest.raises(TypeError, match="int"):
        to_dtype(3)  # type: ignore[arg-type]
    vec = dtypes.float.vec(2)
    assert to_dtype(vec) is vec


# -------------------- promotion


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (dtypes.int8, dtypes.uint8, dtypes.int16),
        (dtypes.int64, dtypes.uint64, dtypes.float16),
        (dtypes.bool, dtypes.int8, dtypes.int8),
        (dtypes.float16, dtypes.bfloat16, dtypes.float32),
        (dtypes.uint32, dtypes.int32, dtypes.int64),
        (dtypes.bool, dtypes.bool, dtypes.bool),
        (dtypes.bool, dtypes.uint8, dtypes.uint8),
        (dtypes.uint8, dtypes.uint16, dtypes.uint16),
        (dtypes.uint16, dtypes.int16, dtypes.int32),
        (dtypes.uint64, dtypes.int8, dtypes.float16),
        (dtypes.int32, dtypes.float16, dtypes.float16),
        (dtypes.int32, dtypes.bfloat16, dtypes.bfloat16),
        (dtypes.float32, dtypes.float64, dtypes.float64),
        (dtypes.bfloat16, dtypes.float64, dtypes.float64),
        (dtypes.uint64, dtypes.uint32, dtypes.uint64),
    ],
)
def test_promotion_examples(a: DType, b: DType, expected: DType) -> None:
    assert least_upper_dtype(a, b) is expected
    assert least_upper_dtype(b, a) is expected


@pytest.mark.parametrize(
    ("child", "parents"),
    [
        (dtypes.bool, (dtypes.int8, dtypes.uint8)),
        (dtypes.int8, (dtypes.int16,)),
        (dtypes.int16, (dtypes.int32,)),
        (dtypes.int32, (dtypes.int64,)),
        (dtypes.int64, (dtypes.float16, dtypes.bfloat16)),
        (dtypes.uint8, (dtypes.int16, dtypes.uint16)),
        (dtypes.uint16, (dtypes.int32, dtypes.uint32)),
        (dtypes.uint32, (dtypes.int64, dtypes.uint64)),
        (dtypes.uint64, (dtypes.float16, dtypes.bfloat16)),
        (dtypes.float16, (dtypes.float32,)),
        (dtypes.bfloat16, (dtypes.float32,)),
        (dtypes.float32, (dtypes.float64,)),
    ],
)
def test_lattice_edges(child: DType, parents: tuple[DType, ...]) -> None:
    for parent in parents:
        assert least_upper_dtype(child, parent) is parent
    if len(parents) == 2:  # the two parents are incomparable; they meet one level up
        assert least_upper_dtype(*parents) not in parents


def test_n_ary_promotion() -> None:
    assert least_upper_dtype(dtypes.float) is dtypes.float
    assert least_upper_dtype(dtypes.int8, dtypes.uint8, dtypes.bool) is dtypes.int16
    # the n-ary form takes the common ancestors of all inputs at once
    assert least_upper_dtype(dtypes.int64, dtypes.uint64, dtypes.bfloat16) is dtypes.bfloat16


def test_promotion_of_images_and_vectors() -> None:
    img, img2 = dtypes.imageh((2, 2)), dtypes.imagef((4, 4))
    assert least_upper_dtype(dtypes.float, img, img2) is img
    assert least_upper_dtype(img2, dtypes.int8, img) is img2
    assert least_upper_dtype(dtypes.int8.vec(4), dtypes.uint8.vec(4)) is dtypes.int16.vec(4)
    p = dtypes.float.ptr()
    assert least_upper_dtype(p, p) is p
    assert least_upper_dtype(dtypes.void, dtypes.void) is dtypes.void


def test_promotion_errors() -> None:
    with pytest.raises(ValueError, match="at least one"):
        least_upper_dtype()
    with pytest.raises(ValueError, match=r"dtypes\.void is not in the promotion lattice"):
        least_upper_dtype(dtypes.void, dtypes.int)
    with pytest.raises(ValueError, match="pointer"):
        least_upper_dtype(dtypes.float.ptr(), dtypes.float)
    with pytest.raises(ValueError, match="vector widths"):
        least_upper_dtype(dtypes.float.vec(2), dtypes.float)
    with pytest.raises(TypeError, match="str"):
        least_upper_dtype(dtypes.float, "float")  # type: ignore[arg-type]


def _above(a: DType, b: DType) -> bool:
    """b is a (non-strict) ancestor of a."""
    return least_upper_dtype(a, b) is b


@given(st.lists(scalar_dtypes, min_size=1, max_size=5), st.randoms(use_true_random=False))
def test_lub_is_permutation_invariant_upper_bound(ds: list[DType], rnd: object) -> None:
    lub = least_upper_dtype(*ds)
    shuffled = list(ds)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert least_upper_dtype(*shuffled) is lub
    assert least_upper_dtype(*ds, *ds) is lub
    for d in ds:
        assert _above(d, lub)
        assert lub.priority >= d.priority
    # least: every common upper bound of the inputs is at least the result in the dtype order
    for u in LATTICE_SCALARS:
        if all(_above(d, u) for d in ds):
            assert lub <= u


@given(scalar_dtypes, scalar_dtypes)
def test_lub_commutative_and_idempotent(a: DType, b: DType) -> None:
    assert least_upper_dtype(a, b) is least_upper_dtype(b, a)
    assert least_upper_dtype(a, a) is a
    assert least_upper_dtype(a, dtypes.float64) is dtypes.float64
    assert least_upper_dtype(a, dtypes.bool) is a
    if _above(a, b) and _above(b, a):
        assert a is b


@pytest.mark.parametrize(
    ("dt", "expected"),
    [
        (dtypes.bool, dtypes.default_float),
        (dtypes.int8, dtypes.default_float),
        (dtypes.uint64, dtypes.default_float),
        (dtypes.float16, dtypes.float16),
        (dtypes.bfloat16, dtypes.bfloat16),
        (dtypes.float64, dtypes.float64),
        (dtypes.int32.vec(4), dtypes.default_float.vec(4)),
        (dtypes.half.vec(2), dtypes.half.vec(2)),
    ],
)
def test_least_upper_float(dt: DType, expected: DType) -> None:
    assert least_upper_float(dt) is expected


@pytest.mark.parametrize(
    ("dt", "expected"),
    [
        (dtypes.bool, dtypes.int32),
        (dtypes.int8, dtypes.int32),
        (dtypes.int16, dtypes.int32),
        (dtypes.int32, dtypes.int32),
        (dtypes.int64, dtypes.int64),
        (dtypes.uint8, dtypes.uint32),
        (dtypes.uint16, dtypes.uint32),
        (dtypes.uint32, dtypes.uint32),
        (dtypes.uint64, dtypes.uint64),
        (dtypes.float16, dtypes.float32),
        (dtypes.bfloat16, dtypes.float32),
        (dtypes.float32, dtypes.float32),
        (dtypes.float64, dtypes.float64),
        (dtypes.uint8.vec(4), dtypes.uint32.vec(4)),
    ],
)
def test_sum_acc_dtype(dt: DType, expected: DType) -> None:
    assert sum_acc_dtype(dt) is expected


# -------------------- truncate


def test_truncate_covers_every_scalar_but_void() -> None:
    assert set(truncate) == set(LATTICE_SCALARS)
    with pytest.raises(TypeError):
        truncate[dtypes.float] = float  # type: ignore[index]


@pytest.mark.parametrize(
    ("dt", "value", "expected"),
    [
        (dtypes.uint8, 256, 0),
        (dtypes.uint8, -1, 255),
        (dtypes.uint8, 3.9, 3),
        (dtypes.int8, 128, -128),
        (dtypes.int8, 255, -1),
        (dtypes.int8, -129, 127),
        (dtypes.int8, -3.9, -3),
        (dtypes.int16, 40000, 40000 - 65536),
        (dtypes.uint16, -2, 65534),
        (dtypes.int32, 2**31, -(2**31)),
        (dtypes.uint32, -1, 2**32 - 1),
        (dtypes.int64, 2**63, -(2**63)),
        (dtypes.int64, 2**64 + 5, 5),
        (dtypes.uint64, -1, 2**64 - 1),
        (dtypes.int32, True, 1),
        (dtypes.bool, 0, False),
        (dtypes.bool, 2, True),
        (dtypes.bool, 0.0, False),
        (dtypes.bool, -0.5, True),
        (dtypes.float16, 65504.0, 65504.0),
        (dtypes.float16, 65519.0, 65504.0),
        (dtypes.float16, 65520.0, math.inf),
        (dtypes.float16, 1e6, math.inf),
        (dtypes.float16, -1e6, -math.inf),
        (dtypes.float16, 1 + 2**-11, 1.0),
        (dtypes.float16, 2**-25, 0.0),
        (dtypes.float16, 2**-24, 2**-24),
        (dtypes.float16, 10**400, math.inf),
        (dtypes.float32, 0.1, 0.10000000149011612),
        (dtypes.float32, 1e39, math.inf),
        (dtypes.float32, -1e39, -math.inf),
        (dtypes.float32, 3, 3.0),
        (dtypes.bfloat16, 1 + 2**-8, 1.0),
        (dtypes.bfloat16, 1 + 3 * 2**-8, 1 + 2**-6),
        (dtypes.bfloat16, 1e39, math.inf),
        (dtypes.bfloat16, 3.1415926, 3.140625),
        (dtypes.bfloat16, 2**-133, 2**-133),
        (dtypes.bfloat16, 2**-135, 0.0),
        (dtypes.float64, 0.1, 0.1),
        (dtypes.float64, 10**400, math.inf),
        (dtypes.float64, -(10**400), -math.inf),
    ],
)
def test_truncate_examples(dt: DType, value: object, expected: object) -> None:
    got = truncate[dt](value)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64], ids=repr)
def test_truncate_floats_keep_nan_inf_and_signed_zero(dt: DType) -> None:
    assert math.isnan(truncate[dt](math.nan))
    assert truncate[dt](math.inf) == math.inf
    assert truncate[dt](-math.inf) == -math.inf
    assert math.copysign(1.0, truncate[dt](-0.0)) == -1.0


@pytest.mark.parametrize("dt", INTS, ids=repr)
def test_truncate_int_errors(dt: DType) -> None:
    with pytest.raises(ValueError, match=r"non-finite inf .*dtypes\."):
        truncate[dt](math.inf)
    with pytest.raises(ValueError, match="nan"):
        truncate[dt](math.nan)
    with pytest.raises(TypeError, match="'3'"):
        truncate[dt]("3")
    with pytest.raises(TypeError, match="complex"):
        truncate[dt](1j)


@given(st.sampled_from(INTS), st.integers(min_value=-(2**70), max_value=2**70))
def test_truncate_ints_match_c(dt: DType, x: int) -> None:
    got = truncate[dt](x)
    assert got == CTYPES_INT[dt](x).value
    assert dtypes.min(dt) <= got <= dtypes.max(dt)
    assert (got - x) % (1 << (8 * dt.itemsize)) == 0


@given(st.floats(allow_nan=False))
def test_truncate_float32_matches_c(x: float) -> None:
    assert truncate[dtypes.float32](x) == ctypes.c_float(x).value


@given(st.floats(allow_nan=False))
def test_truncate_float16_matches_struct_or_overflows(x: float) -> None:
    got = truncate[dtypes.float16](x)
    try:
        expected = struct.unpack("e", struct.pack("e", x))[0]
    except OverflowError:
        expected = math.copysign(math.inf, x)
    assert got == expected
    assert math.isinf(got) or abs(got) <= 65504


@given(st.floats(allow_nan=False))
def test_generic_rounding_agrees_with_struct(x: float) -> None:
    for fmt, mant, min_exp, max_finite in (("e", 10, -14, 65504.0), ("f", 23, -126, 3.4028234663852886e38)):
        try:
            expected = struct.unpack(fmt, struct.pack(fmt, x))[0]
        except OverflowError:
            expected = math.copysign(math.inf, x)
        got = _round_float(x, mant, min_exp, max_finite)
        assert got == expected and math.copysign(1, got) == math.copysign(1, expected)


@given(st.floats(width=32, allow_nan=False))
def test_truncate_bfloat16_matches_bit_rounding_of_float32(x: float) -> None:
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    expected = struct.unpack("<f", struct.pack("<I", rounded & 0xFFFFFFFF))[0]
    assert truncate[dtypes.bfloat16](x) == expected


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_truncate_is_idempotent(x: float) -> None:
    for dt in (dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64, dtypes.int8, dtypes.uint32):
        once = truncate[dt](x)
        if math.isfinite(once):
            assert truncate[dt](once) == once


# -------------------- ARUNTIME_DEFAULT_FLOAT


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", dtypes.float32),
        ("float16", dtypes.float16),
        ("HALF", dtypes.float16),
        ("bfloat16", dtypes.bfloat16),
        ("double", dtypes.float64),
        (" float32 ", dtypes.float32),
    ],
)
def test_default_float_setting(value: str, expected: DType) -> None:
    assert _default_float_from_env(value) is expected


@pytest.mark.parametrize(("value", "message"), [("int32", "not a float type"), ("floaty", "not a dtype name")])
def test_default_float_setting_errors(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"ARUNTIME_DEFAULT_FLOAT='{value}'.*{message}"):
        _default_float_from_env(value)


def test_default_float_env_at_import() -> None:
    code = (
        "from aruntime.dtype import dtypes, least_upper_float; "
        "print(repr(dtypes.default_float), repr(least_upper_float(dtypes.int)), repr(dtypes.from_py(1.0)))"
    )
    proc = _run_python(code, ARUNTIME_DEFAULT_FLOAT="HALF")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["dtypes.half", "dtypes.half", "dtypes.half"]
    bad = _run_python("import aruntime.dtype", ARUNTIME_DEFAULT_FLOAT="uint8")
    assert bad.returncode != 0
    assert "ValueError" in bad.stderr and "ARUNTIME_DEFAULT_FLOAT='uint8'" in bad.stderr
