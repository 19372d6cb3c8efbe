"""PyTorch frontend of fp8kv: exact FP8 paged KV-cache write (with fused RoPE), page
dequantization, and paged decode attention over every cache format.

CUDA tensors run the compiled Triton kernels; CPU tensors run the same kernels under Triton's
interpreter (slow, for tests and CPU-only development). Every function is also a
``torch.library`` custom op (``torch.ops.fp8kv.*``), so ``torch.compile(fullgraph=True)`` and CUDA
graphs capture it.
"""
from __future__ import annotations

import functools
import inspect
from typing import Sequence, Union

try:
    import torch
except ImportError as e:   # torch is the extra "torch" of fp8kv, not a dependency: say so
    # (ModuleNotFoundError: what pytest.importorskip and tools expect of a missing module)
    raise ModuleNotFoundError(f"fp8kv_torch needs PyTorch, which cannot be imported ({e}): "
                              'pip install "fp8kv[torch]"', name="torch") from e

from fp8kv.optable import OPS
from fp8kv.spelling import check_flag

from . import _launch, _ops
from ._fast import FastPathWarning
from ._spelling import output_dtype

__all__ = ["write_kv", "write_kv_combined", "dequantize_pages", "dequantize_pages_combined",
           "rope_write_kv", "rope_write_kv_combined", "paged_attention",
           "paged_attention_combined", "FastPathWarning"]

Tensor = torch.Tensor
Scale = Union[float, Tensor, None]
ScaleCache = Union[Tensor, str, None]
Layer = Union[int, Tensor, None]


def _public(op: str, prepare=None):
    """The public function of ``op``: the decorated stub's signature and docstring; a call binds
    its arguments by name (by hand: torch.compile cannot trace ``locals()``; a wrong call raises
    Python's own ``TypeError``s), has ``prepare(op, named)`` ready op-specific ones, and runs
    eagerly through the launcher, under torch.compile as the op's custom op."""
    def wrap(stub):
        params = tuple(inspect.signature(stub).parameters.values())
        positional = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
        names = frozenset(p.name for p in params)
        defaults = tuple((p.name, p.default) for p in params)   # (a required one's: empty)
        where = f"{stub.__name__}()"

        @functools.wraps(stub)
        def call(*args, **kwargs):
            if len(args) > len(positional):
                raise TypeError(f"{where} takes {len(positional)} positional arguments but "
                                f"{len(args)} were given")
            named = dict(zip(positional, args))
            for name, value in kwargs.items():
                if name not in names:
                    raise TypeError(f"{where} got an unexpected keyword argument {name!r}")
                if name in named:
                    raise TypeError(f"{where} got multiple values for argument {name!r}")
                named[name] = value
            for name, default in defaults:
                if name not in named:
                    if default is inspect.Parameter.empty:
                        raise TypeError(f"{where} missing required argument: {name!r}")
                    named[name] = default
            # Before any cache: 1 or "yes" fails every time.
            check_flag(named["check_bounds"], "check_bounds")
            if prepare is not None:
                prepare(op, named)
            if torch.compiler.is_compiling():
                return _ops.call(op, named)
            return _launch.run(op, named)
        return call
    return wrap


