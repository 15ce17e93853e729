"""Data types: interned scalar, vector, pointer and image dtypes, and the promotion lattice.

Every dtype is interned: building one with the same fields returns the one shared
object, and unpickling yields that object again, so dtypes compare and hash by
identity. ``dtypes`` is the namespace of the built-in types and of helpers that
classify, convert and bound them; ``least_upper_dtype`` promotes along a JAX-style
lattice; ``truncate`` maps each scalar dtype to a function that wraps a Python value
to that dtype's range the way a C cast does.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import math
import operator
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, TypeAlias

from aruntime.helpers import getenv

__all__ = [
    "ConstType",
    "DType",
    "ImageDType",
    "PtrDType",
    "dtypes",
    "least_upper_dtype",
    "least_upper_float",
    "sum_acc_dtype",
    "to_dtype",
    "truncate",
]

ConstType: TypeAlias = float | int | bool
"""A Python value a dtype's constants take: ``float``, ``int`` or ``bool``."""


class _Interned(type):
    """Metaclass that makes construction return one shared instance per distinct set of fields."""

    _cache: ClassVar[dict[tuple[Any, ...], Any]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        fresh = super().__call__(*args, **kwargs)
        key = (cls, *fresh._field_values())
        with _Interned._lock:
            return _Interned._cache.setdefault(key, fresh)


def _check_int(what: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True, eq=False, repr=False)
class DType(metaclass=_Interned):
    """A data type: scalar (``count == 1``) or a vector of ``count`` scalars.

    Fields: ``priority`` (its rank for promotion), ``itemsize`` (bytes), ``name``
    (the C spelling, e.g. ``"unsigned char"``), ``fmt`` (the ``struct`` format
    character, or ``None``), ``count`` (vector width) and ``_scalar`` (the element
    type of a vector, ``None`` for a scalar). Instances are interned, so ``==`` is
    identity and equal dtypes hash alike. Dtypes are totally ordered, lowest
    priority first.
    """

    priority: int
    itemsize: int
    name: str
    fmt: str | None
    count: int
    _scalar: DType | None

    def __post_init__(self) -> None:
        _check_int("DType priority", self.priority, -(2**31))
        _check_int("DType itemsize", self.itemsize, 0)
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"DType name must be a non-empty str, got {self.name!r}")
        if self.fmt is not None and not (isinstance(self.fmt, str) and len(self.fmt) == 1):
            raise TypeError(f"DType fmt must be one struct format character or None, got {self.fmt!r}")
        _check_int("DType count", self.count, 1)
        if self._scalar is not None and not isinstance(self._scalar, DType):
            raise TypeError(f"DType scalar type must be a DType or None, got {self._scalar!r}")

    @functools.cached_property
    def _order(self) -> tuple[Any, ...]:
        return self._sort_key()

    def _field_values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def _sort_key(self) -> tuple[Any, ...]:
        scalar_key = self._scalar._sort_key() if self._scalar is not None else ()
        return (self.priority, self.itemsize, self.name, self.fmt or "", self.count, scalar_key)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle as a constructor call, so unpickling returns the interned instance."""
        return (type(self), self._field_values())

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, DType):
            return NotImplemented
        result: bool = self._order < other._order
        return result

    def __le__(self, other: object) -> bool:
        if not isinstance(other, DType):
            return NotImplemented
        result: bool = self is other or self._order < other._order
        return result

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, DType):
            return NotImplemented
        result: bool = other._order < self._order
        return result

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, DType):
            return NotImplemented
        result: bool = self is other or other._order < self._order
        return result

    def __repr__(self) -> str:
        if self._scalar is not None and self.count > 1:
            return f"{self._scalar!r}.vec({self.count})"
        known = _REPR_NAMES.get(self)
        if known is not None:
            return f"dtypes.{known}"
        return (
            f"DType(priority={self.priority}, itemsize={self.itemsize}, name={self.name!r}, "
            f"fmt={self.fmt!r}, count={self.count}, scalar={self._scalar!r})"
        )

    @property
    def vcount(self) -> int:
        """The vector width: ``count`` here, the pointer's ``v`` on a ``PtrDType``."""
        return self.count

    def vec(self, n: int) -> DType:
        """The vector of ``n`` of this scalar type (named ``name + str(n)``).

        ``n == 1`` and ``void`` return the type itself. Vectorizing a vector raises
        ``ValueError``; ``n`` must be a positive int.
        """
        _check_int("vector width", n, 1)
        if self.count != 1:
            raise ValueError(f"can't vectorize {self!r} to width {n}: vec works only on scalar dtypes")
        if n == 1 or self is dtypes.void:
            return self
        return DType(self.priority, self.itemsize * n, f"{self.name}{n}", None, n, self)

    def scalar(self) -> DType:
        """The element type of a vector; a scalar returns itself."""
        return self._scalar if self._scalar is not None else self

    def ptr(self, size: int = -1, local: bool = False) -> PtrDType:
        """A pointer to this type: ``size`` elements (``-1`` = unbounded), in local memory if ``local``."""
        return PtrDType(self.priority, self.itemsize, self.name, self.fmt, self.count, None, self, local, 1, size)


