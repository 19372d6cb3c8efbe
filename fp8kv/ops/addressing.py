"""Page addressing in the kernels: layers, slots, pages, heads and row offsets, writes and reads.

Each paged array (a cache, a side scale array, dequantized pages) comes to a kernel as a
:class:`fp8kv.constexprs.Strides` record, in its own elements; these helpers turn records into
offsets and pointers, so every kernel addresses pages the same way:

* stacked caches (docs/SPEC.md section 14): :func:`select_layer` finds the call's layer (an
  out-of-range one comes back as 0 with a count of 0, which makes every slot or page of the call
  out of range: nothing is written, every page is padding) and :func:`at_layer` moves a stacked
  array's base pointer to it; everything after that addresses one layer;
* writes: :func:`token_slots` gives each token's page and offset from its slot, :func:`slot_rows`
  the row offsets of that slot in a side's cache and side array;
* reads: :func:`table_entry` gives a program's block-table entry and page, :func:`page_at` a
  page's base pointer, :func:`page_rows` a tile of head rows of a page in layout order and
  :func:`head_rows` their offsets, :func:`page_offsets` a flat chunk's element offsets.

Helpers that take a side (:class:`fp8kv.constexprs.Side`) pick its cache or, with ``SCALES``,
its side array; :func:`page_at` and :func:`head_rows` also take an array's strides alone
(``SCALES`` None: dequantized pages). A reader that walks a sequence's pages through a block
table (``page = table[seq, n // PAGE_SIZE]`` for its token ``n``) forms its rows with
:func:`slot_rows` (``page``, ``n % PAGE_SIZE``) and :func:`head_rows`, as the write does for
slots, and decodes its codes and block scales with :mod:`fp8kv.ops.codec` from the cache's
``FMT`` record.
"""
import triton.language as tl

from ..modes import LayerKind
from ._dual import jit
from .codec import OUT_FLOAT8_E4M3FN, OUT_FLOAT32

LAYER_NONE: tl.constexpr = tl.constexpr(LayerKind.NONE.id)
LAYER_TENSOR: tl.constexpr = tl.constexpr(LayerKind.TENSOR.id)


# ---------------------------------------------------------------------------------------------
# Stacked caches

@jit
def select_layer(layer_ptr, layer, count, KIND: tl.constexpr, NUM_LAYERS: tl.constexpr):
    """``(index, count)``: the layer as int64 -- loaded from ``layer_ptr`` (``KIND`` TENSOR) or
    the scalar ``layer`` (VALUE) -- and ``count`` (the call's slots or pages), both 0 when the
    layer is out of range (``< 0`` or ``>= NUM_LAYERS``: no wrap-around)."""
    if KIND == LAYER_TENSOR:
        index = tl.load(layer_ptr).to(tl.int64)
    else:
        index = tl.cast(layer, tl.int64)   # a scalar, or a constexpr where a launcher made it one
    in_range = (index >= 0) & (index < NUM_LAYERS)
    return tl.where(in_range, index, 0), tl.where(in_range, count, 0)


@jit
def at_layer(ptr, layer, SIDE: tl.constexpr, SCALES: tl.constexpr):
    """``ptr`` at layer ``layer`` of a side's stacked cache (``SCALES``: of its side array). A
    side array the call does not have (layer stride 0; its pointer may be None, compiled in)
    must not be moved: callers test that first."""
    STRIDES: tl.constexpr = SIDE.SCALES if SCALES else SIDE.CODES
    return ptr + layer * STRIDES.LAYER


# ---------------------------------------------------------------------------------------------
# Writes: slots

@jit
def token_slots(slot_ptr, num_tokens, num_slots, BLOCK_T: tl.constexpr, PAGE_SIZE: tl.constexpr,
                OFFSETS_64: tl.constexpr):
    """``(tok, in_range, keep, page, off)`` of this program's ``BLOCK_T`` tokens (grid axis 0):
    their indices, whether each is below ``num_tokens``, whether its slot is in
    ``[0, num_slots)`` (padding below zero and slots past the cache write nothing), and its page
    and offset in the page -- 0 where not kept. Indices and rows are int32 unless the plan asks
    for int64 offsets (``OFFSETS_64``: some array reaches past 2**31 elements): int32 address
    arithmetic is shorter, which a small program's latency feels."""
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
def slot_rows(page, off, SIDE: tl.constexpr):
    """``(codes, scales)``: the offsets of slot ``off`` of page ``page`` (each token's) in a
    side's cache and in its side array -- the start of that slot's row of heads in each."""
    CODES: tl.constexpr = SIDE.CODES
    SCALES: tl.constexpr = SIDE.SCALES
    return (page * CODES.PAGE + off * CODES.SLOT + CODES.OFFSET,
            page * SCALES.PAGE + off * SCALES.SLOT + SCALES.OFFSET)


@jit
def cache_bytes(key_cache_out_ptr, value_cache_out_ptr, COMBINED: tl.constexpr):
    """``(key_dst, value_dst)``: the caches' outputs as byte pointers (codes are stored as their
    bytes, whatever the caches' dtype); a combined cache (one output per buffer) writes V
    through the K output."""
    key_dst = key_cache_out_ptr.to(tl.pointer_type(tl.uint8))
    if COMBINED:
        value_dst = key_dst
    else:
        value_dst = value_cache_out_ptr.to(tl.pointer_type(tl.uint8))
    return key_dst, value_dst


