"""Launch plans: grid, warps, and every scalar and constexpr by name, from shapes alone.

Both frontends launch exactly what a plan says (bound by name, :mod:`fp8kv.binding`); nothing here
imports torch or jax. The constexprs are a few records (:mod:`fp8kv.constexprs`): the caches, the
call's rows or outputs, the tile, and ``EXACT``. Plans are cached on the (hashable) validated
arguments, so a steady-state call costs one dict lookup.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .arrays import ArrayInfo
from .constexprs import Cache, Rows, Side, Strides
from .layout import Layers
from .modes import LayerKind

INTERPRET, CUDA = "interpret", "cuda"


@dataclass(frozen=True, eq=False)
class LaunchPlan:
    """What to launch: grid, warps, and the kernel's scalars and constexprs by parameter name.

    Scalars are Python ints (Triton types them i32 / i64 by value) and floats, which are fp32
    parameters: only what may change from call to call without a new compile (token and page
    counts, host scale values). Everything fixed by the arrays' layout -- head counts, head_dim,
    page size, every stride -- is a constexpr: an engine's caches and inputs keep their layout
    from step to step, so this costs it no compile, and the compiler sees exact strides
    (alignment and contiguity proofs for 16-byte accesses come from them).
    """

    grid: tuple[int, ...]
    num_warps: int
    scalars: dict = field(default_factory=dict)
    constexprs: dict = field(default_factory=dict)
    # The kernel (a name in fp8kv.ops) that the plan is for: the op and the format choose it.
    kernel: str = ""
    # Exactness must not depend on a compiler default (Triton fuses a*b+c into an FMA unless told
    # otherwise, jax-triton passes True): every launch says it. The kernels' arithmetic that must
    # round once per step is written with explicit fma / div_rn either way.
    enable_fp_fusion: bool = False
    # Launched as a programmatic dependent of the stream's previous kernel (torch's launches;
    # the kernel waits for that one inside): fp8kv.attention.PDL.
    launch_pdl: bool = False

    @property
    def empty(self) -> bool:
        return any(g == 0 for g in self.grid)


def strides(pages, layer: int = 0) -> Strides:
    """The :class:`~fp8kv.constexprs.Strides` of a paged array (a cache, a side scale array,
    dequantized pages; :class:`fp8kv.layout.PagedCache` or :class:`fp8kv.layout.ScaleCache`)
    and its layer stride; all 0 without one (never read)."""
    if pages is None:
        return Strides()
    return Strides(pages.stride_page, pages.stride_slot, pages.stride_head,
                   getattr(pages, "offset", 0), layer)


def cache_record(args, scale_pow2: bool = False) -> Cache:
    """The caches of a validated call as the kernels take them (:class:`fp8kv.constexprs.Cache`):
    geometry, format, each side's strides and scaling, the stack."""
    kc, vc = args.key_cache, args.value_cache
    ks, vs = args.key_scale, args.value_scale
    layers = args.layers
    lk = Layers(0, 0, 0) if layers is None else layers
    kind = (LayerKind.NONE if layers is None else
            LayerKind.TENSOR if layers.on_device else LayerKind.VALUE)
    return Cache(
        NUM_HEADS=kc.num_heads, HEAD_DIM=kc.head_dim * args.fmt.codes_per_byte,
        PAGE_SIZE=kc.page_size, FMT=args.fmt.codec,
        KEY=Side(strides(kc, lk.stride_key_cache), strides(ks.stored, lk.stride_key_scale_cache),
                 ks.kind.id, ks.dynamic.id),
        VALUE=Side(strides(vc, lk.stride_value_cache),
                   strides(vs.stored, lk.stride_value_scale_cache), vs.kind.id, vs.dynamic.id),
        INLINE_PAD=args.inline_pad, SCALE_POW2=scale_pow2, COMBINED=args.combined,
        LAYER_KIND=kind.id, NUM_LAYERS=lk.num_layers)


def kv_scalars(args) -> dict:
    """The runtime scalars every K/V kernel takes: both sides' host scale values and (kernels
    that take stacked caches) the host layer -- a runtime scalar, so that one compiled kernel
    serves every layer; 0 where a device array names it or there is no layer axis."""
    layers = args.layers
    scalars = dict(key_scale_value=float(args.key_scale.value),
                   value_scale_value=float(args.value_scale.value))
    if not args.fmt.packed:
        scalars["layer"] = 0 if layers is None or layers.on_device else layers.index
    return scalars


def exact_for(backend: str, exact: bool | None) -> bool:
    """The interpreter must take the exact conversions (its own fp8/bf16 casts are wrong)."""
    return backend == INTERPRET if exact is None else exact


def token_rows(x: ArrayInfo, head_dim: int) -> Rows:
    """Token rows ``[T, H, D]`` as the kernels take them; packed where a token's heads are
    contiguous."""
    return Rows(x.strides[0], x.strides[1], x.strides[1] == head_dim or x.shape[1] == 1)


INT32_REACH = 2**31 - 1  # the largest element offset that int32 address arithmetic may form


def paged_reach(pages, heads: int, cols: int, geometry=None) -> int:
    """The largest element offset into a paged array (:class:`fp8kv.layout.PagedCache` or
    ``ScaleCache``) of its last slot, ``heads`` heads and ``cols`` columns on; ``geometry``: the
    cache whose pages and slots it has (default: its own)."""
    g = geometry or pages
    return (getattr(pages, "offset", 0) + (g.num_pages - 1) * pages.stride_page
            + (g.page_size - 1) * pages.stride_slot + heads * pages.stride_head + cols)


def kv_reach(args, heads: int, cols: int) -> list[int]:
    """:func:`paged_reach` of a validated write's caches and side scale arrays."""
    kc = args.key_cache
    return ([paged_reach(c, heads, cols) for c in (kc, args.value_cache)]
            + [paged_reach(sc, heads, 0, kc) for sc in (args.key_scale.stored,
                                                         args.value_scale.stored)
               if sc is not None])
