"""Data types: names, classes and their numpy equivalents.

cuvil spells dtypes as numpy does ("float32", "int64", "bool", ...).  float16 is
a storage type: values are held in float32 while computing and rounded when
stored or cast.
"""

from __future__ import annotations

import numpy as np

from cuvil.errors import DTypeError

FLOATS = ("float16", "float32", "float64")
SIGNED = ("int8", "int16", "int32", "int64")
UNSIGNED = ("uint8", "uint16", "uint32", "uint64")
INTS = SIGNED + UNSIGNED
ALL = FLOATS + INTS + ("bool",)

_BITS = {
    "float16": 16, "float32": 32, "float64": 64, "bool": 8,
    "int8": 8, "int16": 16, "int32": 32, "int64": 64,
    "uint8": 8, "uint16": 16, "uint32": 32, "uint64": 64,
}


def canonical(dtype: object) -> str:
    """Return cuvil's name for ``dtype`` (a string, numpy dtype or type)."""
    if isinstance(dtype, str) and dtype in ALL:
        return dtype
    try:
        name = np.dtype(dtype).name  # type: ignore[call-overload]
    except TypeError as exc:
        raise DTypeError(f"unknown dtype {dtype!r}; supported: {', '.join(ALL)}") from exc
    if name not in ALL:
        raise DTypeError(f"unsupported dtype {name!r}; supported: {', '.join(ALL)}")
    return name


def is_float(dtype: str) -> bool:
    return dtype in FLOATS


def is_int(dtype: str) -> bool:
    return dtype in INTS


def is_signed(dtype: str) -> bool:
    return dtype in SIGNED


def is_bool(dtype: str) -> bool:
    return dtype == "bool"


def bits(dtype: str) -> int:
    return _BITS[dtype]


def nbytes(dtype: str) -> int:
    return _BITS[dtype] // 8


def to_numpy(dtype: str) -> np.dtype:
    return np.dtype(dtype)


# ONNX's spelling of each dtype in a value's type, "tensor(float)" (what onnxruntime's NodeArg.type says)
ONNX_TYPE_NAMES = {"float32": "float", "float64": "double", "float16": "float16", "bool": "bool", "int8": "int8",
                   "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8", "uint16": "uint16",
                   "uint32": "uint32", "uint64": "uint64"}
