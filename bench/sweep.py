"""Tuning sweep: the size tables of ``fp8kv.plan`` and ``fp8kv.attention`` and the cost of the
bit-exact conversions."""
from __future__ import annotations

import contextlib
import itertools

import torch

from fp8kv import attention, dequantize, plan, write
from fp8kv.validate import frontend_args
from fp8kv.write import check_write
from fp8kv_torch._launch import clear_launch_caches, info

from . import attention as attention_bench
from . import latency
from .common import Config, Timer, free_memory
from .dequant import build_dequant_case
from .results import Table, tokens_case
from .write_torch import HEAD_DIM, HEADS, build_write_case

TILES = (1024, 2048, 4096, 8192)      # write: elements per program (per K or V)
BLOCKS = (1024, 2048, 4096, 8192)     # dequant: elements per program
WARPS = (2, 4, 8)


@contextlib.contextmanager
def planned_with(sizes: dict, backend: str, **entries):
    """Plan with ``entries`` in ``sizes[backend]`` (a ``plan.*_SIZES`` table); restore afterwards.

    The plan caches and the torch frontend's cached launches would otherwise keep serving what
    the old sizes made, so both are cleared on the way in and out.
    """
    saved = dict(sizes[backend])
    sizes[backend].update(entries)
    clear_launch_caches()
    try:
        yield
    finally:
        sizes[backend].clear()
        sizes[backend].update(saved)
        clear_launch_caches()


def _write_plan(case, backend: str) -> plan.LaunchPlan:
    """The plan the launcher makes for ``case`` now (the tile can override the warps)."""
    key, value, slots = case.sets[0]
    arrays = dict(key=key, value=value, key_cache=case.key_cache, value_cache=case.value_cache,
                  slots=slots)
    args = check_write(**frontend_args(info, torch.Tensor, arrays, case.key_scale,
                                       case.value_scale, None, None),
                       layout=case.layout, fp8_format=None)
    return write.plan_write(args, backend)


def _sweep_write(device, cfg: Config, timer: Timer, backend: str, mode: str, tokens: int) -> Table:
    table = Table(f"sweep_write_{tokens}", f"Sweep: write tile and warps at {tokens:,} tokens",
                  "`WRITE_SIZES` candidates, fastest first; `->` gives the launched block "
                  "(tokens x row elements) and warps, as the plan may override the warps.",
                  plot="bars", sort=True)
    sizes = write.WRITE_SIZES[backend]
    small = tokens * HEADS * HEAD_DIM <= sizes["small_batch_elems"]
    default = (sizes["tile"], sizes["small_batch_warps" if small else "num_warps"])
    case = build_write_case(device, cfg, tokens)
    fns = case.fp8kv_calls()
    for tile, warps in itertools.product(TILES, WARPS):
        with planned_with(write.WRITE_SIZES, backend, tile=tile, max_block_hd=tile,
                          num_warps=warps, small_batch_warps=warps):
            launched = _write_plan(case, backend)
            c = launched.constexprs["TILE"]
            label = (f"tile {tile}, {warps}w -> {c.BLOCK_T}x{c.BLOCK_HD}, "
                     f"{launched.num_warps}w" + (" (default)" if (tile, warps) == default else ""))
            table.add(label, tokens, "fp8kv", mode, timer.time(mode, fns, sweep=True), case.nbytes)
    return table


def _sweep_dequant(device, cfg: Config, timer: Timer, backend: str, mode: str) -> Table:
    batch, pages_per_seq, name = cfg.sweep_dequant
    table = Table("sweep_dequant", f"Sweep: dequantize block and warps at {name}",
                  "`DEQUANT_SIZES` candidates, fastest first (block: elements of a page per "
                  "program).", plot="bars", sort=True)
    default = dequantize.DEQUANT_SIZES[backend]
    default = (default["block"], default["num_warps"])
    case = build_dequant_case(device, cfg, batch, pages_per_seq)
    fns = case.fp8kv_calls()
    for block, warps in itertools.product(BLOCKS, WARPS):
        with planned_with(dequantize.DEQUANT_SIZES, backend,
                          block=block, num_warps=warps):
            label = f"block {block}, {warps}w" + (" (default)" if (block, warps) == default else "")
            table.add(label, batch * pages_per_seq, "fp8kv", mode,
                      timer.time(mode, fns, sweep=True), case.nbytes)
    return table


