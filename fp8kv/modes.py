"""Named modes: how a kernel gets its scales and what it writes. The plan passes them as ints.

Kernels compare constexprs, so each mode is an ``IntEnum`` whose ``int`` the plan hands over;
:mod:`fp8kv.ops.fp8_math` turns the same members into ``tl.constexpr`` globals.
"""
from __future__ import annotations

import enum


class ScaleMode(enum.IntEnum):
    """How a kernel gets one operand's scale."""

    NONE = 0     # no scale, or 1.0: x / 1 is exact, the division is skipped
    VALUE = 1    # a host float, passed as an fp32 scalar argument
    TENSOR = 2   # a device fp32 scalar ([] or [1]), read by the kernel
    HEAD = 3     # a device fp32 vector, one scale per kv head
    # Dynamic scales (docs/SPEC.md, "Dynamic scales"): computed by write_kv from the new tokens
    # and stored per slot; dequantize_pages reads them back. Every mode from TOKEN on is dynamic.
    TOKEN = 4        # one scale per token (over all its kv heads)
    TOKEN_HEAD = 5   # one scale per token and kv head (side array or inline in the cache rows)

    @property
    def dynamic(self) -> bool:
        return self >= ScaleMode.TOKEN


class OutKind(enum.IntEnum):
    """The dtype ``dequantize_pages`` writes."""

    BFLOAT16 = 0
    FLOAT16 = 1
    FLOAT32 = 2


OUT_KIND_OF_DTYPE = {kind.name.lower(): kind for kind in OutKind}   # members named after dtypes
