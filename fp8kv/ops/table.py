"""Block tables in the dequantize kernels: which page a program reads, where its output goes, the
renumbered table (docs/SPEC.md section 5)."""
import triton.language as tl

from ._dual import jit
from .codec import OUT_FLOAT8_E4M3FN, OUT_FLOAT32


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
def output_bits(key_out_ptr, value_out_ptr, OUT_KIND: tl.constexpr, SHARED_OUT: tl.constexpr):
    """``(key_dst, value_dst)``: the outputs as pointers to each element's bits (uint8 for an
    e4m3 workspace, uint32 for fp32, uint16 for bf16/fp16), stored as computed; with
    ``SHARED_OUT`` (a combined output, one output per buffer) V goes through the K output."""
    if OUT_KIND == OUT_FLOAT8_E4M3FN:
        bits_ty: tl.constexpr = tl.uint8
    elif OUT_KIND == OUT_FLOAT32:
        bits_ty: tl.constexpr = tl.uint32
    else:
        bits_ty: tl.constexpr = tl.uint16
    key_dst = key_out_ptr.to(tl.pointer_type(bits_ty))
    if SHARED_OUT:
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
