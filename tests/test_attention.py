"""``paged_attention`` (docs/SPEC.md section 16) through torch: every cache format, scale kind,
layout and option against the fp64 reference within the spec's bound, on the interpreter (CPU)
and compiled (GPU); the GPU's exact and fast conversions give the same bytes (a bf16 / fp16
cache's exact path reads fp32 operands, as the interpreter: within the bound); a call repeats its
bytes; CUDA graphs, torch.compile; bad inputs.
"""
from __future__ import annotations

import inspect
import os
import re

import numpy as np
import pytest
import triton
import triton.language as tl

torch = pytest.importorskip("torch")

import fp8kv_torch  # noqa: E402
from fp8kv import attention  # noqa: E402
from fp8kv.attention import ATTENTION_SIZES, error_bound, plan_attention, splits_for  # noqa: E402
from fp8kv.attention import paged_attention as reference_attention  # noqa: E402
from fp8kv.ops._dual import jit  # noqa: E402
from fp8kv.ops.paged_attention import balanced_share  # noqa: E402
from fp8kv.plan import CUDA, INTERPRET  # noqa: E402
from fp8kv_torch import _attention  # noqa: E402
from tests.attention_cases import (NOTHING_TO_READ, RANDOM_CASES, AttentionCase,  # noqa: E402
                                   build, gpu_infos, nothing_to_read)
from tests.helpers import requires_cuda, to_torch  # noqa: E402

# One case per feature; each runs on every device (the interpreter: a second or two each).
CASES = [
    AttentionCase(),
    AttentionCase(cache="e5m2", scale="tensor", seq_lens=(9, 0, 17), num_heads=4,
                  num_kv_heads=4, head_dim=32, page_size=4),
    AttentionCase(cache="bfloat16", seq_lens=(20, 33), num_heads=4, head_dim=32),
    AttentionCase(cache="float16", query_dtype="float16", seq_lens=(3,), num_heads=4,
                  num_kv_heads=1, head_dim=32, page_size=1, rank=3),
    AttentionCase(scale="head", layout="HND", seq_lens=(18, 40), head_dim=32, page_size=8),
    AttentionCase(scale="token_head", seq_lens=(25, 2), head_dim=32, page_size=8),
    AttentionCase(scale="token", seq_lens=(25,), head_dim=32, page_size=8, num_heads=4),
    AttentionCase(scale="inline", seq_lens=(12, 30), head_dim=32, page_size=8),
    AttentionCase(scale="inline16", seq_lens=(12,), head_dim=32, page_size=8, layout="HND"),
    AttentionCase(cache="nvfp4", seq_lens=(21, 40), head_dim=32, page_size=8),
    AttentionCase(cache="nvfp4", scale="tensor", seq_lens=(7,), head_dim=80, page_size=4,
                  layout="HND", num_heads=2, num_kv_heads=1),
    AttentionCase(combined=True, seq_lens=(21, 9), head_dim=32, page_size=8),
    AttentionCase(layers=3, layer=1, seq_lens=(21, 9), head_dim=32, page_size=8),
    AttentionCase(layers=2, layer=2, seq_lens=(5,), head_dim=16, page_size=4),   # out of range
    AttentionCase(query_lens=(3, 1), seq_lens=(30, 7), head_dim=32, page_size=4, window=6,
                  num_heads=4, num_kv_heads=1),
    AttentionCase(query_lens=(4, 0, 2), seq_lens=(9, 3, 2), head_dim=16, page_size=2,
                  num_heads=8, num_kv_heads=1),      # two row tiles: 4 tokens x 8 heads
    AttentionCase(soft_cap=4.0, sinks=True, seq_lens=(30, 0), head_dim=32, page_size=4),
    AttentionCase(head_dim=80, seq_lens=(30,), page_size=16, num_heads=2, num_kv_heads=2),
    AttentionCase(seq_lens=(150,), head_dim=32, page_size=16, num_heads=2, num_kv_heads=1),
    AttentionCase(cache="mxfp8", seq_lens=(21, 9), head_dim=64, page_size=8, layout="HND"),
]


def call_of(case: AttentionCase, device):
    c = build(case)
    return {k: to_torch(v, device) if isinstance(v, np.ndarray) else v
            for k, v in c["call"].items()}, c


def attend(call: dict, **kw):
    call = dict(call)
    if "kv_cache" in call:
        return fp8kv_torch.paged_attention_combined(call.pop("query"), call.pop("kv_cache"),
                                                    call.pop("block_table"),
                                                    call.pop("seq_lens"), **call, **kw)
    return fp8kv_torch.paged_attention(call.pop("query"), call.pop("key_cache"),
                                       call.pop("value_cache"), call.pop("block_table"),
                                       call.pop("seq_lens"), **call, **kw)


