"""Sharded caches under ``jax.jit``: a partitioning rule for every call (docs/SPEC.md section 15).

A custom call without a rule makes XLA gather its whole operands onto every device. Each call is
therefore a ``jax.experimental.custom_partitioning`` function whose rule keeps the caches where
they are: each cache dimension has a role (layers ``l``, pages ``p``, the combined K/V axis ``k``,
slots in a page ``s``, kv heads ``h``, row bytes ``c``), every other array of the call is sharded
by the same roles, and the op table (:mod:`fp8kv.optable`) gives each array's roles and the cache
roles each op may split; any other cache sharding raises, naming ``jax.shard_map``. A device
writing into its own pages or layers gets slots and layer shifted by its shard's offset (the
kernels skip what falls outside). Each device runs the call on its shards through the same path
as one device, validated and planned for the shard's shapes.

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
from fp8kv.optable import DIMS, FOLLOWS, JAX, OPS, Role
from fp8kv.validate import frontend_args

from . import _args, _jnp, _triton

_IMPLS = {"triton": _triton, "jnp": _jnp}


class Call(NamedTuple):
    """A frontend call, static (the partitioned function's first argument)."""

    op: str          # its name in the op table
    impl: str        # "triton" | "jnp"
    args: object     # the validated call of the whole arrays
    names: tuple     # the array arguments passed, in order
    absent: tuple    # the optional arrays not passed (None for the impl)
    outputs: tuple   # the results, by name, in order
    options: tuple   # (name, value): layout, fp8_format, ..., host scales and layer
    cache_rank: int  # of one layer's K or V cache: 3 or 4

    @property
    def paged(self):
        """The part of :attr:`args` that describes the caches."""
        return OPS[self.op].paged_args(self.args)


def run(op: str, impl, given: dict, args, outputs: tuple, options: dict) -> dict:
    """``impl``'s ``op`` on ``given`` (by argument name; None where absent), through the
    partitioning rule where the arrays may be sharded; the results by name."""
    names = tuple(n for n, a in given.items() if isinstance(a, jax.Array))
    arrays = [given[n] for n in names]
    # Under a trace the mesh is known only when lowering: the rule decides there.
    traced = any(isinstance(a, jax.core.Tracer) for a in arrays)
    if not traced and all(len(a.sharding.device_set) == 1 for a in arrays):
        return impl.launch(OPS[op].family, given, args=args)
    paged = OPS[op].paged_args(args)
    cache = given["kv_cache"] if paged.combined else given["key_cache"]
    rank = cache.ndim - paged.combined - (paged.layers is not None)
    call = Call(op, "triton" if impl is _triton else "jnp", args, names,
                tuple(n for n, a in given.items() if a is None), outputs,
                tuple(sorted(options.items())), rank)
    if traced:
        results = _partitioned(call, *arrays)
    else:   # concrete arrays on several devices: partitioned as a jitted call
        results = jax.jit(_partitioned, static_argnums=0)(call, *arrays)
    return dict(zip(outputs, results))


def _local(call: Call, arrays: dict) -> tuple:
    """The impl's outputs for ``arrays`` (one device's shards, or the whole arrays), validated
    and planned for their shapes."""
    entry = OPS[call.op]
    options = dict(call.options)
    optional = {n: arrays.get(n, options.pop(n, None)) for n in entry.optional(JAX)}
    infos = frontend_args(_args.info, jax.Array, {n: arrays[n] for n in entry.required(JAX)},
                          optional)
    args = entry.check(**infos, **options)
    out = _IMPLS[call.impl].launch(entry.family, {**dict.fromkeys(call.absent), **arrays},
                                   args=args)
    return tuple(out[n] for n in call.outputs)


@functools.partial(custom_partitioning, static_argnums=(0,))
def _partitioned(call: Call, *arrays):
    return _local(call, dict(zip(call.names, arrays)))


# ---------------------------------------------------------------------------------------------
# Dimension roles of every array of a call.

def _cache_roles(call: Call, stacked: bool, scale_side=None) -> tuple:
    """The roles of a cache's dimensions (``scale_side``: of that side's scale array instead)."""
    args = call.paged
    if call.cache_rank == 3:
        page = ("p", "h", "c")
    else:
        page = tuple("pshc" if args.layout == "NHD" else "phsc")
    if scale_side is not None:
        kind = getattr(args, f"{scale_side}_scale").dynamic
        if kind is not ScaleKind.BLOCK:   # block scales (nvfp4) have the cache's dimensions
            page = page[:-1] if kind is ScaleKind.TOKEN_HEAD else tuple(
                r for r in page[:-1] if r != "h")
    elif args.combined:
        page = page[:1] + ("k",) + page[1:]
    return (("l",) if stacked else ()) + page


def roles(call: Call, name: str, ndim: int) -> tuple:
    """The roles of the dimensions of argument (or result) ``name`` of rank ``ndim``."""
    arg = OPS[call.op].arg(name)
    stacked = arg.layered and call.paged.layers is not None
    if arg.dims == "cache":
        return _cache_roles(call, stacked)
    if arg.dims == "side":
        return _cache_roles(call, stacked, name.removesuffix("_scale_cache"))
    if arg.dims == "scale":
        return ("h",) if ndim == 1 and call.paged.key_cache.num_heads > 1 else ("o",) * ndim
    if arg.dims == "pages":
        return ("n",) + tuple(("d" if r == "c" else r) for r in _cache_roles(call, False)[1:])
    if arg.dims == "any":
        return ("o",) * ndim
    return tuple(arg.dims.split())


def _split(call: Call, mesh, arg_shapes) -> dict:
    """``{role: mesh axes}`` of the cache's sharding; raises for a role the call cannot split."""
    name = "kv_cache" if call.paged.combined else "key_cache"
    shape = arg_shapes[call.names.index(name)]
    cache_roles = roles(call, name, len(shape.shape))
    entry = OPS[call.op]
    split = {}
    spec = shape.sharding.spec if isinstance(shape.sharding, NamedSharding) else ()
    for role, axes in zip(cache_roles, spec):   # a spec may leave out trailing dimensions
        if axes is None:
            continue
        if role not in entry.splits:
            allowed = ", ".join(DIMS[r] for r in entry.splits)
            raise ValueError(
                f"{name}: sharded over its {DIMS[role]} dimension (mesh axes {axes}); "
                f"{entry.family} partitions a cache over {allowed} only: call it under "
                f"jax.shard_map for this sharding")
        split[role] = axes
    if "h" in split:
        for side in (a.name for a in entry.args if a.role is Role.SIDE):
            if getattr(call.paged, side.removesuffix("_cache")).dynamic is ScaleKind.TOKEN:
                raise ValueError(
                    f"{side}: per-token dynamic scales need every kv head of a token, "
                    f"but {name} is sharded over kv heads (mesh axes {split['h']}): call it "
                    f"under jax.shard_map with whole tokens per device, or use per-token-head "
                    f"scales")
    return split


def _sharding(call: Call, mesh, name: str, ndim: int, split: dict) -> NamedSharding:
    return NamedSharding(mesh, P(*(split.get(FOLLOWS.get(r, r))
                                   for r in roles(call, name, ndim))))


def _infer(call: Call, mesh, arg_shapes, result_shape):
    split = _split(call, mesh, arg_shapes)
    results = result_shape if isinstance(result_shape, (tuple, list)) else (result_shape,)
    return tuple(_sharding(call, mesh, n, len(s.shape), split)
                 for n, s in zip(call.outputs, results))


def _partition(call: Call, mesh, arg_shapes, result_shape):
    split = _split(call, mesh, arg_shapes)
    arg_shardings = tuple(_sharding(call, mesh, n, len(s.shape), split)
                          for n, s in zip(call.names, arg_shapes))
    result_shardings = _infer(call, mesh, arg_shapes, result_shape)
    cache_name = "kv_cache" if call.paged.combined else "key_cache"
    cache_roles = roles(call, cache_name, 0)

    def lower(*arrays):
        local = dict(zip(call.names, arrays))
        cache = local[cache_name]
        if "p" in split:   # this device's pages: global slots shifted into its range
            per_page = 1 if call.cache_rank == 3 else call.paged.key_cache.page_size
            first = jax.lax.axis_index(split["p"]) * cache.shape[cache_roles.index("p")]
            local["slots"] = local["slots"] - (first * per_page).astype(local["slots"].dtype)
        if "l" in split:   # this device's layers (only a stacked cache has the role)
            layer = local.get("layer", dict(call.options).get("layer"))
            first = jax.lax.axis_index(split["l"]) * cache.shape[0]
            local["layer"] = (jnp.asarray(layer, jnp.int32) - first).astype(jnp.int32)
        return _local(call, local)

    return mesh, lower, result_shardings, arg_shardings


def _rule(call: Call, mesh, operand_types, result_types):
    """The Shardy rule: one factor per role; only the op's cache splits may be split. A role
    that follows another (a query's heads, FOLLOWS) is the compound ``(h H)``: the kv head,
    then the query head within it (never split), so that a split of ``h`` reaches it."""
    arrays = [(n, t.shape) for n, t in zip(call.names, operand_types)] + [
        (n, t.shape) for n, t in zip(call.outputs, result_types)]
    dims = [roles(call, n, len(shape)) for n, shape in arrays]
    sizes = {r: d for rs, (_, shape) in zip(dims, arrays) for r, d in zip(rs, shape)}
    sizes.update((r, sizes[r] // sizes[h]) for r, h in FOLLOWS.items() if r in sizes)

    def spec(rs):
        return " ".join(f"({FOLLOWS[r]} {r})" if r in FOLLOWS else r for r in rs)

    specs = [spec(rs) for rs in dims]
    text = ", ".join(specs[:len(call.names)]) + " -> " + ", ".join(specs[len(call.names):])
    used = dict.fromkeys(text.translate(str.maketrans(",()", "   ")).replace("->", " ").split())
    splits = OPS[call.op].splits
    return text, dict(need_replication_factors=tuple(r for r in used if r not in splits),
                      **{r: sizes[r] for r in used if r in FOLLOWS})


_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           sharding_rule=_rule)
