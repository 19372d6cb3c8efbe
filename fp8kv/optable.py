"""The op table: each public op's arguments, declared once.

Every op of both frontends is an :class:`Op`: its arguments in the public functions' order, each
with its role, whether it may be left out, whether it has a layer axis with ``layer=``, the roles
of its dimensions and one line of documentation; which results JAX returns and which cache
dimensions it may be sharded over; and the core functions that validate a call, check its bounds,
shape its new outputs and map its kernel's arrays. The frontends derive from it what they would
otherwise spell out per op: the order in which torch keys and launches a call, which arguments
validation takes as arrays, the ``torch.library`` schemas, what JAX returns and how each array is
sharded under ``jax.jit`` (docs/SPEC.md section 15). The public functions keep their own
signatures and NumPy docstrings; the tests hold both to this table. docs/ADDING_AN_OP.md says
what a new op touches.

A combined op (``*_combined``) is its op with ``key_cache`` / ``value_cache`` replaced by one
``kv_cache`` (and a dequantize's ``key_out`` / ``value_out`` by ``kv_out``): :func:`combined`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from . import attention, dequantize, rope_write, write
from .attention import attention_bounds, attention_operands, check_attention
from .dequantize import check_dequantize, dequantize_bounds, dequantize_made, dequantize_operands
from .rope_write import check_rope_write, rope_bounds, rope_made, rope_write_operands
from .write import check_write, write_bounds, write_operands

TORCH, JAX = "torch", "jax"


class Role(enum.Enum):
    """What an argument is to a call."""

    INPUT = "input"     # an array the kernel reads
    CACHE = "cache"     # a paged cache: the call follows its sharding
    SCALE = "scale"     # a static scale: None, a host number (compiled in) or a device array
    SIDE = "side"       # a side scale array of a cache: None, a device array or "inline"
    LAYER = "layer"     # the layer of stacked caches: None, an int or a device array
    OUTPUT = "output"   # an array the kernel writes that no input holds
    OPTION = "option"   # a host value, validated and compiled into the plan


# The roles of array dimensions (docs/SPEC.md section 15). A shape word in Arg.dims stands for
# several, found per call: "cache" (a cache's: l? p [k] s h c in its layout), "side" (a side
# scale array's: the cache's without c, without h per token), "scale" (h for a per-head scale),
# "pages" (dequantized pages: n, then the cache's page roles with d for c), "any" (o per dim).
DIMS = {"l": "layer", "p": "pages", "k": "combined K/V", "s": "page_size", "h": "kv heads",
        "c": "head_dim", "t": "tokens", "d": "head_dim", "H": "query heads", "b": "batch",
        "q": "pages_per_seq", "n": "pages", "m": "positions", "r": "rotary_dim", "o": "size-1",
        "B": "sequences + 1"}
SHAPES = ("cache", "side", "scale", "pages", "any")
# A dimension split wherever another is: a query's heads go with the caches' kv heads.
FOLLOWS = {"H": "h"}


@dataclass(frozen=True)
class Arg:
    """One argument of an op (or one output it makes)."""

    name: str
    role: Role
    doc: str                      # one line
    optional: bool = False        # an array that may be None (scales, sides, layer: always)
    layered: bool = False         # [num_layers, ...] with layer=
    updated: bool = False         # written in place: torch's op mutates it, JAX returns it
    made: bool = False            # an output made per call where not given
    dims: str = ""                # the roles of its dimensions, or a shape word (DIMS)
    schema: object = None         # an option's type in the torch op (None: not passed to it)
    frontends: tuple = (TORCH, JAX)   # whose public functions take it (none: an output only)
    parts: tuple = ()             # torch's out=: the outputs it holds, in order
    validated: bool = True        # passed to the op's check
    result: str = ""              # an output's name in the docstrings' Returns
    contiguous: bool = False      # a given output must be contiguous
    combined: str = ""            # what it becomes in the combined op ("": itself)

    @property
    def array(self) -> bool:
        """Whether it is (or may be) an array: not an option."""
        return self.role is not Role.OPTION


@dataclass(frozen=True)
class Op:
    """A public op: its arguments, and the core functions that serve every frontend.

    ``check(**arguments)`` validates (ArrayInfo for arrays, options as given) and returns the
    validated call; ``bounds(args, read)`` is the opt-in ``check_bounds`` (``read(name)``: the
    argument's values on the host); ``made(args)`` ``{output: (shape, dtype)}`` of the outputs
    a call makes; ``empty(args)``: nothing to compute (no launch); ``operands(args)``: the
    kernel's operand map (:mod:`fp8kv.operands`); ``plan(args, outs, backend, exact, aligned)``
    its launch plan (``outs``: ``{output: ArrayInfo}`` of the outputs a call makes or is given;
    ``aligned``: every array starts at a multiple of 16 bytes), whose ``kernel`` names the kernel
    in :mod:`fp8kv.ops`.
    """

    name: str
    args: tuple[Arg, ...]
    check: Callable
    bounds: Callable
    made: Callable
    empty: Callable
    operands: Callable
    plan: Callable
    returns: tuple[str, ...]      # JAX's results, in order (side arrays only where given)
    splits: tuple[str, ...]       # the cache dimensions a sharded call may split
    reads: tuple[str, ...]        # what check_bounds reads on the host (named first: the first)
    paged: str = ""               # the validated call's attribute with the caches' part
    # Scratch arrays its kernels hand each other within a call (made by the frontend per call,
    # never returned): paged attention's split partials.
    workspace: tuple[str, ...] = ()

    lists: dict = field(init=False, repr=False, compare=False)   # derived once, below

    def __post_init__(self):
        lists = {"arg": {a.name: a for a in self.args}}
        for frontend in (TORCH, JAX):
            public = tuple(a for a in self.args if frontend in a.frontends)
            required = tuple(a.name for a in public
                             if a.role in (Role.INPUT, Role.CACHE) and not a.optional)
            lists[frontend] = {
                "public": public, "required": required,
                "optional": tuple(a.name for a in public if a.array and not a.parts
                                  and a.name not in required),
                "options": tuple(a.name for a in public
                                 if a.role is Role.OPTION and a.validated)}
        object.__setattr__(self, "lists", lists)

    @property
    def family(self) -> str:
        """The name its combined form shares: the frontends' implementation of both."""
        return self.name.removesuffix("_combined")

    def arg(self, name: str) -> Arg:
        return self.lists["arg"][name]

    def public(self, frontend: str) -> tuple[Arg, ...]:
        """The arguments of ``frontend``'s public function, in order."""
        return self.lists[frontend]["public"]

    def required(self, frontend: str) -> tuple[str, ...]:
        """The arrays a call must have (validation raises, naming one that is not an array)."""
        return self.lists[frontend]["required"]

    def optional(self, frontend: str) -> tuple[str, ...]:
        """The arguments validation takes as arrays where they are ones, else as given."""
        return self.lists[frontend]["optional"]

    def options(self, frontend: str) -> tuple[str, ...]:
        """The options validation takes (keyword arguments of ``check``)."""
        return self.lists[frontend]["options"]

    def paged_args(self, args):
        """The part of a validated call that describes its caches (WriteArgs, DequantArgs)."""
        return getattr(args, self.paged) if self.paged else args


# ---------------------------------------------------------------------------------------------
# Arguments several ops share.

def _caches(updated: bool) -> tuple[Arg, Arg]:
    return tuple(Arg(f"{side}_cache", Role.CACHE, f"the paged {side.upper()} cache", layered=True,
                     updated=updated, dims="cache", combined="kv_cache")
                 for side in ("key", "value"))


def _scales(*sides: str) -> tuple[Arg, ...]:
    return tuple(Arg(f"{side}_scale", Role.SCALE, f"the {side} dequant scale (static)",
                     optional=True, dims="scale") for side in sides)


def _sides(updated: bool) -> tuple[Arg, Arg]:
    return tuple(Arg(f"{side}_scale_cache", Role.SIDE, f"{side} scales stored per slot, or "
                     "'inline'", optional=True, layered=True, updated=updated, dims="side")
                 for side in ("key", "value"))


def _option(name: str, doc: str, schema=None, **kw) -> Arg:
    return Arg(name, Role.OPTION, doc, schema=schema, **kw)


KEY_VALUE = (Arg("key", Role.INPUT, "new keys [num_tokens, num_kv_heads, head_dim]",
                 dims="t h d"),
             Arg("value", Role.INPUT, "new values, as key", dims="t h d"))
SLOTS = Arg("slots", Role.INPUT, "each token's cache row (< 0: padding)", dims="t")
LAYOUT = _option("layout", "NHD or HND", str)
FP8_FORMAT = _option("fp8_format", "the format of a uint8 FP8 cache", Optional[str])
CACHE_FORMAT = _option("cache_format", "the cache's format (or fp8_format)", Optional[str])
SCALE_ROUNDING = _option("scale_rounding", "dynamic scales exact or up to a power of two", str)
CHECK_BOUNDS = _option("check_bounds", "read indices on the host and raise past the cache",
                       validated=False)
LAYER = Arg("layer", Role.LAYER, "the layer of stacked caches", optional=True, dims="any")


def _from_shapes(plan: Callable) -> Callable:
    """The table's planner of a ``plan(args, backend, exact)`` that reads the validated call
    alone (not the outputs' arrays or their alignment)."""
    return lambda args, outs, backend, exact=None, aligned=True: plan(args, backend, exact)


WRITE_KV = Op(
    "write_kv",
    (*KEY_VALUE, *_caches(updated=True), SLOTS, *_scales("key", "value"), LAYOUT, FP8_FORMAT,
     *_sides(updated=True), SCALE_ROUNDING, CHECK_BOUNDS, CACHE_FORMAT, LAYER),
    check_write, write_bounds, lambda args: {}, lambda args: args.num_tokens == 0,
    write_operands, _from_shapes(write.plan_write),
    returns=("key_cache", "value_cache", "key_scale_cache", "value_scale_cache"),
    splits=("h", "p", "l"), reads=("slots", "layer"))

_PAGES = tuple(Arg(f"{side}_out", Role.OUTPUT, f"the {side.upper()} pages read", made=True,
                   dims="pages", frontends=(), result=f"{side}_pages", combined="kv_out")
               for side in ("key", "value"))
_TABLE_OUT = Arg("table_out", Role.OUTPUT, "the renumbered block table", made=True, dims="b q",
                 frontends=(), result="new_block_table", contiguous=True)

DEQUANTIZE_PAGES = Op(
    "dequantize_pages",
    (*_caches(updated=False),
     Arg("block_table", Role.INPUT, "each sequence's pages (< 0: padding)", dims="b q"),
     *_scales("key", "value"),
     _option("dtype", "the pages' dtype", schema=None),   # the torch op's: its outputs' dtype
     LAYOUT, FP8_FORMAT, _option("null_page", "a page id that is padding too", Optional[int]),
     Arg("out", Role.OUTPUT, "preallocated outputs", optional=True, frontends=(TORCH,),
         parts=("key_out", "value_out", "table_out")),
     *_sides(updated=False), _option("head_dim", "the pages' head_dim", Optional[int]),
     CHECK_BOUNDS, CACHE_FORMAT,
     Arg("out_scale", Role.SCALE, "the FP8 pages' scale", optional=True, dims="any"), LAYER,
     *_PAGES, _TABLE_OUT),
    check_dequantize, dequantize_bounds, dequantize_made,
    lambda args: args.batch * args.pages_per_seq == 0, dequantize_operands,
    dequantize.plan_call, returns=("key_out", "value_out", "table_out"), splits=("h",),
    reads=("block_table", "layer"))

ROPE_WRITE_KV = Op(
    "rope_write_kv",
    (Arg("query", Role.INPUT, "queries [num_tokens, num_heads, head_dim]", dims="t H d"),
     *KEY_VALUE, *_caches(updated=True), SLOTS,
     Arg("positions", Role.INPUT, "each token's row of cos_sin_cache", dims="t"),
     Arg("cos_sin_cache", Role.INPUT, "cos and sin per position", dims="m r"),
     *_scales("key", "value"),
     Arg("query_scale", Role.SCALE, "FP8 query codes' scale", optional=True, dims="any"),
     _option("rope_style", "neox or gptj", str),
     _option("rotary_dim", "the rotated columns", Optional[int]), LAYOUT, FP8_FORMAT,
     Arg("query_out", Role.OUTPUT, "the rotated query", optional=True, made=True, dims="t H d"),
     Arg("key_out", Role.OUTPUT, "the rotated key", optional=True, dims="t h d",
         frontends=(TORCH,)),
     _option("return_key", "also return the rotated key", frontends=(JAX,)),
     *_sides(updated=True), SCALE_ROUNDING, CHECK_BOUNDS),
    check_rope_write, rope_bounds, rope_made, lambda args: args.num_tokens == 0,
    rope_write_operands, _from_shapes(rope_write.plan_rope_write),
    returns=("query_out", "key_cache", "value_cache", "key_scale_cache", "value_scale_cache",
             "key_out"),
    splits=("h", "p"), reads=("positions", "slots"), paged="write")


PAGED_ATTENTION = Op(
    "paged_attention",
    (Arg("query", Role.INPUT, "queries [num_tokens, num_heads, head_dim]", dims="t H d"),
     *_caches(updated=False),
     Arg("block_table", Role.INPUT, "each sequence's pages", dims="b q"),
     Arg("seq_lens", Role.INPUT, "each sequence's tokens in the cache", dims="b"),
     *_scales("key", "value"),
     Arg("query_start_loc", Role.INPUT, "each sequence's first query row", optional=True,
         dims="B"),
     _option("softmax_scale", "the scores' scale (default 1 / sqrt(head_dim))",
             Optional[float]),
     _option("sliding_window", "the tokens a query sees", Optional[int]),
     _option("logits_soft_cap", "cap * tanh(score / cap)", Optional[float]),
     Arg("sinks", Role.INPUT, "one sink logit per query head", optional=True, dims="H"),
     *_sides(updated=False), CACHE_FORMAT, LAYOUT,
     _option("head_dim", "the data columns of an inline cache", Optional[int]), LAYER,
     _option("max_query_len", "the longest query (sizes the launch)", Optional[int]),
     CHECK_BOUNDS,
     Arg("out", Role.OUTPUT, "the attention output", optional=True, made=True, dims="t H d",
         frontends=(TORCH,), result="out", contiguous=True)),
    check_attention, attention_bounds, lambda args: {"out": (args.out_shape, args.out_dtype)},
    lambda args: args.num_tokens == 0, attention_operands,
    _from_shapes(attention.plan_attention), returns=("out",), splits=("h",),
    reads=("seq_lens", "query_start_loc", "layer"), workspace=("partial_out", "partial_stats"))


def combined(op: Op) -> Op:
    """``op`` on one combined ``kv_cache`` [num_pages, 2, ...] (K at index 0 of dim 1, V at 1):
    the arguments (and outputs) marked ``combined`` become one, at the first one's place."""
    merged = {"kv_cache": Arg("kv_cache", Role.CACHE, "the paged K and V caches in one array",
                              layered=True, updated=op.arg("key_cache").updated, dims="cache"),
              "kv_out": Arg("kv_out", Role.OUTPUT, "the K and V pages read", made=True,
                            dims="pages", frontends=(), result="kv_pages")}
    args, seen = [], set()
    for a in op.args:
        if a.combined in seen:
            continue
        if a.combined:
            seen.add(a.combined)
        if a.parts:
            a = replace(a, parts=tuple(dict.fromkeys(op.arg(p).combined or p for p in a.parts)))
        args.append(merged[a.combined] if a.combined else a)
    return replace(op, name=f"{op.name}_combined", args=tuple(args),
                   returns=tuple(dict.fromkeys(op.arg(n).combined or n for n in op.returns)))


OPS = {op.name: op for base in (WRITE_KV, DEQUANTIZE_PAGES, ROPE_WRITE_KV, PAGED_ATTENTION)
       for op in (base, combined(base))}
