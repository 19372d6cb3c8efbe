"""Sharded caches under plain ``jax.jit``: a partitioning rule for every call (docs/SPEC.md section 15).

A custom call without a rule makes XLA gather its whole operands onto every device. Each call is
therefore a ``jax.experimental.custom_partitioning`` function whose rule keeps the caches where
they are: the cache's sharding decides, each of its dimensions has a role (layers ``l``, pages
``p``, the combined K/V axis ``k``, slots in a page ``s``, kv heads ``h``, row bytes ``c``), and
every other array of the call is sharded by the same roles (``key``'s heads with the cache's
heads, ...). A write may be split over heads, pages and layers (a device writes the slots of its
own pages into its own layers: slots and layer are shifted by its shard's offset, and the kernels
skip what falls outside), a dequantize over heads; any other cache sharding raises, naming
``jax.shard_map``. Each device runs the call on its shards through the same path as one device,
validated and planned for the shard's shapes.

On one device (and under ``shard_map``) the rule is not used: the call is inlined as it is.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp8kv.modes import ScaleKind
from fp8kv.validate import check_dequantize, check_write, frontend_args

from . import _args, _jnp, _triton

_IMPLS = {"triton": _triton, "jnp": _jnp}
ROLE_NAMES = {"l": "layer", "p": "pages", "k": "combined K/V", "s": "page_size", "h": "kv heads",
              "c": "head_dim", "t": "tokens", "d": "head_dim", "b": "batch",
              "q": "pages_per_seq", "n": "pages", "o": "size-1"}
SPLITS = {"write": ("h", "p", "l"), "dequantize": ("h",)}   # the cache roles a call may split
SCALES = ("key_scale", "value_scale", "key_scale_cache", "value_scale_cache", "out_scale", "layer")


class Call(NamedTuple):
    """A frontend call, static: the validated arguments of the whole (unsharded) arrays, which
    arrays it passes (by name, in order) and which it returns, and every other argument."""

    op: str          # "write" | "dequantize"
    impl: str        # "triton" | "jnp"
    args: object     # WriteArgs | DequantArgs of the whole arrays
    names: tuple     # the array arguments passed, in order
    absent: tuple    # the optional arrays not passed (None for the impl)
    outputs: tuple   # the results, by name, in order
    options: tuple   # (name, value): layout, fp8_format, ..., host scales and layer
    cache_rank: int  # of one layer's K or V cache: 3 or 4


def needed(arrays) -> bool:
    """Whether a call may be partitioned: under a trace (a mesh is known only when lowering), or
    concrete arrays on several devices."""
    arrays = [a for a in arrays if isinstance(a, jax.Array)]
    return any(isinstance(a, jax.core.Tracer) for a in arrays) or any(
        len(a.sharding.device_set) > 1 for a in arrays)


def run(op: str, impl, given: dict, args, outputs: tuple, options: dict) -> dict:
    """``impl``'s ``op`` on ``given`` (by argument name; None where absent), through the
    partitioning rule where the arrays may be sharded; the results by name."""
    fn = impl.write_kv if op == "write" else impl.dequantize_pages
    if not needed(given.values()):
        return fn(given, args=args)
    names = tuple(n for n, a in given.items() if isinstance(a, jax.Array))
    cache = given["kv_cache"] if args.combined else given["key_cache"]
    rank = cache.ndim - args.combined - (args.layers is not None)
    call = Call(op, "triton" if impl is _triton else "jnp", args, names,
                tuple(n for n, a in given.items() if a is None), outputs,
                tuple(sorted(options.items())), rank)
    arrays = [given[n] for n in names]
    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        results = _partitioned(call, *arrays)
    else:   # concrete arrays on several devices: partitioned as a jitted call
        results = jax.jit(_partitioned, static_argnums=0)(call, *arrays)
    return dict(zip(outputs, results))


def _local(call: Call, arrays: dict) -> dict:
    """The impl's outputs for ``arrays`` (one device's shards, or the whole arrays), validated
    and planned for their shapes."""
    opts = dict(call.options)
    scales = {n: arrays.get(n, opts.get(n)) for n in SCALES
              if call.op == "dequantize" or n != "out_scale"}   # out_scale: dequantize's
    given = {**dict.fromkeys(call.absent), **arrays}
    plain = {n: a for n, a in arrays.items() if n not in SCALES}
    infos = frontend_args(_args.info, jax.Array, plain, scales)
    if call.op == "write":
        args = check_write(**infos, layout=opts["layout"], fp8_format=opts["fp8_format"],
                           scale_rounding=opts["scale_rounding"],
                           cache_format=opts.get("cache_format"))
        out = _IMPLS[call.impl].write_kv(given, args=args)
    else:
        args = check_dequantize(**infos, dtype=call.args.out_dtype, layout=opts["layout"],
                                fp8_format=opts["fp8_format"], null_page=opts["null_page"],
                                head_dim=opts["head_dim"], cache_format=opts.get("cache_format"))
        out = _IMPLS[call.impl].dequantize_pages(given, args=args)
    return tuple(out[n] for n in call.outputs)


@functools.partial(custom_partitioning, static_argnums=(0,))
def _partitioned(call: Call, *arrays):
    return _local(call, dict(zip(call.names, arrays)))


# ---------------------------------------------------------------------------------------------
# Dimension roles of every array of a call.

def _cache_roles(call: Call, stacked: bool, combined: bool, scale_side=None) -> tuple:
    """The roles of a cache's dimensions (``scale_side``: of that side's scale array instead)."""
    args = call.args
    if call.cache_rank == 3:
        page = ("p", "h", "c")
    elif args.layout == "NHD":
        page = ("p", "s", "h", "c")
    else:
        page = ("p", "h", "s", "c")
    if scale_side is not None:
        kind = getattr(args, f"{scale_side}_scale").dynamic
        page = page[:-1] if kind is ScaleKind.TOKEN_HEAD else tuple(
            r for r in page[:-1] if r != "h")
    elif combined:
        page = page[:1] + ("k",) + page[1:]
    return (("l",) if stacked else ()) + page


def roles(call: Call, name: str, ndim: int) -> tuple:
    """The roles of the dimensions of argument (or result) ``name`` of rank ``ndim``."""
    args = call.args
    stacked, combined = args.layers is not None, args.combined
    if name in ("key", "value"):
        return ("t", "h", "d")
    if name == "slots":
        return ("t",)
    if name in ("key_cache", "value_cache", "kv_cache"):
        return _cache_roles(call, stacked, combined)
    if name.endswith("_scale_cache"):
        return _cache_roles(call, stacked, False, name.split("_")[0])
    if name in ("key_scale", "value_scale"):
        return ("h",) if ndim == 1 and args.key_cache.num_heads > 1 else ("o",) * ndim
    if name in ("block_table", "table_out"):
        return ("b", "q")
    if name in ("key_out", "value_out", "kv_out"):
        cache = _cache_roles(call, False, name == "kv_out")
        return ("n",) + tuple(("d" if r == "c" else r) for r in cache[1:])
    return ("o",) * ndim   # layer


def _spec_of(sharding, ndim: int) -> tuple:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (ndim - len(spec))


def _split(call: Call, mesh, arg_shapes) -> dict:
    """``{role: mesh axes}`` of the cache's sharding; raises for a role the call cannot split."""
    name = "kv_cache" if call.args.combined else "key_cache"
    shape = arg_shapes[call.names.index(name)]
    cache_roles = roles(call, name, len(shape.shape))
    split = {}
    for role, axes in zip(cache_roles, _spec_of(shape.sharding, len(shape.shape))):
        if axes is None:
            continue
        if role not in SPLITS[call.op]:
            allowed = ", ".join(ROLE_NAMES[r] for r in SPLITS[call.op])
            raise ValueError(
                f"{name}: sharded over its {ROLE_NAMES[role]} dimension (mesh axes {axes}); "
                f"{call.op} partitions a cache over {allowed} only: call it under jax.shard_map "
                f"for this sharding")
        split[role] = axes
    if "h" in split:
        for side in ("key", "value"):
            if getattr(call.args, f"{side}_scale").dynamic is ScaleKind.TOKEN:
                raise ValueError(
                    f"{side}_scale_cache: per-token dynamic scales need every kv head of a token, "
                    f"but {name} is sharded over kv heads (mesh axes {split['h']}): call it "
                    f"under jax.shard_map with whole tokens per device, or use per-token-head "
                    f"scales")
    return split


