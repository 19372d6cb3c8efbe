"""Small writes under CUDA-graph replay: fp8kv against one-program-per-token writers.

A decode step writes 1-256 tokens; inside a CUDA graph the host costs nothing and what is left is
the kernel's own latency: its first loads (slots, K/V rows, the scale), the division, the stores.
The rows compare fp8kv's write (exact IEEE division) with two plain writers of the kind engines
ship (bench/anchors.py, Triton's ``/``): the tiled one-program-per-token writer (2,048-element
tiles, 16 warps) and the SGLang-style one (one tile per row, 4 warps); then fp8kv with other
small-batch entries of ``fp8kv.write.WRITE_SIZES`` (the split of a few tokens' rows over
programs, warps, the division), measured in the same run to choose them.
"""
from __future__ import annotations

import functools

import fp8kv_torch
from fp8kv import plan, write
from fp8kv.modes import Division

from . import anchors
from .common import Config, Timer, free_memory
from .results import Table, tokens_case
from .sweep import planned_with
from .write_torch import HEAD_DIM, HEADS, PAGE_SIZE, build_write_case

TOKENS = (1, 16, 64, 256)
# fp8kv with other small-batch plan entries: label -> WRITE_SIZES entries. "chunks": rows split
# over programs (grid axis 1) up to the given batch size.
PLAN_VARIANTS = {
    "fp8kv, rows whole": dict(split_batch_tokens=0),
    "fp8kv, rows whole, 8 warps, FMA division (the previous plan)": dict(
        split_batch_tokens=0, decode_batch_elems=0, reciprocal_div=Division.FMA),
    "fp8kv, 128-column chunks up to 256 tokens": dict(split_batch_tokens=256),
    "fp8kv, 128-column chunks, fp64 division": dict(split_division=Division.FP64),
}


def _anchor_calls(case, writer) -> list:
    return [functools.partial(writer, k, v, case.key_cache, case.value_cache, s, case.key_scale,
                              case.value_scale) for k, v, s in case.sets]


def table_write_small(device, cfg: Config, timer: Timer, copy_gbps: float) -> Table:
    # The title and description say how this machine timed the calls: graph replay on a GPU.
    how = "CUDA-graph replay" if timer.cuda else "eager calls"
    table = Table(
        "write_small", f"Small writes, {how} (torch)",
        f"{HEADS} kv heads x {HEAD_DIM} dims, page {PAGE_SIZE}, bf16 -> e4m3, one device scale, "
        f"random slots; time per call from {how}. `fp8kv`: `fp8kv_torch.write_kv` "
        "(exact division). `tiled writer`: the seed-style one-program-per-token writer in "
        "bench/anchors.py (2,048-element tiles over heads x head_dim, 16 warps, scale loaded once "
        "per program, Triton's `/`). `SGLang-style writer`: one program per token, one tile per "
        "row, 4 warps. `fp8kv, no scale`: the same write without a scale (what the division "
        "costs). The other `fp8kv, ...` rows change one small-batch entry of the plan.",
        xlabel="tokens written per call")
    mode = "graph" if timer.cuda else timer.modes[0]
    for tokens in TOKENS if timer.cuda else TOKENS[:2]:
        case = build_write_case(device, cfg, tokens)
        name = tokens_case(tokens)
        no_scale = [functools.partial(fp8kv_torch.write_kv, k, v, case.key_cache,
                                      case.value_cache, s) for k, v, s in case.sets]
        providers = [("fp8kv", case.fp8kv_calls()),
                     ("fp8kv, no scale (no division)", no_scale),
                     ("tiled writer", _anchor_calls(case, anchors.write_tokens_tiled)),
                     ("SGLang-style writer", _anchor_calls(case, anchors.write_tokens))]
        for provider, fns in providers:
            table.add(name, tokens, provider, mode, timer.time(mode, fns), case.nbytes)
        if timer.cuda:
            for label, entries in PLAN_VARIANTS.items():
                with planned_with(write.WRITE_SIZES, plan.CUDA, **entries):
                    table.add(name, tokens, label, mode, timer.time(mode, case.fp8kv_calls()),
                              case.nbytes)
        del case, providers
        free_memory()
    return table
