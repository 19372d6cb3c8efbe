"""Dequantize tables (torch): ``fp8kv_torch.dequantize_pages`` against a PyTorch gather."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import fp8kv_torch
from fp8kv_torch import _launch

from .common import Config, Timer, free_memory, num_sets
from .results import Table
from .write_torch import HEADS, HEAD_DIM, PAGE_SIZE, SCALE

PAGE_ELEMS = PAGE_SIZE * HEADS * HEAD_DIM


def dequant_bytes(entries: int, out_itemsize: int = 2) -> int:
    """Minimal traffic: fp8 K and V pages read, K and V pages written, table read and written."""
    return entries * PAGE_ELEMS * (1 + out_itemsize) * 2 + entries * 4 * 2


@dataclass
class DequantCase:
    """A random e4m3 cache, block tables over it (one per input set) and preallocated outputs."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_scale: torch.Tensor
    value_scale: torch.Tensor
    tables: list
    outs: tuple
    nbytes: int

    def fp8kv_calls(self) -> list:
        return [functools.partial(fp8kv_torch.dequantize_pages, self.key_cache, self.value_cache,
                                  t, self.key_scale, self.value_scale, out=self.outs)
                for t in self.tables]

    def launch_calls(self, exact: bool) -> list:
        """Calls of the launcher with the exact (True) or hardware (False) conversions forced."""
        return [functools.partial(_launch.call, "dequantize_pages", self.key_cache, self.value_cache, t,
                                  self.key_scale, self.value_scale, self.outs[0].dtype, "NHD", None,
                                  None, tuple(self.outs), exact=exact)
                for t in self.tables]

    def gather_calls(self) -> list:
        return [functools.partial(gather_dequant, self.key_cache, self.value_cache, t,
                                  self.key_scale, self.value_scale) for t in self.tables]


def gather_dequant(key_cache, value_cache, block_table, key_scale, value_scale,
                   dtype=torch.bfloat16):
    """The baseline: gather the named pages, upcast, scale, round to ``dtype``; plus the new table."""
    flat = block_table.flatten()
    # Gather through uint8 views: same bytes and kernel, without relying on float8 indexing.
    key_pages, value_pages = ((c.view(torch.uint8)[flat].view(c.dtype).float() * s).to(dtype)
                              for c, s in ((key_cache, key_scale), (value_cache, value_scale)))
    table = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device).view(block_table.shape)
    return key_pages, value_pages, table


def build_dequant_case(device, cfg: Config, batch: int, pages_per_seq: int) -> DequantCase:
    """Allocate a ``cfg.dequant_cache_pages`` cache and ``batch x pages_per_seq`` tables.

    Every table names distinct random pages of the cache (``batch * pages_per_seq`` must not
    exceed its pages), and each input set has its own table, so rotated calls read other pages.
    """
    shape = (cfg.dequant_cache_pages, PAGE_SIZE, HEADS, HEAD_DIM)
    # Finite codes only (no NaN), so that the comparison with the baseline can be exact.
    key_cache, value_cache = (torch.randn(shape, dtype=torch.bfloat16, device=device)
                              .to(torch.float8_e4m3fn) for _ in range(2))
    entries = batch * pages_per_seq
    nbytes = dequant_bytes(entries)
    tables = [torch.randperm(shape[0], device=device)[:entries].to(torch.int32)
              .reshape(batch, pages_per_seq) for _ in range(num_sets(cfg, nbytes))]
    key_scale = torch.tensor(SCALE, dtype=torch.float32, device=device)
    value_scale = torch.tensor(2 * SCALE, dtype=torch.float32, device=device)
    outs = fp8kv_torch.dequantize_pages(key_cache, value_cache, tables[0], key_scale, value_scale)
    return DequantCase(key_cache, value_cache, key_scale, value_scale, tables, outs, nbytes)


def table_dequant(device, cfg: Config, timer: Timer, copy_gbps: float) -> Table:
    """Table 4: dequantize the pages of block tables into a compact bf16 cache."""
    table = Table(
        "dequant", "Dequantize pages named by a block table (torch)",
        f"Cases are batch x pages per sequence over a {cfg.dequant_cache_pages}-page e4m3 cache "
        f"({HEADS} kv heads x {HEAD_DIM} dims, page {PAGE_SIZE}) -> bf16, random distinct pages. "
        "`fp8kv`: `fp8kv_torch.dequantize_pages(..., out=...)`. `torch-gather`: "
        "`(cache[table.flatten()].float() * scale).to(bf16)` for K and V plus the arange table. "
        "Bytes: fp8 pages read, bf16 pages written, table read and written.",
        plot="bars")
    mismatched = []
    for batch, pages_per_seq, name in cfg.dequant_shapes:
        case = build_dequant_case(device, cfg, batch, pages_per_seq)
        entries = batch * pages_per_seq
        got = fp8kv_torch.dequantize_pages(case.key_cache, case.value_cache, case.tables[0],
                                           case.key_scale, case.value_scale)
        want = case.gather_calls()[0]()
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            mismatched.append(name)
        del got, want
        for mode in timer.modes:
            table.add(name, entries, "fp8kv", mode, timer.time(mode, case.fp8kv_calls()),
                      case.nbytes)
        # No graph for the baseline: ten captured calls would hold ten sets of its temporaries.
        for mode in (m for m in timer.modes if m != "graph"):
            table.add(name, entries, "torch-gather", mode, timer.time(mode, case.gather_calls()),
                      case.nbytes)
        if timer.cuda:
            table.add_roofline(name, entries, case.nbytes, copy_gbps)
        del case
        free_memory()
    if mismatched:
        table.note(f"fp8kv and torch-gather gave DIFFERENT pages for {mismatched}")
    else:
        table.note("fp8kv and torch-gather gave identical pages and tables for every case.")
    return table