@dataclass(frozen=True, eq=False, repr=False)
class PtrDType(DType):
    """A pointer to ``base``: local or global, vector width ``v``, ``size`` elements (-1 = unbounded).

    priority, itemsize, name, fmt and count are the pointee's. A pointer can be
    vectorized once with ``vec``; ``scalar()`` drops that width again. A pointer to
    a pointer is an error.
    """

    base: DType
    local: bool = False
    v: int = 1
    size: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.base, DType):
            raise TypeError(f"pointer base must be a DType, got {self.base!r}")
        if isinstance(self.base, PtrDType):
            raise TypeError(f"can't make a pointer to the pointer type {self.base!r}")
        if not isinstance(self.local, bool):
            raise TypeError(f"pointer local flag must be a bool, got {self.local!r}")
        _check_int("pointer vector width v", self.v, 1)
        _check_int("pointer size", self.size, -1)
        super().__post_init__()

    def _sort_key(self) -> tuple[Any, ...]:
        return (*super()._sort_key(), self.base._sort_key(), self.local, self.v, self.size)

    def __repr__(self) -> str:
        local = ", local=True" if self.local else ""
        return f"{self.base!r}.ptr({self.size}{local})" + (f".vec({self.v})" if self.v != 1 else "")

    @property
    def vcount(self) -> int:
        """The pointer's vector width ``v``."""
        return self.v

    def vec(self, n: int) -> PtrDType:
        """This pointer with vector width ``n``; a pointer already vectorized raises ``ValueError``."""
        _check_int("vector width", n, 1)
        if self.v != 1:
            raise ValueError(f"can't vectorize {self!r} to width {n}: the pointer is already vectorized")
        if n == 1:
            return self
        return dataclasses.replace(self, v=n)

    def scalar(self) -> PtrDType:
        """This pointer with vector width 1."""
        return self if self.v == 1 else dataclasses.replace(self, v=1)

    def ptr(self, size: int = -1, local: bool = False) -> PtrDType:
        """Always raises ``TypeError``: a pointer to a pointer is not a dtype."""
        raise TypeError(f"can't make a pointer to the pointer type {self!r}")


@dataclass(frozen=True, eq=False, repr=False)
class ImageDType(PtrDType):
    """An image: a global pointer type with a ``shape``; its ``size`` is the product of the shape.

    Build one with ``dtypes.imageh(shape)`` (half storage) or ``dtypes.imagef(shape)``
    (float storage). ``ptr()`` returns the image itself; images can't be local.
    """

    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or not self.shape:
            raise TypeError(f"image shape must be a non-empty tuple of ints, got {self.shape!r}")
        for dim in self.shape:
            _check_int(f"image shape {self.shape!r} dimension", dim, 1)
        if self.local:
            raise ValueError(f"images can't be local: {self.name}{self.shape}")
        if self.size != math.prod(self.shape):
            raise ValueError(f"image size {self.size} is not the product of its shape {self.shape!r}")
        super().__post_init__()

    def _sort_key(self) -> tuple[Any, ...]:
        return (*super()._sort_key(), self.shape)

    def __repr__(self) -> str:
        return f"dtypes.{self.name}({self.shape})" + (f".vec({self.v})" if self.v != 1 else "")

    def ptr(self, size: int = -1, local: bool = False) -> PtrDType:
        """The image itself (an image already is a pointer type); ``local=True`` raises ``ValueError``."""
        if local:
            raise ValueError(f"images can't be local: {self!r}")
        return self


