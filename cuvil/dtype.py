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


# ONNX's TensorProto element type code of each dtype (Cast's "to", a value's elem_type)
ONNX_CODES = {"float32": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6, "int64": 7, "bool": 9,
              "float16": 10, "float64": 11, "uint32": 12, "uint64": 13}
_OF_ONNX_CODE = {code: name for name, code in ONNX_CODES.items()}


def from_onnx_code(code: int, what: str) -> str:
    """cuvil's dtype for an ONNX TensorProto element type code (``what``: where it was read, for the error)."""
    if code not in _OF_ONNX_CODE:
        try:
            from onnx import TensorProto

            name = TensorProto.DataType.Name(code)
        except (ImportError, ValueError):
            name = str(code)
        raise DTypeError(f"{what}: element type {name} is not supported; cuvil supports "
                         f"{', '.join(sorted(ONNX_CODES))}")
    return _OF_ONNX_CODE[code]


# ONNX's spelling of each dtype in a value's type, "tensor(float)" (what onnxruntime's NodeArg.type says)
ONNX_TYPE_NAMES = {"float32": "float", "float64": "double", "float16": "float16", "bool": "bool", "int8": "int8",
                   "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8", "uint16": "uint16",
                   "uint32": "uint32", "uint64": "uint64"}