@_public("write_kv")
def write_kv(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slots: Tensor,
             key_scale: Scale = None, value_scale: Scale = None, *, layout: str = "NHD",
             fp8_format: str | None = None, key_scale_cache: ScaleCache = None,
             value_scale_cache: ScaleCache = None, scale_rounding: str = "exact",
             check_bounds: bool = False, cache_format: str | None = None,
             layer: Layer = None) -> None:
    """Quantize ``key``/``value`` to FP8 (or NVFP4) and write them into a paged cache, in one
    launch.

    Parameters
    ----------
    key, value : torch.Tensor
        ``[num_tokens, num_kv_heads, head_dim]``, bfloat16 / float16 / float32; any strides with a
        unit-stride last dim (e.g. K and V sliced out of a fused QKV output).
    key_cache, value_cache : torch.Tensor
        ``float8_e4m3fn``, ``float8_e5m2`` or raw ``uint8``, same shape, any strided view with a
        unit-stride last dim (e.g. ``kv[:, 0]`` of a combined buffer):

        * ``layout="NHD"``: ``[num_pages, page_size, num_kv_heads, head_dim]``
        * ``layout="HND"``: ``[num_pages, num_kv_heads, page_size, head_dim]``
        * either layout: ``[num_slots, num_kv_heads, head_dim]`` (page_size 1)
    slots : torch.Tensor
        ``[num_tokens]`` int32 / int64, ``slot = page * page_size + offset``. Tokens with
        ``slot < 0`` (padding) or ``slot >= num_pages * page_size`` are not written.
    key_scale, value_scale : None, float or torch.Tensor
        Dequant scales: ``q = fp8(x / scale)``. A tensor is float32 of shape ``[]``, ``[1]`` (per
        tensor) or ``[num_kv_heads]`` on the caches' device; the kernel reads it (no host sync).
    layout : {"NHD", "HND"}
    fp8_format : {None, "e4m3", "e5m2"}
        Format of a ``uint8`` cache (default ``"e4m3"``); must match a typed cache if given.
    key_scale_cache, value_scale_cache : None, torch.Tensor or "inline"
        Dynamic scales (K and V independent; that side's ``key_scale``/``value_scale`` must then
        be None): each written token gets its scale from its own values, ``s = max(amax / fmax,
        1e-6)`` (docs/SPEC.md, "Dynamic scales"), and the scale is stored at its slot. A float32
        tensor (any strides) whose shape gives the granularity:

        * per token-head: ``[num_pages, page_size, num_kv_heads]`` (NHD),
          ``[num_pages, num_kv_heads, page_size]`` (HND), ``[num_slots, num_kv_heads]`` (rank 3);
        * per token: ``[num_pages, page_size]``, ``[num_slots]`` (rank 3).

        ``"inline"`` (both sides, per token-head): the caches' last dimension is ``head_dim + 4``
        or ``head_dim + 16``; each head row holds its codes, then the fp32 scale (little-endian),
        then zeros. For a combined scale buffer ``sc`` of shape ``[num_pages, 2, ...]`` pass the
        views ``sc[:, 0]`` and ``sc[:, 1]``.
    scale_rounding : {"exact", "pow2"}
        ``"pow2"`` rounds each dynamic scale up to a power of two.
    check_bounds : bool
        Debugging aid for engine developers hunting a bad slot mapping (off by default): read
        ``slots`` on the host and raise ``ValueError`` if a slot is past the cache (instead of
        skipping it). A device sync: refused (``RuntimeError``) inside CUDA-graph capture and
        under ``torch.compile``.
    cache_format : {None, "e4m3", "e5m2", "nvfp4", "mxfp8"}
        The cache's format (pass it or ``fp8_format``, not both). ``"nvfp4"`` (docs/SPEC.md
        section 13): ``uint8`` caches of ``head_dim / 2`` bytes per head row (NHD
        ``[num_pages, page_size, H, D/2]``, HND ``[num_pages, H, page_size, D/2]``,
        ``[num_slots, H, D/2]``; ``head_dim`` a multiple of 16), two E2M1 codes per byte;
        ``key_scale_cache``/``value_scale_cache`` (required) hold the e4m3 block scales,
        ``float8_e4m3fn`` or ``uint8`` tensors of the caches' shape with last dim ``D/16``;
        ``key_scale``/``value_scale`` are the global scales. ``"mxfp8"`` (section 13a): e4m3
        codes, ``float8_e4m3fn`` or ``uint8`` caches (``head_dim`` a multiple of 32);
        ``key_scale_cache``/``value_scale_cache`` (required) hold one E8M0 power-of-two scale
        per 32 elements, ``uint8`` tensors of the caches' shape with last dim ``D/32``; no
        ``key_scale``/``value_scale``.
    layer : None, int or torch.Tensor
        Stacked caches (docs/SPEC.md section 14): given, every cache (and side scale array) has
        a leading layer axis, ``[num_layers, ...]`` with ``...`` as above, and the tokens go to
        layer ``layer``: an int (a kernel argument: one compiled kernel serves every layer) or
        a 0-d int32 / int64 tensor on the caches' device (read by the kernel: CUDA graphs may
        replay it with new values). Out of range (no wrap-around): nothing is written
        (``check_bounds=True``: ``ValueError``).

    Returns
    -------
    None

    Note
    ----
    ``key_cache`` and ``value_cache`` (and the scale caches) are modified in place; bytes that no
    written slot names are never touched (with ``layer``: nor any other layer). Rounding is
    IEEE fp32 division, then round-to-nearest-even with saturation
    (NaN -> 0x7F), identical on every backend (see docs/SPEC.md).

    Examples
    --------
    >>> import torch, fp8kv_torch
    >>> key = torch.tensor([[[1.0, -2.0, 500.0, 0.3]]], dtype=torch.bfloat16)  # 1 token, 1 head
    >>> k_cache = torch.zeros(2, 4, 1, 4, dtype=torch.float8_e4m3fn)          # 2 pages of 4
    >>> v_cache = torch.zeros_like(k_cache)
    >>> fp8kv_torch.write_kv(key, key, k_cache, v_cache, torch.tensor([5]), key_scale=0.5)
    >>> k_cache[1, 1, 0].float().tolist()
    [2.0, -4.0, 448.0, 0.625]

    NVFP4: 16 elements, one block; its amax 6 gives the block scale 1.0 (6 / 6).

    >>> x = torch.linspace(-6, 6, 16).reshape(1, 1, 16)                 # head_dim 16
    >>> codes = torch.zeros(2, 4, 1, 8, dtype=torch.uint8)              # head_dim / 2 bytes
    >>> blocks = torch.zeros(2, 4, 1, 1, dtype=torch.float8_e4m3fn)     # head_dim / 16 scales
    >>> fp8kv_torch.write_kv(x, x, codes, codes.clone(), torch.tensor([5]),
    ...                      key_scale_cache=blocks, value_scale_cache=blocks.clone(),
    ...                      cache_format="nvfp4")
    >>> blocks[1, 1, 0].float().tolist(), [hex(b) for b in codes[1, 1, 0, :3].tolist()]
    ([1.0], ['0xff', '0xee', '0xcd'])
    """


