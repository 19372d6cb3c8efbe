"""Cache formats as data, dtype names and the constants every path shares.

A format is one row of :data:`FORMATS`: what its codes are (bits per code, exponent and mantissa
bits, the largest value and its code, the code written for NaN, infinities or not) and, for a
block-scaled format, its :class:`BlockScaling` (elements per block scale and the scales' own
format). The kernels take a row as one constexpr record, :attr:`Format.codec`, and
:mod:`fp8kv.ops.codec` encodes and decodes from its fields; the reference
(:mod:`fp8kv.reference`) and the jnp path read the same row. docs/ADDING_A_FORMAT.md says what
else a new row needs.

Dtypes are passed around by name (``"bfloat16"``, ``"float8_e4m3fn"`` ...), the spelling both
``torch`` and ``jax``/``numpy`` use, so this module imports neither framework.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Codec(NamedTuple):
    """A format row as the kernels take it: one constexpr record (:mod:`fp8kv.ops.codec`).

    ``TRITON_DTYPE``: Triton's dtype of the codes, whose hardware conversions the fast path uses
    (None: the integer arithmetic serves every path). ``BLOCK_SIZE`` / ``BLOCK_SCALE``: elements
    per block scale and the scales' codec (0 / None without block scales).
    """

    CODE_BITS: int
    EXP_BITS: int
    MAN_BITS: int
    BIAS: int
    MAX_CODE: int
    NAN_CODE: int
    HAS_INF: bool
    SIGNED: bool
    MAX_VALUE: float
    RCP_MAX_VALUE: float
    SUBNORMAL_UNIT: float
    TRITON_DTYPE: str | None
    BLOCK_SIZE: int = 0
    BLOCK_SCALE: "Codec | None" = None


@dataclass(frozen=True)
class BlockScaling:
    """How a block-scaled format stores its scales: one scale in format ``scale`` per ``size``
    consecutive elements of a head row, in a side array of one of ``dtypes`` (the cache's shape
    with ``head_dim / size`` scales per head row)."""

    size: int
    scale: "Format"
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class Format:
    """One format: its codes and, where it has them, its block scales."""

    name: str            # the spelling of the format argument ("e4m3", "e5m2", ...)
    dtype: str | None    # the typed dtype of its codes (None: stored in uint8 only)
    code_bits: int       # bits per code: 8 or 4
    exp_bits: int
    man_bits: int
    max_value: float     # largest finite value; writes saturate to it
    max_code: int        # its code (positive)
    nan_code: int        # the code every NaN is written as
    has_inf: bool = False              # the all-ones exponent with a zero mantissa is +-inf
    signed: bool = True                # the top bit of a code is its sign
    triton_dtype: str | None = None    # Triton's dtype of the codes (hardware conversions)
    blocks: BlockScaling | None = None

    @property
    def block_scaled(self) -> bool:
        """Stored with block scales in side arrays (``key_scale_cache`` / ``value_scale_cache``)."""
        return self.blocks is not None

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.code_bits

    @property
    def packed(self) -> bool:
        """Several codes share a byte: the packed-code kernels (``write_nvfp4``,
        ``dequantize_nvfp4``) serve it, the FP8 kernels serve the others."""
        return self.codes_per_byte > 1

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
    def magnitudes(self) -> tuple[float, ...]:
        """The value of each magnitude code ``0 .. max_code`` (subnormals, then normals)."""
        step = 1 << self.man_bits
        return tuple(c * self.subnormal_unit if c < step else
                     2.0 ** ((c >> self.man_bits) - self.bias) * (1 + (c % step) / step)
                     for c in range(self.max_code + 1))

    @property
    def out_dtypes(self) -> tuple[str, ...]:
        """What ``dequantize_pages`` writes for this format: the 16/32-bit dtypes, and an FP8
        workspace for a packed (4-bit) format."""
        return OUTPUT_DTYPES if self.packed else INPUT_DTYPES

    @property
    def codec(self) -> Codec:
        """This row as the kernels' constexpr record."""
        blocks = self.blocks
        return Codec(self.code_bits, self.exp_bits, self.man_bits, self.bias, self.max_code,
                     self.nan_code, self.has_inf, self.signed, self.max_value, self.reciprocal_max,
                     self.subnormal_unit, self.triton_dtype,
                     blocks.size if blocks else 0, blocks.scale.codec if blocks else None)