def within_bound(out, c):
    got = out.float().cpu().numpy()
    err = np.abs(got - c["ref"])
    bad = np.argwhere(~(err <= c["bound"]))
    assert not bad.size, (f"{len(bad)} elements outside the bound, first {tuple(bad[0])}: "
                          f"{got[tuple(bad[0])]} vs {c['ref'][tuple(bad[0])]}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_the_reference_within_the_bound(case, device):
    call, c = call_of(case, device)
    within_bound(attend(call), c)


def test_mxfp8_nan_block_scales_make_their_rows_and_columns_nan(device):
    """An E8M0 NaN (0xFF) in a token's V block scales makes that block's output columns of the
    rows that see the token NaN, in K its rows; every other element keeps the reference's
    bound (each block has a unit of its own)."""
    case = AttentionCase(cache="mxfp8", seq_lens=(21, 9, 14), head_dim=128, page_size=8)
    c = build(case)
    call = dict(c["call"])
    _set_bytes(call, "value_scale_cache", 0, 5, 2, 0xFF)   # (index: the block of 32)
    _set_bytes(call, "key_scale_cache", 1, 8, 0, 0xFF)
    ref = reference_attention(**call)[0]
    assert np.isnan(ref[0, :, 64:96]).all() and np.isnan(ref[1]).all()
    _assert_nan_as_the_reference(call, ref, c, device)


def _set_bytes(call: dict, name: str, seq: int, token: int, index: int, value: int):
    """``call[name]`` (NHD ``[pages, 8 slots, kv heads, last]``, as bytes) with ``value`` at
    ``index`` of sequence ``seq``'s ``token`` in every kv head (a copy)."""
    table = call["block_table"]
    x = call[name].copy()
    x.view(np.uint8)[table[seq, token // 8], token % 8, :, index] = value
    call[name] = x


def _assert_nan_as_the_reference(call: dict, ref, c: dict, device):
    """The poisoned ``call``'s output is NaN exactly where its reference ``ref`` is, and every
    other element keeps the unpoisoned case's bound (``c``: :func:`build`'s)."""
    got = attend({k: to_torch(v, device) if isinstance(v, np.ndarray) else v
                  for k, v in call.items()}).float().cpu().numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    finite = ~np.isnan(ref)
    assert (np.abs(got - c["ref"])[finite] <= c["bound"][finite]).all()


@pytest.mark.parametrize("fmt, nan_code", [("e4m3", 0x7F), ("e5m2", 0xFE)])
def test_fp8_nan_codes_make_what_reads_them_nan(fmt, nan_code, device):
    """A NaN code in a visible token's K makes the rows that see the token NaN, in its V the
    column of those rows (NaN times a probability, even 0); every other element keeps the
    reference's bound (SPEC section 16.2)."""
    case = AttentionCase(cache=fmt, scale="tensor", seq_lens=(21, 9, 14), head_dim=64,
                         page_size=8)
    c = build(case)
    call = dict(c["call"])
    _set_bytes(call, "key_cache", 1, 4, 7, nan_code)
    _set_bytes(call, "value_cache", 2, 13, 50, nan_code)
    ref = reference_attention(**call)[0]
    assert np.isnan(ref[1]).all() and np.isnan(ref[2, :, 50]).all()
    assert not np.isnan(ref[0]).any() and not np.isnan(np.delete(ref[2], 50, axis=-1)).any()
    _assert_nan_as_the_reference(call, ref, c, device)


@pytest.mark.parametrize("case", CASES[:3] + CASES[9:10], ids=lambda c: c.id)
def test_out_is_written_and_returned(case, device):
    call, c = call_of(case, device)
    q = call["query"]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    assert attend(call, out=out) is out
    within_bound(out, c)


@pytest.mark.parametrize("kind", NOTHING_TO_READ)
def test_a_call_that_reads_no_token_gives_zeros(kind, device):
    """An engine's empty step (no sequences, no query tokens, no pages) returns its output's
    shape of zeros, without reading the (NaN) caches."""
    call = {k: to_torch(v, device) if isinstance(v, np.ndarray) else v
            for k, v in nothing_to_read(kind).items()}
    out = attend(call)
    assert out.shape == call["query"].shape and out.dtype == torch.bfloat16
    assert not (out != 0).any()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gpu_exact_conversions_give_the_fast_bytes_and_calls_repeat(case):
    call, c = call_of(case, "cuda")
    fast = attend(call)
    again = attend(call)
    exact = attend_exact(call)
    assert torch.equal(fast.view(torch.int16), again.view(torch.int16))
    if case.cache in ("bfloat16", "float16"):   # fp32 operands and IEEE dots (SPEC 16.2)
        within_bound(exact, c)
    else:
        assert torch.equal(fast.view(torch.int16), exact.view(torch.int16))


def attend_exact(call: dict):
    """The call through the exact conversions (the interpreter's integer paths, compiled)."""
    op = "paged_attention_combined" if "kv_cache" in call else "paged_attention"
    defaults = {n: p.default for n, p in inspect.signature(getattr(fp8kv_torch, op)).parameters
                .items() if p.default is not p.empty}
    return _attention.run(op, {**defaults, **call, "exact": True})


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", RANDOM_CASES, ids=lambda c: c.id)
def test_gpu_random_configurations(case):
    call, c = call_of(case, "cuda")
    within_bound(attend(call), c)


# Those the interpreter runs in a few seconds at most: both unquantized dtypes, e4m3 (head scales,
# inline), e5m2 (head, token-head), nvfp4, mxfp8; ranks 3 and 4, both layouts, windows, sinks,
# caps, stacked and combined caches, query lengths of 0.
INTERPRETED_RANDOM_CASES = [RANDOM_CASES[i] for i in (0, 1, 12, 19, 24, 30, 36, 37, 48)]


@pytest.mark.parametrize("case", INTERPRETED_RANDOM_CASES, ids=lambda c: c.id)
def test_random_configurations_through_the_interpreter(case):
    call, c = call_of(case, "cpu")
    within_bound(attend(call), c)


@requires_cuda
@pytest.mark.gpu
def test_gpu_large_batch_splits_and_merges_every_share():
    case = AttentionCase(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                         seq_lens=(4096, 1, 1000))
    call, c = call_of(case, "cuda")
    _attention.clear()
    out = attend(call)
    ready = next(iter(_attention._READY.values()))
    assert ready.plan.merge is not None     # 3 x 8 programs: split
    within_bound(out, c)


@requires_cuda
@pytest.mark.gpu
def test_gpu_nvfp4_large_grid_reads_with_one_warp_per_program():
    """An NVFP4 call of 1,056 programs (the CUDA row's ``packed``: one warp each, unsplit from
    ``split_below``; ragged lengths, 0 and 1 among them): within the bound, and the exact
    conversions' bytes."""
    lens = tuple(int(n) for n in np.random.default_rng(7).integers(0, 160, 130)) + (0, 1)
    case = AttentionCase(cache="nvfp4", num_heads=32, num_kv_heads=8, head_dim=128,
                         seq_lens=lens)
    call, c = call_of(case, "cuda")
    _attention.clear()
    out = attend(call)
    ready = next(iter(_attention._READY.values()))
    assert ready.plan.attention.num_warps == 1 and ready.plan.merge is None
    assert len(lens) * 8 >= ATTENTION_SIZES[CUDA]["packed"]["split_below"]
    within_bound(out, c)
    assert torch.equal(out.view(torch.int16), attend_exact(call).view(torch.int16))


@requires_cuda
@pytest.mark.gpu
def test_gpu_cuda_graph_replay_reads_new_lengths_without_a_sync():
    case = AttentionCase(seq_lens=(40, 70), head_dim=64)
    call, c = call_of(case, "cuda")
    out = torch.empty_like(call["query"])
    attend(call, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend(call, out=out)
    # The same caches and table, shorter sequences: only the device array seq_lens changes.
    lens = np.int32([13, 2])
    call["seq_lens"].copy_(torch.from_numpy(lens))
    graph.replay()
    ref, vmax, mass = reference_attention(**{**c["call"], "seq_lens": lens})
    within_bound(out, dict(ref=ref, bound=error_bound(ref, vmax, mass, case.head_dim)))


@requires_cuda
@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    case = AttentionCase(scale="token_head", seq_lens=(33, 5), head_dim=64, page_size=16)
    call, c = call_of(case, "cuda")
    compiled = torch.compile(lambda kw: attend(kw), fullgraph=True)
    within_bound(compiled(call), c)


@pytest.mark.parametrize("seq_lens", [(20,), (40, 3), (200,)],
                         ids=["unsplit", "balanced", "split"])
@pytest.mark.parametrize("warps", [1, 4])
def test_other_warp_counts_merge_their_states(warps, seq_lens, device, monkeypatch):
    """The size tables use two warps (their states summed in one exchange); other counts take
    the generic merge of the warps' states: unsplit calls (no merge kernel), balanced ones and
    split ones stay within the bound."""
    sizes = ATTENTION_SIZES[INTERPRET if device == "cpu" else CUDA]
    monkeypatch.setitem(sizes, "warps", warps)
    monkeypatch.setitem(sizes, "balance_seqs", 64 if seq_lens == (40, 3) else 0)
    if seq_lens == (20,):
        monkeypatch.setitem(sizes, "split_below", 0)
    case = AttentionCase(seq_lens=seq_lens, head_dim=32, page_size=8, scale="token_head")
    call, c = call_of(case, device)
    _attention.clear()
    try:
        within_bound(attend(call), c)
        plan = next(iter(_attention._READY.values())).plan
        assert plan.attention.constexprs["C"].tiles.warps == warps
        assert (plan.merge is None) == (seq_lens == (20,) or (device != "cpu" and
                                                               seq_lens == (200,)))
        assert (plan.attention.constexprs["C"].tiles.block_b > 0) == (seq_lens == (40, 3))
    finally:
        monkeypatch.undo()
        _attention.clear()


@pytest.mark.parametrize("seq_lens", [(40, 3), (200,)], ids=["unsplit", "split"])
def test_nvfp4_calls_read_with_one_warp_per_program(seq_lens, device, monkeypatch):
    """One warp per program (the CUDA row's NVFP4 override; the interpreter's row set so):
    split or not, within the bound."""
    sizes = ATTENTION_SIZES[INTERPRET] if device == "cpu" else ATTENTION_SIZES[CUDA]["packed"]
    monkeypatch.setitem(sizes, "warps", 1)
    case = AttentionCase(cache="nvfp4", seq_lens=seq_lens, head_dim=64, page_size=8)
    call, c = call_of(case, device)
    _attention.clear()
    try:
        within_bound(attend(call), c)
        plan = next(iter(_attention._READY.values())).plan
        assert plan.attention.num_warps == plan.attention.constexprs["C"].tiles.warps == 1
    finally:
        monkeypatch.undo()
        _attention.clear()


@pytest.mark.parametrize("align_end,column_sums", [(False, False), (True, False),
                                                    (False, True), (True, True)],
                         ids=["tiles_from_the_start", "aligned_end_only", "column_sums_only",
                              "both"])
@pytest.mark.parametrize("cache", ["e4m3", "nvfp4"])
def test_tile_alignment_and_row_sums_each_way(cache, align_end, column_sums, device,
                                              monkeypatch):
    """Tiles from a share's start (its last one masked) or ending at its end (the peeled one
    masked before the share), row sums reduced every step or kept per token column: each way
    stays within the bound, with shares that are not whole tiles (odd lengths, a split). (The
    interpreter's row takes both new ways, the CUDA row both for NVFP4's split calls alone.)"""
    row = ATTENTION_SIZES[INTERPRET if device == "cpu" else CUDA]
    for sizes in (row, row["packed"]):   # (the format overrides that may name them)
        for split in ("", "split_"):
            monkeypatch.setitem(sizes, split + "align_end", align_end)
            monkeypatch.setitem(sizes, split + "column_sums", column_sums)
    case = AttentionCase(cache=cache, seq_lens=(77, 5, 130), head_dim=64, page_size=8)
    call, c = call_of(case, device)
    _attention.clear()
    try:
        within_bound(attend(call), c)
        tiles = next(iter(_attention._READY.values())).plan.attention.constexprs["C"].tiles
        assert (tiles.align_end, tiles.column_sums) == (align_end, column_sums)
    finally:
        monkeypatch.undo()
        _attention.clear()


@requires_cuda
@pytest.mark.gpu
def test_gpu_dependent_launch_and_prefetch_change_no_byte(monkeypatch):
    """The merge's dependent launch and the L2 prefetch are hints: with both off (the fallback
    ``FP8KV_PDL=0`` or a Triton without them gives) a call writes the same bytes."""
    case = AttentionCase(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                         seq_lens=(4096, 1, 1000))
    call, c = call_of(case, "cuda")
    _attention.clear()
    try:
        on = attend(call)
        plan = next(iter(_attention._READY.values())).plan
        assert plan.merge.launch_pdl == attention.PDL
        monkeypatch.setattr(attention, "PDL", False)
        monkeypatch.setitem(ATTENTION_SIZES[CUDA], "prefetch", 0)
        _attention.clear()
        off = attend(call)
        plan = next(iter(_attention._READY.values())).plan
        tiles = plan.attention.constexprs["C"].tiles
        assert not plan.merge.launch_pdl and not tiles.pdl and tiles.prefetch == 0
    finally:
        monkeypatch.undo()
        _attention.clear()
    assert torch.equal(on.view(torch.int16), off.view(torch.int16))
    within_bound(on, c)


def test_dependent_launch_is_planned_for_split_calls_only(monkeypatch):
    from fp8kv.attention import check_attention

    def plan_of(seq_lens):
        arrays = gpu_infos(build(AttentionCase(seq_lens=seq_lens))["call"])
        return plan_attention(check_attention(**arrays), CUDA)

    for pdl in (True, False):
        monkeypatch.setattr(attention, "PDL", pdl)
        plan_attention.cache_clear()
        split, whole = plan_of((2000,)), plan_of((3,) * 600)
        assert whole.merge is None and not whole.attention.constexprs["C"].tiles.pdl
        monkeypatch.setitem(ATTENTION_SIZES[CUDA], "balance_seqs", 1024)
        plan_attention.cache_clear()
        balanced = plan_of((3,) * 600)   # balanced on the device: merged, whatever the lengths
        for plan in (split, balanced):
            assert plan.merge.launch_pdl == plan.attention.constexprs["C"].tiles.pdl == pdl
        monkeypatch.undo()
        monkeypatch.setattr(attention, "PDL", pdl)
        plan_attention.cache_clear()
    plan_attention.cache_clear()


@pytest.mark.parametrize("heads, kv_heads, query_lens, block_m, m_tiles", [
    (32, 8, None, 8, 1), (64, 8, None, 8, 1), (32, 2, None, 16, 1), (8, 8, None, 8, 1),
    (32, 8, (4, 4), 16, 1), (32, 8, (16, 3), 16, 4)],
    ids=["group4", "group8", "group16", "mha", "group4-q4", "group4-q16"])
def test_query_rows_per_tile_are_the_mma_columns_a_call_fills(heads, kv_heads, query_lens,
                                                              block_m, m_tiles):
    """The query rows are the MMAs' N: a tile holds the next power of two of a sequence's rows
    (its longest query x the group), from the MMA's 8 columns up to ``block_m``; more rows take
    more row tiles."""
    from fp8kv.attention import check_attention
    case = AttentionCase(num_heads=heads, num_kv_heads=kv_heads, head_dim=64,
                         seq_lens=(40, 20), query_lens=query_lens)
    arrays = gpu_infos(build(case)["call"])
    if query_lens:
        arrays["max_query_len"] = max(query_lens)
    tiles = plan_attention(check_attention(**arrays), CUDA).attention.constexprs["C"].tiles
    assert (tiles.block_m, tiles.m_tiles) == (block_m, m_tiles)


def test_fp8kv_pdl_0_turns_the_dependent_launch_off():
    import subprocess
    import sys
    code = "import fp8kv.attention as a; print(a.PDL)"
    env = {**os.environ, "FP8KV_PDL": "0"}
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert got == "False"


def test_v_unpacking_shifts_give_each_code_its_exact_fp16_bits():
    """The V asm's masks and shifts (no prmt), run in NumPy on every pair of two tokens' bytes:
    code position ``c`` of each token becomes ``(code & 7) << 9 | (code & 8) << 12``, the
    exact path's fp16 bits (the element times ``2**-14``), token ``t`` in the low half."""
    from fp8kv.ops.paged_attention import _V_CODE_SHIFTS
    pairs = np.arange(1 << 16, dtype=np.uint64)                 # (byte of t, byte of t + 1)
    # Bytes 0 and 2 are codes 0-1 of the two tokens, bytes 1 and 3 codes 2-3.
    words = np.concatenate([(pairs & 0xFF) | (pairs >> 8) << 16,
                            ((pairs & 0xFF) << 8) | (pairs >> 8) << 24])
    mask32 = np.uint64(0xFFFFFFFF)
    nibbles = {"l": words & 0x0F0F0F0F, "u": words & 0xF0F0F0F0}

    def shift(x, op, n):
        return ((x << np.uint64(n)) & mask32) if op == "shl" else x >> np.uint64(n)

    for c, (src, mag_op, mag, sign_op, sign) in enumerate(_V_CODE_SHIFTS):
        x = nibbles[src]
        got = (shift(x, mag_op, mag) | (shift(x, sign_op, sign) if sign_op else x)) & 0x8E008E00
        first = 8 * (c // 2) + 4 * (c % 2)                     # the code's bits in the word
        for lane, at in ((0, first), (16, first + 16)):
            code = (words >> np.uint64(at)) & 0xF
            want = ((code & 7) << 9) | ((code & 8) << 12)
            np.testing.assert_array_equal((got >> np.uint64(lane)) & 0xFFFF, want)


def test_plan_splits_small_calls_into_powers_of_two():
    sizes = ATTENTION_SIZES[CUDA]
    assert splits_for(512, 8192, 64, sizes) == 1
    for programs, context in ((8, 8192), (64, 4096), (3, 300)):
        s = splits_for(programs, context, 64, sizes)
        assert s & (s - 1) == 0 and s <= sizes["max_splits"]
        assert s == 1 or context // s >= sizes["min_split_tokens"] // 2


@pytest.mark.parametrize("seqs, context, splits", [
    (1, 8192, 64), (8, 4096, 16), (32, 4096, 4), (48, 4096, 3), (64, 2048, 2), (64, 8192, 2),
    (256, 1024, 1), (8, 96, 1)],
    ids=lambda v: str(v))
def test_plan_nvfp4_llama_decode_one_warp_programs_split_to_1024(seqs, context, splits):
    """The CUDA row's ``packed`` override: one warp per program, calls split to about 1,024
    programs (3 splits where that is what reaches it: no power-of-two rounding), each split at
    least ``min_split_tokens``."""
    from fp8kv.attention import check_attention
    from fp8kv.arrays import ArrayInfo
    case = AttentionCase(cache="nvfp4", num_heads=32, num_kv_heads=8, head_dim=128,
                         seq_lens=(16,) * seqs, page_size=16)
    arrays = gpu_infos(build(case)["call"])
    # The plan reads the block table's width (the longest context a call may have), not
    # seq_lens: a table of context / 16 pages per sequence.
    arrays["block_table"] = ArrayInfo.contiguous((seqs, context // 16), "int32", "cuda:0")
    plan = plan_attention(check_attention(**arrays), CUDA)
    assert plan.attention.num_warps == 1
    assert plan.attention.constexprs["C"].tiles.splits == splits
    assert plan.attention.grid == (8, seqs * splits)   # (kv heads, a slot per share)
    assert (plan.merge is None) == (splits == 1)


def test_a_three_way_split_merges_in_split_order(device, monkeypatch):
    """Split counts need not be powers of two: three shares of a call (the merge reads a
    power-of-two block of them, the fourth masked) stay within the bound, and two calls give
    the same bytes."""
    sizes = ATTENTION_SIZES[INTERPRET if device == "cpu" else CUDA]
    for key, value in dict(pow2_splits=False, target_programs=3, split_below=2,
                           min_split_tokens=16).items():
        monkeypatch.setitem(sizes, key, value)
    # Three whole tiles at least (the interpreter's are 32 tokens, the GPU's 64).
    case = AttentionCase(num_heads=2, num_kv_heads=1, seq_lens=(100 if device == "cpu" else 200,),
                         head_dim=32, page_size=8, scale="token_head")
    call, c = call_of(case, device)
    _attention.clear()
    try:
        out = attend(call)
        within_bound(out, c)
        plan = next(iter(_attention._READY.values())).plan
        # (the merge reads blocks of merge_splits shares: the interpreter's 2, two blocks)
        assert plan.attention.grid == (1, 3)
        assert plan.merge.constexprs["BLOCK_S"] == min(4, sizes["merge_splits"])
        assert torch.equal(attend(call).view(torch.int16), out.view(torch.int16))
    finally:
        monkeypatch.undo()
        _attention.clear()


def test_a_new_signature_is_planned_again():
    """The ready launch of one call never serves another shape (a longer block table)."""
    a, _ = call_of(AttentionCase(seq_lens=(5,)), "cpu")
    b, cb = call_of(AttentionCase(seq_lens=(70,)), "cpu")
    attend(a)
    within_bound(attend(b), cb)


# ---------------------------------------------------------------------------------------------
# Bad inputs: each a clear error naming the argument, before anything runs.

def _base(device="cpu"):
    call, _ = call_of(AttentionCase(seq_lens=(20, 9), head_dim=32, page_size=8), device)
    return call


def _raises(call, exc, match, **kw):
    with pytest.raises(exc, match=match):
        attend(call, **kw)


@pytest.mark.parametrize("change, exc, match", [
    (lambda c: c.update(query=c["query"][:, :3]), ValueError,
     "query: expected num_heads a multiple of num_kv_heads"),
    (lambda c: c.update(query=c["query"].float()), TypeError, "query: expected dtype"),
    (lambda c: c.update(query=c["query"][:1]), ValueError, "query: expected num_tokens == num_seqs"),
    (lambda c: c.update(query=c["query"][..., :16]), ValueError, "query: expected head_dim 32"),
    (lambda c: c.update(block_table=c["block_table"].long()), TypeError,
     "block_table: expected dtype int32"),
    (lambda c: c.update(seq_lens=c["seq_lens"][:1]), ValueError,
     r"seq_lens: expected shape \[2\]"),
    (lambda c: c.update(key_scale=None, key_scale_cache=torch.zeros(3, 8, dtype=torch.float32)),
     ValueError, "key_scale_cache: expected shape"),
    (lambda c: c.update(sinks=torch.zeros(3)), ValueError, r"sinks: expected shape \[8\]"),
    (lambda c: c.update(query_start_loc=torch.tensor([0, 1], dtype=torch.int32)), ValueError,
     r"query_start_loc: expected shape \[3\]"),
    (lambda c: c.update(query=c["query"].repeat(17, 1, 1),
                        query_start_loc=torch.tensor([0, 17, 34], dtype=torch.int32)),
     ValueError, "query: expected at most 16 query tokens per sequence"),
    (lambda c: c.update(softmax_scale=-1.0), ValueError, "softmax_scale: expected a finite"),
    (lambda c: c.update(sliding_window=0), ValueError, "sliding_window: expected an int"),
    (lambda c: c.update(logits_soft_cap="big"), TypeError, "logits_soft_cap: expected"),
    (lambda c: c.update(max_query_len=2), ValueError, "max_query_len: expected 1"),
], ids=["heads-not-a-multiple", "query-dtype", "tokens-without-query-start-loc", "head-dim",
        "table-dtype", "seq-lens-shape", "scale-cache-shape", "sinks-shape",
        "query-start-loc-shape", "query-longer-than-16", "softmax-scale", "window",
        "soft-cap-type", "max-query-len-without-varlen"])
def test_bad_inputs_name_the_argument(change, exc, match):
    call = _base()
    change(call)
    _raises(call, exc, match)


def test_unquantized_cache_of_another_dtype_is_refused():
    call, _ = call_of(AttentionCase(cache="bfloat16", seq_lens=(4,), head_dim=32), "cpu")
    call["query"] = call["query"].half()
    _raises(call, TypeError, "key_cache: expected dtype float16 .that of query.")


def test_out_of_another_shape_is_refused_and_left_unwritten():
    call = _base()
    out = torch.zeros(2, 8, 16, dtype=torch.bfloat16)
    _raises(call, ValueError, r"out: expected shape \[2, 8, 32\]", out=out)
    assert not out.any()


def test_check_bounds_finds_a_block_table_too_short_for_seq_lens():
    call = _base()
    call["seq_lens"] = torch.tensor([20, 500], dtype=torch.int32)
    _raises(call, ValueError, "seq_lens: expected 0 <= seq_lens <=", check_bounds=True)


def test_the_fake_op_validates_like_the_launch():
    """torch.compile traces the fake: the same checks, the same message (Dynamo wraps the
    error in its own)."""
    call = _base()
    call["sinks"] = torch.zeros(3)
    with pytest.raises(Exception, match=r"sinks: expected shape \[8\] \(num_heads\), got \[3\]"):
        torch.compile(lambda kw: attend(kw), fullgraph=True)(call)


def test_interpreter_plan_is_planned_for_small_grids():
    call = _base()
    _attention.clear()
    attend(call)
    plan = next(iter(_attention._READY.values())).plan
    assert plan.attention.constexprs["C"].options.exact
    assert plan_attention.cache_info().currsize >= 1
    assert INTERPRET in ATTENTION_SIZES


# ---------------------------------------------------------------------------------------------
# Every kernel variant the plans make compiles for Hopper, without a GPU (CI has none).

def _compile_variants():
    def arrays(case):
        return gpu_infos(build(case)["call"])

    return [
        ("e4m3", arrays(AttentionCase(num_heads=32, num_kv_heads=8, head_dim=128,
                                      seq_lens=(64,) * 40))),
        ("e4m3-split-varlen-window-cap-sinks", arrays(AttentionCase(
            query_lens=(3, 1), seq_lens=(30, 7), head_dim=64, window=6, soft_cap=4.0,
            sinks=True))),
        ("e5m2-head-HND", arrays(AttentionCase(cache="e5m2", scale="head", layout="HND"))),
        ("bfloat16", arrays(AttentionCase(cache="bfloat16", head_dim=128))),
        ("float16-d80", arrays(AttentionCase(cache="float16", query_dtype="float16",
                                             head_dim=80))),
        ("token-head", arrays(AttentionCase(scale="token_head"))),
        ("inline", arrays(AttentionCase(scale="inline"))),
        ("nvfp4", arrays(AttentionCase(cache="nvfp4", head_dim=128))),
        ("nvfp4-llama", arrays(AttentionCase(cache="nvfp4", num_heads=32, num_kv_heads=8,
                                                head_dim=128, seq_lens=(64,) * 128))),
        ("mxfp8", arrays(AttentionCase(cache="mxfp8", head_dim=128))),
        ("mxfp8-split-layers-d96", arrays(AttentionCase(cache="mxfp8", head_dim=96, layers=2,
                                                        layer=1, seq_lens=(64,) * 3))),
        ("combined-layers", arrays(AttentionCase(combined=True, layers=2, layer=1))),
    ]


def operands_before_last_load(ptx: str) -> tuple[int, int]:
    """``(plain, transposed)``: the ``ldmatrix`` instructions (a tile's bytes reaching an MMA
    operand's layout) before the last 128-bit global load that precedes the first MMA, without
    and with ``.trans`` (the PTX keeps that order: no load moves across the barrier that guards
    the shared-memory round trip)."""
    head = ptx[:ptx.index("mma.sync")]
    marks = re.findall(r"ld\.global\.v4\.b32|ldmatrix\S*", head)
    last = max(k for k, m in enumerate(marks) if not m.startswith("ldmatrix"))
    trans = sum(m.startswith("ldmatrix") and ".trans" in m for m in marks[:last])
    return sum(m.startswith("ldmatrix") for m in marks[:last]) - trans, trans


def _compile_attention(arrays):
    """``(args, plan, compiled)``: the attention kernel of ``arrays`` as the CUDA plan launches
    it, compiled for sm_90."""
    from fp8kv import ops
    from fp8kv.attention import attention_operands, check_attention
    from tests.test_sm90_compile import compile_for_hopper

    args = check_attention(**arrays)
    plan = plan_attention(args, CUDA)
    ops_map = attention_operands(args, plan)
    compiled = compile_for_hopper(ops._paged_attention_kernel,
                                  {o.param: _dtypes(arrays, args)[o.source]
                                   for o in ops_map.params}, plan.attention)
    return args, plan, compiled


def _dtypes(arrays, args) -> dict:
    dtypes = {n: a.dtype for n, a in arrays.items() if hasattr(a, "dtype")}
    dtypes.update(out=args.out_dtype, partial_out="float32", partial_stats="float32",
                  partial_rows="float32")
    if args.layers is not None and "layer" not in dtypes:
        dtypes["layer"] = "int32"
    return dtypes


@pytest.mark.parametrize("name, arrays", [pytest.param(n, a, id=n) for n, a in _compile_variants()])
def test_kernels_compile_for_sm90(name, arrays):
    from fp8kv import ops
    from fp8kv.attention import merge_operands
    from tests.test_sm90_compile import compile_for_hopper

    args, plan, compiled = _compile_attention(arrays)
    dtypes = _dtypes(arrays, args)
    ptx = compiled.asm["ptx"]
    if name == "e4m3":   # the hardware conversion, four codes per instruction pair
        assert "cvt.rn.f16x2.e4m3x2" in ptx
        # The Llama decode shape at 5 stages: four programs per SM (228 KB, 1 KB reserved per
        # program) -- the query's operand kept in registers (the peeled first tile), not in
        # shared memory beside the pipeline's buffers.
        assert plan.attention.constexprs["C"].tiles.peel
        # A property of the compiler's scheduling: Triton 3.6 (the GPU suite's) and 3.9 keep the
        # peeled query in registers; 3.8 keeps its shared buffer too (57,856 bytes: 3 per SM).
        if not triton.__version__.startswith("3.8."):
            assert compiled.metadata.shared <= 56 * 1024
    tiles = plan.attention.constexprs["C"].tiles
    if tiles.peel:
        # The query's and the peeled tile's bytes (and the scales) are all requested before any
        # of them is converted (a conversion's barrier would wait for them) -- but NVFP4's V
        # codes, whose layout change is the MMA operand's own ldmatrix.trans (one x4 per 8 of a
        # warp's tokens), which Triton puts right after their load: K's codes wait for that one
        # round trip. (Before the tokens became the MMAs' M, Triton 3.8 also converted the
        # NVFP4 kernel's query there; no version does now.)
        nvfp4 = name.startswith("nvfp4")
        assert operands_before_last_load(ptx) == (0, tiles.block_n // 8 if nvfp4 else 0)
    if name == "bfloat16":   # the ``plain`` override: a pipeline that leaves 4 programs per SM
        assert tiles.stages == ATTENTION_SIZES[CUDA]["plain"]["stages"] == 4
        assert compiled.metadata.shared <= 56 * 1024
    if name.startswith("nvfp4"):
        assert plan.attention.num_warps == 1   # one warp per program (the ``packed`` override)
        # Codes times block scales in one asm, fp16 pairs out.
        assert "prmt.b32" in ptx and "mul.rn.f16x2" in ptx
        # K's pairs along the head dimension (prmt 0x1404), V's pairs of tokens (masks and
        # shifts, 0x8E008E00) straight from the codes' ldmatrix.trans: no fp16 V tile goes
        # through shared memory.
        assert "0x1404" in ptx and "0x8E008E00" in ptx
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert "mma.sync" in ptx or "wgmma" in ptx
    if name.startswith(("e4m3", "e5m2")):   # codes converted four per register pair, as loaded
        assert not re.search(r"ld\.shared\.[bu]8", ptx)   # (no byte-wise gather)
    if name.startswith("e5m2"):   # each code the high byte of its fp16: prmt, no arithmetic
        assert "0x1404" in ptx and "0x3424" in ptx
    if name.startswith("mxfp8"):   # e4m3 codes as fp16 operands, one warp, a dot per block
        assert plan.attention.num_warps == 1 and "cvt.rn.f16x2.e4m3x2" in ptx
    # The tiles after the peeled one asked of L2 (where the row prefetches), or nothing.
    assert ("prefetch.global.L2" in ptx) == (tiles.prefetch > 0)
    if name == "e4m3":
        assert tiles.prefetch == ATTENTION_SIZES[CUDA]["prefetch"]
    if plan.merge is not None:
        merge = merge_operands(args, plan)
        merged = compile_for_hopper(ops._attention_merge_kernel,
                                    {o.param: dtypes[o.source] for o in merge.params}, plan.merge)
        # A dependent launch waits for the attention grid inside the merge.
        assert ("griddepcontrol.wait" in merged.asm["ptx"]) == plan.merge.launch_pdl



# ---------------------------------------------------------------------------------------------
# The balanced schedule (SPEC 16.2): the kernel's own helper, run by the interpreter, against
# the spec's formula in NumPy.

def _spec_shares(seq_lens, slots, cap, min_share, span=None):
    n = np.maximum(np.asarray(seq_lens, np.int64), 0)
    if span is not None:
        n = np.minimum(n, span)
    extra = slots - len(n)
    return np.minimum(np.minimum(1 + n * extra // max(int(n.sum()), 1), cap),
                      np.maximum(n // min_share, 1))


@jit
def _shares_kernel(seq_lens_ptr, out_ptr, num_seqs, window, C: tl.constexpr):
    slot = tl.program_id(1)
    b, split, splits, seq_len = balanced_share(seq_lens_ptr, slot, num_seqs, window, C)
    at = out_ptr + slot * 4
    tl.store(at, b)
    tl.store(at + 1, split)
    tl.store(at + 2, splits)
    tl.store(at + 3, seq_len)


def _kernel_shares(seq_lens, slots, tiles, window=None, group=4):
    """``[slots, 4]``: ``(b, split, splits, seq_len)`` of each slot, as the attention kernel's
    :func:`~fp8kv.ops.paged_attention.balanced_share` finds them."""
    from types import SimpleNamespace as NS

    from fp8kv import ops

    C = NS(geometry=NS(group=group), tiles=tiles, options=NS(window=window is not None))
    out = torch.full((slots, 4), -1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ops.interpreted(_shares_kernel)[(1, slots)](lens, out, len(seq_lens), window or 0, C=C)
    return out.numpy()


@pytest.mark.parametrize("seq_lens, splits, extra, window", [
    ((8192,) + (512,) * 63, 1, 33, None), ((4096,) * 32, 4, 31, None),
    ((5000, 0, 1, 77, 3000, 129), 2, 5, None), ((9000, 100, 40000), 1, 2, 1000),
    (tuple(int(n) for n in np.random.default_rng(3).integers(0, 9000, 20)), 1, 13, None)],
    ids=["one-long", "uniform", "ragged-with-empty", "window", "random"])
def test_balanced_shares_follow_the_spec(seq_lens, splits, extra, window):
    """Each slot names the sequence and share that the spec's formula gives, sequences in order,
    each share once; the slots left over name none; a batch of equal lengths gets the plan's
    split count, and a long sequence among short ones most of the extra slots."""
    from types import SimpleNamespace as NS
    seqs = len(seq_lens)
    slots = seqs * splits + extra
    # (a block wider than every case: its lanes past the last sequence are masked)
    tiles = NS(block_b=128, m_tiles=1, block_m=8, split_cap=64, min_share=256)
    got = _kernel_shares(seq_lens, slots, tiles, window)
    want = _spec_shares(seq_lens, slots, 64, 256, None if window is None else window + 8 // 4)
    assert want.sum() <= slots
    expect = [(b, k, want[b], seq_lens[b]) for b in range(seqs) for k in range(want[b])]
    np.testing.assert_array_equal(got[:len(expect)], np.array(expect, np.int64).reshape(-1, 4))
    assert (got[len(expect):, 0] >= seqs).all()
    if len(set(seq_lens)) == 1:
        assert (want == splits).all()
    if seq_lens[0] == 8192:
        assert want[0] == 7 and (want[1:] == 1).all()   # (1 + 8192 * 33 // 40448)


@pytest.mark.parametrize("cache", ["e4m3", "nvfp4", "bfloat16"])
def test_a_balanced_ragged_batch_reads_within_the_bound(cache, device, monkeypatch):
    """The balanced schedule on a ragged batch (one long sequence, empty and one-token ones,
    a sliding window on the GPU): within the bound, and the same bytes on a second call."""
    sizes = ATTENTION_SIZES[INTERPRET if device == "cpu" else CUDA]
    monkeypatch.setitem(sizes, "balance_seqs", 64)
    lens = (300, 0, 1, 37, 5) if device == "cpu" else (6000, 0, 1, 129, 700, 33, 2048, 64)
    case = AttentionCase(cache=cache, seq_lens=lens, head_dim=64, page_size=16,
                         window=None if device == "cpu" else 1500)
    call, c = call_of(case, device)
    _attention.clear()
    try:
        out = attend(call)
        plan = next(iter(_attention._READY.values())).plan
        assert plan.attention.constexprs["C"].tiles.block_b > 0 and plan.merge is not None
        within_bound(out, c)
        again = attend(call)
        assert (out.view(torch.int16) == again.view(torch.int16)).all()
    finally:
        monkeypatch.undo()
        _attention.clear()


@pytest.mark.parametrize("balance_seqs", [64, 0], ids=["balanced", "split-alike"])
def test_query_rows_past_the_last_sequence_are_left_alone(balance_seqs, device, monkeypatch):
    """A CUDA graph's padded batch: query rows past ``query_start_loc[num_seqs]`` belong to no
    sequence (SPEC 16.1). The split call merges the other rows within the bound and reads
    nothing outside its workspace for those (their index entries are never written: the
    workspace is poisoned with huge ones here)."""
    sizes = ATTENTION_SIZES[INTERPRET if device == "cpu" else CUDA]
    monkeypatch.setitem(sizes, "balance_seqs", balance_seqs)
    # (a table long enough that the CUDA plan splits too: 1,300 tokens, eight shares)
    longest = 300 if device == "cpu" else 1300
    case = AttentionCase(seq_lens=(longest, 40, 5), query_lens=(3, 1, 2), head_dim=32,
                         page_size=16, num_heads=4, num_kv_heads=1)
    call, c = call_of(case, device)
    tokens = call["query"].shape[0]
    call["query"] = torch.cat([call["query"], call["query"][:5]])   # five padding rows
    empty, made = torch.empty, []

    def poisoned(*shape, **kw):   # the workspace: every int32 bit pattern huge
        if kw.get("dtype") != torch.float32:
            return empty(*shape, **kw)
        made.append(shape)
        return empty(*shape, **kw).view(torch.int32).fill_(0x7FFFFF00).view(torch.float32)

    _attention.clear()
    try:
        monkeypatch.setattr(_attention.torch, "empty", poisoned)
        out = attend(call, max_query_len=3)
        plan = next(iter(_attention._READY.values())).plan
        assert plan.merge is not None and plan.balanced == (balance_seqs > 0)
        assert len(made) == 3   # (the workspace was poisoned)
        within_bound(out[:tokens], c)
    finally:
        monkeypatch.undo()
        _attention.clear()