def _sweep_division(device, cfg: Config, timer: Timer, backend: str, mode: str) -> Table:
    """div.rn per element vs one reciprocal per program and two FMA corrections (both exact)."""
    table = Table("sweep_division", "Sweep: division by the scale",
                  "`div_rn`: IEEE division per element; `reciprocal`: RN(1/s) once, then "
                  "q = x*y and two FMA corrections (exact by Markstein's theorem; see "
                  "fp8kv.ops.codec.divide_by_scalar). Device scale [] per tensor.", plot="bars")
    for tokens in cfg.sweep_write_tokens:
        case = build_write_case(device, cfg, tokens)
        for reciprocal in (False, True):
            with planned_with(write.WRITE_SIZES, backend, reciprocal_div=reciprocal):
                table.add(f"write {tokens_case(tokens)}", tokens,
                          "reciprocal" if reciprocal else "div_rn", mode,
                          timer.time(mode, case.fp8kv_calls(), sweep=True), case.nbytes)
        del case
        free_memory()
    return table


def _exact_vs_fast(device, cfg: Config, timer: Timer, mode: str) -> Table:
    table = Table("sweep_exact", "Sweep: bit-exact software conversions vs hardware conversions",
                  "`exact`: the integer-arithmetic conversions the CPU interpreter needs "
                  "(`_launch.*(..., exact=True)`); `fast`: the hardware `cvt` instructions "
                  "(`exact=False`, the default on CUDA). Both give the same bytes.",
                  plot="bars")
    cases = [(f"write {tokens_case(t)}", t, build_write_case(device, cfg, t))
             for t in cfg.sweep_write_tokens]
    batch, pages_per_seq, name = cfg.sweep_dequant
    cases.append((f"dequant {name}", batch * pages_per_seq,
                  build_dequant_case(device, cfg, batch, pages_per_seq)))
    for label, size, case in cases:
        for exact in (True, False):
            table.add(label, size, "exact" if exact else "fast", mode,
                      timer.time(mode, case.launch_calls(exact), sweep=True), case.nbytes)
    return table


# Attention: overrides of the CUDA row of ``ATTENTION_SIZES``, read by every format (the row's
# ``packed`` and ``plain`` overrides set aside unless a candidate names them); the first is the
# row with its overrides. The open question: the loop's tiles ending at the share's end and
# the row sums per token column, which the row gives NVFP4's split calls, against neither and
# both everywhere (NVFP4's split shapes faster, 256 x 1,024 slower in one H200 lease). Kept
# short: every candidate is a compile of its own (bench/NOTES.md has the earlier candidates'
# numbers).
_ROW = attention.ATTENTION_SIZES[attention.CUDA]
_AS_IS = {"packed": _ROW["packed"], "plain": _ROW["plain"]}
_NO_SPLIT_CUTS = dict(split_align_end=False, split_column_sums=False)
_CUTS = dict(split_align_end=True, split_column_sums=True, align_end=True, column_sums=True)
ATTENTION_CANDIDATES = (
    _AS_IS, dict(_AS_IS, packed={**_ROW["packed"], **_NO_SPLIT_CUTS}),
    dict(_AS_IS, **_CUTS),   # (the row's ``packed`` names the split cuts only: NVFP4 gets all four)
)
ATTENTION_SWEEP_FORMATS = ("e4m3", "e4m3 token-head", "nvfp4", "bf16")
ATTENTION_SWEEP_SHAPES = ((1, 8192), (8, 4096), (32, 4096), (64, 2048), (256, 1024))
_LABEL_KEYS = (("n", "block_n"), ("w", "warps"), ("s", "stages"), ("ss", "split_stages"),
               ("b", "split_below"), ("t", "target_programs"), ("m", "min_split_tokens"),
               ("r", "merge_rows"), ("p", "peel"), ("pf", "prefetch"), ("g", "pdl"),
               ("f", "fuse_scale"), ("x", "pow2_splits"), ("ae", "align_end"),
               ("cs", "column_sums"), ("sae", "split_align_end"), ("scs", "split_column_sums"))