E4M3 = Format("e4m3", "float8_e4m3fn", 8, 4, 3, 448.0, 0x7E, 0x7F, triton_dtype="fp8e4nv")
E5M2 = Format("e5m2", "float8_e5m2", 8, 5, 2, 57344.0, 0x7B, 0x7F, has_inf=True,
              triton_dtype="fp8e5")
# NVFP4 (docs/SPEC.md section 13): E2M1 codes, two per uint8 (element 2i in the low nibble), one
# e4m3 block scale per 16 elements and a global fp32 scale per side. E2M1 has no inf and no NaN:
# its nan_code 0x0 is what a NaN element (or a NaN quotient) is written as, +0.
NVFP4 = Format("nvfp4", None, 4, 2, 1, 6.0, 0x7, 0x0,
               blocks=BlockScaling(16, E4M3, ("float8_e4m3fn", "uint8")))
# E8M0 (OCP MX v1.0): a scale format -- unsigned, 8 exponent bits, no mantissa, bias 127; code e
# is 2**(e - 127) (0 .. 254), 0xFF is NaN. Not a cache format: MXFP8's block scales.
E8M0 = Format("e8m0", None, 8, 8, 0, 2.0 ** 127, 0xFE, 0xFF, signed=False)
# MXFP8 (docs/SPEC.md section 13a): e4m3 codes (E4M3's, one per byte, typed or uint8 caches) and
# one E8M0 scale per 32 elements of a head row, in uint8 side arrays; no global scale. Not packed:
# the FP8 kernels serve it, its block scales a dynamic granularity of their own.
MXFP8 = Format("mxfp8", "float8_e4m3fn", 8, 4, 3, 448.0, 0x7E, 0x7F, triton_dtype="fp8e4nv",
               blocks=BlockScaling(32, E8M0, ("uint8",)))
FORMATS = {f.name: f for f in (E4M3, E5M2, NVFP4, MXFP8)}
FP8_FORMATS = tuple(name for name, f in FORMATS.items() if not f.blocks)  # fp8_format=
# A typed cache names its format only where one unscaled format has that dtype.
FORMAT_OF_DTYPE = {f.dtype: f for f in FORMATS.values() if f.dtype is not None and not f.blocks}
DEFAULT_FORMAT = "e4m3"   # of a uint8 cache when no format is named


def resolve_format(cache_dtype: str, name: str | None) -> Format:
    """The format of a cache: a block-scaled ``name``'s, else its own dtype's, else ``name``'s
    (default e4m3)."""
    named = FORMATS.get(name) if name else None
    if named is not None and named.blocks:
        return named
    return FORMAT_OF_DTYPE.get(cache_dtype) or FORMATS[name or DEFAULT_FORMAT]


INPUT_DTYPES = ("bfloat16", "float16", "float32")
FP8_OUTPUT_DTYPE = "float8_e4m3fn"   # dequantize_pages of a packed cache (nvfp4): FP8 workspace
OUTPUT_DTYPES = INPUT_DTYPES + (FP8_OUTPUT_DTYPE,)   # every dtype dequantize_pages may write
CACHE_DTYPES = ("float8_e4m3fn", "float8_e5m2", "uint8")
SLOT_DTYPES = ("int32", "int64")

# Dequantized NaNs are written as one canonical quiet NaN per output dtype, so that the GPU
# (whose multiply returns 0x7FFFFFFF), the interpreter and XLA all give the same bits.
CANONICAL_NAN_BITS = {"bfloat16": 0x7FC0, "float16": 0x7E00, "float32": 0x7FC00000}

# Dynamic scales (docs/SPEC.md, "Dynamic scales"): the smallest scale, 1e-6 rounded to fp32. Every
# path takes it from here, as this exact fp32 value.
DYNAMIC_SCALE_FLOOR = struct.unpack("<f", struct.pack("<f", 1e-6))[0]
