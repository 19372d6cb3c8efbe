"""torch.library custom ops: what torch.compile sees. Eager calls skip the dispatcher.

One op per public function (``fp8kv::write_kv``, ``fp8kv::write_kv_combined``,
``fp8kv::dequantize_pages``, ``fp8kv::dequantize_pages_combined``, ``fp8kv::rope_write_kv``,
``fp8kv::rope_write_kv_combined``): a combined cache is its own op with its own argument, never a
missing one. With ``layer=`` the cache arguments are the stacked ``[num_layers, ...]`` tensors,
declared mutated as a whole.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _launch

Tensor = torch.Tensor


def split_scales(key_scale, value_scale, key_scale_cache, value_scale_cache) -> tuple:
    """Custom ops take neither ``float | Tensor`` nor ``str | Tensor``: the scales as ``(key
    tensor, value tensor, key float, value float)``, the scale caches as ``(key tensor, value
    tensor, key inline flag, value inline flag)``. A scale cache other than ``"inline"`` (a wrong
    type or string) is passed on as is, as by the eager path: the op's own validation rejects it."""
    (ks, ksv), (vs, vsv) = ((s, None) if isinstance(s, Tensor) else (None, s)
                            for s in (key_scale, value_scale))
    (ksc, ksi), (vsc, vsi) = ((None, True) if isinstance(c, str) and c == "inline" else (c, False)
                              for c in (key_scale_cache, value_scale_cache))
    return (ks, vs, ksv, vsv), (ksc, vsc, ksi, vsi)


def split_scale(scale) -> tuple:
    """``(tensor, float)`` of one scale (a custom op takes no ``float | Tensor``)."""
    return (scale, None) if isinstance(scale, Tensor) else (None, scale)


def split_layer(layer) -> tuple:
    """Custom ops take no ``int | Tensor``: ``layer`` as ``(int or None, tensor or None)``."""
    return (None, layer) if isinstance(layer, Tensor) else (layer, None)


def _layer(layer_value, layer_tensor):
    return layer_tensor if layer_tensor is not None else layer_value


def _scales(key_scale, value_scale, key_scale_value, value_scale_value, key_scale_cache,
            value_scale_cache, key_scale_inline, value_scale_inline) -> dict:
    """The launcher's scale arguments from an op's split ones (:func:`split_scales`)."""
    return dict(key_scale=key_scale if key_scale is not None else key_scale_value,
                value_scale=value_scale if value_scale is not None else value_scale_value,
                key_scale_cache="inline" if key_scale_inline else key_scale_cache,
                value_scale_cache="inline" if value_scale_inline else value_scale_cache)


# No defaults in the ops' schemas: torch (2.11) drops trailing default arguments when it
# redispatches, and then cannot find a mutated one by position. Every caller passes every argument.
def _write_kv(launch: bool):
    """The write op's implementation (``launch``) or its fake (validation only): one body."""
    def write_kv(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                 slots: Tensor, key_scale: Optional[Tensor], value_scale: Optional[Tensor],
                 key_scale_value: Optional[float], value_scale_value: Optional[float],
                 layout: str, fp8_format: Optional[str], key_scale_cache: Optional[Tensor],
                 value_scale_cache: Optional[Tensor], key_scale_inline: bool,
                 value_scale_inline: bool, scale_rounding: str,
                 cache_format: Optional[str], layer: Optional[int],
                 layer_tensor: Optional[Tensor]) -> None:
        s = _scales(key_scale, value_scale, key_scale_value, value_scale_value, key_scale_cache,
                    value_scale_cache, key_scale_inline, value_scale_inline)
        _launch.write_kv(key, value, key_cache, value_cache, slots, s["key_scale"],
                         s["value_scale"], layout, fp8_format, launch=launch,
                         key_scale_cache=s["key_scale_cache"],
                         value_scale_cache=s["value_scale_cache"], scale_rounding=scale_rounding,
                         cache_format=cache_format, layer=_layer(layer, layer_tensor))
    return write_kv


