"""torch tensors -> ``fp8kv.attention`` checks and plan -> the attention kernels' launches.

A call's launches are kept ready per signature, like the other ops' (:mod:`fp8kv_torch._launch`):
everything the checks and the plan read is in the key (tensor metadata, every other argument
with its type), so a repeat costs a key, a dict lookup, the output and workspace allocations and
two launches.
"""
from __future__ import annotations

import torch

from fp8kv import ops
from fp8kv.attention import (AttentionArgs, attention_operands, check_attention, check_out,
                             check_seq_lens_in_range, merge_operands, plan_attention)
from fp8kv.binding import bind
from fp8kv.plan import CUDA, INTERPRET
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


__all__ = ["paged_attention", "CUDA"]