@_public("write_kv_combined")
def write_kv_combined(key: Tensor, value: Tensor, kv_cache: Tensor, slots: Tensor,
                      key_scale: Scale = None, value_scale: Scale = None, *, layout: str = "NHD",
                      fp8_format: str | None = None, key_scale_cache: ScaleCache = None,
                      value_scale_cache: ScaleCache = None, scale_rounding: str = "exact",
                      check_bounds: bool = False, cache_format: str | None = None,
                      layer: Layer = None) -> None:
    """:func:`write_kv` into one combined cache (vLLM / FlashInfer style).

    Parameters
    ----------
    kv_cache : torch.Tensor
        ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD),
        ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND) or
        ``[num_slots, 2, num_kv_heads, head_dim]``; index 0 of dim 1 is K, index 1 is V.

    Other parameters are those of :func:`write_kv`; ``key_scale_cache``/``value_scale_cache``
    are shaped as for one half of ``kv_cache`` (e.g. views ``sc[:, 0]``, ``sc[:, 1]`` of a
    combined scale buffer); with ``layer``, ``kv_cache`` is ``[num_layers, ...]`` of the above.
    ``kv_cache`` (and the scale caches) are modified in place.

    Examples
    --------
    >>> import torch, fp8kv_torch
    >>> kv = torch.zeros(2, 2, 4, 1, 4, dtype=torch.uint8)
    >>> x = torch.ones(1, 1, 4)
    >>> fp8kv_torch.write_kv_combined(x, -x, kv, torch.tensor([6]))
    >>> kv[1, :, 2, 0].tolist()
    [[56, 56, 56, 56], [184, 184, 184, 184]]
    """


# What out= holds, by the names of the results: (key_pages, value_pages, new_block_table).
_OUT_RESULTS = {name: tuple(op.arg(p).result for a in op.args for p in a.parts)
                for name, op in OPS.items()}


def _dequantize_out(op: str, named: dict) -> None:
    """``dtype`` as a torch dtype, ``out`` as a tuple of one tensor per output."""
    named["dtype"] = dtype = output_dtype(named["dtype"])
    if named["out"] is None:
        return
    outs = named["out"] = tuple(named["out"])
    if len(outs) != len(_OUT_RESULTS[op]):
        raise ValueError(f"out: expected ({', '.join(_OUT_RESULTS[op])}), got {len(outs)} tensors")
    if isinstance(outs[0], torch.Tensor) and outs[0].dtype != dtype:
        raise TypeError(f"out[0]: expected dtype {dtype} (the dtype argument), got {outs[0].dtype}")