def _write_kv_combined(launch: bool):
    def write_kv_combined(key: Tensor, value: Tensor, kv_cache: Tensor, slots: Tensor,
                          key_scale: Optional[Tensor], value_scale: Optional[Tensor],
                          key_scale_value: Optional[float], value_scale_value: Optional[float],
                          layout: str, fp8_format: Optional[str],
                          key_scale_cache: Optional[Tensor], value_scale_cache: Optional[Tensor],
                          key_scale_inline: bool, value_scale_inline: bool,
                          scale_rounding: str, cache_format: Optional[str],
                          layer: Optional[int], layer_tensor: Optional[Tensor]) -> None:
        s = _scales(key_scale, value_scale, key_scale_value, value_scale_value, key_scale_cache,
                    value_scale_cache, key_scale_inline, value_scale_inline)
        _launch.write_kv_combined(key, value, kv_cache, slots, s["key_scale"], s["value_scale"],
                                  layout, fp8_format, launch=launch,
                                  key_scale_cache=s["key_scale_cache"],
                                  value_scale_cache=s["value_scale_cache"],
                                  scale_rounding=scale_rounding, cache_format=cache_format,
                                  layer=_layer(layer, layer_tensor))
    return write_kv_combined


def _dequantize_pages(launch: bool):
    """The dequantize op's implementation (``launch``) or its fake (validation only)."""
    def dequantize_pages(key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                         key_scale: Optional[Tensor], value_scale: Optional[Tensor],
                         key_scale_value: Optional[float], value_scale_value: Optional[float],
                         layout: str, fp8_format: Optional[str], null_page: Optional[int],
                         key_out: Tensor, value_out: Tensor, table_out: Tensor,
                         key_scale_cache: Optional[Tensor], value_scale_cache: Optional[Tensor],
                         key_scale_inline: bool, value_scale_inline: bool,
                         head_dim: Optional[int], cache_format: Optional[str],
                         out_scale: Optional[Tensor], out_scale_value: Optional[float],
                         layer: Optional[int], layer_tensor: Optional[Tensor]) -> None:
        s = _scales(key_scale, value_scale, key_scale_value, value_scale_value, key_scale_cache,
                    value_scale_cache, key_scale_inline, value_scale_inline)
        _launch.dequantize_pages(key_cache, value_cache, block_table, s["key_scale"],
                                 s["value_scale"], key_out.dtype, layout, fp8_format, null_page,
                                 (key_out, value_out, table_out), launch=launch,
                                 key_scale_cache=s["key_scale_cache"],
                                 value_scale_cache=s["value_scale_cache"], head_dim=head_dim,
                                 cache_format=cache_format,
                                 out_scale=out_scale if out_scale is not None else out_scale_value,
                                 layer=_layer(layer, layer_tensor))
    return dequantize_pages


def _dequantize_pages_combined(launch: bool):
    def dequantize_pages_combined(kv_cache: Tensor, block_table: Tensor,
                                  key_scale: Optional[Tensor], value_scale: Optional[Tensor],
                                  key_scale_value: Optional[float],
                                  value_scale_value: Optional[float], layout: str,
                                  fp8_format: Optional[str], null_page: Optional[int],
                                  kv_out: Tensor, table_out: Tensor,
                                  key_scale_cache: Optional[Tensor],
                                  value_scale_cache: Optional[Tensor], key_scale_inline: bool,
                                  value_scale_inline: bool, head_dim: Optional[int],
                                  cache_format: Optional[str], out_scale: Optional[Tensor],
                                  out_scale_value: Optional[float], layer: Optional[int],
                                  layer_tensor: Optional[Tensor]) -> None:
        s = _scales(key_scale, value_scale, key_scale_value, value_scale_value, key_scale_cache,
                    value_scale_cache, key_scale_inline, value_scale_inline)
        _launch.dequantize_pages_combined(kv_cache, block_table, s["key_scale"],
                                          s["value_scale"], kv_out.dtype, layout, fp8_format,
                                          null_page, (kv_out, table_out), launch=launch,
                                          key_scale_cache=s["key_scale_cache"],
                                          value_scale_cache=s["value_scale_cache"],
                                          head_dim=head_dim, cache_format=cache_format,
                                          out_scale=(out_scale if out_scale is not None
                                                     else out_scale_value),
                                          layer=_layer(layer, layer_tensor))
    return dequantize_pages_combined


def _op(name: str, make, mutates: tuple):
    op = torch.library.custom_op(f"fp8kv::{name}", mutates_args=mutates)(make(launch=True))
    op.register_fake(make(launch=False))
    return op


_SCALE_CACHES = ("key_scale_cache", "value_scale_cache")
write_kv_op = _op("write_kv", _write_kv, ("key_cache", "value_cache") + _SCALE_CACHES)
write_kv_combined_op = _op("write_kv_combined", _write_kv_combined, ("kv_cache",) + _SCALE_CACHES)
dequantize_pages_op = _op("dequantize_pages", _dequantize_pages,
                          ("key_out", "value_out", "table_out"))
