"""Eager-call tables (torch): what one call costs when an engine makes them back to back.

Each row is :func:`bench.common.back_to_back_us`: warm-up calls, then repetitions of many
back-to-back eager calls with one ``torch.cuda.synchronize()`` at the end, wall time per call
(median repetition). Next to fp8kv's calls: the single-launch Triton anchors of
:mod:`bench.anchors` (launched with ``kernel[grid](...)``) and the floor, an empty Triton kernel
launched the same way and timed the same way in the same run.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

import fp8kv_torch

from . import anchors
from .common import Config, back_to_back_us, free_memory
from .dequant import PAGE_ELEMS, build_dequant_case
from .results import Table, tokens_case
from .write_torch import HEAD_DIM, HEADS, PAGE_SIZE, build_write_case

MODE = "eager-wall"


def _floor_us(device, cfg: Config, cuda: bool) -> float:
    x = torch.zeros(1, device=device)
    return back_to_back_us([functools.partial(anchors.empty, x)], cfg, cuda)


def _describe(cfg: Config) -> str:
    return (f"Wall time per call of back-to-back eager calls ({cfg.eager_warmup} warm-up, then "
            f"{cfg.eager_reps} x {cfg.eager_calls} calls with one synchronize at the end of each; "
            f"median). Caches: {cfg.eager_cache_pages} pages x {PAGE_SIZE} x {HEADS} heads x "
            f"{HEAD_DIM} e4m3 each, bf16 K/V, per-tensor device scales. `floor`: an empty Triton "
            "kernel's `kernel[grid](...)` call, timed the same way (dashed line in the plot). ")


def table_eager_dequant(device, cfg: Config, cuda: bool, floor_us: float) -> Table:
    """``dequantize_pages`` eager calls: allocating, ``out=``, combined cache; the anchor; floor."""
    table = Table(
        "eager_dequant", "Eager calls: dequantize pages (torch)",
        _describe(cfg) + "`fp8kv alloc`: `fp8kv_torch.dequantize_pages(...)` allocating its "
        "outputs; `fp8kv out=`: into preallocated outputs; `fp8kv combined out=`: "
        "`dequantize_pages_combined` on one [P, 2, S, H, D] cache; `anchor triton`: a plain "
        "vLLM-shaped Triton kernel (one program per (table entry, 2048-element chunk), gather, "
        "scale, store bf16; no renumbered table). Bytes: fp8 pages read, bf16 pages written, "
        "block table read (and, for fp8kv, the new table written).",
        xlabel="table entries (pages)", plot="time")
    eager_cfg = dataclasses.replace(cfg, dequant_cache_pages=cfg.eager_cache_pages)
    mismatched = []
    for batch, pages_per_seq in cfg.eager_dequant_shapes:
        entries = batch * pages_per_seq
        name = f"{batch}x{pages_per_seq} pages"
        case = build_dequant_case(device, eager_cfg, batch, pages_per_seq)
        ks, vs = case.key_scale, case.value_scale
        allocating = [functools.partial(fp8kv_torch.dequantize_pages, case.key_cache,
                                        case.value_cache, t, ks, vs) for t in case.tables]
        kv_cache = torch.stack([case.key_cache, case.value_cache], dim=1)
        combined_out = fp8kv_torch.dequantize_pages_combined(kv_cache, case.tables[0], ks, vs)
        combined = [functools.partial(fp8kv_torch.dequantize_pages_combined, kv_cache, t, ks, vs,
                                      out=combined_out) for t in case.tables]
        flat = [t.flatten() for t in case.tables]
        anchor_out = (torch.empty_like(case.outs[0]), torch.empty_like(case.outs[1]))
        anchor = [functools.partial(anchors.dequant_pages, case.key_cache, case.value_cache, t,
                                    ks, vs, *anchor_out) for t in flat]
        anchor_bytes = entries * PAGE_ELEMS * (1 + 2) * 2 + entries * 4
        for provider, fns, nbytes in (("fp8kv alloc", allocating, case.nbytes),
                                      ("fp8kv out=", case.fp8kv_calls(), case.nbytes),
                                      ("fp8kv combined out=", combined, case.nbytes),
                                      ("anchor triton", anchor, anchor_bytes)):
            table.add(name, entries, provider, MODE, back_to_back_us(fns, cfg, cuda), nbytes)
        if cuda:  # the interpreter rounds the anchor's casts its own way: compare on a GPU only
            case.fp8kv_calls()[0]()
            anchor[0]()
            if not all(torch.equal(a, b) for a, b in zip(case.outs[:2], anchor_out)):
                mismatched.append(name)
        del case, kv_cache, combined_out, anchor_out, allocating, combined, anchor
        free_memory()
    table.add("empty Triton kernel", 0, "floor", MODE, floor_us, 0)
    if not cuda:
        table.note("The anchor's pages are not compared with fp8kv's on the CPU (the interpreter "
                   "rounds plain Triton casts differently).")
    elif mismatched:
        table.note(f"the anchor's pages DIFFER from fp8kv's for {mismatched}")
    else:
        table.note("The anchor's pages equal fp8kv's in every case.")
    return table


def table_eager_write(device, cfg: Config, cuda: bool, floor_us: float) -> Table:
    """``write_kv`` eager calls at 1 and 32 tokens; the SGLang-style anchor writer; the floor."""
    table = Table(
        "eager_write", "Eager calls: write K/V (torch)",
        _describe(cfg) + "`fp8kv`: `fp8kv_torch.write_kv`; `anchor triton`: a plain Triton "
        "writer in the style of a fused FP8 set-KV-buffer (one program per token, K and V rows "
        "divided by the scale with Triton's `/`, cast to e4m3, stored at the slot). Random "
        "distinct int64 slots. Bytes: K and V read, fp8 written, slots read.",
        xlabel="tokens written per call", plot="time")
    row = HEADS * HEAD_DIM
    eager_cfg = dataclasses.replace(
        cfg, min_cache_bytes=2 * cfg.eager_cache_pages * PAGE_SIZE * row)
    differing = {}
    for tokens in cfg.eager_write_tokens:
        case = build_write_case(device, eager_cfg, tokens)
        anchor = [functools.partial(anchors.write_tokens, k, v, case.key_cache, case.value_cache,
                                    s, case.key_scale, case.value_scale) for k, v, s in case.sets]
        name = tokens_case(tokens)
        for provider, fns in (("fp8kv", case.fp8kv_calls()), ("anchor triton", anchor)):
            table.add(name, tokens, provider, MODE, back_to_back_us(fns, cfg, cuda), case.nbytes)
        if cuda:
            differing[tokens] = _write_difference(case, anchor[0])
        del case, anchor
        free_memory()
    table.add("empty Triton kernel", 0, "floor", MODE, floor_us, 0)
    if not cuda:
        table.note("The anchor's bytes are not compared with fp8kv's on the CPU (the interpreter "
                   "rounds plain Triton casts differently).")
    else:
        table.note("Cache bytes where the anchor differs from fp8kv (exact division), per token "
                   "count: " + ", ".join(f"{t}: {n}" for t, n in differing.items()) + ".")
    return table


def _write_difference(case, anchor_call) -> int:
    """Bytes of K and V caches where one anchor call and one fp8kv call disagree (fresh caches)."""
    caches = (case.key_cache, case.value_cache)
    for c in caches:
        c.zero_()
    case.fp8kv_calls()[0]()
    want = [c.view(torch.uint8).clone() for c in caches]
    for c in caches:
        c.zero_()
    anchor_call()
    return int(sum((c.view(torch.uint8) != w).sum().item() for c, w in zip(caches, want)))


def eager_tables(device, cfg: Config, timer, copy_gbps: float):
    """Yield the dequantize and write eager tables; the floor is measured once, first. (The
    tables time calls their own way, not with ``timer``.)"""
    cuda = timer.cuda
    floor_us = _floor_us(device, cfg, cuda)
    yield table_eager_dequant(device, cfg, cuda, floor_us)
    free_memory()
    yield table_eager_write(device, cfg, cuda, floor_us)
    free_memory()
