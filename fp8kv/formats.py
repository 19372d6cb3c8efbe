"""Cache formats as data, dtype names and the constants every path shares.

A format is one row of :data:`FORMATS`: what its codes are (bits per code, how many share a byte,
exponent and mantissa bits, the largest value and its code, the code written for NaN) and how it
is scaled (``block_size`` elements per stored block scale, 0 for none, and the format of those
block scales). Kernels receive the row's
``id`` as the ``FORMAT`` constexpr and dispatch on it in :mod:`fp8kv.ops.codec`; the reference
(:mod:`fp8kv.reference`) and the jnp path read the same row. Adding a format is one row here, its
encode/decode branch in the codec module and its reference (README, "Adding a format").

Dtypes are passed around by name (``"bfloat16"``, ``"float8_e4m3fn"`` ...), the spelling both
``torch`` and ``jax``/``numpy`` use, so this module imports neither framework.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Format:
    """One cache format: its codes and its scaling."""

    name: str            # the spelling of the format argument ("e4m3", "e5m2")
    id: int              # the FORMAT constexpr of the kernels
    dtype: str | None    # the typed-cache dtype name (None: stored in uint8 only)
    code_bits: int       # bits per code: 8 or 4
    exp_bits: int
    man_bits: int
    max_value: float     # largest finite value; writes saturate to it
    max_code: int        # its code (positive)
    nan_code: int        # the code every NaN is written as
    block_size: int = 0  # elements per stored block scale (0: no block scales)
    block_scale: str | None = None   # the format (a FORMATS name) of the block scales

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.code_bits

    @property
    def sign_bit(self) -> int:
        return 1 << (self.code_bits - 1)

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
        """The value of the smallest subnormal (code 1)."""
        return 2.0 ** (1 - self.bias - self.man_bits)

    @property
    def has_inf(self) -> bool:
        """Whether the all-ones exponent holds IEEE infinities (e5m2). e4m3fn has no inf and one
        NaN magnitude, 0x7F."""
        return self.max_code < (((1 << self.exp_bits) - 1) << self.man_bits)

    @property
    def magnitudes(self) -> tuple[float, ...]:
        """The value of each magnitude code ``0 .. max_code`` (subnormals, then normals)."""
        step = 1 << self.man_bits
        return tuple(c * self.subnormal_unit if c < step else
                     2.0 ** ((c >> self.man_bits) - self.bias) * (1 + (c % step) / step)
                     for c in range(self.max_code + 1))

    @property
    def inf_magnitude(self) -> int:
        """The magnitude code of inf (e5m2); every larger magnitude is NaN. e4m3fn: 0x7F (NaN)."""
        return ((1 << self.exp_bits) - 1) << self.man_bits if self.has_inf else self.sign_bit - 1


E4M3 = Format("e4m3", 0, "float8_e4m3fn", 8, 4, 3, 448.0, 0x7E, 0x7F)
E5M2 = Format("e5m2", 1, "float8_e5m2", 8, 5, 2, 57344.0, 0x7B, 0x7F)
# NVFP4 (docs/SPEC.md section 13): E2M1 codes, two per uint8 (element 2i in the low nibble), one
# e4m3 block scale per 16 elements and a global fp32 scale per side. E2M1 has no inf and no NaN:
# its nan_code 0x0 is what a NaN element (or a NaN quotient) is written as, +0.
NVFP4 = Format("nvfp4", 2, None, 4, 2, 1, 6.0, 0x7, 0x0, block_size=16, block_scale="e4m3")
FORMATS = {f.name: f for f in (E4M3, E5M2, NVFP4)}
FP8_FORMATS = tuple(name for name, f in FORMATS.items() if f.code_bits == 8)  # fp8_format=
FORMAT_OF_DTYPE = {f.dtype: f for f in FORMATS.values() if f.dtype is not None}
DEFAULT_FORMAT = "e4m3"   # of a uint8 cache when no format is named


def resolve_format(cache_dtype: str, name: str | None) -> Format:
    """The format of a cache: its own dtype's, or ``name`` (default e4m3) for uint8."""
    return FORMAT_OF_DTYPE.get(cache_dtype) or FORMATS[name or DEFAULT_FORMAT]


INPUT_DTYPES = ("bfloat16", "float16", "float32")
OUTPUT_DTYPES = INPUT_DTYPES
FP8_OUTPUT_DTYPE = "float8_e4m3fn"   # dequantize_pages of an nvfp4 cache: an FP8 workspace
BLOCK_SCALE_DTYPES = ("float8_e4m3fn", "uint8")   # arrays of e4m3 block scales
CACHE_DTYPES = ("float8_e4m3fn", "float8_e5m2", "uint8")
SLOT_DTYPES = ("int32", "int64")

# Dequantized NaNs are written as one canonical quiet NaN per output dtype, so that the GPU
# (whose multiply returns 0x7FFFFFFF), the interpreter and XLA all give the same bits.
CANONICAL_NAN_BITS = {"bfloat16": 0x7FC0, "float16": 0x7E00, "float32": 0x7FC00000}

# Dynamic scales (docs/SPEC.md, "Dynamic scales"): the smallest scale, 1e-6 rounded to fp32. Every
# path takes it from here, as this exact fp32 value.
DYNAMIC_SCALE_FLOOR = struct.unpack("<f", struct.pack("<f", 1e-6))[0]