dequantize_pages_combined_op = _op("dequantize_pages_combined", _dequantize_pages_combined,
                                   ("kv_out", "table_out"))


def _rope_write_kv(launch: bool, combined: bool):
    """The rope_write_kv op's implementation (``launch``) or its fake (validation only); the
    frontend makes ``query_out`` before calling it. ``combined``: ``caches`` is ``(kv_cache,)``.
    """
    launcher = _launch.rope_write_kv_combined if combined else _launch.rope_write_kv

    def run(query, key, value, caches, slots, positions, cos_sin_cache, key_scale, value_scale,
            query_scale, key_scale_value, value_scale_value, query_scale_value, rope_style,
            rotary_dim, layout, fp8_format, query_out, key_out, key_scale_cache,
            value_scale_cache, key_scale_inline, value_scale_inline, scale_rounding):
        s = _scales(key_scale, value_scale, key_scale_value, value_scale_value, key_scale_cache,
                    value_scale_cache, key_scale_inline, value_scale_inline)
        launcher(query, key, value, *caches, slots, positions, cos_sin_cache, s["key_scale"],
                 s["value_scale"], query_scale if query_scale is not None else query_scale_value,
                 query_out, key_out, rope_style=rope_style, rotary_dim=rotary_dim, layout=layout,
                 fp8_format=fp8_format, key_scale_cache=s["key_scale_cache"],
                 value_scale_cache=s["value_scale_cache"], scale_rounding=scale_rounding,
                 launch=launch)

    if combined:
        def rope_write_kv_combined(
                query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, slots: Tensor,
                positions: Tensor, cos_sin_cache: Tensor, key_scale: Optional[Tensor],
                value_scale: Optional[Tensor], query_scale: Optional[Tensor],
                key_scale_value: Optional[float], value_scale_value: Optional[float],
                query_scale_value: Optional[float], rope_style: str, rotary_dim: Optional[int],
                layout: str, fp8_format: Optional[str], query_out: Tensor,
                key_out: Optional[Tensor], key_scale_cache: Optional[Tensor],
                value_scale_cache: Optional[Tensor], key_scale_inline: bool,
                value_scale_inline: bool, scale_rounding: str) -> None:
            run(query, key, value, (kv_cache,), slots, positions, cos_sin_cache, key_scale,
                value_scale, query_scale, key_scale_value, value_scale_value, query_scale_value,
                rope_style, rotary_dim, layout, fp8_format, query_out, key_out, key_scale_cache,
                value_scale_cache, key_scale_inline, value_scale_inline, scale_rounding)
        return rope_write_kv_combined

    def rope_write_kv(query: Tensor, key: Tensor, value: Tensor, key_cache: Tensor,
                      value_cache: Tensor, slots: Tensor, positions: Tensor,
                      cos_sin_cache: Tensor, key_scale: Optional[Tensor],
                      value_scale: Optional[Tensor], query_scale: Optional[Tensor],
                      key_scale_value: Optional[float], value_scale_value: Optional[float],
                      query_scale_value: Optional[float], rope_style: str,
                      rotary_dim: Optional[int], layout: str, fp8_format: Optional[str],
                      query_out: Tensor, key_out: Optional[Tensor],
                      key_scale_cache: Optional[Tensor], value_scale_cache: Optional[Tensor],
                      key_scale_inline: bool, value_scale_inline: bool,
                      scale_rounding: str) -> None:
        run(query, key, value, (key_cache, value_cache), slots, positions, cos_sin_cache,
            key_scale, value_scale, query_scale, key_scale_value, value_scale_value,
            query_scale_value, rope_style, rotary_dim, layout, fp8_format, query_out, key_out,
            key_scale_cache, value_scale_cache, key_scale_inline, value_scale_inline,
            scale_rounding)
    return rope_write_kv


_ROPE_OUTPUTS = ("query_out", "key_out") + _SCALE_CACHES
rope_write_kv_op = _op("rope_write_kv", lambda launch: _rope_write_kv(launch, False),
                       ("key_cache", "value_cache") + _ROPE_OUTPUTS)
rope_write_kv_combined_op = _op("rope_write_kv_combined",
                                lambda launch: _rope_write_kv(launch, True),
                                ("kv_cache",) + _ROPE_OUTPUTS)
