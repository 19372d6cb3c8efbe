"""fp8kv_jax's GPU launch code on any machine, without torch: stand-ins for
``jax_triton.triton_call`` (checking what jax-triton 0.3.1 requires of a call) and for the binding
of XLA's Triton call (``fp8kv_jax._xla_triton._bind``: the same launch, its scalars and unused
pointers compiled in as constants), each running the kernel under Triton's CPU interpreter on
host NumPy arrays.

Triton's interpreter takes as a tensor anything with ``data_ptr()``: it copies the argument's
storage to the host (``untyped_storage().cpu()``, ``new_empty(...).set_(...)``), runs the kernel
on raw memory at ``data_ptr()``, and copies results back (``copy_``). A NumPy array already lives
on the host, so :class:`HostArray` is its own storage and its own host copy.
"""
from __future__ import annotations

import types

import jax
import numpy as np

from fp8kv import ops


class HostArray:
    """A NumPy array as the tensor Triton's interpreter expects (every copy a no-op)."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype   # str() is Triton's name for it: 'bfloat16', 'float8_e4m3fn', ...

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def copy_(self, other):
        return self

    def new_empty(self, *shape, device=None):
        return self

    def set_(self, storage, offset, size, stride):
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)


def exact(constexprs: dict) -> dict:
    """``constexprs`` for the interpreter: the exact path (the interpreter rounds like the GPU
    only there), and a kernel with one constexpr tuple ``C`` (paged attention) its options so."""
    if "C" in constexprs:
        c = constexprs["C"]
        return {**constexprs, "C": c._replace(options=c.options._replace(exact=True,
                                                                           pipelined=False))}
    return {**constexprs, "EXACT": True}


def interpreted_triton_call(*args, kernel, out_shape, grid, num_warps, enable_fp_fusion,
                            input_output_aliases, name, **constexprs):
    arrays = [a for a in args if isinstance(a, jax.Array)]
    scalars = args[len(arrays):]
    # jax-triton takes arrays, then scalars; it types Python ints by value and np.float32 as fp32
    # (a Python float would be fp64, a NumPy int an array).
    assert all(not isinstance(s, jax.Array) for s in scalars), "an array after a scalar"
    assert all(type(s) in (int, np.float32) for s in scalars), [type(s) for s in scalars]
    assert name == kernel.fn.__name__ and enable_fp_fusion is False
    for i, o in input_output_aliases.items():
        assert (arrays[i].shape, arrays[i].dtype) == (out_shape[o].shape, out_shape[o].dtype)
    # jax-triton gives arrays, scalars and outputs to the kernel's first parameters by position and
    # keywords by name: a keyword (a constexpr, or None for an unused output) must come after them.
    positional = len(args) + len(out_shape)
    assert all(kernel.arg_names.index(k) >= positional for k in constexprs), "keyword too early"

    def run(*host):
        inputs = [np.array(a, order="C", copy=True) for a in host]  # callback arrays are read-only
        aliased = {o: i for i, o in input_output_aliases.items()}
        outs = [inputs[aliased[o]].copy() if o in aliased else np.zeros(out.shape, out.dtype)
                for o, out in enumerate(out_shape)]
        # EXACT: the interpreter rounds like the GPU only on the exact (bit arithmetic) path.
        ops.interpreted(kernel)[grid](*map(HostArray, inputs),
                                      *(s.item() if isinstance(s, np.float32) else s
                                        for s in scalars),
                                      *map(HostArray, outs), num_warps=num_warps,
                                      **exact(constexprs))
        return tuple(outs)

    return jax.pure_callback(run, tuple(out_shape), *arrays)


def interpreted_xla_call(call, ir_bytes: bytes, arrays: dict, new) -> list:
    """``fp8kv_jax._xla_triton._bind`` under the interpreter: the :class:`KernelCall`'s pointers
    (operands, then results) and constants go to the kernel by name, as XLA would pass them to
    the kernel's IR. ``ir_bytes`` was made and parsed by jaxlib, as on the GPU."""
    from fp8kv_jax import _xla_triton

    assert ir_bytes[:4] == b"ML\xefR"   # MLIR bytecode
    out_shapes = _xla_triton._out_shapes(call, arrays, new)
    constants = dict(call.constants)
    assert not any(isinstance(v, float) and v != 1.0 for v in constants.values())

    def run(*host):
        inputs = [np.array(a, order="C", copy=True) for a in host]
        aliased = {o: i for i, o in call.aliases}
        outs = [inputs[aliased[o]].copy() if o in aliased else np.zeros(s.shape, s.dtype)
                for o, s in enumerate(out_shapes)]
        pointers = {p: HostArray(a) for (p, _), a in zip(call.inputs + call.outputs,
                                                         inputs + outs)}
        ops.interpreted(call.kernel)[call.grid](**pointers, **exact(constants),
                                               num_warps=call.num_warps)
        return tuple(outs)

    return list(jax.pure_callback(run, out_shapes, *(arrays[s] for _, s in call.inputs)))


def use_interpreted_gpu_path(monkeypatch) -> None:
    """fp8kv_jax takes its GPU path through jax-triton, replaced by the interpreter stand-in."""
    import fp8kv_jax._args
    import fp8kv_jax._triton

    monkeypatch.setenv("FP8KV_JAX_XLA_TRITON", "0")
    monkeypatch.setattr(fp8kv_jax._args, "use_triton", lambda arrays: True)
    monkeypatch.setattr(fp8kv_jax._triton, "jax_triton",
                        lambda: types.SimpleNamespace(triton_call=interpreted_triton_call))


def use_interpreted_xla_path(monkeypatch) -> None:
    """fp8kv_jax takes its GPU path through XLA's Triton call, whose binding is replaced by the
    interpreter stand-in (the kernel's IR is still made and parsed by jaxlib)."""
    import fp8kv_jax._args
    import fp8kv_jax._xla_triton

    monkeypatch.setenv("FP8KV_JAX_XLA_TRITON", "1")
    monkeypatch.setattr(fp8kv_jax._args, "use_triton", lambda arrays: True)
    monkeypatch.setattr(fp8kv_jax._xla_triton, "_bind", interpreted_xla_call)
