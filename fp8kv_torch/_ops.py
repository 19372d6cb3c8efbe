"""torch.library custom ops: what torch.compile sees. Eager calls skip the dispatcher."""
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


def join_scale(tensor, value):
    return tensor if tensor is not None else value


def join_scale_cache(tensor, inline):
    return "inline" if inline else tensor


# No defaults in the ops' schemas: torch (2.11) drops trailing default arguments when it
# redispatches, and then cannot find a mutated one by position. Every caller passes every argument.
def _write_kv(launch: bool):
    """The write op's implementation (``launch``) or its fake (validation only): one body."""
    def write_kv(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Optional[Tensor],
                 slots: Tensor, key_scale: Optional[Tensor], value_scale: Optional[Tensor],
                 key_scale_value: Optional[float], value_scale_value: Optional[float],
                 layout: str, fp8_format: Optional[str], key_scale_cache: Optional[Tensor],
                 value_scale_cache: Optional[Tensor], key_scale_inline: bool,
                 value_scale_inline: bool, scale_rounding: str) -> None:
        _launch.write_kv(key, value, key_cache, value_cache, slots,
                         join_scale(key_scale, key_scale_value),
                         join_scale(value_scale, value_scale_value), layout, fp8_format,
                         launch=launch,
                         key_scale_cache=join_scale_cache(key_scale_cache, key_scale_inline),
                         value_scale_cache=join_scale_cache(value_scale_cache, value_scale_inline),
                         scale_rounding=scale_rounding)
    return write_kv


def _dequantize_pages(launch: bool):
    """The dequantize op's implementation (``launch``) or its fake (validation only)."""
    def dequantize_pages(key_cache: Tensor, value_cache: Optional[Tensor], block_table: Tensor,
                         key_scale: Optional[Tensor], value_scale: Optional[Tensor],
                         key_scale_value: Optional[float], value_scale_value: Optional[float],
                         layout: str, fp8_format: Optional[str], null_page: Optional[int],
                         key_out: Tensor, value_out: Optional[Tensor], table_out: Tensor,
                         key_scale_cache: Optional[Tensor], value_scale_cache: Optional[Tensor],
                         key_scale_inline: bool, value_scale_inline: bool,
                         head_dim: Optional[int]) -> None:
        _launch.dequantize_pages(
            key_cache, value_cache, block_table, join_scale(key_scale, key_scale_value),
            join_scale(value_scale, value_scale_value), key_out.dtype, layout, fp8_format,
            null_page, (key_out, value_out, table_out), launch=launch,
            key_scale_cache=join_scale_cache(key_scale_cache, key_scale_inline),
            value_scale_cache=join_scale_cache(value_scale_cache, value_scale_inline),
            head_dim=head_dim)
    return dequantize_pages


write_kv_op = torch.library.custom_op(
    "fp8kv::write_kv", mutates_args=("key_cache", "value_cache", "key_scale_cache",
                                     "value_scale_cache"))(_write_kv(launch=True))
write_kv_op.register_fake(_write_kv(launch=False))

dequantize_pages_op = torch.library.custom_op(
    "fp8kv::dequantize_pages",
    mutates_args=("key_out", "value_out", "table_out"))(_dequantize_pages(launch=True))
dequantize_pages_op.register_fake(_dequantize_pages(launch=False))