@_public("dequantize_pages", _dequantize_out)
def dequantize_pages(key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                     key_scale: Scale = None, value_scale: Scale = None, *,
                     dtype: torch.dtype | str = torch.bfloat16, layout: str = "NHD",
                     fp8_format: str | None = None, null_page: int | None = None,
                     out: Sequence[Tensor] | None = None, key_scale_cache: ScaleCache = None,
                     value_scale_cache: ScaleCache = None,
                     head_dim: int | None = None, check_bounds: bool = False,
                     cache_format: str | None = None, out_scale: Scale = None,
                     layer: Layer = None) -> tuple[Tensor, Tensor, Tensor]:
    """Dequantize the pages a block table names into a compact paged cache + renumbered table.

    Parameters
    ----------
    key_cache, value_cache : torch.Tensor
        FP8 caches as in :func:`write_kv` (NHD ``[num_pages, page_size, H, D]``, HND
        ``[num_pages, H, page_size, D]`` or ``[num_slots, H, D]``), typed or ``uint8``.
    block_table : torch.Tensor
        ``[batch, pages_per_seq]`` int32 (or int64). Entries ``< 0``, equal to ``null_page``, or
        ``>= num_pages`` are padding.
    key_scale, value_scale : None, float or torch.Tensor
        As in :func:`write_kv`: ``out = round(fp32(decode(q)) * scale)``.
    dtype : torch.dtype or str
        ``torch.bfloat16`` (default), ``torch.float16`` or ``torch.float32``, or the same by name
        (``"bfloat16"``, ``"float16"``, ``"float32"``, as ``fp8kv_jax`` takes them); for an nvfp4
        cache also ``torch.float8_e4m3fn`` / ``"float8_e4m3fn"`` (an FP8 workspace, with
        ``out_scale``).
    layout : {"NHD", "HND"}
    fp8_format : {None, "e4m3", "e5m2"}
    null_page : int, optional
        A page id that also means padding (vLLM's null block is 0).
    out : tuple of torch.Tensor, optional
        Preallocated ``(key_pages, value_pages, new_block_table)`` (e.g. for CUDA graphs); each may
        be a strided view with a unit-stride last dim.
    key_scale_cache, value_scale_cache : None, torch.Tensor or "inline"
        Dynamic scales as written by :func:`write_kv` (shapes there), read per slot instead of a
        static scale (that side's ``key_scale``/``value_scale`` must be None).
    head_dim : int, optional
        Required with ``"inline"`` (the caches' last dimension is ``head_dim + 4`` or
        ``head_dim + 16``); the pages then hold ``head_dim`` columns. Otherwise, if given, it must
        equal the caches' last dimension.
    check_bounds : bool
        Debugging aid (off by default): read ``block_table`` on the host and raise
        ``ValueError`` if an entry is past the cache (instead of giving a zero page). A device
        sync: refused (``RuntimeError``) inside CUDA-graph capture and under ``torch.compile``.
    cache_format : {None, "e4m3", "e5m2", "nvfp4", "mxfp8"}
        As in :func:`write_kv`. ``"nvfp4"``: the block scales in ``key_scale_cache`` /
        ``value_scale_cache``, the global scales in ``key_scale`` / ``value_scale``; the pages
        hold ``head_dim = 2 x`` the caches' last dimension elements per head row. ``"mxfp8"``:
        the E8M0 block scales in ``key_scale_cache`` / ``value_scale_cache``, no static scales.
    out_scale : None, float or torch.Tensor
        With ``dtype=torch.float8_e4m3fn``: the FP8 output's dequant scale, ``out =
        e4m3(value / out_scale)`` (a float32 ``[]``/``[1]`` tensor is read on the device).
    layer : None, int or torch.Tensor
        Stacked caches (docs/SPEC.md section 14), as in :func:`write_kv`: the pages are read from
        layer ``layer`` of ``[num_layers, ...]`` caches (and side scale arrays). Out of range:
        every page is zero (``check_bounds=True``: ``ValueError``).

    Returns
    -------
    key_pages, value_pages : torch.Tensor
        ``[batch * pages_per_seq, ...page]`` in the cache's layout, ``dtype``: output page ``i`` is
        the cache page ``block_table.flatten()[i]``, dequantized; padding entries give zero pages.
    new_block_table : torch.Tensor
        ``arange(batch * pages_per_seq).reshape(batch, pages_per_seq)``, int32.

    Note
    ----
    The caches are only read. With ``out``, the three tensors are overwritten entirely.

    Examples
    --------
    >>> import torch, fp8kv_torch
    >>> cache = torch.full((3, 2, 1, 4), 0x38, dtype=torch.uint8)   # every byte is 1.0 in e4m3
    >>> table = torch.tensor([[2, -1]], dtype=torch.int32)             # -1: padding
    >>> k, v, table = fp8kv_torch.dequantize_pages(cache, cache, table, key_scale=0.5)
    >>> k[:, 0, 0].tolist(), table.tolist()
    ([[0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]], [[0, 1]])

    NVFP4 codes (two per byte, low nibble first) with block scale 2.0 (e4m3 0x40), as bf16 and as
    an FP8 workspace with ``out_scale`` 0.5:

    >>> codes = torch.full((1, 1, 1, 8), 0x9A, dtype=torch.uint8)     # 0xA: -1.0, 0x9: -0.5
    >>> blocks = torch.full((1, 1, 1, 1), 0x40, dtype=torch.uint8)
    >>> table = torch.tensor([[0]], dtype=torch.int32)
    >>> k, _, _ = fp8kv_torch.dequantize_pages(codes, codes, table, key_scale_cache=blocks,
    ...                                         value_scale_cache=blocks, cache_format="nvfp4")
    >>> k[0, 0, 0, :4].tolist()
    [-2.0, -1.0, -2.0, -1.0]
    >>> k, _, _ = fp8kv_torch.dequantize_pages(codes, codes, table, key_scale_cache=blocks,
    ...                                         value_scale_cache=blocks, cache_format="nvfp4",
    ...                                         dtype=torch.float8_e4m3fn, out_scale=0.5)
    >>> k[0, 0, 0, :2].float().tolist()
    [-4.0, -2.0]
    """


