"""NVFP4 caches (torch): the write at a large batch and under CUDA-graph replay, and the
dequantize to bf16 and to an FP8 workspace, with e4m3 rows of the same shapes beside them and
plan variants for tuning (``fp8kv.write.NVFP4_WRITE_SIZES`` / ``NVFP4_DEQUANT_SIZES``).

Bytes count what an nvfp4 call must move: bf16 K and V read, half a byte of code plus 1/16 byte
of block scale written per element (the reverse for a dequantize), slots or tables.
"""
from __future__ import annotations

import functools

import torch

import fp8kv_torch
from fp8kv import dequantize, plan, write
from fp8kv.modes import Division

from .common import Config, Timer, free_memory, num_sets
from .results import Table, tokens_case
from .sweep import planned_with
from .write_torch import HEAD_DIM, HEADS, PAGE_SIZE, build_write_case

GLOBAL_SCALE = 0.0213     # a global dequant scale: amax 6 * 448 * 0.0213 = 57 covers randn data
GRAPH_TOKENS = (1, 16, 64, 256)
# Plan variants, measured in the same run: label -> entries of NVFP4_WRITE_SIZES[CUDA].
WRITE_VARIANTS = {
    "tile 4096, 4 warps": dict(tile=4096, num_warps=4),
    "tile 2048, 2 warps": dict(tile=2048, num_warps=2),
    "tile 2048, 4 warps": dict(tile=2048, num_warps=4),
    "V loaded after K's stores": dict(loads_first=False),
}
SMALL_VARIANTS = {
    "small: whole groups per thread": dict(small_blockwise=False),
    "small: blockwise, 8 warps": dict(small_batch_warps=8),
}
DEQUANT_VARIANTS = {
    "FMA division": dict(reciprocal_div=Division.FMA),
    "2048 elements per program": dict(block=2048),
    "8192 elements per program": dict(block=8192),
    "8 warps": dict(num_warps=8),
}
# An FP8 output's lookup (NVFP4_DEQUANT_SIZES["lookup"], "lookup_block"): its rows only.
FP8_DEQUANT_VARIANTS = {
    "FP8 output per element (no lookup)": dict(lookup=False),
    "lookup: 4096 elements per program": dict(lookup_block=4096),
    "lookup: 16384 elements per program": dict(lookup_block=16384),
}


