"""Every Triton function here exists twice: compiled (CUDA tensors) and interpreted (CPU tensors).

``triton.jit`` picks one of the two from ``knobs.runtime.interpret`` (``TRITON_INTERPRET``) when it
decorates. fp8kv serves CUDA and CPU tensors in the same process, so :func:`jit` builds the
compiled function with that knob off, and :func:`interpreted` builds, on first use, a twin with it
on, whose globals point at the interpreted versions of the helpers it calls.
"""
from __future__ import annotations

import types

import triton
import triton.language as tl
from triton import knobs

_INTERPRETED: dict[int, object] = {}


def _jit(fn, interpret: bool, do_not_specialize=(), noinline=False):
    with knobs.runtime.scope():
        knobs.runtime.interpret = interpret
        return triton.jit(fn, do_not_specialize=list(do_not_specialize),
                          noinline=noinline or None)


def jit(fn=None, *, do_not_specialize=(), noinline=False):
    """Decorator: a compiled Triton function, whatever ``TRITON_INTERPRET`` says.

    ``do_not_specialize`` names integer parameters (batch sizes) that must not become part of the
    compiled variant's key: Triton would otherwise compile again for the value 1 and for
    multiples of 16. ``noinline``: a helper compiled as a function of its own, called -- for a
    rarely taken path whose code would otherwise sit in the middle of a hot one.
    """
    if fn is None:
        return lambda f: _jit(f, False, do_not_specialize, noinline)
    return _jit(fn, False, do_not_specialize, noinline)


def interpreted(jit_fn: triton.JITFunction):
    """The interpreter twin of a function made by :func:`jit` (memoized)."""
    twin = _INTERPRETED.get(id(jit_fn))
    if twin is None:
        fn = jit_fn.fn
        scope = dict(fn.__globals__)
        clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        twin = _jit(clone, True)
        _INTERPRETED[id(jit_fn)] = twin
        # Rebind helpers after registering, so mutually-referencing helpers terminate. Constexpr
        # globals become their plain values: the interpreter runs the body as Python, where
        # `1 << MAN_BITS` needs an int (tl.constexpr has no reflected shift or bitwise operators).
        for name, value in list(scope.items()):
            if isinstance(value, triton.JITFunction):
                scope[name] = interpreted(value)
            elif isinstance(value, tl.constexpr):
                scope[name] = value.value
    return twin


def kernel_for(jit_fn: triton.JITFunction, interpret: bool):
    return interpreted(jit_fn) if interpret else jit_fn
