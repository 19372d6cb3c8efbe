"""Stacked caches in the kernels: the layer a call reads or writes (docs/SPEC.md section 14).

A kernel that takes stacked ``[num_layers, ...]`` caches has, beside its own parameters, the
input ``layer_ptr`` (last of its inputs; :func:`fp8kv.operands.layer_input`), the runtime scalar
``layer`` and the constexprs of :func:`fp8kv.plan.layer_params` (``LAYER_KIND``, ``NUM_LAYERS``,
``STRIDE_<array>_LAYER``). At its top it calls :func:`select_layer` and moves each stacked
array's base pointer by ``layer * STRIDE_<array>_LAYER``; everything after that addresses one
layer, as without stacking. An out-of-range layer comes back as 0 (base pointers stay inside the
stack) with a count of 0, which makes every slot or page of the call out of range: nothing is
written, every page is padding.
"""
import triton.language as tl

from ..modes import LayerKind
from ._dual import jit

LAYER_NONE: tl.constexpr = tl.constexpr(LayerKind.NONE.id)
LAYER_TENSOR: tl.constexpr = tl.constexpr(LayerKind.TENSOR.id)


@jit
def select_layer(layer_ptr, layer, count, KIND: tl.constexpr, NUM_LAYERS: tl.constexpr):
    """``(index, count)``: the layer as int64 -- loaded from ``layer_ptr`` (``KIND`` TENSOR) or
    the scalar ``layer`` (VALUE) -- and ``count`` (the call's slots or pages), both 0 when the
    layer is out of range (``< 0`` or ``>= NUM_LAYERS``: no wrap-around)."""
    if KIND == LAYER_TENSOR:
        index = tl.load(layer_ptr).to(tl.int64)
    else:
        index = tl.cast(layer, tl.int64)   # a scalar, or a constexpr where a launcher made it one
    in_range = (index >= 0) & (index < NUM_LAYERS)
    return tl.where(in_range, index, 0), tl.where(in_range, count, 0)