def _sharding(call: Call, mesh, name: str, ndim: int, split: dict) -> NamedSharding:
    return NamedSharding(mesh, P(*(split.get(r) if r in ("h", "p", "l") else None
                                   for r in roles(call, name, ndim))))


def _partition(call: Call, mesh, arg_shapes, result_shape):
    split = _split(call, mesh, arg_shapes)
    arg_shardings = tuple(_sharding(call, mesh, n, len(s.shape), split)
                          for n, s in zip(call.names, arg_shapes))
    results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
    result_shardings = tuple(_sharding(call, mesh, n, len(s.shape), split)
                             for n, s in zip(call.outputs, results))
    stacked = call.args.layers is not None
    cache_name = "kv_cache" if call.args.combined else "key_cache"
    cache_roles = roles(call, cache_name, 0)

    def lower(*arrays):
        local = dict(zip(call.names, arrays))
        cache = local[cache_name]
        if "p" in split:   # this device's pages: global slots shifted into its range
            per_page = 1 if call.cache_rank == 3 else call.args.key_cache.page_size
            first = jax.lax.axis_index(split["p"]) * cache.shape[cache_roles.index("p")]
            local["slots"] = local["slots"] - (first * per_page).astype(local["slots"].dtype)
        if "l" in split and stacked:   # this device's layers
            layer = local.get("layer", dict(call.options).get("layer"))
            first = jax.lax.axis_index(split["l"]) * cache.shape[0]
            local["layer"] = (jnp.asarray(layer, jnp.int32) - first).astype(jnp.int32)
        return _local(call, local)

    return mesh, lower, result_shardings, arg_shardings


def _infer(call: Call, mesh, arg_shapes, result_shape):
    split = _split(call, mesh, arg_shapes)
    results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
    return tuple(_sharding(call, mesh, n, len(s.shape), split)
                 for n, s in zip(call.outputs, results))


def _rule(call: Call, mesh, operand_types, result_types):
    """The Shardy rule: one factor per role; only heads, pages and layers may be split."""
    def spec(name, ndim):
        return " ".join(roles(call, name, ndim))

    ranks_in = [len(t.shape) for t in operand_types]
    ranks_out = [len(t.shape) for t in result_types]
    text = (", ".join(spec(n, r) for n, r in zip(call.names, ranks_in)) + " -> "
            + ", ".join(spec(n, r) for n, r in zip(call.outputs, ranks_out)))
    used = dict.fromkeys(text.replace(",", " ").replace("->", " ").split())   # in factor order
    keep = tuple(r for r in used if r not in SPLITS[call.op])
    return text, dict(need_replication_factors=keep)


_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           sharding_rule=_rule)
