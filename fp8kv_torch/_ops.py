"""torch.library custom ops: what torch.compile sees. Eager calls skip the dispatcher."""
from __future__ import annotations

from typing import Optional

import torch

from . import _launch

Tensor = torch.Tensor


def split_scale(scale):
    """Custom ops cannot take ``float | Tensor``: split a scale into (tensor, float)."""
    return (scale, None) if isinstance(scale, Tensor) else (None, scale)


def join_scale(tensor, value):
    return tensor if tensor is not None else value


@torch.library.custom_op("fp8kv::write_kv", mutates_args=("key_cache", "value_cache"))
def write_kv_op(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Optional[Tensor],
                slots: Tensor, key_scale: Optional[Tensor], value_scale: Optional[Tensor],
                key_scale_value: Optional[float], value_scale_value: Optional[float], layout: str,
                fp8_format: Optional[str]) -> None:
    _launch.write_kv(key, value, key_cache, value_cache, slots, join_scale(key_scale, key_scale_value),
                     join_scale(value_scale, value_scale_value), layout, fp8_format)


@write_kv_op.register_fake
def _write_kv_fake(key, value, key_cache, value_cache, slots, key_scale, value_scale, key_scale_value,
                   value_scale_value, layout, fp8_format):
    _launch.write_kv(key, value, key_cache, value_cache, slots, join_scale(key_scale, key_scale_value),
                     join_scale(value_scale, value_scale_value), layout, fp8_format, launch=False)


@torch.library.custom_op("fp8kv::dequantize_pages",
                         mutates_args=("key_out", "value_out", "table_out"))
def dequantize_pages_op(key_cache: Tensor, value_cache: Optional[Tensor], block_table: Tensor,
                        key_scale: Optional[Tensor], value_scale: Optional[Tensor],
                        key_scale_value: Optional[float], value_scale_value: Optional[float],
                        layout: str, fp8_format: Optional[str], null_page: Optional[int],
                        key_out: Tensor, value_out: Optional[Tensor], table_out: Tensor) -> None:
    _launch.dequantize_pages(key_cache, value_cache, block_table,
                             join_scale(key_scale, key_scale_value),
                             join_scale(value_scale, value_scale_value), key_out.dtype, layout,
                             fp8_format, null_page, (key_out, value_out, table_out))


@dequantize_pages_op.register_fake
def _dequantize_pages_fake(key_cache, value_cache, block_table, key_scale, value_scale,
                           key_scale_value, value_scale_value, layout, fp8_format, null_page,
                           key_out, value_out, table_out):
    _launch.dequantize_pages(key_cache, value_cache, block_table,
                             join_scale(key_scale, key_scale_value),
                             join_scale(value_scale, value_scale_value), key_out.dtype, layout,
                             fp8_format, null_page, (key_out, value_out, table_out), launch=False)
