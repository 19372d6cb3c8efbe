"""Slots in the kernels: where each token's row goes in a paged cache (docs/SPEC.md section 3)."""
import triton.language as tl

from ._dual import jit


@jit
def token_rows(slot_ptr, num_tokens, num_slots, BLOCK_T: tl.constexpr, PAGE_SIZE: tl.constexpr,
               OFFSETS_64: tl.constexpr):
    """``(tok, in_range, keep, page, off)`` of this program's ``BLOCK_T`` tokens (grid axis 0):
    their indices, whether each is below ``num_tokens``, whether its slot is in
    ``[0, num_slots)`` (padding below zero and slots past the cache write nothing), and its page
    and offset in the page -- 0 where not kept. Indices and rows are int32 unless the plan asks
    for int64 offsets (``OFFSETS_64``: some array reaches past 2**31 elements); int32 address
    arithmetic saves a tenth of a small program's instructions (graph replay of a 256-token
    dynamic-scale write 2.44 -> 2.28 us on the H200)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    keep = in_range & (slot >= 0) & (slot < num_slots)
    slot = tl.where(keep, slot, 0)
    if OFFSETS_64:
        tok = tok.to(tl.int64)
    else:
        slot = slot.to(tl.int32)
    return tok, in_range, keep, slot // PAGE_SIZE, slot % PAGE_SIZE


@jit
def cache_bytes(key_cache_out_ptr, value_cache_out_ptr, SHARED_OUT: tl.constexpr):
    """``(key_dst, value_dst)``: the caches' outputs as byte pointers (codes are stored as their
    bytes, whatever the caches' dtype); with ``SHARED_OUT`` (a combined cache, one output per
    buffer) V goes through the K output."""
    key_dst = key_cache_out_ptr.to(tl.pointer_type(tl.uint8))
    if SHARED_OUT:
        value_dst = key_dst
    else:
        value_dst = value_cache_out_ptr.to(tl.pointer_type(tl.uint8))
    return key_dst, value_dst
