"""Cache geometry: how an array of a given shape and layout is seen as pages of token rows.

Everything here is arithmetic on shapes and strides (in elements); the checks that raise for a
bad argument are :mod:`fp8kv.validate`'s. A combined ``[num_pages, 2, ...]`` cache is two halves
of one array: K at element offset 0, V at ``strides[1]``. Both frontends pass such an array as the
K and the V operand and let the offset find V, so a combined cache needs no kernel of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .arrays import ArrayInfo

LAYOUTS = ("NHD", "HND")


@dataclass(frozen=True)
class PagedCache:
    """A K or V cache seen as ``[num_pages, page_size, num_heads, head_dim]`` + strides.

    ``offset``: elements from the operand's first element to this cache's (V of a combined cache).
    """

    num_pages: int
    page_size: int
    num_heads: int
    head_dim: int
    stride_page: int
    stride_slot: int
    stride_head: int
    offset: int = 0

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def packed_rows(self) -> bool:
        """A token's ``num_heads * head_dim`` row is contiguous."""
        return self.stride_head == self.head_dim or self.num_heads == 1

    def packed_pages(self, layout: str) -> bool:
        """A page's ``page_size * num_heads * head_dim`` elements are contiguous, in layout
        order."""
        if self.page_size == 1:
            return self.packed_rows
        if layout == "NHD":
            return self.packed_rows and self.stride_slot == self.num_heads * self.head_dim
        return self.stride_slot == self.head_dim and (
            self.num_heads == 1 or self.stride_head == self.page_size * self.head_dim)


def expected_cache_shape(layout: str, rank: int) -> str:
    """The shape a cache of ``rank`` 3 or 4 must have, in words (for error messages)."""
    if rank == 3:
        return "[num_slots, num_kv_heads, head_dim]"
    middle = "page_size, num_kv_heads" if layout == "NHD" else "num_kv_heads, page_size"
    return f"[num_pages, {middle}, head_dim]"


def paged(cache: ArrayInfo, layout: str, offset: int = 0) -> PagedCache:
    """A rank-3 or rank-4 cache (already checked) as pages."""
    if cache.ndim == 3:  # [num_slots, H, D]: page_size 1, either layout
        n, h, d = cache.shape
        return PagedCache(n, 1, h, d, cache.strides[0], 0, cache.strides[1], offset)
    if layout == "NHD":
        p, s, h, d = cache.shape
        return PagedCache(p, s, h, d, cache.strides[0], cache.strides[1], cache.strides[2], offset)
    p, h, s, d = cache.shape
    return PagedCache(p, s, h, d, cache.strides[0], cache.strides[2], cache.strides[1], offset)


def combined_halves(kv_cache: ArrayInfo, layout: str) -> tuple[PagedCache, PagedCache]:
    """K and V of a combined ``[num_pages, 2, ...]`` cache: one array, V ``strides[1]`` after K."""
    half = kv_cache.drop_dim(1)
    return paged(half, layout), paged(half, layout, offset=kv_cache.strides[1])


def pages_shape(cache: PagedCache, layout: str, rank: int, num_entries: int,
                combined: bool = False) -> tuple[int, ...]:
    """Shape of ``num_entries`` pages of ``cache`` in its layout (``[N, 2, ...]`` if combined)."""
    if rank == 3:
        page = (cache.num_heads, cache.head_dim)
    elif layout == "NHD":
        page = (cache.page_size, cache.num_heads, cache.head_dim)
    else:
        page = (cache.num_heads, cache.page_size, cache.head_dim)
    return (num_entries, 2) + page if combined else (num_entries,) + page


def block_scales_shape(cache: PagedCache, layout: str, rank: int, fmt) -> tuple[int, ...]:
    """The shape of a block-scale array of a ``rank`` 3/4 cache of codes of a block-scaled
    format: the cache's, with ``head_dim / fmt.blocks.size`` scales per head row
    (``cache.head_dim`` is in bytes)."""
    blocks = cache.head_dim * fmt.codes_per_byte // fmt.blocks.size
    return pages_shape(replace(cache, head_dim=blocks), layout, rank, cache.num_pages)


# ---------------------------------------------------------------------------------------------
# Dynamic scales: where each written token's scale lives.

# Bytes after each head's data in an inline cache: the fp32 scale alone (+4), or the scale and
# 12 zero bytes, which keeps every head row a multiple of 16 bytes when head_dim is (+16).
INLINE_PADS = (4, 16)


@dataclass(frozen=True)
class ScaleCache:
    """A side scale array seen as ``[num_pages, page_size, num_heads or 1]`` + strides (elements).

    ``per_head`` False: one scale per token (``stride_head`` 0).
    """

    per_head: bool
    stride_page: int
    stride_slot: int
    stride_head: int


def scale_cache_shapes(cache: PagedCache, layout: str, rank: int) -> dict:
    """The side scale array shapes a ``rank`` 3/4 cache accepts, ``{"token_head": ..., "token":
    ...}``: the cache's shape without ``head_dim``, or without heads and ``head_dim``."""
    token = (cache.num_pages,) if rank == 3 else (cache.num_pages, cache.page_size)
    return {"token_head": pages_shape(cache, layout, rank, cache.num_pages)[:-1], "token": token}


def scale_cache(info: ArrayInfo, layout: str, rank: int) -> ScaleCache:
    """Geometry of a side scale array whose shape was checked against :func:`scale_cache_shapes`."""
    st = info.strides
    if info.ndim == rank - 1:   # per token-head: the cache's geometry without head_dim
        p = paged(ArrayInfo((*info.shape, 1), (*st, 1), info.dtype, info.device), layout)
        return ScaleCache(True, p.stride_page, p.stride_slot, p.stride_head)
    return ScaleCache(False, st[0], st[1] if rank == 4 else 0, 0)


def inline_data(cache: PagedCache, head_dim: int) -> PagedCache:
    """An inline-scale cache as pages of its data: rows of ``head_dim`` codes, the scale after."""
    return replace(cache, head_dim=head_dim)


# ---------------------------------------------------------------------------------------------
# Stacked caches: a leading layer axis on every cache argument (docs/SPEC.md section 14).

@dataclass(frozen=True)
class Layers:
    """The layer axis of a call's stacked arrays and which layer it reads or writes.

    Strides are in elements of each array (0 for an array the call does not have); the caches'
    geometry (:class:`PagedCache`, :class:`ScaleCache`) is then one layer's. ``index``: the host
    layer (may be out of range), or None when a device array names it.
    """

    num_layers: int
    stride_key_cache: int
    stride_value_cache: int
    stride_key_scale_cache: int = 0
    stride_value_scale_cache: int = 0
    index: int | None = None

    @property
    def on_device(self) -> bool:
        return self.index is None

    @property
    def host_in_range(self) -> bool:
        """A host layer that names a layer of the stack."""
        return self.index is not None and 0 <= self.index < self.num_layers
