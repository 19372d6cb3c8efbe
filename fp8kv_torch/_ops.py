"""torch.library custom ops: what torch.compile sees. Eager calls skip the dispatcher.

One op per public function (``fp8kv::write_kv``, ``fp8kv::write_kv_combined``, ...): a combined
cache is its own op with its own argument, never a missing one. Each op's schema is its public
function's arguments in the op table's order (:mod:`fp8kv.optable`), with what a schema cannot
type split in two: a scale (``float | Tensor``) into ``NAME: Tensor?`` and ``NAME_value:
float?``, a scale cache (``Tensor | "inline"``) into ``NAME: Tensor?`` and ``NAME_inline: bool``,
``layer`` (``int | Tensor``) into ``layer: int?`` and ``layer_tensor: Tensor?`` -- a run of such
arguments gives all its first halves, then all its second ones. ``out=`` is its outputs, one
tensor each; ``check_bounds`` (the frontend refuses it under torch.compile) and ``dtype`` (the
outputs' dtype) are not arguments. The arrays a call writes (caches and scale caches updated in
place, outputs) are declared mutated; with ``layer=`` the stacked caches, as a whole.

No defaults in the schemas: torch (2.11) drops trailing default arguments when it redispatches,
and then cannot find a mutated one by position. Every caller passes every argument.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from fp8kv.optable import OPS, Role

from . import _launch

Tensor = torch.Tensor


# role: (split, merge, the two halves' (name, type)); a side's flag is key_scale_inline. A scale
# cache other than "inline" (a wrong type or string) is passed on as is, as by the eager path:
# the op's own validation rejects it.
_HALVES = {
    Role.SCALE: (lambda x: (x, None) if isinstance(x, Tensor) else (None, x),
                 lambda t, v: t if t is not None else v,
                 (("{}", Optional[Tensor]), ("{}_value", Optional[float]))),
    Role.SIDE: (lambda x: (None, True) if isinstance(x, str) and x == "inline" else (x, False),
                lambda t, inline: "inline" if inline else t,
                (("{}", Optional[Tensor]), ("{}_inline", bool))),
    Role.LAYER: (lambda x: (None, x) if isinstance(x, Tensor) else (x, None),
                 lambda v, t: t if t is not None else v,
                 (("{}", Optional[int]), ("{}_tensor", Optional[Tensor]))),
}


def _half_name(arg, half: int) -> str:
    base = arg.name.removesuffix("_cache") if half and arg.role is Role.SIDE else arg.name
    return _HALVES[arg.role][2][half][0].format(base)


def _type(arg):
    if arg.role is Role.OPTION:
        return arg.schema
    return Optional[Tensor] if arg.optional and not arg.made else Tensor


class Schema:
    """One op's schema: its parameters ``(name, argument, half)`` in order (half 0 of an
    argument that is not split is the argument itself), the ones it mutates, and the
    conversions between a public call's arguments and the op's."""

    def __init__(self, op):
        self.op = op
        columns = []
        for a in op.public("torch"):
            if a.parts:
                columns.extend(op.arg(p) for p in a.parts)
            elif a.array or a.schema is not None:
                columns.append(a)
        self.params, run = [], []
        for a in columns + [None]:
            if run and (a is None or a.role is not run[0].role):
                self.params += [(_half_name(b, h), b, h) for h in (0, 1) for b in run]
                run = []
            if a is not None and a.role in _HALVES:
                run.append(a)
            elif a is not None:
                self.params.append((a.name, a, 0))
        self.mutated = tuple(name for name, a, half in self.params
                             if half == 0 and (a.updated or a.role is Role.OUTPUT))
        self.signature = inspect.Signature(
            [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                               annotation=_HALVES[a.role][2][h][1] if a.role in _HALVES
                               else _type(a)) for name, a, h in self.params],
            return_annotation=None)

    def values(self, named: dict) -> tuple:
        """The op's arguments from a call's (``named``, outputs included by name)."""
        halves = {a.name: _HALVES[a.role][0](named[a.name]) for _, a, h in self.params
                  if a.role in _HALVES and h == 0}
        return tuple(halves[a.name][h] if a.role in _HALVES else named[a.name]
                     for _, a, h in self.params)

    def named(self, values: tuple) -> dict:
        """A call's arguments by name from the op's."""
        by_param = dict(zip((name for name, _, _ in self.params), values))
        named = {}
        for name, a, h in self.params:
            if a.role not in _HALVES:
                named[a.name] = by_param[name]
            elif h == 1:
                named[a.name] = _HALVES[a.role][1](by_param[_half_name(a, 0)], by_param[name])
        return named


def _implementation(schema: Schema, launch: bool):
    """The op's implementation (``launch``) or its fake (validation only): one body."""
    op = schema.op
    spec = _launch.SPECS[op.name]

    def implementation(*values) -> None:
        named = schema.named(values)
        named.update(check_bounds=False, launch=launch)
        if spec.holder:
            named[spec.holder] = tuple(named[n] for n in spec.made)
        if "dtype" in spec.options:   # the dtype its outputs were made with
            named["dtype"] = named[spec.made[0]].dtype
        _launch.run(op.name, named)

    implementation.__signature__ = schema.signature
    implementation.__name__ = op.name
    return implementation


SCHEMAS, CUSTOM_OPS = {}, {}
for _name, _op in OPS.items():
    _schema = SCHEMAS[_name] = Schema(_op)
    CUSTOM_OPS[_name] = torch.library.custom_op(f"fp8kv::{_name}", mutates_args=_schema.mutated)(
        _implementation(_schema, launch=True))
    CUSTOM_OPS[_name].register_fake(_implementation(_schema, launch=False))
write_kv_op, dequantize_pages_op = CUSTOM_OPS["write_kv"], CUSTOM_OPS["dequantize_pages"]


def call(op: str, named: dict):
    """``op``'s custom op on a public call's arguments (under torch.compile); its outputs, made
    first where none are given (by the launcher's fake: a graph cannot keep an allocation an
    op makes), are returned as the public function returns them."""
    if named["check_bounds"]:
        name = OPS[op].reads[0]
        _launch.host_values(named[name], name)   # raises: no host reads in a compiled graph
    spec = _launch.SPECS[op]
    outs = spec.given(named)
    if outs is None and spec.made:
        made = _launch.run(op, {**named, "launch": False})
        outs = made if spec.holder else (made,)
    CUSTOM_OPS[op](*SCHEMAS[op].values({**named, **dict(zip(spec.made, outs or ()))}))
    return spec.result(outs)