@_public("dequantize_pages_combined", _dequantize_out)
def dequantize_pages_combined(kv_cache: Tensor, block_table: Tensor, key_scale: Scale = None,
                              value_scale: Scale = None, *,
                              dtype: torch.dtype | str = torch.bfloat16,
                              layout: str = "NHD", fp8_format: str | None = None,
                              null_page: int | None = None,
                              out: Sequence[Tensor] | None = None,
                              key_scale_cache: ScaleCache = None,
                              value_scale_cache: ScaleCache = None,
                              head_dim: int | None = None, check_bounds: bool = False,
                              cache_format: str | None = None, out_scale: Scale = None,
                              layer: Layer = None) -> tuple[Tensor, Tensor]:
    """:func:`dequantize_pages` from and to combined ``[N, 2, ...]`` caches (FlashInfer TRT-LLM).

    Parameters
    ----------
    kv_cache : torch.Tensor
        ``[num_pages, 2, page_size, H, D]`` (NHD), ``[num_pages, 2, H, page_size, D]`` (HND) or
        ``[num_slots, 2, H, D]``; K at index 0 of dim 1, V at index 1.
    out : tuple of torch.Tensor, optional
        Preallocated ``(kv_pages, new_block_table)``.

    Returns
    -------
    kv_pages : torch.Tensor
        ``[batch * pages_per_seq, 2, ...page]``, ``dtype``.
    new_block_table : torch.Tensor
        ``[batch, pages_per_seq]`` int32.

    Other parameters are those of :func:`dequantize_pages` (dynamic scale caches shaped as for
    one half of ``kv_cache``, e.g. views ``sc[:, 0]``, ``sc[:, 1]`` of a combined scale buffer;
    with ``layer``, ``kv_cache`` is ``[num_layers, ...]`` of the above).

    Examples
    --------
    >>> import torch, fp8kv_torch
    >>> kv = torch.full((2, 2, 1, 1, 2), 0xB8, dtype=torch.uint8)   # -1.0 in e4m3
    >>> pages, table = fp8kv_torch.dequantize_pages_combined(kv, torch.tensor([[1]], dtype=torch.int32))
    >>> pages.shape, pages[0, 1, 0, 0].tolist()
    (torch.Size([1, 2, 1, 1, 2]), [-1.0, -1.0])
    """