def _make_image(name: str, itemsize: int, fmt: str, shape: Iterable[int]) -> ImageDType:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise TypeError(f"{name} shape must be a sequence of ints, got {shape!r}")
    dims = tuple(shape)
    if not dims:
        raise ValueError(f"{name} shape must not be empty")
    for dim in dims:
        _check_int(f"{name} shape {dims!r} dimension", dim, 1)
    return ImageDType(100, itemsize, name, fmt, 1, None, dtypes.float32, False, 1, math.prod(dims), dims)


class dtypes:
    """The built-in dtypes, their aliases and groups, and helpers on dtypes.

    Scalars: ``void, bool, int8, uint8, int16, uint16, int32, uint32, int64, uint64,
    float16, bfloat16, float32, float64``. Aliases: ``half, float, double`` and
    ``char, short, int, long`` (signed) and ``uchar, ushort, uint, ulong``.
    """

    void: ClassVar[DType] = DType(-1, 0, "void", None, 1, None)
    bool: ClassVar[DType] = DType(0, 1, "bool", "?", 1, None)
    int8: ClassVar[DType] = DType(1, 1, "signed char", "b", 1, None)
    uint8: ClassVar[DType] = DType(2, 1, "unsigned char", "B", 1, None)
    int16: ClassVar[DType] = DType(3, 2, "short", "h", 1, None)
    uint16: ClassVar[DType] = DType(4, 2, "unsigned short", "H", 1, None)
    int32: ClassVar[DType] = DType(5, 4, "int", "i", 1, None)
    uint32: ClassVar[DType] = DType(6, 4, "unsigned int", "I", 1, None)
    int64: ClassVar[DType] = DType(7, 8, "long", "q", 1, None)
    uint64: ClassVar[DType] = DType(8, 8, "unsigned long", "Q", 1, None)
    float16: ClassVar[DType] = DType(9, 2, "half", "e", 1, None)
    bfloat16: ClassVar[DType] = DType(10, 2, "__bf16", None, 1, None)
    float32: ClassVar[DType] = DType(11, 4, "float", "f", 1, None)
    float64: ClassVar[DType] = DType(12, 8, "double", "d", 1, None)

    # aliases (C spellings); the repr of a scalar uses these where one exists
    half: ClassVar[DType] = float16
    float: ClassVar[DType] = float32
    double: ClassVar[DType] = float64
    uchar: ClassVar[DType] = uint8
    ushort: ClassVar[DType] = uint16
    uint: ClassVar[DType] = uint32
    ulong: ClassVar[DType] = uint64
    char: ClassVar[DType] = int8
    short: ClassVar[DType] = int16
    int: ClassVar[DType] = int32
    long: ClassVar[DType] = int64

    floats: ClassVar[tuple[DType, ...]] = (float16, bfloat16, float32, float64)
    uints: ClassVar[tuple[DType, ...]] = (uint8, uint16, uint32, uint64)
    sints: ClassVar[tuple[DType, ...]] = (int8, int16, int32, int64)
    ints: ClassVar[tuple[DType, ...]] = uints + sints

    default_float: ClassVar[DType] = float32
    """float32, or the float type the environment variable ARUNTIME_DEFAULT_FLOAT names (read at import)."""
    default_int: ClassVar[DType] = int32

    @staticmethod
    def is_float(x: DType) -> builtins.bool:
        """True for float scalars and vectors, and for image types."""
        return x.scalar() in dtypes.floats or isinstance(x, ImageDType)

    @staticmethod
    def is_int(x: DType) -> builtins.bool:
        """True for signed and unsigned integer scalars and vectors (not bool)."""
        return x.scalar() in dtypes.ints

    @staticmethod
    def is_unsigned(x: DType) -> builtins.bool:
        """True for unsigned integer scalars and vectors."""
        return x.scalar() in dtypes.uints

    @staticmethod
    def is_storable(x: object) -> builtins.bool:
        """Whether a buffer can hold elements of ``x``: a scalar or vector dtype with a size (not void, not a
        pointer, not an image; an image's layout goes in the buffer's spec)."""
        return isinstance(x, DType) and not isinstance(x, (PtrDType, ImageDType)) and x.itemsize > 0

    @staticmethod
    def from_py(x: Any) -> DType:
        """The dtype of a Python value.

        float -> ``default_float``, bool -> ``bool``, int -> ``default_int``; a list or
        tuple -> the greatest of its elements' dtypes (empty -> ``default_float``).
        Anything else raises ``TypeError``.
        """
        if isinstance(x, builtins.float):
            return dtypes.default_float
        if isinstance(x, builtins.bool):
            return dtypes.bool
        if isinstance(x, builtins.int):
            return dtypes.default_int
        if isinstance(x, (list, tuple)):
            return builtins.max((dtypes.from_py(e) for e in x), default=dtypes.default_float)
        raise TypeError(f"can't infer a dtype from a {type(x).__name__} value: {x!r}")

    @staticmethod
    def as_const(val: ConstType | tuple[ConstType, ...], dtype: DType) -> ConstType | tuple[ConstType, ...]:
        """``val`` as the Python type of ``dtype``'s constants: int, float or bool.

        A tuple converts element-wise and must have ``dtype.count`` elements.
        """
        if isinstance(val, tuple):
            if len(val) != dtype.count:
                raise ValueError(f"constant {val!r} has {len(val)} elements but {dtype!r} has {dtype.count}")
            return tuple(_as_scalar_const(x, dtype) for x in val)
        return _as_scalar_const(val, dtype)

    @staticmethod
    def min(dtype: DType) -> ConstType:
        """The least value of ``dtype`` (of its scalar type): an int, ``-inf`` or ``False``."""
        s = _plain_scalar(dtype, "min")
        if s is dtypes.bool:
            return False
        if s in dtypes.uints:
            return 0
        if s in dtypes.sints:
            return -(1 << (8 * s.itemsize - 1))
        return -math.inf

    @staticmethod
    def max(dtype: DType) -> ConstType:
        """The greatest value of ``dtype`` (of its scalar type): an int, ``inf`` or ``True``."""
        s = _plain_scalar(dtype, "max")
        if s is dtypes.bool:
            return True
        if s in dtypes.uints:
            return (1 << (8 * s.itemsize)) - 1
        if s in dtypes.sints:
            return (1 << (8 * s.itemsize - 1)) - 1
        return math.inf

    @staticmethod
    def finfo(dtype: DType) -> tuple[builtins.int, builtins.int]:
        """(exponent bits, mantissa bits) of a float dtype; any other dtype raises ``ValueError``."""
        bits = _FINFO.get(dtype.scalar())
        if bits is None:
            raise ValueError(f"finfo needs a float dtype, got {dtype!r}")
        return bits

    @staticmethod
    def fields() -> dict[str, DType]:
        """A fresh name -> dtype table of every public dtype and alias (not void, not the defaults)."""
        return dict(_FIELDS)

    @staticmethod
    def imageh(shape: Iterable[builtins.int]) -> ImageDType:
        """An image of half-precision storage with ``shape``."""
        return _make_image("imageh", 2, "e", shape)

    @staticmethod
    def imagef(shape: Iterable[builtins.int]) -> ImageDType:
        """An image of single-precision storage with ``shape``."""
        return _make_image("imagef", 4, "f", shape)


