"""How one side (K or V) is scaled, and what ``dequantize_pages`` writes: named kinds.

A side has a static scale (:attr:`SideScale.kind`: none, a host value, a device scalar or a
device vector per head) and, optionally, dynamic scales computed at write time and stored per slot
(:attr:`SideScale.dynamic`). Kinds are compared by identity and described by named properties,
never ordered; the plan hands their ``id`` to the kernels as constexprs, which compare them with
``==`` (:mod:`fp8kv.ops.codec` holds the same ids as constexpr globals).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class ScaleKind(enum.Enum):
    """One kind of scale; ``value`` is the kernels' id."""

    NONE = 0         # no scale, or 1.0: x / 1 is exact, the division is skipped
    VALUE = 1        # a host float, passed as an fp32 scalar argument
    TENSOR = 2       # a device fp32 scalar ([] or [1]), read by the kernel
    HEAD = 3         # a device fp32 vector, one scale per kv head
    TOKEN = 4        # dynamic: one scale per written token (over all its kv heads)
    TOKEN_HEAD = 5   # dynamic: one scale per written token and kv head
    BLOCK = 6        # dynamic: one scale per block of a head row (the format's block scales)

    @property
    def id(self) -> int:
        return self.value

    @property
    def dynamic(self) -> bool:
        """Computed by ``write_kv`` from the new tokens and stored per slot."""
        return self in (ScaleKind.TOKEN, ScaleKind.TOKEN_HEAD, ScaleKind.BLOCK)

    @property
    def on_device(self) -> bool:
        """A static scale the kernel reads from a device array."""
        return self in (ScaleKind.TENSOR, ScaleKind.HEAD)

    @property
    def per_head(self) -> bool:
        return self in (ScaleKind.HEAD, ScaleKind.TOKEN_HEAD, ScaleKind.BLOCK)


@dataclass(frozen=True)
class SideScale:
    """The scaling of one side.

    ``kind``: the static scale (NONE, VALUE, TENSOR or HEAD; ``value`` is VALUE's fp32 number).
    ``dynamic``: NONE, or the granularity of the scales computed at write time and stored per
    slot (then ``kind`` is NONE, except for BLOCK: an nvfp4 side has its global scale in
    ``kind``/``value`` and its block scales here); ``stored``: the side array's geometry
    (:class:`fp8kv.layout.ScaleCache`; for BLOCK the block-scale array as a
    :class:`fp8kv.layout.PagedCache`), None for inline scales or none.
    """

    kind: ScaleKind = ScaleKind.NONE
    value: float = 1.0
    dynamic: ScaleKind = ScaleKind.NONE
    stored: object = None

    @property
    def is_dynamic(self) -> bool:
        return self.dynamic is not ScaleKind.NONE


class OutKind(enum.IntEnum):
    """The dtype ``dequantize_pages`` writes (the ``OUT_KIND`` constexpr)."""

    BFLOAT16 = 0
    FLOAT16 = 1
    FLOAT32 = 2
    FLOAT8_E4M3FN = 3   # nvfp4 caches only: e4m3 codes of the value / out_scale


OUT_KIND_OF_DTYPE = {kind.name.lower(): kind for kind in OutKind}   # members named after dtypes


class LayerKind(enum.Enum):
    """How a call names the layer of stacked caches (docs/SPEC.md section 14); ``value`` is the
    kernels' ``LAYER_KIND`` id."""

    NONE = 0     # no layer axis: the caches are one layer's
    VALUE = 1    # a host int, passed as a runtime scalar (one kernel for every layer)
    TENSOR = 2   # an int32 / int64 device scalar, read by the kernel

    @property
    def id(self) -> int:
        return self.value


class Division(enum.IntEnum):
    """How a kernel divides by one scale per side (the plans' ``reciprocal_div`` entry, the
    kernels' ``RECIPROCAL_DIV`` constexpr); every one gives IEEE's ``RN(x / s)`` codes
    (:mod:`fp8kv.ops.codec`)."""

    DIV_RN = 0    # div.rn per element
    FMA = 1       # an fp32 reciprocal per program, two FMA corrections per element
    FP64 = 2      # an fp64 reciprocal per program, one fp64 product per element
