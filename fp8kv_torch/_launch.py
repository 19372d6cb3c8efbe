"""torch tensors -> core validation -> core plan -> kernel launch. No decisions are made here."""
from __future__ import annotations

import torch
from triton import knobs
from triton.runtime import driver

from fp8kv import ops
from fp8kv.arrays import ArrayInfo
from fp8kv.binding import BoundCall, bind
from fp8kv.plan import CUDA, INTERPRET, plan_dequantize, plan_write
from fp8kv.validate import check_dequantize, check_out, check_write, dequantized_shape


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name the core uses for a dtype."""
    return str(dtype).removeprefix("torch.")


def info(t: torch.Tensor) -> ArrayInfo:
    return ArrayInfo(tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype), str(t.device))


def scale_arg(scale):
    """A scale as the core sees it: None, a number, or an ArrayInfo (the core checks which)."""
    return info(scale) if isinstance(scale, torch.Tensor) else scale


def scale_cache_arg(scale_cache):
    """A scale cache as the core sees it: None, ``"inline"`` (or any other object, which the
    core rejects), or an ArrayInfo."""
    return info(scale_cache) if isinstance(scale_cache, torch.Tensor) else scale_cache


def _backend(t: torch.Tensor, name: str) -> str:
    if t.device.type == "cuda":
        return CUDA
    if t.device.type == "cpu":
        return INTERPRET
    raise ValueError(f"{name}: expected a CUDA or CPU tensor, got device {t.device}")


def _launch(kernel, plan, backend, device, arrays):
    """Launch through Triton's own entry point; returns the bound call and, on CUDA, the
    CompiledKernel."""
    call = bind(kernel, plan, arrays)
    kernel = ops.kernel_for(kernel, backend == INTERPRET)
    if backend == CUDA and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            return call, kernel[plan.grid](*call.args, num_warps=plan.num_warps, **call.constexprs)
    return call, kernel[plan.grid](*call.args, num_warps=plan.num_warps, **call.constexprs)


class _ReadyLaunch:
    """A compiled kernel bound to its grid, scalars and constexprs: one C launch per call.

    ``kernel[grid](...)`` re-binds and re-specializes every argument in Python (~10 us); a steady
    serving loop repeats the same signature, so ``write_kv`` keys this on everything that decided
    the plan and Triton's specialization (shapes, strides, dtypes, scales, 16-byte alignment).
    """

    __slots__ = ("compiled", "grid", "inputs", "outputs", "scalars", "constexprs")

    def __init__(self, compiled, call: BoundCall, grid):
        self.compiled = compiled
        self.grid = grid + (1,) * (3 - len(grid))
        self.inputs, self.outputs = call.signature.inputs, call.signature.outputs
        self.scalars = call.scalars
        self.constexprs = tuple(call.constexprs.values())

    def __call__(self, device_index, arrays):
        c = self.compiled
        args = (*[arrays[n] for n in self.inputs], *self.scalars,
                *[arrays[n] for n in self.outputs], *self.constexprs)
        stream = driver.active.get_current_stream(device_index)
        meta = None if knobs.runtime.launch_enter_hook is None else c.launch_metadata(
            self.grid, stream, *args)
        c.run(*self.grid, stream, c.function, c.packed_metadata, meta, knobs.runtime.launch_enter_hook,
              knobs.runtime.launch_exit_hook, *args)


_READY: dict = {}
_READY_LIMIT = 4096  # float scales that change every call would otherwise grow it without bound


def clear_launch_caches() -> None:
    """Forget cached plans and launches (after changing ``fp8kv.plan``'s size tables)."""
    plan_write.cache_clear()
    plan_dequantize.cache_clear()
    _READY.clear()


def _tensor_key(t: torch.Tensor):
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def _scale_key(scale):
    return _tensor_key(scale) if isinstance(scale, torch.Tensor) else scale


def write_kv(key, value, key_cache, value_cache, slots, key_scale, value_scale, layout, fp8_format,
             exact=None, launch=True, key_scale_cache=None, value_scale_cache=None,
             scale_rounding="exact"):
    """Validate, plan and launch one write. ``value_cache=None``: ``key_cache`` is combined.

    ``exact`` forces the exact (True) or hardware (False) conversions; ``launch=False`` only
    validates (the fake implementation of the custom op).
    """
    combined = value_cache is None
    ready_key = None
    if launch and exact is None and key.is_cuda and key.device.index == torch.cuda.current_device():
        ready_key = (_tensor_key(key), _tensor_key(value), _tensor_key(key_cache),
                     None if combined else _tensor_key(value_cache), _tensor_key(slots),
                     _scale_key(key_scale), _scale_key(value_scale), layout, fp8_format,
                     key.device.index, _scale_key(key_scale_cache), _scale_key(value_scale_cache),
                     scale_rounding)
        ready = _READY.get(ready_key)
        if ready is not None:
            ready(key.device.index, _write_operands(key, value, key_cache, value_cache, slots,
                                                    key_scale, value_scale, key_scale_cache,
                                                    value_scale_cache))
            return
    args = check_write(
        info(key), info(value), None if combined else info(key_cache),
        None if combined else info(value_cache), info(slots),
        scale_arg(key_scale), scale_arg(value_scale),
        layout=layout, fp8_format=fp8_format, kv_cache=info(key_cache) if combined else None,
        key_scale_cache=scale_cache_arg(key_scale_cache),
        value_scale_cache=scale_cache_arg(value_scale_cache), scale_rounding=scale_rounding)
    backend = _backend(key, "key")
    plan = plan_write(args, backend, exact)
    if plan.empty or not launch:
        return
    arrays = _write_operands(key, value, key_cache, value_cache, slots, key_scale, value_scale,
                             key_scale_cache, value_scale_cache)
    call, compiled = _launch(ops._write_kv_kernel, plan, backend, key.device, arrays)
    if ready_key is not None:
        if len(_READY) >= _READY_LIMIT:
            _READY.clear()
        _READY[ready_key] = _ReadyLaunch(compiled, call, plan.grid)


def _write_operands(key, value, key_cache, value_cache, slots, key_scale, value_scale,
                    key_scale_cache=None, value_scale_cache=None) -> dict:
    """The kernel's arrays by name. Each cache is an input and an output; a combined cache
    (``value_cache`` None) is both caches, the plan's offset finding V in it. A side scale array
    takes the static scale's place as input and is also the scale output."""
    value_cache = key_cache if value_cache is None else value_cache
    key_scale = _pointer_or(key_scale_cache, _pointer_or(key_scale, slots))
    value_scale = _pointer_or(value_scale_cache, _pointer_or(value_scale, slots))
    return dict(key_ptr=key, value_ptr=value, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
                slot_ptr=slots, key_scale_ptr=key_scale, value_scale_ptr=value_scale,
                key_cache_out_ptr=key_cache, value_cache_out_ptr=value_cache,
                key_scale_out_ptr=key_scale, value_scale_out_ptr=value_scale)


def _pointer_or(scale, placeholder):
    """A device scale, or a placeholder pointer that the plan's scale mode never reads."""
    return scale if isinstance(scale, torch.Tensor) else placeholder


def dequantize_args(key_cache, value_cache, block_table, key_scale, value_scale, dtype, layout,
                    fp8_format, null_page, key_scale_cache=None, value_scale_cache=None,
                    head_dim=None):
    combined = value_cache is None
    return check_dequantize(
        None if combined else info(key_cache), None if combined else info(value_cache),
        info(block_table), scale_arg(key_scale), scale_arg(value_scale),
        dtype=dtype, layout=layout, fp8_format=fp8_format, null_page=null_page,
        kv_cache=info(key_cache) if combined else None,
        key_scale_cache=scale_cache_arg(key_scale_cache),
        value_scale_cache=scale_cache_arg(value_scale_cache), head_dim=head_dim)


def dequantize_pages(key_cache, value_cache, block_table, key_scale, value_scale, layout, fp8_format,
                     null_page, key_out, value_out, table_out, exact=None, launch=True, args=None,
                     key_scale_cache=None, value_scale_cache=None, head_dim=None):
    """Validate, plan and launch one dequantize into preallocated outputs.

    ``value_cache=None``: ``key_cache`` is a combined cache; ``value_out=None``: ``key_out`` is a
    combined output. ``args``: the caller's :func:`dequantize_args` for these inputs, if it has them
    (the allocating call validated already to size the outputs).
    """
    dtype = dtype_name(key_out.dtype)
    if args is None:
        args = dequantize_args(key_cache, value_cache, block_table, key_scale, value_scale, dtype,
                               layout, fp8_format, null_page, key_scale_cache, value_scale_cache,
                               head_dim)
    device = str(key_cache.device)
    combined_out = value_out is None
    check_out(info(key_out), "out[0]", dequantized_shape(args, combined_out), dtype, device)
    if not combined_out:
        check_out(info(value_out), "out[1]", dequantized_shape(args, False), dtype, device)
    check_out(info(table_out), "out[-1]", (args.batch, args.pages_per_seq), "int32", device)
    if not table_out.is_contiguous():
        raise ValueError("out[-1]: expected a contiguous new_block_table")
    backend = _backend(key_cache, "key_cache")
    plan = plan_dequantize(args, info(key_out), None if combined_out else info(value_out), backend,
                           exact)
    if plan.empty or not launch:
        return
    value_cache = key_cache if value_cache is None else value_cache
    arrays = dict(key_cache_ptr=key_cache, value_cache_ptr=value_cache, table_ptr=block_table,
                  key_scale_ptr=_pointer_or(key_scale_cache, _pointer_or(key_scale, block_table)),
                  value_scale_ptr=_pointer_or(value_scale_cache,
                                              _pointer_or(value_scale, block_table)),
                  key_out_ptr=key_out,
                  value_out_ptr=key_out if combined_out else value_out, new_table_ptr=table_out)
    _launch(ops._dequantize_pages_kernel, plan, backend, key_cache.device, arrays)