def _plain_scalar(dtype: DType, what: str) -> DType:
    s = dtype.scalar()
    if isinstance(s, PtrDType) or not (s is dtypes.bool or s in dtypes.ints or s in dtypes.floats):
        raise TypeError(f"dtypes.{what} needs a bool, int or float dtype, got {dtype!r}")
    return s


def _as_scalar_const(x: Any, dtype: DType) -> ConstType:
    if dtypes.is_int(dtype):
        return int(x)
    if dtypes.is_float(dtype):
        return float(x)
    return bool(x)


_FINFO: dict[DType, tuple[int, int]] = {
    dtypes.float16: (5, 10),
    dtypes.bfloat16: (8, 7),
    dtypes.float32: (8, 23),
    dtypes.float64: (11, 52),
}

_FIELDS: Mapping[str, DType] = MappingProxyType(
    {k: v for k, v in vars(dtypes).items() if isinstance(v, DType) and k != "void" and not k.startswith("default")}
)

# repr name of each scalar: an alias where there is one (aliases come after the canonical names)
_REPR_NAMES: dict[DType, str] = {v: k for k, v in _FIELDS.items()}
_REPR_NAMES[dtypes.void] = "void"


def _default_float_from_env(value: str) -> DType:
    """The dtype the ARUNTIME_DEFAULT_FLOAT setting ``value`` names (case-insensitive); empty means float32."""
    if value == "":
        return dtypes.float32
    dt = _FIELDS.get(value.strip().lower())
    floats = ", ".join(k for k, v in _FIELDS.items() if v in dtypes.floats)
    if dt is None:
        raise ValueError(f"ARUNTIME_DEFAULT_FLOAT={value!r} is not a dtype name; use one of: {floats}")
    if not dtypes.is_float(dt):
        raise ValueError(
            f"ARUNTIME_DEFAULT_FLOAT={value!r} names {dt!r}, which is not a float type; use one of: {floats}"
        )
    return dt


