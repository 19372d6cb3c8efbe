"""Dynamic-scale placements side by side (torch): per-token-head scales in a side array, inline
after each head row (+4 bytes, vLLM's layout) and inline padded to 16 bytes, against a static
scale, for the write, the dequantize and a gather of one sequence's rows as an attention kernel
reads them. Bytes count the scales too.
"""
from __future__ import annotations

import torch

import fp8kv_torch

from .common import Config, Timer, free_memory
from .results import Table
from .write_torch import HEADS, PAGE_SIZE

PLACEMENTS = {"static": 0, "side": 0, "inline+4": 4, "inline+16": 16}


def _scale_kwargs(placement: str, key_cache, head_dim: int, dequantize: bool) -> dict:
    if placement == "static":
        return dict(key_scale=0.5, value_scale=0.5)
    if placement == "side":
        side = torch.zeros(key_cache.shape[:-1], device=key_cache.device)
        return dict(key_scale_cache=side, value_scale_cache=side.clone())
    return dict(key_scale_cache="inline", value_scale_cache="inline",
                **(dict(head_dim=head_dim) if dequantize else {}))


def _write_bytes(tokens: int, head_dim: int, row: int, scale_bytes: int) -> int:
    """bf16 K and V read, their cache rows (and scales) written, slots read."""
    return tokens * HEADS * (2 * head_dim * 2 + 2 * row + 2 * scale_bytes) + tokens * 8


def table_dynamic(device, cfg: Config, timer: Timer, copy_gbps: float) -> Table:
    tokens = cfg.dynamic_tokens
    batch, pages_per_seq = cfg.dynamic_dequant
    table = Table("dynamic", "Dynamic per-token-head scales: placements side by side",
                  f"{HEADS} kv heads, page {PAGE_SIZE}, bf16 -> e4m3. `write`: {tokens:,} tokens "
                  f"at random slots; `dequantize`: {batch}x{pages_per_seq} pages to bf16; "
                  "`gather`: one sequence's pages of K read as an attention kernel reads them "
                  "(`cache[pages]`)" + ("; `graph N`: a CUDA-graph replay of an N-token write"
                                         if timer.cuda else "")
                  + ". Bytes include the scales (4 per head and token).", plot="bars")
    for head_dim in cfg.dynamic_head_dims:
        num_pages = tokens // PAGE_SIZE + batch * pages_per_seq + 16
        k = torch.randn(tokens, HEADS, head_dim, dtype=torch.bfloat16, device=device)
        v = torch.randn_like(k)
        slots = torch.randperm(num_pages * PAGE_SIZE, device=device)[:tokens]
        block_table = torch.randint(0, num_pages, (batch, pages_per_seq), dtype=torch.int32,
                                    device=device)
        for placement, pad in PLACEMENTS.items():
            row = head_dim + pad
            scale_bytes = 0 if placement == "static" else 4
            kc = torch.zeros(num_pages, PAGE_SIZE, HEADS, row, dtype=torch.uint8, device=device)
            vc = torch.zeros_like(kc)
            kw = _scale_kwargs(placement, kc, head_dim, False)
            name = f"D{head_dim} {placement}"
            write_bytes = _write_bytes(tokens, head_dim, row, scale_bytes)
            us = timer.time("eager", [lambda: fp8kv_torch.write_kv(k, v, kc, vc, slots, **kw)])
            table.add(f"write {name}", tokens, "fp8kv", "eager", us, write_bytes)
            dkw = _scale_kwargs(placement, kc, head_dim, True)
            if placement == "side":
                dkw = dict(key_scale_cache=kw["key_scale_cache"],
                           value_scale_cache=kw["value_scale_cache"])
            rows = batch * pages_per_seq * PAGE_SIZE * HEADS
            dq_bytes = (rows * (2 * row + 2 * head_dim * 2 + 2 * scale_bytes)
                        + batch * pages_per_seq * 8)
            us = timer.time("eager", [lambda: fp8kv_torch.dequantize_pages(kc, vc, block_table,
                                                                             **dkw)])
            table.add(f"dequantize {name}", batch * pages_per_seq, "fp8kv", "eager", us, dq_bytes)
            seq = block_table[0].long()
            us = timer.time("eager", [lambda: kc[seq].sum(dtype=torch.int32)])
            table.add(f"gather {name}", pages_per_seq, "torch", "eager", us,
                      pages_per_seq * PAGE_SIZE * HEADS * row)
            if placement != "static" and timer.cuda:
                for n in cfg.dynamic_graph_tokens:
                    kn, vn, sn = k[:n].clone(), v[:n].clone(), slots[:n].clone()
                    us = timer.time("graph", [lambda: fp8kv_torch.write_kv(kn, vn, kc, vc, sn,
                                                                           **kw)])
                    table.add(f"graph {n} {name}", n, "fp8kv", "graph", us,
                              _write_bytes(n, head_dim, row, scale_bytes))
            del kc, vc, kw, dkw
            free_memory()
        if timer.cuda:
            table.note(f"D{head_dim}: % of copy bandwidth is bytes / time / {copy_gbps:.0f} GB/s.")
    return table