@jit
def row_columns(col, HEAD_DIM: tl.constexpr, STRIDE_HEAD: tl.constexpr, PACKED: tl.constexpr):
    """Offsets of columns ``col`` of a token's ``heads x HEAD_DIM`` row in an array whose heads
    are ``STRIDE_HEAD`` apart. Packed rows (heads contiguous) address by ``col`` alone, which
    keeps the compiler's contiguity proof and so 16-byte accesses."""
    if PACKED:
        off = col
    else:
        off = (col // HEAD_DIM) * STRIDE_HEAD + col % HEAD_DIM
    return off


# ---------------------------------------------------------------------------------------------
# Reads: block tables and pages

@jit
def table_entry(table_ptr, pages_per_seq, stride_table_seq, stride_table_page, num_pages,
                null_page, CHUNKS: tl.constexpr, HAS_NULL_PAGE: tl.constexpr):
    """``(entry, chunk, page, valid)`` of this program (grid ``batch * pages_per_seq * CHUNKS``,
    chunk-major): its flat block-table entry and chunk of that page, the page the entry names
    (0 where not valid) and whether it is a real page -- in ``[0, num_pages)`` and not the null
    page (``HAS_NULL_PAGE``). Padding entries dequantize to zeros."""
    pid = tl.program_id(0)
    entry = (pid // CHUNKS).to(tl.int64)
    chunk = pid % CHUNKS
    b = entry // pages_per_seq
    page = tl.load(table_ptr + b * stride_table_seq
                   + (entry - b * pages_per_seq) * stride_table_page).to(tl.int64)
    valid = (page >= 0) & (page < num_pages)
    if HAS_NULL_PAGE:
        valid = valid & (page != null_page)
    return entry, chunk, tl.where(valid, page, 0), valid


@jit
def page_at(ptr, page, ARRAY: tl.constexpr, SCALES: tl.constexpr):
    """The pointer to page ``page`` of a paged array (``ptr``: its operand's first element).
    ``ARRAY``: its strides (``SCALES`` None), or a side whose cache it is (``SCALES`` False) or
    whose side array (True)."""
    STRIDES: tl.constexpr = ARRAY if SCALES is None else ARRAY.SCALES if SCALES else ARRAY.CODES
    return ptr + (page * STRIDES.PAGE + STRIDES.OFFSET)


@jit
def page_rows(chunk, ROWS: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr,
              HND: tl.constexpr):
    """``(slot, head, mask)`` of head rows ``chunk * ROWS ..`` of a page, in its layout's order
    (HND: head-major), as int64; ``mask``: the rows inside the page."""
    r = chunk * ROWS + tl.arange(0, ROWS)
    mask = r < PAGE_SIZE * NUM_HEADS
    if HND:
        head = r // PAGE_SIZE
        slot = r % PAGE_SIZE
    else:
        slot = r // NUM_HEADS
        head = r % NUM_HEADS
    return slot.to(tl.int64), head.to(tl.int64), mask


@jit
def head_rows(slot, head, ARRAY: tl.constexpr, SCALES: tl.constexpr):
    """Offsets in a page of the rows of ``(slot, head)`` (``ARRAY``, ``SCALES``: as for
    :func:`page_at`)."""
    STRIDES: tl.constexpr = ARRAY if SCALES is None else ARRAY.SCALES if SCALES else ARRAY.CODES
    return slot * STRIDES.SLOT + head * STRIDES.HEAD


@jit
def page_offsets(j, STRIDES: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, HND: tl.constexpr, PACKED: tl.constexpr):
    """Element offsets in a page of flat layout-order indices ``j`` (``PACKED``: the page is
    contiguous, ``j`` itself)."""
    if PACKED:
        off = j
    else:
        d = j % HEAD_DIM
        if HND:
            h = j // (PAGE_SIZE * HEAD_DIM)
            s = (j // HEAD_DIM) % PAGE_SIZE
        else:
            s = j // (NUM_HEADS * HEAD_DIM)
            h = (j // HEAD_DIM) % NUM_HEADS
        off = s.to(tl.int64) * STRIDES.SLOT + h.to(tl.int64) * STRIDES.HEAD + d
    return off


@jit
def output_bits(key_out_ptr, value_out_ptr, OUT_KIND: tl.constexpr, COMBINED: tl.constexpr):
    """``(key_dst, value_dst)``: the outputs as pointers to each element's bits (uint8 for an
    e4m3 workspace, uint32 for fp32, uint16 for bf16/fp16), stored as computed; a combined
    output (one output per buffer) takes V through the K output."""
    if OUT_KIND == OUT_FLOAT8_E4M3FN:
        bits_ty: tl.constexpr = tl.uint8
    elif OUT_KIND == OUT_FLOAT32:
        bits_ty: tl.constexpr = tl.uint32
    else:
        bits_ty: tl.constexpr = tl.uint16
    key_dst = key_out_ptr.to(tl.pointer_type(bits_ty))
    if COMBINED:
        value_dst = key_dst
    else:
        value_dst = value_out_ptr.to(tl.pointer_type(bits_ty))
    return key_dst, value_dst


@jit
def renumber(new_table_ptr, entry, chunk):
    """The renumbered block table: entry ``i`` names output page ``i`` (written once, by the
    entry's chunk-0 program)."""
    if chunk == 0:
        tl.store(new_table_ptr + entry, entry.to(tl.int32))
