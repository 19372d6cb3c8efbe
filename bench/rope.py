"""RoPE + write (torch): ``fp8kv_torch.rope_write_kv`` against the unfused pair it replaces.

Llama-3-8B attention shape (32 query heads, 8 kv heads x 128, page 16), bf16 -> e4m3, device
scales, Q/K/V as views of one fused QKV projection output, fp32 cos/sin cache of 131,072
positions, random positions and slots. Providers, all timed in the same run:

* ``fused, bf16 Q``: ``rope_write_kv`` (the query rotated in place);
* ``fused, FP8 Q``: the query written as e4m3 codes (``query_scale``, a preallocated
  ``query_out``);
* ``fused, dynamic``: bf16 Q, K/V with dynamic per-token-head scales in side arrays;
* ``unfused ...``: the same work as engines do it without the fusion: an in-place Triton RoPE
  kernel on q and k (:func:`rope_inplace`, one launch, the same fp32 arithmetic), then
  ``fp8kv_torch.write_kv`` of the rotated (bf16) key -- and, for an FP8 query, a separate Triton
  quantization of q (:func:`quantize_query`). Two or three launches.

Bytes are the fused op's minimal traffic for every provider of a row (Q in and out, K and V in,
codes and scales out, cos/sin rows, positions, slots); the unfused pair moves more (the rotated
q and k make a round trip), which is what its longer time shows. Small sizes (1-256 tokens)
are CUDA-graph replays; the ``fused, ...`` rows after them change one small-batch entry of
``fp8kv.rope_write.ROPE_SIZES``, to choose the defaults.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

import fp8kv_torch
from fp8kv import plan, rope_write
from fp8kv.modes import Division
from fp8kv.ops import interpreted

from .common import Config, Timer, free_memory
from .results import Table, tokens_case
from .sweep import planned_with

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
MAX_POSITION = 131072
SCALE = 0.05          # K/V dequant scale (device tensor)
Q_SCALE = 0.02        # query scale of the FP8 query
SMALL = (1, 16, 64, 256)
LARGE = 65536
# Small-batch plan entries to try (label -> ROPE_SIZES entries; the tiny-batch tier is off while
# they are timed, so that each applies at every small size).
# Large-batch plan entries to try (the division of K/V and of an FP8 query by their scales).
LARGE_VARIANTS = {
    "div.rn": dict(reciprocal_div=Division.DIV_RN, fp8q_reciprocal_div=Division.DIV_RN),
    "FMA division": dict(reciprocal_div=Division.FMA, fp8q_reciprocal_div=Division.FMA),
    "fp64 division": dict(reciprocal_div=Division.FP64, fp8q_reciprocal_div=Division.FP64),
    "4,096-element query steps": dict(fp8q_q_tile=4096),
}
PLAN_VARIANTS = {
    "all heads, 4 warps": dict(small_kv_heads_per_program=0, small_batch_warps=4),
    "all heads, 4 warps, FMA division": dict(
        small_kv_heads_per_program=0, small_batch_warps=4, small_reciprocal_div=Division.FMA,
        small_fp8q_reciprocal_div=Division.FMA),
    "2 kv heads per program, 4 warps, fp64 division": dict(
        small_kv_heads_per_program=2, small_batch_warps=4, small_reciprocal_div=Division.FP64,
        small_fp8q_reciprocal_div=Division.FP64),
}


@triton.jit
def _rope_inplace_kernel(q_ptr, k_ptr, position_ptr, cos_sin_ptr, STRIDE_Q: tl.constexpr,
                         STRIDE_K: tl.constexpr, Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr):
    """NeoX RoPE of one token's q and k heads, in place: ``x1 c - x2 s``, ``x2 c + x1 s`` in
    fp32 (launched without FMA fusion: the fused kernel's arithmetic), rounded to the input
    dtype."""
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(position_ptr + t)
    i = tl.arange(0, HALF)
    c = tl.load(cos_sin_ptr + pos * HEAD_DIM + i)[None, :]
    s = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + i)[None, :]
    hq = tl.arange(0, Q_HEADS)
    q = q_ptr + t * STRIDE_Q + hq[:, None] * HEAD_DIM + i[None, :]
    hk = tl.arange(0, K_HEADS)
    k = k_ptr + t * STRIDE_K + hk[:, None] * HEAD_DIM + i[None, :]
    q1, q2 = tl.load(q).to(tl.float32), tl.load(q + HALF).to(tl.float32)
    k1, k2 = tl.load(k).to(tl.float32), tl.load(k + HALF).to(tl.float32)
    tl.store(q, (q1 * c - q2 * s).to(q_ptr.dtype.element_ty))
    tl.store(q + HALF, (q2 * c + q1 * s).to(q_ptr.dtype.element_ty))
    tl.store(k, (k1 * c - k2 * s).to(k_ptr.dtype.element_ty))
    tl.store(k + HALF, (k2 * c + k1 * s).to(k_ptr.dtype.element_ty))


@triton.jit
def _quantize_query_kernel(q_ptr, scale_ptr, out_ptr, STRIDE_Q: tl.constexpr,
                           ROW: tl.constexpr):
    """One token's query row to e4m3: IEEE division by the scale, saturating conversion."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, ROW)
    x = tl.load(q_ptr + t * STRIDE_Q + j).to(tl.float32)
    y = tl.math.div_rn(x, tl.load(scale_ptr))
    tl.store(out_ptr + t * ROW + j, y.to(out_ptr.dtype.element_ty))


def _kernel(jit_fn, tensor):
    return interpreted(jit_fn) if tensor.device.type == "cpu" else jit_fn


def rope_inplace(q, k, positions, cos_sin) -> None:
    """NeoX RoPE of ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` in place (packed heads, any
    token stride; power-of-two head counts): one launch."""
    _kernel(_rope_inplace_kernel, q)[(q.shape[0],)](
        q, k, positions, cos_sin, STRIDE_Q=q.stride(0), STRIDE_K=k.stride(0),
        Q_HEADS=q.shape[1], K_HEADS=k.shape[1], HEAD_DIM=q.shape[2], num_warps=8,
        enable_fp_fusion=False)


def quantize_query(q, scale, out) -> None:
    """``out`` ``[T, Hq, D]`` e4m3 (contiguous) = ``RNE_sat(q / scale)``: one launch."""
    _kernel(_quantize_query_kernel, q)[(q.shape[0],)](
        q, scale, out, STRIDE_Q=q.stride(0), ROW=q.shape[1] * q.shape[2], num_warps=8)


def rope_bytes(tokens: int, fp8_query: bool = False, dynamic: bool = False) -> int:
    """The fused op's minimal traffic: Q read and written (bf16, or e4m3 codes), K and V read,
    their codes (and per-token-head scales) written, one cos/sin row, a position and a slot
    per token."""
    row_q, row_kv = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    per_token = (row_q * (2 + (1 if fp8_query else 2)) + row_kv * (2 * 2 + 2)
                 + (2 * KV_HEADS * 4 if dynamic else 0) + HEAD_DIM * 4 + 8 + 8)
    return tokens * per_token


class RopeCase:
    """Inputs, caches and the calls of every provider for one size."""

    def __init__(self, device, tokens: int):
        self.tokens = tokens
        width = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.qkv = torch.randn(tokens, width, dtype=torch.bfloat16, device=device)
        q, k, v = self.qkv.view(tokens, -1, HEAD_DIM).split([Q_HEADS, KV_HEADS, KV_HEADS], 1)
        self.q, self.k, self.v = q, k, v
        num_pages = triton.cdiv(tokens, PAGE_SIZE) + 64
        shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
        self.key_cache = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
        self.value_cache = torch.zeros_like(self.key_cache)
        self.scale_caches = [torch.zeros(shape[:3], device=device) for _ in range(2)]
        self.slots = torch.randperm(num_pages * PAGE_SIZE, device=device)[:tokens]
        self.positions = torch.randint(0, MAX_POSITION, (tokens,), device=device)
        inv_freq = 500000.0 ** (-torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)
        angles = torch.arange(MAX_POSITION, device=device)[:, None] * inv_freq
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
        self.scale = torch.tensor(SCALE, device=device)
        self.q_scale = torch.tensor(Q_SCALE, device=device)
        self.q_fp8 = torch.empty(tokens, Q_HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn,
                                 device=device)

    def fused(self, fp8_query=False, dynamic=False):
        scales = (dict(key_scale_cache=self.scale_caches[0],
                       value_scale_cache=self.scale_caches[1]) if dynamic
                  else dict(key_scale=self.scale, value_scale=self.scale))
        query = (dict(query_scale=self.q_scale, query_out=self.q_fp8) if fp8_query
                 else dict(query_out=self.q))
        return functools.partial(fp8kv_torch.rope_write_kv, self.q, self.k, self.v,
                                 self.key_cache, self.value_cache, self.slots, self.positions,
                                 self.cos_sin, **scales, **query)

    def unfused(self, fp8_query=False, dynamic=False):
        scales = (dict(key_scale_cache=self.scale_caches[0],
                       value_scale_cache=self.scale_caches[1]) if dynamic
                  else dict(key_scale=self.scale, value_scale=self.scale))

        def call():
            rope_inplace(self.q, self.k, self.positions, self.cos_sin)
            if fp8_query:
                quantize_query(self.q, self.q_scale, self.q_fp8)
            fp8kv_torch.write_kv(self.k, self.v, self.key_cache, self.value_cache, self.slots,
                                 **scales)
        return call


def _compare(case: RopeCase) -> str:
    """What the fused and the unfused calls write from the same inputs: the same rotated bf16
    query; FP8 query and K codes that differ where rounding the rotation to bf16 before
    quantizing it (unfused) moves them."""
    saved = case.qkv.clone()
    codes = lambda c: c.view(torch.uint8).view(-1, KV_HEADS, HEAD_DIM)[case.slots]  # noqa: E731
    case.fused()()
    fused_q, fused_k = case.q.clone(), codes(case.key_cache)
    case.qkv.copy_(saved)
    case.fused(fp8_query=True)()
    fused_fp8 = case.q_fp8.clone()
    case.qkv.copy_(saved)
    case.unfused(fp8_query=True)()
    same_q = torch.equal(fused_q.view(torch.int16), case.q.view(torch.int16))
    k_differ = int((fused_k != codes(case.key_cache)).sum())
    q_differ = int((fused_fp8.view(torch.uint8) != case.q_fp8.view(torch.uint8)).sum())
    case.qkv.copy_(saved)
    return (f"At {case.tokens:,} tokens the rotated bf16 queries of fused and unfused are "
            f"{'identical' if same_q else 'DIFFERENT'}; {q_differ:,} of {case.q_fp8.numel():,} "
            f"FP8 query codes and {k_differ:,} of {fused_k.numel():,} K codes differ: the "
            "unfused pair rounds the rotation to bf16 before quantizing it, the fused op "
            "quantizes the fp32 rotation (docs/SPEC.md, section 12).")


PROVIDERS = (("fused, bf16 Q", "unfused: RoPE + write_kv", dict()),
             ("fused, FP8 Q", "unfused: RoPE + Q quantize + write_kv", dict(fp8_query=True)),
             ("fused, dynamic", "unfused: RoPE + write_kv dynamic", dict(dynamic=True)))


def table_rope(device, cfg: Config, timer: Timer, copy_gbps: float) -> Table:
    table = Table(
        "rope", "RoPE + FP8 write: fused vs unfused (torch)",
        f"{Q_HEADS} query heads, {KV_HEADS} kv heads x {HEAD_DIM}, page {PAGE_SIZE}, bf16 -> "
        "e4m3, device scales, Q/K/V views of one fused QKV buffer, fp32 cos/sin of "
        f"{MAX_POSITION:,} positions. `fused, ...`: `fp8kv_torch.rope_write_kv` (bf16 query in "
        "place; FP8 query into a preallocated e4m3 tensor; dynamic per-token-head K/V scales). "
        "`unfused: ...`: an in-place Triton RoPE of q and k, (a Triton Q quantization,) then "
        "`fp8kv_torch.write_kv`. Bytes: the fused op's minimal traffic (Q in and out, K and V "
        "in, codes and scales out, cos/sin, positions, slots) for both providers of a row.",
        xlabel="tokens per call")
    large = LARGE if timer.cuda else 16
    small = SMALL if timer.cuda else (1,)
    for tokens in (large,) + small:
        case = RopeCase(device, tokens)
        name = tokens_case(tokens)
        modes = timer.modes if not timer.cuda else (
            ("graph", "eager") if tokens == large else ("graph",))
        for fused, unfused, kind in PROVIDERS:
            nbytes = rope_bytes(tokens, **kind)
            for mode in modes:
                table.add(name, tokens, fused, mode, timer.time(mode, [case.fused(**kind)]),
                          nbytes)
                table.add(name, tokens, unfused, mode, timer.time(mode, [case.unfused(**kind)]),
                          nbytes)
        if timer.cuda and tokens == large:
            for label, entries in LARGE_VARIANTS.items():
                with planned_with(rope_write.ROPE_SIZES, plan.CUDA, **entries):
                    for fused, _, kind in PROVIDERS:
                        table.add(name, tokens, f"{fused}, {label}", "graph",
                                  timer.time("graph", [case.fused(**kind)]),
                                  rope_bytes(tokens, **kind))
        if timer.cuda and tokens in small:
            for label, entries in PLAN_VARIANTS.items():
                with planned_with(rope_write.ROPE_SIZES, plan.CUDA, tiny_batch_tokens=0,
                                  tiny_batch_tokens_dynamic=0, tiny_batch_tokens_fp8q=0,
                                  **entries):
                    for fused, _, kind in PROVIDERS:
                        table.add(name, tokens, f"{fused}, {label}", "graph",
                                  timer.time("graph", [case.fused(**kind)]),
                                  rope_bytes(tokens, **kind))
        if timer.cuda:
            table.add_roofline(name, tokens, rope_bytes(tokens), copy_gbps)
        if tokens == large:
            table.note(_compare(case))
        del case
        free_memory()
    return table
