"""FP8 formats, dtype names and layouts: the vocabulary shared by every path.

Dtypes are passed around by name (``"bfloat16"``, ``"float8_e4m3fn"`` ...), the spelling both
``torch`` and ``jax``/``numpy`` use, so this module imports neither framework.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fp8Format:
    name: str          # "e4m3" / "e5m2": the fp8_format= spelling
    dtype: str         # the typed-cache dtype name
    exp_bits: int
    man_bits: int
    max_value: float   # largest finite value; writes saturate to it
    max_code: int      # its byte (positive)
    nan_code: int      # the byte every NaN is written as (cvt.rn.satfinite's, pinned by a GPU test)

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def reciprocal_max(self) -> float:
        """``RN(1 / max_value)`` in fp32 (numpy's fp32 division is IEEE): the fast path's
        constant for ``amax / max_value``."""
        return float(np.float32(1) / np.float32(self.max_value))

    @property
    def subnormal_unit(self) -> float:
        """The value of the smallest subnormal (code 0x01)."""
        return 2.0 ** (1 - self.bias - self.man_bits)

    @property
    def has_inf(self) -> bool:
        """e5m2 keeps IEEE infinities (magnitude 0x7C) and NaNs above them; e4m3fn has no inf and
        one NaN magnitude, 0x7F."""
        return self.max_code < 0x7C

    @property
    def inf_magnitude(self) -> int:
        """The magnitude byte of inf (e5m2); every larger magnitude is NaN. e4m3fn: 0x7F (NaN)."""
        return ((1 << self.exp_bits) - 1) << self.man_bits if self.has_inf else 0x7F


E4M3 = Fp8Format("e4m3", "float8_e4m3fn", 4, 3, 448.0, 0x7E, 0x7F)
E5M2 = Fp8Format("e5m2", "float8_e5m2", 5, 2, 57344.0, 0x7B, 0x7F)
FORMATS = {f.name: f for f in (E4M3, E5M2)}
FORMAT_OF_DTYPE = {f.dtype: f for f in (E4M3, E5M2)}


def resolve_format(cache_dtype: str, fp8_format: str | None) -> Fp8Format:
    """The format of a cache: its own dtype's, or ``fp8_format`` (default e4m3) for uint8."""
    return FORMAT_OF_DTYPE.get(cache_dtype) or FORMATS[fp8_format or "e4m3"]


INPUT_DTYPES = ("bfloat16", "float16", "float32")
OUTPUT_DTYPES = INPUT_DTYPES
CACHE_DTYPES = ("float8_e4m3fn", "float8_e5m2", "uint8")
SLOT_DTYPES = ("int32", "int64")

# Dequantized NaNs are written as one canonical quiet NaN per output dtype, so that the GPU
# (whose multiply returns 0x7FFFFFFF), the interpreter and XLA all give the same bits.
CANONICAL_NAN_BITS = {"bfloat16": 0x7FC0, "float16": 0x7E00, "float32": 0x7FC00000}

# Dynamic scales (docs/SPEC.md, "Dynamic scales"): the smallest scale, 1e-6 rounded to fp32. Every
# path takes it from here, as this exact fp32 value.
DYNAMIC_SCALE_FLOOR = struct.unpack("<f", struct.pack("<f", 1e-6))[0]