dtypes.default_float = _default_float_from_env(getenv("DEFAULT_FLOAT", ""))


# ----------------------------------------------------------------------------------------------------
# promotion

_PROMO_LATTICE: dict[DType, tuple[DType, ...]] = {
    dtypes.bool: (dtypes.int8, dtypes.uint8),
    dtypes.int8: (dtypes.int16,),
    dtypes.int16: (dtypes.int32,),
    dtypes.int32: (dtypes.int64,),
    dtypes.int64: (dtypes.float16, dtypes.bfloat16),
    dtypes.uint8: (dtypes.int16, dtypes.uint16),
    dtypes.uint16: (dtypes.int32, dtypes.uint32),
    dtypes.uint32: (dtypes.int64, dtypes.uint64),
    dtypes.uint64: (dtypes.float16, dtypes.bfloat16),
    dtypes.float16: (dtypes.float32,),
    dtypes.bfloat16: (dtypes.float32,),
    dtypes.float32: (dtypes.float64,),
    dtypes.float64: (),
}


def _upward_closure(dt: DType) -> frozenset[DType]:
    seen = {dt}
    todo = [dt]
    while todo:
        for parent in _PROMO_LATTICE[todo.pop()]:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return frozenset(seen)


_ANCESTORS: dict[DType, frozenset[DType]] = {dt: _upward_closure(dt) for dt in _PROMO_LATTICE}


def least_upper_dtype(*ds: DType) -> DType:
    """The least dtype every one of ``ds`` promotes to.

    That is the lowest (by dtype ordering) common ancestor in the promotion lattice,
    or the first image type among the inputs if there is one. Vectors of one width
    promote their scalars and keep the width. Identical inputs return themselves.
    Other mixes (pointers, void, vectors of different widths) raise ``ValueError``.
    """
    if not ds:
        raise ValueError("least_upper_dtype needs at least one dtype")
    for d in ds:
        if not isinstance(d, DType):
            raise TypeError(f"least_upper_dtype takes DTypes, got {type(d).__name__} {d!r}")
    for d in ds:
        if isinstance(d, ImageDType):
            return d
    if all(d is ds[0] for d in ds):
        return ds[0]
    if any(isinstance(d, PtrDType) for d in ds):
        raise ValueError(f"can't promote pointer types: {ds!r}")
    width = ds[0].count
    if any(d.count != width for d in ds):
        raise ValueError(f"can't promote dtypes of different vector widths: {ds!r}")
    scalars = [d.scalar() for d in ds]
    for s in scalars:
        if s not in _ANCESTORS:
            raise ValueError(f"{s!r} is not in the promotion lattice (promoting {ds!r})")
    common = frozenset.intersection(*(_ANCESTORS[s] for s in scalars))
    return min(common).vec(width)


def _keep_width(fn: Callable[[DType], DType], dt: DType) -> DType:
    if not isinstance(dt, PtrDType) and dt.count > 1:
        return fn(dt.scalar()).vec(dt.count)
    return fn(dt)


def least_upper_float(dt: DType) -> DType:
    """``dt`` if it is a float type, else the least float it promotes to with ``default_float``."""
    if dtypes.is_float(dt):
        return dt
    return _keep_width(lambda s: least_upper_dtype(s, dtypes.default_float), dt)


def sum_acc_dtype(dt: DType) -> DType:
    """The accumulator dtype for a sum over ``dt``.

    Unsigned -> at least uint32; signed int or bool -> at least int32; otherwise
    at least float32. A vector keeps its width.
    """

    def acc(s: DType) -> DType:
        if dtypes.is_unsigned(s):
            return least_upper_dtype(s, dtypes.uint32)
        if dtypes.is_int(s) or s is dtypes.bool:
            return least_upper_dtype(s, dtypes.int32)
        return least_upper_dtype(s, dtypes.float32)

    return _keep_width(acc, dt)