@_public("rope_write_kv")
def rope_write_kv(query: Tensor, key: Tensor, value: Tensor, key_cache: Tensor,
                  value_cache: Tensor, slots: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                  key_scale: Scale = None, value_scale: Scale = None, *,
                  query_scale: Scale = None, rope_style: str = "neox",
                  rotary_dim: int | None = None, layout: str = "NHD",
                  fp8_format: str | None = None, query_out: Tensor | None = None,
                  key_out: Tensor | None = None, key_scale_cache: ScaleCache = None,
                  value_scale_cache: ScaleCache = None, scale_rounding: str = "exact",
                  check_bounds: bool = False) -> Tensor:
    """Apply RoPE to ``query`` and ``key``, then quantize K and V to FP8 and write them into a
    paged cache, in one launch (docs/SPEC.md, section 12).

    The result is exactly :func:`write_kv` of the rotated key (fp32), the rotation being
    ``y_a = RN(RN(x_a c) - RN(x_b s))``, ``y_b = RN(RN(x_b c) + RN(x_a s))`` in fp32 (no FMA).

    Parameters
    ----------
    query : torch.Tensor
        ``[num_tokens, num_heads, head_dim]``, the dtype of ``key``; ``num_heads`` a multiple of
        ``num_kv_heads``. Any strides with a unit-stride last dim (e.g. the query slice of a
        fused QKV projection output).
    key, value : torch.Tensor
        ``[num_tokens, num_kv_heads, head_dim]``, bfloat16 / float16 / float32, any strides with
        a unit-stride last dim.
    key_cache, value_cache : torch.Tensor
        As in :func:`write_kv`: NHD ``[num_pages, page_size, num_kv_heads, head_dim]``, HND
        ``[num_pages, num_kv_heads, page_size, head_dim]`` or ``[num_slots, num_kv_heads,
        head_dim]``; ``float8_e4m3fn``, ``float8_e5m2`` or ``uint8``.
    slots : torch.Tensor
        ``[num_tokens]`` int32 / int64, as in :func:`write_kv` (``< 0``: padding, no K/V write;
        the query row is still rotated).
    positions : torch.Tensor
        ``[num_tokens]`` int32 / int64, each token's row of ``cos_sin_cache``. A position outside
        ``[0, max_position)`` gives an all-zero query (and key_out) row and writes no K/V.
    cos_sin_cache : torch.Tensor
        ``[max_position, rotary_dim]`` float32 / bfloat16 / float16: cos in the first
        ``rotary_dim / 2`` columns, sin in the rest (vLLM / FlashInfer convention).
    key_scale, value_scale : None, float or torch.Tensor
        Dequant scales of the cache, as in :func:`write_kv`.
    rope_style : {"neox", "gptj"}
        Pairs ``(i, i + rotary_dim / 2)`` (NeoX, Llama) or ``(2i, 2i + 1)`` (GPT-J).
    rotary_dim : int, optional
        The rotated columns (default: the width of ``cos_sin_cache``, which it must equal); even,
        at most ``head_dim``. Columns from ``rotary_dim`` on pass through.
    query_scale : None, float or torch.Tensor
        None: ``query_out`` has ``query``'s dtype. A float or a float32 tensor ``[]`` / ``[1]``:
        ``query_out`` holds FP8 codes ``RNE_sat(y / query_scale)`` (for FP8 attention).
    query_out : torch.Tensor, optional
        ``[num_tokens, num_heads, head_dim]`` to write the rotated query into (e.g. for CUDA
        graphs), any strides with a unit-stride last dim: ``query``'s dtype, or with
        ``query_scale`` ``float8_e4m3fn``, ``float8_e5m2`` (e5m2 codes) or ``uint8`` (e4m3
        codes). May be ``query`` itself (in place). None: a new contiguous tensor.
    key_out : torch.Tensor, optional
        ``[num_tokens, num_kv_heads, head_dim]`` of ``key``'s dtype: receives the rotated key
        (may be ``key`` itself).
    layout, fp8_format, key_scale_cache, value_scale_cache, scale_rounding
        As in :func:`write_kv` (dynamic scales take the amax of the rotated key rows).
    check_bounds : bool
        Debugging aid (off by default): read ``positions`` and ``slots`` on the host and raise
        ``ValueError`` for a position outside the cos/sin cache or a slot past the cache. A
        device sync: refused inside CUDA-graph capture and under ``torch.compile``.

    Returns
    -------
    query_out : torch.Tensor
        The rotated query (the given ``query_out``, or a new tensor).

    Note
    ----
    ``key_cache`` and ``value_cache`` (and the scale caches), ``query_out`` and ``key_out`` are
    modified in place; cache bytes that no written slot names are never touched. Every element
    of ``query_out`` and ``key_out`` is written.

    Examples
    --------
    >>> import torch, fp8kv_torch
    >>> qkv = torch.tensor([[1.0, 2.0, 3.0, 4.0, 8.0, -8.0]], dtype=torch.bfloat16)  # Hq=Hkv=1, D=2
    >>> q, k, v = (qkv[:, i:i + 2].view(1, 1, 2) for i in (0, 2, 4))
    >>> cos_sin = torch.tensor([[1.0, 0.0], [0.0, 1.0]])                  # positions 0 and 1
    >>> k_cache = torch.zeros(2, 4, 1, 2, dtype=torch.float8_e4m3fn)
    >>> v_cache = torch.zeros_like(k_cache)
    >>> q_rot = fp8kv_torch.rope_write_kv(q, k, v, k_cache, v_cache, torch.tensor([5]),
    ...                                   torch.tensor([1]), cos_sin, key_scale=0.5)
    >>> q_rot.tolist(), k_cache[1, 1, 0].float().tolist(), v_cache[1, 1, 0].float().tolist()
    ([[[-2.0, 1.0]]], [-8.0, 6.0], [8.0, -8.0])
    """


