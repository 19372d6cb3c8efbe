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

_INTERPRETED: dict[int, tuple] = {}


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
    # Keyed by id (a JITFunction hashes by its cache key, which walks its callees), the function
    # kept alive beside its twin: were it freed (a test's local kernel), a new function at the
    # same address would be handed its twin.
    known, twin = _INTERPRETED.get(id(jit_fn), (None, None))
    if known is not jit_fn:
        fn = jit_fn.fn
        scope = dict(fn.__globals__)
        clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        twin = _jit(clone, True)
        _INTERPRETED[id(jit_fn)] = (jit_fn, twin)
        # Rebind helpers after registering, so mutually-referencing helpers terminate. Constexpr
        # globals become their plain values: the interpreter runs the body as Python, where
        # `1 << MAN_BITS` needs an int (tl.constexpr has no reflected shift or bitwise operators).
        for name, value in list(scope.items()):
            if isinstance(value, triton.JITFunction):
                scope[name] = interpreted(value)
            elif isinstance(value, tl.constexpr):
                scope[name] = value.value
    return twin


def check_compiled_launch() -> None:
    """Raise a ``RuntimeError`` where Triton cannot compile fp8kv's kernels.

    With ``TRITON_INTERPRET=1`` in the environment when Triton is imported, Triton builds its own
    library functions (``tl.max``, ``tl.min``, ...) for its interpreter, and a compiled kernel
    that calls one fails deep inside Triton's compiler; while the variable is set, Triton's
    compiler also takes some decisions the interpreter's way. fp8kv needs the variable for
    nothing (CPU tensors run the interpreter twins whatever it says), so the first compiled
    launch says so instead, the same way for every op and both frontends.
    """
    if knobs.runtime.interpret:
        why = "is set"
    elif not isinstance(tl.max, triton.JITFunction):
        why = "was set when Triton was imported"
    else:
        return
    raise RuntimeError(
        f"fp8kv: TRITON_INTERPRET {why}, so Triton cannot compile fp8kv's kernels for CUDA "
        "tensors / arrays on the GPU. Unset TRITON_INTERPRET and start the process again: fp8kv "
        "runs CPU tensors under Triton's interpreter without it.")


def kernel_for(jit_fn: triton.JITFunction, interpret: bool):
    """The kernel to launch: its interpreter twin, or the compiled function once
    :func:`check_compiled_launch` passed."""
    if interpret:
        return interpreted(jit_fn)
    check_compiled_launch()
    return jit_fn
