"""torch tensors -> ``fp8kv.attention`` checks and plan -> the attention kernels' launches.

A call's launches are kept ready per signature, like the other ops' (:mod:`fp8kv_torch._launch`):
everything the checks and the plan read is in the key (tensor metadata, every other argument
with its type), so a repeat costs a key, a dict lookup, the output and workspace allocations and
two launches.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8kv import ops
from fp8kv.attention import (AttentionArgs, attention_operands, check_attention, check_out,
                             check_seq_lens_in_range, merge_operands, plan_attention)
from fp8kv.binding import bind
from fp8kv.plan import INTERPRET
from fp8kv.validate import frontend_args

from ._launch import _backend, check_layer_bounds, host_values, info, typed

# The arguments a call must have as arrays, and the optional ones (arrays or host values).
ARRAYS = ("query", "key_cache", "value_cache", "kv_cache", "block_table", "seq_lens")
OPTIONAL = ("key_scale", "value_scale", "key_scale_cache", "value_scale_cache", "layer",
            "query_start_loc", "sinks")
OPTIONS = ("softmax_scale", "sliding_window", "logits_soft_cap", "cache_format", "layout",
           "head_dim", "max_query_len")

_READY: dict = {}
_READY_LIMIT = 1024
Tensor = torch.Tensor


class _Ready:
    """One signature's plan and bound launches: ``run(given)`` with ``given`` the call's arrays
    by name (the output and the workspace included)."""

    __slots__ = ("args", "plan", "launches", "device")

    def __init__(self, args: AttentionArgs, plan, backend: str, device: torch.device):
        self.args, self.plan, self.device = args, plan, device
        interpret = backend == INTERPRET
        self.launches = []
        for kernel_plan, operands in ((plan.attention, attention_operands(args, plan)),
                                      (plan.merge, merge_operands(args))):
            if kernel_plan is None:
                continue
            kernel = getattr(ops, kernel_plan.kernel)
            self.launches.append((ops.kernel_for(kernel, interpret)[kernel_plan.grid], kernel,
                                  kernel_plan, operands))

    def run(self, given: dict) -> None:
        for launch, kernel, kernel_plan, operands in self.launches:
            call = bind(kernel, kernel_plan, {o.param: given[o.source] for o in operands.params})
            launch(*call.args, num_warps=kernel_plan.num_warps,
                   enable_fp_fusion=kernel_plan.enable_fp_fusion, **call.constexprs)


def _key(named: dict, options: tuple):
    return (options, *[(n, t.shape, t.stride(), t.dtype, t.get_device())
                       if isinstance(t, torch.Tensor) else (n, type(t), t)
                       for n, t in named.items()])


def paged_attention(query, key_cache=None, value_cache=None, block_table=None, seq_lens=None,
                    key_scale=None, value_scale=None, *, kv_cache=None, query_start_loc=None,
                    softmax_scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                    key_scale_cache=None, value_scale_cache=None, cache_format=None,
                    layout="NHD", head_dim=None, layer=None, out=None, max_query_len=None,
                    check_bounds=False, exact=None, launch=True):
    """Validate, plan and launch one paged attention; returns ``out`` (made when None).
    ``launch=False`` validates and makes the output only (the custom op's fake)."""
    named = dict(query=query, key_cache=key_cache, value_cache=value_cache, kv_cache=kv_cache,
                 block_table=block_table, seq_lens=seq_lens, key_scale=key_scale,
                 value_scale=value_scale, key_scale_cache=key_scale_cache,
                 value_scale_cache=value_scale_cache, layer=layer,
                 query_start_loc=query_start_loc, sinks=sinks)
    if kv_cache is None:
        named.pop("kv_cache")
    else:
        named.pop("key_cache"), named.pop("value_cache")
    options = typed((softmax_scale, sliding_window, logits_soft_cap, cache_format, layout,
                     head_dim, max_query_len, exact))
    ready = None
    key = None
    if launch and not check_bounds and isinstance(query, torch.Tensor):
        try:
            key = _key(named, options)
            ready = _READY.get(key)
        except TypeError:   # unhashable: validation says what is wrong
            key = None
    if ready is None:
        arrays = {n: a for n, a in named.items() if n in ARRAYS}
        others = {n: a for n, a in named.items() if n in OPTIONAL}
        args = check_attention(**frontend_args(info, torch.Tensor, arrays, others),
                               softmax_scale=softmax_scale, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, cache_format=cache_format,
                               layout=layout, head_dim=head_dim, max_query_len=max_query_len)
        if check_bounds:
            check_layer_bounds(layer, args.layers)
            check_seq_lens_in_range(
                host_values(seq_lens, "seq_lens"),
                None if query_start_loc is None else host_values(query_start_loc,
                                                                 "query_start_loc"),
                args.block_table.shape[1], args.key_cache.page_size, args.max_query_len)
        backend = _backend(query, "query")
        if out is not None:
            check_out(info(out, "out"), args)
        if not launch:
            return out if out is not None else query.new_empty(args.out_shape)
        ready = _Ready(args, plan_attention(args, backend, exact), backend, query.device)
        if key is not None:
            if len(_READY) >= _READY_LIMIT:
                _READY.clear()
            _READY[key] = ready
    elif out is not None:
        check_out(info(out, "out"), ready.args)
    args, plan = ready.args, ready.plan
    if out is None:
        out = torch.empty(args.out_shape, dtype=query.dtype, device=query.device)
    if plan.empty:
        return out.zero_()
    given = dict(named, out=out,
                 partial_out=torch.empty(plan.partial_out, dtype=torch.float32,
                                         device=query.device),
                 partial_stats=torch.empty(plan.partial_stats, dtype=torch.float32,
                                           device=query.device))
    if query.device.type == "cuda" and query.device.index != torch.cuda.current_device():
        with torch.cuda.device(query.device):
            ready.run(given)
    else:
        ready.run(given)
    return out


def clear() -> None:
    _READY.clear()
    plan_attention.cache_clear()




# ---------------------------------------------------------------------------------------------
# torch.library custom ops: what torch.compile sees (eager calls skip the dispatcher). The op
# writes a given ``out`` (the frontend makes one when the caller gives none). Custom ops take
# neither ``float | Tensor`` nor ``str | Tensor`` nor ``int | Tensor``: scales, scale caches and
# the layer come split (fp8kv_torch._ops' helpers).

def _attention_op(launch: bool, combined: bool):
    from ._ops import _layer, _scales

    def run(query, caches, block_table, seq_lens, key_scale, value_scale, key_scale_value,
            value_scale_value, query_start_loc, softmax_scale, sliding_window, logits_soft_cap,
            sinks, key_scale_cache, value_scale_cache, key_scale_inline, value_scale_inline,
            cache_format, layout, head_dim, layer, layer_tensor, max_query_len, out):
        s = _scales(key_scale, value_scale, key_scale_value, value_scale_value, key_scale_cache,
                    value_scale_cache, key_scale_inline, value_scale_inline)
        named = dict(kv_cache=caches[0]) if combined else dict(key_cache=caches[0],
                                                               value_cache=caches[1])
        paged_attention(query, block_table=block_table, seq_lens=seq_lens, **named, **s,
                        query_start_loc=query_start_loc, softmax_scale=softmax_scale,
                        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                        sinks=sinks, cache_format=cache_format, layout=layout,
                        head_dim=head_dim, layer=_layer(layer, layer_tensor),
                        max_query_len=max_query_len, out=out, launch=launch)

    if combined:
        def paged_attention_combined(
                query: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                key_scale: Optional[Tensor], value_scale: Optional[Tensor],
                key_scale_value: Optional[float], value_scale_value: Optional[float],
                query_start_loc: Optional[Tensor], softmax_scale: Optional[float],
                sliding_window: Optional[int], logits_soft_cap: Optional[float],
                sinks: Optional[Tensor], key_scale_cache: Optional[Tensor],
                value_scale_cache: Optional[Tensor], key_scale_inline: bool,
                value_scale_inline: bool, cache_format: Optional[str], layout: str,
                head_dim: Optional[int], layer: Optional[int], layer_tensor: Optional[Tensor],
                max_query_len: Optional[int], out: Tensor) -> None:
            run(query, (kv_cache,), block_table, seq_lens, key_scale, value_scale,
                key_scale_value, value_scale_value, query_start_loc, softmax_scale,
                sliding_window, logits_soft_cap, sinks, key_scale_cache, value_scale_cache,
                key_scale_inline, value_scale_inline, cache_format, layout, head_dim, layer,
                layer_tensor, max_query_len, out)
        return paged_attention_combined

    def paged_attention_op(
            query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
            seq_lens: Tensor, key_scale: Optional[Tensor], value_scale: Optional[Tensor],
            key_scale_value: Optional[float], value_scale_value: Optional[float],
            query_start_loc: Optional[Tensor], softmax_scale: Optional[float],
            sliding_window: Optional[int], logits_soft_cap: Optional[float],
            sinks: Optional[Tensor], key_scale_cache: Optional[Tensor],
            value_scale_cache: Optional[Tensor], key_scale_inline: bool,
            value_scale_inline: bool, cache_format: Optional[str], layout: str,
            head_dim: Optional[int], layer: Optional[int], layer_tensor: Optional[Tensor],
            max_query_len: Optional[int], out: Tensor) -> None:
        run(query, (key_cache, value_cache), block_table, seq_lens, key_scale, value_scale,
            key_scale_value, value_scale_value, query_start_loc, softmax_scale, sliding_window,
            logits_soft_cap, sinks, key_scale_cache, value_scale_cache, key_scale_inline,
            value_scale_inline, cache_format, layout, head_dim, layer, layer_tensor,
            max_query_len, out)
    paged_attention_op.__name__ = "paged_attention"
    return paged_attention_op


def _register(name: str, combined: bool):
    op = torch.library.custom_op(f"fp8kv::{name}", mutates_args=("out",))(
        _attention_op(True, combined))
    op.register_fake(_attention_op(False, combined))
    return op


paged_attention_op = _register("paged_attention", False)
paged_attention_combined_op = _register("paged_attention_combined", True)


def call(query, caches: tuple, block_table, seq_lens, key_scale, value_scale, *,
         query_start_loc, softmax_scale, sliding_window, logits_soft_cap, sinks,
         key_scale_cache, value_scale_cache, cache_format, layout, head_dim, layer,
         max_query_len, check_bounds, out):
    """The public functions' body: the launcher eagerly, the custom op under torch.compile."""
    from fp8kv.spelling import check_flag

    from ._ops import split_layer, split_scales

    check_flag(check_bounds, "check_bounds")
    named = dict(kv_cache=caches[0]) if len(caches) == 1 else dict(key_cache=caches[0],
                                                                   value_cache=caches[1])
    if not torch.compiler.is_compiling():
        return paged_attention(query, block_table=block_table, seq_lens=seq_lens,
                               key_scale=key_scale, value_scale=value_scale,
                               query_start_loc=query_start_loc, softmax_scale=softmax_scale,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                               sinks=sinks, key_scale_cache=key_scale_cache,
                               value_scale_cache=value_scale_cache, cache_format=cache_format,
                               layout=layout, head_dim=head_dim, layer=layer, out=out,
                               max_query_len=max_query_len, check_bounds=check_bounds, **named)
    if check_bounds:
        host_values(seq_lens, "seq_lens")   # raises: no host reads in a compiled graph
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    scales, scale_caches = split_scales(key_scale, value_scale, key_scale_cache,
                                        value_scale_cache)
    op = paged_attention_combined_op if len(caches) == 1 else paged_attention_op
    op(query, *caches, block_table, seq_lens, *scales[:2], *scales[2:], query_start_loc,
       softmax_scale, sliding_window, logits_soft_cap, sinks, *scale_caches, cache_format,
       layout, head_dim, *split_layer(layer), max_query_len, out)
    return out