def attention_candidate_label(overrides: dict) -> str:
    """The candidate's whole row, e.g. ``n32 w2 s5 ss3 b256 t264 m256 p1 f1``."""
    row = {**attention.ATTENTION_SIZES[attention.CUDA], **overrides}
    label = " ".join(f"{short}{int(row[key]) if isinstance(row[key], bool) else row[key]}"
                     for short, key in _LABEL_KEYS)
    return label + "".join(f" {name} {key} {value}"
                           for sub, name in (("packed", "nvfp4"), ("plain", "bf16"))
                           for key, value in overrides.get(sub, {}).items())


def attention_sweep_tables(device, cfg: Config, timer: Timer, copy_gbps: float):
    """``ATTENTION_SIZES`` candidates on the attention table's shapes (CUDA only: the
    interpreter's sizes are not a tuning target)."""
    if not timer.cuda:
        return
    table = Table("sweep_attention", "Sweep: paged attention tiles, warps, stages, splits",
                  "`ATTENTION_SIZES` candidates (`n` tokens per warp tile, `w` warps, `s` / `ss` "
                  "pipeline stages unsplit / split, `b` split below this many programs, `t` "
                  "the programs splitting aims at, `m` the fewest tokens per split, `r` output "
                  "rows per merge program, `p1` the first tile peeled off the loop (FP8 / NVFP4 "
                  "keys), `pf` the tiles after it prefetched into L2, `g1` the merge launched "
                  "as a dependent, `f1` NVFP4 block scales applied in the unpacking asm, `x1` "
                  "split counts rounded up to powers of two, `ae1` the loop's tiles ending "
                  "at the share's end, `cs1` row sums per token column, `sae` / `scs` the "
                  "same for split calls) per "
                  "shape and cache format; the first candidate is the table's row. NVFP4 and "
                  "bf16 read with each candidate's own stages (the row's `packed` and `plain` "
                  "overrides set aside where a candidate does not name them) unless the label "
                  "says `nvfp4 stages` / `bf16 stages`.",
                  plot="bars")
    shapes = ATTENTION_SWEEP_SHAPES
    cases = {}
    for candidate in ATTENTION_CANDIDATES:
        label = attention_candidate_label(candidate)
        entries = {"packed": {}, "plain": {}, **candidate}
        with planned_with(attention.ATTENTION_SIZES, attention.CUDA, **entries):
            try:
                _time_attention_candidate(table, device, timer, label, shapes, cases)
            except Exception as e:   # a candidate that does not compile or fit: say so, go on
                table.note(f"{label}: failed "
                           f"({type(e).__name__}: {str(e)[:120]})")
    del cases
    free_memory()
    yield table


def _time_attention_candidate(table, device, timer, label, shapes, cases):
    for batch, context in shapes:
        for fmt in ATTENTION_SWEEP_FORMATS:
            key = (batch, context, fmt)
            if key not in cases:
                cases[key] = attention_bench.make_cache(batch, context, fmt, device)
            kw, nbytes = cases[key]
            out = torch.empty_like(kw["query"])
            us = timer.time("graph", [lambda: attention_bench.attend(kw, out)], sweep=True)
            table.add(f"{batch}x{context} {fmt}", batch * context,
                      label, "graph", us, nbytes)


def sweep_tables(device, cfg: Config, timer: Timer, copy_gbps: float):
    """Table 5: time every size-table candidate (graph mode) and exact vs fast conversions.

    Yields each table as it completes. On the CPU the interpreter's size table is swept instead,
    which only exercises the harness.
    """
    backend = plan.CUDA if timer.cuda else plan.INTERPRET
    mode = "graph" if timer.cuda else "eager"
    for tokens in cfg.sweep_write_tokens:
        yield _sweep_write(device, cfg, timer, backend, mode, tokens)
        free_memory()
    yield _sweep_dequant(device, cfg, timer, backend, mode)
    free_memory()
    yield _exact_vs_fast(device, cfg, timer, mode)
    free_memory()
    yield _sweep_division(device, cfg, timer, backend, mode)
    free_memory()
    if timer.cuda:  # plain Triton kernels: no interpreter twins on the CPU
        yield latency.table_traffic_floors(device, cfg, timer)
        free_memory()
        yield latency.table_latency_floor(device, cfg, timer)
        free_memory()
