"""``paged_attention`` in JAX: the core's kernels on NVIDIA GPUs (XLA's Triton call or
jax-triton, as the other ops), a jnp path elsewhere, and a partitioning rule for caches sharded
over kv heads under plain ``jax.jit`` (docs/SPEC.md section 16).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp8kv.attention import (AttentionArgs, attention_operands, check_attention,
                             check_seq_lens_in_range, merge_operands, plan_attention)
from fp8kv.modes import ScaleKind
from fp8kv.plan import CUDA
from fp8kv.spelling import check_flag
from fp8kv.validate import DequantArgs, check_layer_in_range, frontend_args

from . import _args, _jnp, _shard, _triton, _xla_triton
from ._args import as_array, as_scales, device_array

ARRAYS = ("query", "key_cache", "value_cache", "kv_cache", "block_table", "seq_lens")
OPTIONAL = ("key_scale", "value_scale", "key_scale_cache", "value_scale_cache", "layer",
            "query_start_loc", "sinks")


def paged_attention(arrays: dict, optional: dict, options: dict, check_bounds) -> jax.Array:
    """The frontend call: ``arrays`` (those the call must have), ``optional`` (scales, side
    arrays, layer, query_start_loc, sinks, by name), ``options`` (host options by name)."""
    check_flag(check_bounds, "check_bounds")
    arrays = {n: as_array(x, n) for n, x in arrays.items()}
    optional = dict(zip(optional, as_scales(*optional.values())))
    args = check_attention(**frontend_args(_args.info, jax.Array, arrays, optional), **options)
    if check_bounds:
        layer = optional.get("layer")
        if args.layers is not None:
            check_layer_in_range(_args.host_values(layer, "layer") if isinstance(layer, jax.Array)
                                 else layer, args.layers.num_layers)
        qsl = optional.get("query_start_loc")
        check_seq_lens_in_range(_args.host_values(arrays["seq_lens"], "seq_lens"),
                                None if qsl is None else _args.host_values(qsl,
                                                                           "query_start_loc"),
                                args.block_table.shape[1], args.key_cache.page_size,
                                args.max_query_len)
    given = {**arrays, **{n: device_array(x) for n, x in optional.items()}}
    if args.num_tokens == 0:
        return jnp.zeros(args.out_shape, args.out_dtype)
    impl = "triton" if _args.use_triton(given.values()) else "jnp"
    names = tuple(n for n, a in given.items() if isinstance(a, jax.Array))
    call = Call(impl, args, names)
    arrays_in = [given[n] for n in names]
    if not _shard.needed(arrays_in):
        return _local(call, *arrays_in)
    if any(isinstance(a, jax.core.Tracer) for a in arrays_in):
        return _partitioned(call, *arrays_in)
    return jax.jit(_partitioned, static_argnums=0)(call, *arrays_in)


class Call(NamedTuple):
    impl: str             # "triton" | "jnp"
    args: AttentionArgs   # of the whole arrays
    names: tuple          # the arrays passed, in order


def _local(call: Call, *arrays) -> jax.Array:
    """The output for ``arrays`` (one device's shards or the whole arrays), validated and
    planned for their shapes."""
    given = dict(zip(call.names, arrays))
    whole = call.args
    infos = {n: _args.info(a, n) for n, a in given.items()}
    keep = dict(softmax_scale=whole.softmax_scale, sliding_window=whole.sliding_window,
                logits_soft_cap=whole.logits_soft_cap, layout=whole.layout,
                head_dim=whole.head_dim if whole.inline_pad else None,
                max_query_len=whole.max_query_len if whole.varlen else None,
                cache_format=None if whole.fmt is None else whole.fmt.name)
    host = dict(key_scale=None if whole.key_scale.kind is not ScaleKind.VALUE
                else whole.key_scale.value,
                value_scale=None if whole.value_scale.kind is not ScaleKind.VALUE
                else whole.value_scale.value)
    if whole.inline_pad:
        host.update(key_scale_cache="inline", value_scale_cache="inline")
    if whole.layers is not None and not whole.layers.on_device:
        host["layer"] = whole.layers.index
    args = check_attention(**{**host, **infos}, **keep)
    if call.impl == "triton":
        return _on_gpu(given, args=args, xla=_xla_triton.enabled())
    return _on_jnp(given, args=args)


# ---------------------------------------------------------------------------------------------
# NVIDIA GPUs: the two kernels of the core's plan.

@functools.partial(jax.jit, static_argnames=("args", "xla"))
def _on_gpu(given: dict, *, args: AttentionArgs, xla: bool) -> jax.Array:
    from fp8kv import ops  # imports Triton: only on this path

    given = dict(given)
    if xla:
        args, given = _xla_triton.device_scalars(args, given)
    plan = plan_attention(args, CUDA)
    out = jax.ShapeDtypeStruct(args.out_shape, jnp.dtype(args.out_dtype))
    new = {"out": out,
           "partial_out": jax.ShapeDtypeStruct(plan.partial_out, jnp.float32),
           "partial_stats": jax.ShapeDtypeStruct(plan.partial_stats, jnp.float32)}
    given.setdefault("seq_lens", None)
    written = _triton._launch(ops._paged_attention_kernel, plan.attention,
                              attention_operands(args, plan), given, new, xla=xla)
    if plan.merge is None:
        return written["out"]
    merged = _triton._launch(ops._attention_merge_kernel, plan.merge, merge_operands(args),
                             {**given, **written}, new, xla=xla)
    return merged["out"]


# ---------------------------------------------------------------------------------------------
# Elsewhere: 16.2's formula in fp32 over the values dequantize_pages gives.

def _values(given: dict, args: AttentionArgs):
    """K and V ``[num_seqs, max_pages * page_size, num_kv_heads, head_dim]`` fp32 in token
    order (padding entries of the block table give zeros: never seen)."""
    table = given["block_table"]
    if args.fmt is None:   # as stored
        pages = []
        layer = None
        if args.layers is not None:
            layer = jnp.clip(_jnp._layer_index(given, args.layers), 0, args.layers.num_layers - 1)
        index = jnp.clip(table.reshape(-1), 0, args.key_cache.num_pages - 1)
        for side, name in ((0, "key_cache"), (1, "value_cache")):
            cache = given["kv_cache" if args.combined else name]
            if layer is not None:
                cache = cache[layer]
            if args.combined:
                cache = cache[:, side]
            pages.append(cache[index].astype(jnp.float32))
    else:
        dq = DequantArgs(args.num_seqs, table.shape[1], args.block_table, args.key_cache,
                         args.value_cache, args.fmt, "float32", args.layout, args.cache_rank,
                         None, args.key_scale, args.value_scale, args.combined, args.inline_pad,
                         None, args.layers)
        full = dict(given)
        for n in ("key_scale", "value_scale", "key_scale_cache", "value_scale_cache", "layer",
                  "key_cache", "value_cache", "kv_cache"):
            full.setdefault(n, None)
        full["out_scale"] = None
        out = _jnp.dequantize_pages(full, args=dq)
        pages = ((out["kv_out"][:, 0], out["kv_out"][:, 1]) if args.combined
                 else (out["key_out"], out["value_out"]))
    result = []
    for p in pages:
        if args.cache_rank == 4 and args.layout == "HND":
            p = jnp.swapaxes(p, 1, 2)
        if args.cache_rank == 3:
            p = p[:, None]
        result.append(p.reshape(args.num_seqs, -1, p.shape[2], p.shape[3]))
    return result


@functools.partial(jax.jit, static_argnames=("args",))
def _on_jnp(given: dict, *, args: AttentionArgs) -> jax.Array:
    k, v = _values(given, args)                                # [B, N, Hkv, D]
    lens = given["seq_lens"]
    if args.layers is not None:   # an out-of-range layer: no token seen
        layer = _jnp._layer_index(given, args.layers)
        lens = jnp.where((layer >= 0) & (layer < args.layers.num_layers), lens, 0)
    tokens = jnp.arange(args.num_tokens)
    if args.varlen:
        qsl = given["query_start_loc"]
        seq = jnp.clip(jnp.searchsorted(qsl, tokens, side="right") - 1, 0, args.num_seqs - 1)
        pos = lens[seq] - (qsl[seq + 1] - qsl[seq]) + (tokens - qsl[seq])
    else:
        seq = tokens
        pos = lens - 1
    group = args.num_heads // args.num_kv_heads
    q = given["query"].astype(jnp.float32).reshape(args.num_tokens, args.num_kv_heads, group,
                                                    args.head_dim)
    ks, vs = k[seq], v[seq]                                     # [T, N, Hkv, D]
    s = jnp.einsum("thgd,tnhd->thgn", q, ks, precision=lax.Precision.HIGHEST)
    s = s * jnp.float32(args.softmax_scale)
    if args.logits_soft_cap is not None:
        cap = jnp.float32(args.logits_soft_cap)
        s = cap * jnp.tanh(s / cap)
    t = jnp.arange(ks.shape[1])
    seen = t[None, :] <= pos[:, None]
    if args.sliding_window is not None:
        seen &= t[None, :] > (pos[:, None] - args.sliding_window)
    seen = seen[:, None, None, :]
    s = jnp.where(seen, s, -jnp.inf)
    top = s.max(axis=-1, keepdims=True)
    if args.sinks:
        sink = given["sinks"].reshape(1, args.num_kv_heads, group, 1)
        top = jnp.maximum(top, sink)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.where(seen, jnp.exp(s - top), 0.0)
    den = p.sum(axis=-1, keepdims=True)
    if args.sinks:
        den = den + jnp.exp(sink - top)
    o = jnp.einsum("thgn,tnhd->thgd", p, vs, precision=lax.Precision.HIGHEST)
    o = jnp.where(den > 0, o / jnp.where(den > 0, den, 1.0), 0.0)
    return o.reshape(args.out_shape).astype(args.out_dtype)


# ---------------------------------------------------------------------------------------------
# Sharded caches: every array split with the caches' kv heads (queries and output over their
# query heads, the same mesh axes), everything else whole.

def _roles(call: Call, name: str, ndim: int) -> tuple:
    args = call.args
    stacked = ("l",) if args.layers is not None else ()
    if call.args.cache_rank == 3:
        page = ("p", "h", "c")
    elif args.layout == "NHD":
        page = ("p", "s", "h", "c")
    else:
        page = ("p", "h", "s", "c")
    if name in ("query", "out"):
        return ("t", "q", "d")
    if name in ("key_cache", "value_cache"):
        return stacked + page
    if name == "kv_cache":
        return stacked + page[:1] + ("k",) + page[1:]
    if name.endswith("_scale_cache"):
        side = getattr(args, f"{name.split('_')[0]}_scale")
        if side.dynamic is ScaleKind.TOKEN:
            return stacked + tuple(r for r in page[:-1] if r != "h")
        return stacked + (page if side.dynamic is ScaleKind.BLOCK else page[:-1])
    if name in ("key_scale", "value_scale"):
        return ("h",) if ndim == 1 and args.num_kv_heads > 1 else ("o",) * ndim
    if name == "sinks":
        return ("q",)
    if name == "block_table":
        return ("b", "n")
    return ("o",) * ndim   # seq_lens, query_start_loc, layer


def _head_axes(call: Call, arg_shapes):
    name = "kv_cache" if call.args.combined else "key_cache"
    shape = arg_shapes[call.names.index(name)]
    roles = _roles(call, name, len(shape.shape))
    spec = tuple(shape.sharding.spec) if isinstance(shape.sharding, NamedSharding) else ()
    spec = spec + (None,) * (len(roles) - len(spec))
    heads = None
    for role, axes in zip(roles, spec):
        if axes is None:
            continue
        if role != "h":
            raise ValueError(f"{name}: sharded over a dimension other than its kv heads (mesh "
                             f"axes {axes}); paged_attention partitions a cache over kv heads "
                             f"only: call it under jax.shard_map for this sharding")
        heads = axes
    return heads


def _sharding(call: Call, mesh, name: str, ndim: int, heads) -> NamedSharding:
    return NamedSharding(mesh, P(*(heads if r in ("h", "q") else None
                                   for r in _roles(call, name, ndim))))


def _partition(call: Call, mesh, arg_shapes, result_shape):
    heads = _head_axes(call, arg_shapes)
    arg_shardings = tuple(_sharding(call, mesh, n, len(s.shape), heads)
                          for n, s in zip(call.names, arg_shapes))
    return mesh, functools.partial(_local, call), _sharding(call, mesh, "out", 3, heads), \
        arg_shardings


def _infer(call: Call, mesh, arg_shapes, result_shape):
    return _sharding(call, mesh, "out", 3, _head_axes(call, arg_shapes))


def _rule(call: Call, mesh, operand_types, result_types):
    specs = [" ".join(_roles(call, n, len(t.shape))) for n, t in zip(call.names, operand_types)]
    text = ", ".join(specs) + " -> t q d"
    used = dict.fromkeys(text.replace(",", " ").replace("->", " ").split())
    return text, dict(need_replication_factors=tuple(r for r in used if r not in ("h", "q")))


@functools.partial(custom_partitioning, static_argnums=(0,))
def _partitioned(call: Call, *arrays):
    return _local(call, *arrays)


_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           sharding_rule=_rule)
