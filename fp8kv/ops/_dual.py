"""Every Triton function here exists twice: compiled (CUDA tensors) and interpreted (CPU tensors).

``triton.jit`` picks one of the two once, from ``TRITON_INTERPRET`` at import time. fp8kv serves CUDA
and CPU tensors in the same process, so :func:`jit` always builds the compiled ``JITFunction`` and
:func:`interpreted` derives, on first use, an ``InterpretedFunction`` whose globals point at the
interpreted versions of the helpers it calls.
"""
from __future__ import annotations

import types

import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_INTERPRETED: dict[int, InterpretedFunction] = {}


def jit(fn=None, *, do_not_specialize=()):
    """Decorator: a compiled Triton function, whatever ``TRITON_INTERPRET`` says.

    ``do_not_specialize`` names integer parameters (batch sizes) that must not become part of the
    compiled variant's key: Triton would otherwise compile again for the value 1 and for
    multiples of 16.
    """
    if fn is None:
        return lambda f: JITFunction(f, do_not_specialize=list(do_not_specialize))
    return JITFunction(fn, do_not_specialize=list(do_not_specialize))


def interpreted(jit_fn: JITFunction) -> InterpretedFunction:
    """The interpreter twin of a function made by :func:`jit` (memoized)."""
    twin = _INTERPRETED.get(id(jit_fn))
    if twin is None:
        fn = jit_fn.fn
        scope = dict(fn.__globals__)
        clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        twin = InterpretedFunction(clone)
        _INTERPRETED[id(jit_fn)] = twin
        # Rebind helpers after registering, so mutually-referencing helpers terminate. Constexpr
        # globals become their plain values: the interpreter runs the body as Python, where
        # `1 << MAN_BITS` needs an int (tl.constexpr has no reflected shift or bitwise operators).
        for name, value in list(scope.items()):
            if isinstance(value, JITFunction):
                scope[name] = interpreted(value)
            elif isinstance(value, tl.constexpr):
                scope[name] = value.value
    return twin


def kernel_for(jit_fn: JITFunction, interpret: bool):
    return interpreted(jit_fn) if interpret else jit_fn
