"""Slots in the kernels: where each token's row goes in a paged cache (docs/SPEC.md section 3)."""
import triton.language as tl

from ._dual import jit


@jit
def slot_rows(slot_ptr, tok, in_range, num_slots, PAGE_SIZE: tl.constexpr,
              OFFSETS_64: tl.constexpr):
    """``(keep, page, off)`` of the tokens ``tok`` (loaded where ``in_range``): whether each
    token's slot is in ``[0, num_slots)`` (padding below zero and slots past the cache write
    nothing), and its page and offset in the page -- 0 where not kept, int32 unless the plan
    asks for int64 offsets (``OFFSETS_64``: int32 address arithmetic is a tenth of a small
    program's instructions)."""
    slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    keep = in_range & (slot >= 0) & (slot < num_slots)
    slot = tl.where(keep, slot, 0)
    if not OFFSETS_64:
        slot = slot.to(tl.int32)
    return keep, slot // PAGE_SIZE, slot % PAGE_SIZE
