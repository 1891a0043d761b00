"""Parse and format byte sizes the way people write them ("512MB", "1.5GiB", "2G")."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.types import TFTensor

# SI suffixes are decimal and IEC suffixes binary, as their standards say. A bare letter ("2G", "512M") is binary,
# as in docker, ulimit and free: that is what people mean when they size a container.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in `text`; raises TfmemUsageError naming the accepted forms."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise TfmemUsageError(
            f"cannot read the size {text!r}: write a number and a unit, such as 512MB, 1.5GiB or 2G "
            "(MB/GB are decimal, MiB/GiB and a bare M/G are binary)"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise TfmemUsageError(f"the size {text!r} is zero: give a positive size such as 512MB")
    return int(value)


def format_bytes(n: float | int | None) -> str:
    """Human-readable binary size: 0 B, 812 B, 3.4 KiB, 1.25 GiB; signed values keep their sign."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(n)} B"
            return f"{sign}{n:.3g} {unit}" if n < 100 else f"{sign}{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def dtype_size(dtype: TFTensor | str) -> int:
    """Bytes per element of a TensorFlow, Keras or numpy dtype (or its name); 4 when it is not one we know."""
    name = str(getattr(dtype, "name", dtype))
    for key, size in (
        ("float64", 8),
        ("int64", 8),
        ("complex128", 16),
        ("complex64", 8),
        ("float16", 2),
        ("bfloat16", 2),
        ("int16", 2),
        ("uint16", 2),
        ("int8", 1),
        ("uint8", 1),
        ("bool", 1),
    ):
        if key in name:
            return size
    return 4


def variable_bytes(variables: Iterable[Any]) -> int:
    """Bytes of the variables' (or tensors') values: elements times the dtype's size; unknown shapes count 0."""
    total = 0
    for v in variables:
        try:
            total += int(math.prod(int(d) for d in v.shape)) * dtype_size(v.dtype)
        except (TypeError, ValueError):
            continue
    return total