def to_dtype(x: str | DType) -> DType:
    """A dtype itself, or the dtype a name in ``dtypes.fields()`` (or ``"void"``) stands for.

    Names match exactly or case-insensitively. An unknown name raises ``ValueError``.
    """
    if isinstance(x, DType):
        return x
    if not isinstance(x, str):
        raise TypeError(f"to_dtype takes a dtype name or a DType, got {type(x).__name__} {x!r}")
    if x.lower() == "void":
        return dtypes.void
    found = _FIELDS.get(x, _FIELDS.get(x.lower()))
    if found is None:
        raise ValueError(f"unknown dtype name {x!r}; known names: {', '.join(_FIELDS)}, void")
    return found


# ----------------------------------------------------------------------------------------------------
# truncation to a dtype's range, as a C cast does


def _to_int(x: Any, dt_name: str) -> int:
    if isinstance(x, int):
        return int(x)
    if isinstance(x, (str, bytes)):
        raise TypeError(f"can't truncate {type(x).__name__} {x!r} to {dt_name}")
    if hasattr(x, "__index__"):
        return operator.index(x)
    try:
        f = float(x)
    except (TypeError, ValueError):
        raise TypeError(f"can't truncate {type(x).__name__} {x!r} to {dt_name}") from None
    if not math.isfinite(f):
        raise ValueError(f"can't truncate non-finite {f!r} to the integer type {dt_name}")
    return int(f)


def _to_float(x: Any, dt_name: str) -> float:
    if isinstance(x, (str, bytes)):
        raise TypeError(f"can't truncate {type(x).__name__} {x!r} to {dt_name}")
    try:
        return float(x)
    except OverflowError:  # an int beyond the double range
        return math.inf if x > 0 else -math.inf
    except (TypeError, ValueError):
        raise TypeError(f"can't truncate {type(x).__name__} {x!r} to {dt_name}") from None


def _int_truncator(bits: int, signed: bool, dt_name: str) -> Callable[[Any], ConstType]:
    mask = (1 << bits) - 1
    sign_bit = 1 << (bits - 1)

    def wrap(x: Any) -> ConstType:
        v = _to_int(x, dt_name) & mask
        return v - (1 << bits) if signed and v & sign_bit else v

    return wrap


def _struct_truncator(fmt: str, dt_name: str) -> Callable[[Any], ConstType]:
    def cast(x: Any) -> ConstType:
        f = _to_float(x, dt_name)
        try:
            out: float = struct.unpack(fmt, struct.pack(fmt, f))[0]
        except OverflowError:  # rounds past the largest finite value
            return math.copysign(math.inf, f)
        return out

    return cast


def _round_float(f: float, mantissa_bits: int, min_normal_exp: int, max_finite: float) -> float:
    """``f`` rounded to nearest-even in a binary float format; overflow gives +-inf."""
    if f == 0 or not math.isfinite(f):
        return f
    if abs(f) >= 2 * max_finite:  # far past the rounding boundary; also keeps the scaling below in range
        return math.copysign(math.inf, f)
    _, e = math.frexp(f)  # |f| in [2**(e-1), 2**e)
    quantum_exp = max(e - 1 - mantissa_bits, min_normal_exp - mantissa_bits)
    out = math.ldexp(round(math.ldexp(f, -quantum_exp)), quantum_exp)
    if abs(out) > max_finite:
        return math.copysign(math.inf, f)
    return math.copysign(out, f)


def _bf16_truncate(x: Any) -> ConstType:
    return _round_float(_to_float(x, "bfloat16"), 7, -126, (2 - 2**-7) * 2.0**127)


def _float64_truncate(x: Any) -> ConstType:
    return _to_float(x, "float64")


truncate: Mapping[DType, Callable[[Any], ConstType]] = MappingProxyType(
    {
        dtypes.bool: bool,
        dtypes.float16: _struct_truncator("e", "float16"),
        dtypes.bfloat16: _bf16_truncate,
        dtypes.float32: _struct_truncator("f", "float32"),
        dtypes.float64: _float64_truncate,
        **{dt: _int_truncator(8 * dt.itemsize, dt in dtypes.sints, repr(dt)) for dt in dtypes.ints},
    }
)
"""dtype -> a function wrapping a Python value to that dtype's range as a C cast does.

Integers wrap (two's complement); floats round to nearest-even and overflow to
+-inf; bool is truthiness.
"""
