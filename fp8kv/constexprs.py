"""The records the plans hand to the kernels: one constexpr each, fields in UPPER_CASE.

A kernel takes a few of these instead of one constexpr per stride or flag: :class:`Cache` (the
K/V caches as stored, shared by every kernel that reads or writes them), a record of the call's
token rows or output pages, a record of its tile, and ``EXACT``. Records nest (a cache's sides,
a side's strides); Triton 3.6 gives a nested record's fields to kernel code as plain Python
values, so a kernel binds a sub-record it passes on to a helper to a ``tl.constexpr`` name
first. :mod:`fp8kv.ops.addressing` turns the strides into offsets and row pointers.
"""
from __future__ import annotations

from typing import NamedTuple

from .formats import Codec


class Strides(NamedTuple):
    """A paged array's strides in its own elements (a cache, a side scale array, dequantized
    pages): per page, slot and head, the offset of this array in its operand (V of a combined
    cache or output) and per layer of a stack (0: not stacked). All 0: no such array."""

    PAGE: int = 0
    SLOT: int = 0
    HEAD: int = 0
    OFFSET: int = 0
    LAYER: int = 0


class Rows(NamedTuple):
    """An array of token rows ``[T, H, D]`` (an input, or rope's outputs): strides per token and
    head; ``PACKED``: a token's heads are contiguous, so a row is addressed by its column
    alone."""

    TOKEN: int
    HEAD: int
    PACKED: bool = False


class Side(NamedTuple):
    """K or V of a cache: its codes, its side array (dynamic scales or block scales) and how it
    is scaled (:class:`fp8kv.modes.ScaleKind` ids: ``STATIC`` -- nvfp4's global scale --, and
    ``DYNAMIC``, NONE without scales stored per slot)."""

    CODES: Strides
    SCALES: Strides
    STATIC: int
    DYNAMIC: int


class Cache(NamedTuple):
    """A K/V cache pair as stored: one layer's geometry (``HEAD_DIM`` in elements), the format
    (its :class:`~fp8kv.formats.Codec`), both sides, the bytes of an inline scale after each
    head row (0: none), whether a write rounds dynamic scales up to powers of two, whether K
    and V are one buffer (a combined cache: V is written, and its pages stored, through K's
    output pointer) and the stack (:class:`fp8kv.modes.LayerKind` id and depth)."""

    NUM_HEADS: int
    HEAD_DIM: int
    PAGE_SIZE: int
    FMT: Codec
    KEY: Side
    VALUE: Side
    INLINE_PAD: int = 0
    SCALE_POW2: bool = False
    COMBINED: bool = False
    LAYER_KIND: int = 0
    NUM_LAYERS: int = 0


class WriteRows(NamedTuple):
    """``write_kv``'s new rows."""

    KEY: Rows
    VALUE: Rows


class WriteTile(NamedTuple):
    """``write_kv``'s tile: ``BLOCK_T`` tokens per program, their rows in ``BLOCK_HD``-column
    steps over a ``ROW_CHUNK`` of the row (static scales) or as ``[BLOCK_T, BLOCK_H, BLOCK_D]``
    tiles (dynamic scales); whether both caches' rows are packed, whether both sides' dynamic
    tiles load before the first amax, the division (:class:`fp8kv.modes.Division`) and int64
    offsets."""

    BLOCK_T: int
    BLOCK_HD: int
    ROW_CHUNK: int
    BLOCK_H: int
    BLOCK_D: int
    CACHE_PACKED: bool
    DYNAMIC_LOADS_FIRST: bool
    RECIPROCAL_DIV: int
    OFFSETS_64: bool


class NvFp4WriteTile(NamedTuple):
    """``write_nvfp4``'s tile: ``[BLOCK_T, BLOCK_H, BLOCK_D]`` elements of whole rows per side,
    loaded as groups of two blocks per thread, or (``BLOCKWISE``) blocks over two threads."""

    BLOCK_T: int
    BLOCK_H: int
    BLOCK_D: int
    LOADS_FIRST: bool
    BLOCKWISE: bool
    OFFSETS_64: bool


class Output(NamedTuple):
    """Dequantized pages: K's and V's strides (V's ``OFFSET`` into a combined output), the
    dtype (:class:`fp8kv.modes.OutKind` id), whether every output page is packed (flat chunks
    address by index alone), and an FP8 output's codec and scale kind (a ScaleKind id)."""

    KEY: Strides
    VALUE: Strides
    KIND: int
    PACKED: bool = False
    FMT: Codec | None = None
    SCALE: int = 0


class ReadTile(NamedTuple):
    """A dequantize's tile: ``BLOCK`` elements per program (flat chunks, or ``BLOCK / BLOCK_D``
    whole head rows with ``ROWWISE``), rows in layout order (``HND``), the block table's null
    page, packed cache pages, the division and the FP8 output's lookup (nvfp4)."""

    BLOCK: int
    BLOCK_D: int
    ROWWISE: bool
    HND: bool
    HAS_NULL_PAGE: bool
    IN_PACKED: bool = False
    RECIPROCAL_DIV: int = 0
    LOOKUP: bool = False


class RopeRows(NamedTuple):
    """``rope_write_kv``'s token rows: the inputs, the outputs (``KEY_OUT`` is ``KEY``'s when
    there is none) and the cos/sin cache's stride per position."""

    QUERY: Rows
    QUERY_OUT: Rows
    KEY: Rows
    KEY_OUT: Rows
    VALUE: Rows
    COS_SIN: int


class Rope(NamedTuple):
    """The rotation and the query output: query heads, rotary dims and style, the FP8 query's
    codec (None: a 16/32-bit query), its scale kind, the query's dtype
    (:class:`fp8kv.modes.OutKind` id) and whether the rotated key is written too."""

    NUM_Q_HEADS: int
    ROTARY_DIM: int
    GPTJ: bool
    Q_FMT: Codec | None
    Q_SCALE: int
    Q_OUT_KIND: int
    KEY_OUT: bool


class RopeTile(NamedTuple):
    """``rope_write_kv``'s tile: ``BLOCK_T`` tokens and ``KV_HEADS`` kv heads per program (their
    query heads ``BLOCK_HQ`` at a time), the padded tiles' widths, the static V loop's step,
    packed caches, the division and int64 offsets."""

    BLOCK_T: int
    KV_HEADS: int
    BLOCK_H: int
    BLOCK_HQ: int
    BLOCK_D: int
    BLOCK_HALF: int
    BLOCK_PASS: int
    BLOCK_VD: int
    CACHE_PACKED: bool
    RECIPROCAL_DIV: int
    OFFSETS_64: bool
