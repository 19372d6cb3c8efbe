"""Kernel arguments by name: one binder turns (named operands, a plan) into the call to make.

A kernel's parameters come in jax-triton's order: input arrays, scalars, output arrays, then
constexprs. Array parameters end in ``_ptr``; constexprs are annotated ``tl.constexpr``. The plan
names every scalar and constexpr, the frontend names every array; :func:`bind` orders them by the
kernel's own signature and fails loudly when the names disagree, so a parameter added to a kernel
without its plan entry (or the reverse) is an error, not shifted arguments.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Mapping

import triton.language as tl


@dataclass(frozen=True)
class Signature:
    """A kernel's parameter names, by role, in order."""

    kernel: str
    inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    outputs: tuple[str, ...]
    constexprs: tuple[str, ...]


@functools.cache
def signature(kernel) -> Signature:
    """Split ``kernel``'s parameters into inputs, scalars, outputs and constexprs."""
    fn = getattr(kernel, "fn", kernel)
    roles = {"inputs": [], "scalars": [], "outputs": [], "constexprs": []}
    order = ("inputs", "scalars", "outputs", "constexprs")
    current = 0
    for p in inspect.signature(fn).parameters.values():
        if p.annotation is tl.constexpr or p.annotation == "tl.constexpr":
            role = "constexprs"
        elif p.name.endswith("_ptr"):
            role = "inputs" if current == 0 else "outputs"
        else:
            role = "scalars"
        if order.index(role) < current:
            raise TypeError(f"{fn.__name__}: parameter {p.name!r} ({role[:-1]}) comes after the "
                            f"{order[current]}; expected inputs, scalars, outputs, constexprs")
        current = order.index(role)
        roles[role].append(p.name)
    return Signature(fn.__name__, *(tuple(roles[r]) for r in order))


@dataclass(frozen=True)
class BoundCall:
    """The positional call: ``kernel[grid](*inputs, *scalars, *outputs, **constexprs)``."""

    signature: Signature
    inputs: tuple
    scalars: tuple
    outputs: tuple
    constexprs: dict

    @property
    def args(self) -> tuple:
        return self.inputs + self.scalars + self.outputs


def check_names(kernel, scalars: Mapping[str, Any], constexprs: Mapping[str, Any],
                arrays: Mapping[str, Any]) -> Signature:
    """Raise ``TypeError`` naming every difference between ``kernel``'s parameters and these."""
    sig = signature(kernel)
    problems = []
    for what, given, wanted in (("array", arrays, sig.inputs + sig.outputs),
                                ("scalar", scalars, sig.scalars),
                                ("constexpr", constexprs, sig.constexprs)):
        missing = [n for n in wanted if n not in given]
        extra = [n for n in given if n not in wanted]
        if missing:
            problems.append(f"no {what} for {missing}")
        if extra:
            problems.append(f"{what}s {extra} are not parameters")
    if problems:
        raise TypeError(f"{sig.kernel}: " + "; ".join(problems))
    return sig


def bind(kernel, plan, arrays: Mapping[str, Any]) -> BoundCall:
    """Order ``arrays`` and ``plan``'s scalars and constexprs as ``kernel`` takes them."""
    sig = signature(kernel)
    if (len(arrays) != len(sig.inputs) + len(sig.outputs) or len(plan.scalars) != len(sig.scalars)
            or len(plan.constexprs) != len(sig.constexprs)):
        check_names(kernel, plan.scalars, plan.constexprs, arrays)
    try:
        return BoundCall(sig, tuple(arrays[n] for n in sig.inputs),
                         tuple(plan.scalars[n] for n in sig.scalars),
                         tuple(arrays[n] for n in sig.outputs),
                         {n: plan.constexprs[n] for n in sig.constexprs})
    except KeyError:
        check_names(kernel, plan.scalars, plan.constexprs, arrays)
        raise
