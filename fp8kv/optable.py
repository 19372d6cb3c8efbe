"""The op table: each public op's arguments, declared once.

Every op of both frontends is an :class:`Op`: its arguments in the public functions' order, each
with its role, whether it may be left out, whether it has a layer axis with ``layer=``, the roles
of its dimensions and one line of documentation; which results JAX returns and which cache
dimensions it may be sharded over; and the core functions that validate a call, check its bounds,
shape its new outputs and map its kernel's arrays. The frontends derive from it what they would
otherwise spell out per op: the order in which torch keys and launches a call, which arguments
validation takes as arrays, the ``torch.library`` schemas, what JAX returns and how each array is
sharded under ``jax.jit`` (docs/SPEC.md section 15). The public functions keep their own
signatures and NumPy docstrings; the tests hold both to this table. Each entry is the ``OP`` of
the op's own module (``fp8kv/write.py``, ...), beside its checks and plan; :data:`OPS` collects
them. docs/ADDING_AN_OP.md says what a new op touches.

A combined op (``*_combined``) is its op with ``key_cache`` / ``value_cache`` replaced by one
``kv_cache`` (and a dequantize's ``key_out`` / ``value_out`` by ``kv_out``): :func:`combined`.
"""
from __future__ import annotations

import enum
import importlib
import pkgutil
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

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
    # Whether JAX may hand its kernel to XLA's own Triton call (fp8kv_jax._xla_triton) for a
    # validated call; else jax-triton launches it.
    xla_triton: Callable = lambda args: False

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

def caches(updated: bool) -> tuple[Arg, Arg]:
    return tuple(Arg(f"{side}_cache", Role.CACHE, f"the paged {side.upper()} cache", layered=True,
                     updated=updated, dims="cache", combined="kv_cache")
                 for side in ("key", "value"))


def scales(*sides: str) -> tuple[Arg, ...]:
    return tuple(Arg(f"{side}_scale", Role.SCALE, f"the {side} dequant scale (static)",
                     optional=True, dims="scale") for side in sides)


def sides(updated: bool) -> tuple[Arg, Arg]:
    return tuple(Arg(f"{side}_scale_cache", Role.SIDE, f"{side} scales stored per slot, or "
                     "'inline'", optional=True, layered=True, updated=updated, dims="side")
                 for side in ("key", "value"))


def option(name: str, doc: str, schema=None, **kw) -> Arg:
    return Arg(name, Role.OPTION, doc, schema=schema, **kw)


KEY_VALUE = (Arg("key", Role.INPUT, "new keys [num_tokens, num_kv_heads, head_dim]",
                 dims="t h d"),
             Arg("value", Role.INPUT, "new values, as key", dims="t h d"))
SLOTS = Arg("slots", Role.INPUT, "each token's cache row (< 0: padding)", dims="t")
LAYOUT = option("layout", "NHD or HND", str)
FP8_FORMAT = option("fp8_format", "the format of a uint8 FP8 cache", Optional[str])
CACHE_FORMAT = option("cache_format", "the cache's format (or fp8_format)", Optional[str])
SCALE_ROUNDING = option("scale_rounding", "dynamic scales exact or up to a power of two", str)
CHECK_BOUNDS = option("check_bounds", "read indices on the host and raise past the cache",
                      validated=False)
LAYER = Arg("layer", Role.LAYER, "the layer of stacked caches", optional=True, dims="any")


def from_shapes(plan: Callable) -> Callable:
    """The table's planner of a ``plan(args, backend, exact)`` that reads the validated call
    alone (not the outputs' arrays or their alignment)."""
    return lambda args, outs, backend, exact=None, aligned=True: plan(args, backend, exact)


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


def __getattr__(name: str):
    """``OPS``: every op and its combined form by name, from the modules of this package that
    declare one (``OP = Op(...)``, beside the op's checks and plan): a new op is declared in its
    own module, not here. Collected on first use, so that those modules can import this one."""
    if name != "OPS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    global OPS
    package = importlib.import_module(__package__)
    bases = [getattr(importlib.import_module(f"{__package__}.{m.name}"), "OP", None)
             for m in pkgutil.iter_modules(package.__path__) if not m.ispkg]
    OPS = {op.name: op for base in bases if isinstance(base, Op)
           for op in (base, combined(base))}
    return OPS
