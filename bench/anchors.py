"""Anchors for the eager-call tables: the simplest single-launch Triton kernels for the same jobs.

They are written for this bench, to show what a plain ``kernel[grid](...)`` call of a minimal
kernel costs on the host and the device, next to fp8kv's calls. They handle no padding, assume
contiguous NHD caches and are not meant to be exact: the writer divides with Triton's ``/`` (not
IEEE division on a GPU), and the CPU interpreter rounds both kernels' casts its own way.

* :func:`dequant_pages`: the shape engines use to gather FP8 pages (vLLM-style): one program per
  (block-table entry, chunk of a page); it reads the entry's page id, loads that chunk of the K and
  V pages, multiplies by the scale and stores bf16 into output page ``entry``.
* :func:`write_tokens`: a fused set-KV-buffer writer (SGLang-style): one program per token; it
  loads the token's K and V rows, divides them by the scale, casts to the cache's FP8 type and
  stores them at the token's slot.
* :func:`write_tokens_tiled`: the seed-style one-program-per-token writer of the kind vLLM's
  Triton cache write is: one program per token walking its ``heads x head_dim`` row in
  2,048-element tiles with 16 warps, the scalar scale loaded once per program, Triton's ``/``.

On CPU tensors they run through the interpreter twins that :mod:`fp8kv.ops` derives, as fp8kv's
own kernels do (a plain ``triton.jit`` kernel cannot take CPU tensors without
``TRITON_INTERPRET``).

The dequantizer writes no renumbered block table; its byte count leaves that table out.
"""
from __future__ import annotations

import triton
import triton.language as tl
from fp8kv.ops import interpreted

from .latency import _empty_kernel

DEQUANT_BLOCK = 2048    # elements of a page per program


@triton.jit
def _dequant_kernel(key_cache, value_cache, table, key_scale, value_scale, key_out, value_out,
                    PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    entry = tl.program_id(0)
    chunk = tl.program_id(1)
    page = tl.load(table + entry).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    src = page * PAGE_ELEMS + offs
    dst = entry.to(tl.int64) * PAGE_ELEMS + offs
    k = tl.load(key_cache + src).to(tl.float32) * tl.load(key_scale)
    tl.store(key_out + dst, k.to(key_out.dtype.element_ty))
    v = tl.load(value_cache + src).to(tl.float32) * tl.load(value_scale)
    tl.store(value_out + dst, v.to(value_out.dtype.element_ty))


@triton.jit
def _write_kernel(key, value, key_cache, value_cache, slots, key_scale, value_scale,
                  ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots + token).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    src = token.to(tl.int64) * ROW + offs
    dst = slot * ROW + offs
    k = tl.load(key + src, mask=mask).to(tl.float32) / tl.load(key_scale)
    tl.store(key_cache + dst, k.to(key_cache.dtype.element_ty), mask=mask)
    v = tl.load(value + src, mask=mask).to(tl.float32) / tl.load(value_scale)
    tl.store(value_cache + dst, v.to(value_cache.dtype.element_ty), mask=mask)


WRITE_TILE = 2048      # row elements per step of the tiled writer
WRITE_TILE_WARPS = 16


@triton.jit
def _write_tiled_kernel(key, value, key_cache, value_cache, slots, key_scale, value_scale,
                        ROW: tl.constexpr, TILE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + token).to(tl.int64)
    k_scale = tl.load(key_scale)
    v_scale = tl.load(value_scale)
    for start in tl.static_range(0, ROW, TILE):
        offs = start + tl.arange(0, TILE)
        mask = offs < ROW
        k = tl.load(key + token * ROW + offs, mask=mask).to(tl.float32) / k_scale
        v = tl.load(value + token * ROW + offs, mask=mask).to(tl.float32) / v_scale
        tl.store(key_cache + slot * ROW + offs, k.to(key_cache.dtype.element_ty), mask=mask)
        tl.store(value_cache + slot * ROW + offs, v.to(value_cache.dtype.element_ty), mask=mask)


def _kernel(jit_fn, tensor):
    """The compiled kernel for CUDA tensors, its interpreter twin for CPU tensors."""
    return interpreted(jit_fn) if tensor.device.type == "cpu" else jit_fn


def dequant_pages(key_cache, value_cache, table, key_scale, value_scale, key_out, value_out):
    """Dequantize the pages ``table`` (int32, flattened) names into ``key_out``/``value_out``.

    Caches ``[P, S, H, D]`` contiguous; outputs ``[len(table), S, H, D]`` contiguous; scales are
    float32 device tensors of one element.
    """
    page_elems = key_cache[0].numel()
    block = min(DEQUANT_BLOCK, page_elems)
    grid = (table.numel(), triton.cdiv(page_elems, block))
    _kernel(_dequant_kernel, key_cache)[grid](
        key_cache, value_cache, table, key_scale, value_scale, key_out, value_out,
        PAGE_ELEMS=page_elems, BLOCK=block)


def write_tokens(key, value, key_cache, value_cache, slots, key_scale, value_scale):
    """Write ``key``/``value`` ``[T, H, D]`` at ``slots`` of NHD caches (all contiguous)."""
    row = key[0].numel()
    _kernel(_write_kernel, key)[(key.shape[0],)](
        key, value, key_cache, value_cache, slots, key_scale, value_scale,
        ROW=row, BLOCK=triton.next_power_of_2(row))


def write_tokens_tiled(key, value, key_cache, value_cache, slots, key_scale, value_scale):
    """:func:`write_tokens` as the tiled one-program-per-token writer (2,048-element tiles,
    16 warps)."""
    row = key[0].numel()
    _kernel(_write_tiled_kernel, key)[(key.shape[0],)](
        key, value, key_cache, value_cache, slots, key_scale, value_scale, ROW=row,
        TILE=WRITE_TILE, num_warps=WRITE_TILE_WARPS)


def empty(x):
    """One launch of an empty kernel (the floor of any eager Triton call)."""
    _kernel(_empty_kernel, x)[(1,)](x)