@_public("rope_write_kv_combined")
def rope_write_kv_combined(query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor,
                           slots: Tensor, positions: Tensor, cos_sin_cache: Tensor,
                           key_scale: Scale = None, value_scale: Scale = None, *,
                           query_scale: Scale = None, rope_style: str = "neox",
                           rotary_dim: int | None = None, layout: str = "NHD",
                           fp8_format: str | None = None, query_out: Tensor | None = None,
                           key_out: Tensor | None = None, key_scale_cache: ScaleCache = None,
                           value_scale_cache: ScaleCache = None, scale_rounding: str = "exact",
                           check_bounds: bool = False) -> Tensor:
    """:func:`rope_write_kv` into one combined cache (vLLM / FlashInfer style).

    Parameters
    ----------
    kv_cache : torch.Tensor
        ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD),
        ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND) or
        ``[num_slots, 2, num_kv_heads, head_dim]``; index 0 of dim 1 is K, index 1 is V.

    Other parameters and the result are those of :func:`rope_write_kv`. ``kv_cache`` (and the
    scale caches, ``query_out``, ``key_out``) are modified in place.

    Examples
    --------
    >>> import torch, fp8kv_torch
    >>> x = torch.tensor([[[1.0, 2.0]]])                        # 1 token, 1 head, head_dim 2
    >>> kv = torch.zeros(2, 2, 4, 1, 2, dtype=torch.uint8)
    >>> q = fp8kv_torch.rope_write_kv_combined(x, x, x, kv, torch.tensor([6]),
    ...                                        torch.tensor([0]), torch.tensor([[0.0, 1.0]]))
    >>> q.tolist(), kv[1, :, 2, 0].tolist()                     # cos 0, sin 1: (-x2, x1)
    ([[[-2.0, 1.0]]], [[192, 56], [56, 64]])
    """


@_public("paged_attention")
def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                    seq_lens: Tensor, key_scale: Scale = None, value_scale: Scale = None, *,
                    query_start_loc: Tensor | None = None, softmax_scale: float | None = None,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: Tensor | None = None, key_scale_cache: ScaleCache = None,
                    value_scale_cache: ScaleCache = None, cache_format: str | None = None,
                    layout: str = "NHD", head_dim: int | None = None, layer: Layer = None,
                    max_query_len: int | None = None, check_bounds: bool = False,
                    out: Tensor | None = None) -> Tensor:
    """Attention of new query tokens over a paged KV cache, read as ``write_kv`` wrote it
    (docs/SPEC.md section 16): FP8, NVFP4 or bf16 / fp16 pages, no dequantized copy.

    Parameters
    ----------
    query : torch.Tensor
        ``[num_tokens, num_heads, head_dim]``, bfloat16 or float16. Query head ``j`` attends
        with kv head ``j // (num_heads // num_kv_heads)``.
    key_cache, value_cache : torch.Tensor
        The caches of :func:`write_kv` (any format, layout and rank; ``layer=``: stacked
        ``[num_layers, ...]``), or unquantized bfloat16 / float16 caches of the query's dtype:

        * ``layout="NHD"``: ``[num_pages, page_size, num_kv_heads, head_dim]``
        * ``layout="HND"``: ``[num_pages, num_kv_heads, page_size, head_dim]``
        * either layout: ``[num_slots, num_kv_heads, head_dim]`` (page_size 1)

        (nvfp4: ``head_dim / 2`` bytes; inline scales: ``head_dim + 4`` / ``+ 16`` bytes.)
    block_table : torch.Tensor
        ``[num_seqs, max_pages]`` int32: token ``t`` of sequence ``b`` is at slot
        ``t % page_size`` of page ``block_table[b, t // page_size]``. Entries past a sequence's
        pages are never read.
    seq_lens : torch.Tensor
        ``[num_seqs]`` int32, on the device (no host sync): the tokens in the cache, the query
        tokens included (write them first).
    key_scale, value_scale : None, float or torch.Tensor
        The static scales the cache was written with (float32 ``[]``, ``[1]`` or
        ``[num_kv_heads]``); nvfp4: the global scales. None with dynamic scales.
    query_start_loc : torch.Tensor, optional
        ``[num_seqs + 1]`` int32: sequence ``b``'s query tokens are rows
        ``query_start_loc[b] .. query_start_loc[b + 1] - 1`` (up to 16, speculative decoding /
        MTP), at the sequence's last positions, causal among themselves. None: one token per
        sequence (``num_tokens == num_seqs``).
    softmax_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    sliding_window : int, optional
        A token at position ``p`` sees positions ``p - sliding_window + 1 .. p``.
    logits_soft_cap : float, optional
        Scores become ``cap * tanh(score / cap)``.
    sinks : torch.Tensor, optional
        ``[num_heads]`` float32: a logit per query head added to the softmax's denominator.
    key_scale_cache, value_scale_cache : None, torch.Tensor or "inline"
        Dynamic scales as :func:`write_kv` stored them (float32 ``[num_pages, page_size,
        num_kv_heads]`` NHD / ``[num_pages, num_kv_heads, page_size]`` HND per token-head,
        ``[num_pages, page_size]`` per token, or ``"inline"``); nvfp4, mxfp8: the block scales.
    cache_format : {None, "e4m3", "e5m2", "nvfp4", "mxfp8"}
        The format of a uint8 cache (None: the cache's dtype, or e4m3).
    layout : {"NHD", "HND"}
    head_dim : int, optional
        The data columns of an inline-scale cache (default: the query's).
    layer : None, int or torch.Tensor
        Stacked caches: the layer read (an int32 / int64 device scalar for CUDA graphs). Out of
        range: zeros.
    max_query_len : int, optional
        The longest query of the call (1..16; default ``min(16, num_tokens)`` with
        ``query_start_loc``): it sizes the launch, so an engine passes its speculative length.
    check_bounds : bool
        Read ``seq_lens`` (and ``query_start_loc``, ``layer``) on the host and raise for a
        sequence past its block-table row or a query longer than allowed (a device sync).
    out : torch.Tensor, optional
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype, contiguous, overwritten.

    Returns
    -------
    torch.Tensor
        ``out`` (or a new tensor): ``softmax(q k^T * softmax_scale) v`` per query row, within
        docs/SPEC.md section 16.3's bound of fp64 attention over the cache's values.

    Note
    ----
    Nothing but ``out`` is written. The same call gives the same bytes every time (fixed split
    and merge order); it allocates a small fp32 workspace when it splits a sequence's tokens.

    Examples
    --------
    >>> import torch, fp8kv_torch
    >>> k = torch.zeros(2, 4, 1, 16, dtype=torch.float8_e4m3fn)       # 2 pages of 4 tokens
    >>> v = torch.zeros_like(k)
    >>> x = torch.arange(1.0, 6.0)[:, None, None].repeat(1, 1, 16)     # 5 tokens' K = V
    >>> fp8kv_torch.write_kv(x, x, k, v, torch.arange(5))
    >>> q = torch.zeros(1, 2, 16, dtype=torch.bfloat16)               # 1 token, 2 query heads
    >>> out = fp8kv_torch.paged_attention(q, k, v, torch.tensor([[0, 1]], dtype=torch.int32),
    ...                                   torch.tensor([5], dtype=torch.int32))
    >>> out[0, :, 0].tolist()                                          # the mean of 1..5
    [3.0, 3.0]
    """