def write_bytes(tokens: int, dtype_bytes: int = 2) -> int:
    elems = tokens * HEADS * HEAD_DIM
    return 2 * elems * dtype_bytes + 2 * (elems // 2 + elems // 16) + tokens * 8


def dequant_bytes(entries: int, out_bytes: int) -> int:
    elems = entries * PAGE_SIZE * HEADS * HEAD_DIM
    return 2 * (elems // 2 + elems // 16 + elems * out_bytes) + entries * 8


def _write_calls(device, cfg: Config, tokens: int) -> list:
    """nvfp4 write calls over rotated input sets, into one cache large enough to scatter."""
    case = build_write_case(device, cfg, tokens, cache_dtype=torch.uint8)   # its inputs, slots
    num_pages = case.key_cache.shape[0]
    cache = torch.zeros(num_pages, PAGE_SIZE, HEADS, HEAD_DIM // 2, dtype=torch.uint8,
                        device=device)
    blocks = torch.zeros(num_pages, PAGE_SIZE, HEADS, HEAD_DIM // 16, dtype=torch.float8_e4m3fn,
                         device=device)
    caches = (cache, cache.clone(), blocks, blocks.clone())
    g = torch.tensor(GLOBAL_SCALE, device=device)
    return [functools.partial(fp8kv_torch.write_kv, k, v, caches[0], caches[1], s, g, g,
                              key_scale_cache=caches[2], value_scale_cache=caches[3],
                              cache_format="nvfp4")
            for k, v, s in case.sets]


def _dequant_calls(device, cfg: Config, batch: int, pages_per_seq: int, dtype, out_scale):
    """nvfp4 dequantize calls over rotated block tables, with preallocated outputs."""
    pages = max(cfg.dequant_cache_pages, batch * pages_per_seq)
    cache = torch.randint(0, 256, (pages, PAGE_SIZE, HEADS, HEAD_DIM // 2), dtype=torch.uint8,
                          device=device)
    # Finite block scales (no NaN byte): e4m3 values 2**-6 .. 2**2.
    blocks = torch.randint(0x08, 0x48, cache.shape[:-1] + (HEAD_DIM // 16,), dtype=torch.uint8,
                           device=device)
    entries = batch * pages_per_seq
    nbytes = dequant_bytes(entries, torch.empty((), dtype=dtype).element_size())
    tables = [torch.randperm(pages, device=device)[:entries].to(torch.int32)
              .reshape(batch, pages_per_seq) for _ in range(num_sets(cfg, nbytes))]
    g = torch.tensor(GLOBAL_SCALE, device=device)
    kw = dict(key_scale_cache=blocks, value_scale_cache=blocks.clone(), cache_format="nvfp4",
              dtype=dtype, out_scale=out_scale)
    outs = fp8kv_torch.dequantize_pages(cache, cache, tables[0], g, g, **kw)
    calls = [functools.partial(fp8kv_torch.dequantize_pages, cache, cache.clone(), t, g, g,
                               out=outs, **kw) for t in tables]
    return calls, nbytes


def _write_rows(table: Table, timer: Timer, mode: str, device, cfg: Config, tokens: int,
                name: str, variants: dict) -> None:
    """The rows of an nvfp4 write of ``tokens``: fp8kv, its plan ``variants`` and the e4m3 call
    of the same size (the last two on a GPU only)."""
    calls = _write_calls(device, cfg, tokens)
    table.add(name, tokens, "fp8kv", mode, timer.time(mode, calls), write_bytes(tokens))
    if timer.cuda:
        for label, entries in variants.items():
            with planned_with(write.NVFP4_WRITE_SIZES, plan.CUDA, **entries):
                table.add(name, tokens, f"fp8kv, {label}", mode, timer.time(mode, calls),
                          write_bytes(tokens))
        e4m3 = build_write_case(device, cfg, tokens)
        table.add(name, tokens, "e4m3 (static scale)", mode,
                  timer.time(mode, e4m3.fp8kv_calls()), e4m3.nbytes)
        del e4m3
    del calls
    free_memory()


def table_nvfp4(device, cfg: Config, timer: Timer, copy_gbps: float) -> Table:
    large = cfg.dynamic_tokens          # 65,536 on a GPU
    batch, pages_per_seq = cfg.dynamic_dequant
    table = Table(
        "nvfp4", "NVFP4 cache: write and dequantize (torch)",
        f"{HEADS} kv heads x {HEAD_DIM} dims, page {PAGE_SIZE}, NHD, bf16 <-> nvfp4 (E2M1 codes, "
        "an e4m3 scale per 16 elements, one device global scale), random slots / distinct "
        "random pages. Bytes: bf16 K and V, codes (half a byte per element) and block scales "
        "(1/16 byte), slots or tables. `e4m3` rows: the FP8 cache's call at the same size. "
        "`fp8kv, ...` rows change one entry of fp8kv.write.NVFP4_WRITE_SIZES / "
        "NVFP4_DEQUANT_SIZES." + (" `graph N`: CUDA-graph replay of an N-token write."
                                  if timer.cuda else ""),
        plot="bars")
    mode = "graph" if timer.cuda else timer.modes[0]
    small = "graph" if timer.cuda else "write"   # the small writes' cases name their mode

    _write_rows(table, timer, mode, device, cfg, large, f"write {tokens_case(large)}",
                WRITE_VARIANTS)
    if timer.cuda:
        table.add_roofline(f"write {tokens_case(large)}", large, write_bytes(large), copy_gbps)
    for tokens in GRAPH_TOKENS if timer.cuda else GRAPH_TOKENS[:2]:
        _write_rows(table, timer, mode, device, cfg, tokens, f"{small} {tokens_case(tokens)}",
                    SMALL_VARIANTS)

    pages = batch * pages_per_seq
    for out, dtype, out_scale in (("bf16", torch.bfloat16, None),
                                  ("fp8, out_scale 2**-2", torch.float8_e4m3fn, 0.25),
                                  ("fp8, out_scale 0.37", torch.float8_e4m3fn, 0.37)):
        calls, nbytes = _dequant_calls(device, cfg, batch, pages_per_seq, dtype, out_scale)
        name = f"dequantize {batch}x{pages_per_seq} -> {out}"
        table.add(name, pages, "fp8kv", mode, timer.time(mode, calls), nbytes)
        if timer.cuda:
            fp8 = dtype == torch.float8_e4m3fn
            variants = dict(DEQUANT_VARIANTS, **(FP8_DEQUANT_VARIANTS if fp8 else {}))
            for label, entries in variants.items():
                with planned_with(dequantize.NVFP4_DEQUANT_SIZES, plan.CUDA, **entries):
                    table.add(name, pages, f"fp8kv, {label}", mode, timer.time(mode, calls),
                              nbytes)
            table.add_roofline(name, pages, nbytes, copy_gbps)
        del calls
        free_memory()
    if timer.cuda:
        table.note(f"% of copy bandwidth is bytes / time / {copy_gbps:.0f} GB/s; the issue's "
                   "goals: the 65,536-token write >= 85 %, graph replays <= 3 us, both "
                   "dequantizes >= 3,800 GB/s.")
    return table