@_public("paged_attention_combined")
def paged_attention_combined(query: Tensor, kv_cache: Tensor, block_table: Tensor,
                             seq_lens: Tensor, key_scale: Scale = None, value_scale: Scale = None,
                             *, query_start_loc: Tensor | None = None,
                             softmax_scale: float | None = None,
                             sliding_window: int | None = None,
                             logits_soft_cap: float | None = None, sinks: Tensor | None = None,
                             key_scale_cache: ScaleCache = None,
                             value_scale_cache: ScaleCache = None,
                             cache_format: str | None = None, layout: str = "NHD",
                             head_dim: int | None = None, layer: Layer = None,
                             max_query_len: int | None = None, check_bounds: bool = False,
                             out: Tensor | None = None) -> Tensor:
    """:func:`paged_attention` over one combined cache.

    Parameters
    ----------
    kv_cache : torch.Tensor
        ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD),
        ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND) or
        ``[num_slots, 2, num_kv_heads, head_dim]``: index 0 of dim 1 is K, 1 is V.

    Other parameters are those of :func:`paged_attention`.

    Returns
    -------
    torch.Tensor
        As :func:`paged_attention`.

    Note
    ----
    As :func:`paged_attention`: only ``out`` is written.

    Examples
    --------
    >>> import torch, fp8kv_torch
    >>> kv = torch.zeros(1, 2, 4, 1, 16, dtype=torch.bfloat16)         # unquantized, 1 page
    >>> kv[0, 1, :2] = 2.0                                             # V of tokens 0, 1
    >>> q = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    >>> out = fp8kv_torch.paged_attention_combined(q, kv, torch.tensor([[0]], dtype=torch.int32),
    ...                                            torch.tensor([2], dtype=torch.int32))
    >>> out[0, 0, :2].tolist()
    [2.0, 2.0]
    """
