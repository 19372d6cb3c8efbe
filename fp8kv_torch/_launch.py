"""torch tensors -> core validation -> core plan -> kernel launch. No decisions are made here.

An engine repeats the same call signature every step, so each op keeps its launch ready per
signature (:class:`_ReadyLaunch`): a steady-state call costs a key of its tensors' metadata, one
dict lookup and one launch. Everything that validation or the plan read is in the key (shapes,
strides, dtypes, devices, 16-byte alignment, scale kinds and values, options), so a call that
differs in any of them is validated and planned afresh; a call that fails validation is never
cached, and fails the same way every time. A repeat of an op's last signature (one per layer of a
step) is recognised before the key is built, by a check in C (:class:`fp8kv_torch._fast.LastCall`),
which hands the call's pointers straight to the kernel.
"""
from __future__ import annotations

import functools
import operator

import torch

from fp8kv import ops
from fp8kv.arrays import ArrayInfo
from fp8kv.binding import BoundCall, bind, signature
from fp8kv.plan import CUDA, INTERPRET, LaunchPlan, plan_dequantize, plan_write
from fp8kv.validate import (check_dequantize, check_out, check_slots_in_range,
                            check_table_in_range, check_write, dequantized_shape, frontend_args)

from . import _fast


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name the core uses for a dtype."""
    return str(dtype).removeprefix("torch.")


def info(t: torch.Tensor, name: str) -> ArrayInfo:
    """What the core validates of a tensor argument; anything else is a TypeError naming it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return ArrayInfo(tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype), str(t.device))


def host_values(t: torch.Tensor, name: str):
    """``t``'s values on the host, for the opt-in bounds checks: a device sync, refused where a
    sync is not allowed (CUDA-graph capture) or cannot be traced (torch.compile)."""
    if torch.compiler.is_compiling():
        raise RuntimeError(f"check_bounds: reads {name} on the host, which torch.compile cannot "
                           "trace; check eagerly, outside the compiled function")
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"check_bounds: reads {name} on the host (a device sync), which "
                           "CUDA-graph capture does not allow")
    return t.detach().cpu().numpy()


def _backend(t: torch.Tensor, name: str) -> str:
    if t.device.type == "cuda":
        return CUDA
    if t.device.type == "cpu":
        return INTERPRET
    raise ValueError(f"{name}: expected a CUDA or CPU tensor, got device {t.device}")


def _operand_index(names: tuple, param: str) -> int:
    """Which operand a kernel parameter takes: ``X_ptr`` (read) and ``X_out_ptr`` (written) are
    both operand ``X`` -- a cache is read and written through the one tensor."""
    return names.index(param.removesuffix("_ptr").removesuffix("_out"))


class _ReadyLaunch:
    """A kernel bound to its grid, scalars and constexprs: one launch per call.

    On CUDA ``runner`` is the launcher of the compiled kernel
    (:func:`fp8kv_torch._fast.direct_launcher`, or ``CompiledKernel[grid]``, the public entry
    point Triton returns from a launch), which skips
    ``kernel[grid](...)``'s per-call argument binding and specialization (~10 us), and takes
    pointers as ints; under the interpreter, the interpreted kernel, which takes the tensors.
    The kernel's arguments are the operands' values, the scalars and the constexprs, in the order
    that :meth:`selector` gives.
    """

    __slots__ = ("runner", "pointers", "inputs", "outputs", "scalars", "consts", "select",
                 "new_outputs")

    def __init__(self, kernel, launched, call: BoundCall, plan: LaunchPlan, backend: str,
                 names: tuple, device: torch.device, new_outputs=None):
        """``names``: the parameter name of each operand, in the order the op passes them."""
        self.new_outputs = new_outputs  # an allocating call's _NewOutputs
        sig = call.signature
        self.inputs = [_operand_index(names, n) for n in sig.inputs]
        self.outputs = [_operand_index(names, n) for n in sig.outputs]
        self.scalars = len(call.scalars)
        self.consts = (*call.scalars, *call.constexprs.values())
        # Pointers as ints on CUDA: Triton's launcher then neither calls each tensor's data_ptr
        # nor asks the driver about each pointer (~0.3 us apiece).
        self.pointers = backend == CUDA
        if self.pointers:
            grid = plan.grid + (1,) * (3 - len(plan.grid))
            self.runner = _fast.direct_launcher(launched, grid, device.index) or launched[grid]
        else:
            self.runner = functools.partial(ops.kernel_for(kernel, True)[plan.grid],
                                            num_warps=plan.num_warps)
        self.select = self.selector(range(len(names)), len(names))

    def selector(self, positions, count: int):
        """``values + consts -> the kernel's arguments`` (inputs, scalars, outputs, constexprs),
        for ``values`` of ``count`` items in which operand ``i`` is at ``positions[i]``: a C-level
        getter, nothing else per call."""
        order = ([positions[i] for i in self.inputs] + [count + j for j in range(self.scalars)]
                 + [positions[i] for i in self.outputs]
                 + [count + j for j in range(self.scalars, len(self.consts))])
        return operator.itemgetter(*order)

    def launch(self, operands) -> None:
        """Launch on these operands (each a tensor on the planned device, as the call's validation
        or key ensured)."""
        values = tuple(map(torch.Tensor.data_ptr, operands)) if self.pointers else operands
        self.runner(*self.select(values + self.consts))


_READY: dict = {}
_READY_LIMIT = 4096  # float scales that change every call would otherwise grow it without bound
_LAST: dict = {}     # op -> _fast.LastCall
_PREVIOUS_KEY: dict = {}  # op -> the key of its last call served from _READY


def clear_launch_caches() -> None:
    """Forget cached plans and launches (after changing ``fp8kv.plan``'s size tables)."""
    plan_write.cache_clear()
    plan_dequantize.cache_clear()
    _READY.clear()
    _LAST.clear()
    _PREVIOUS_KEY.clear()


def _remember(op: str, key, args: tuple, options, ready, allocating: bool) -> None:
    """Make ``ready`` the op's last call once its key came twice in a row (a LastCall costs a few
    us to make: calls that alternate between signatures keep the key path alone)."""
    if _PREVIOUS_KEY.get(op) != key:
        _PREVIOUS_KEY[op] = key
        return
    new_outputs = ready.new_outputs.exists if allocating else ()
    last = _fast.LastCall.make(args, options, ready, _OPERANDS_OF[op], new_outputs)
    if last is None:
        _LAST.pop(op, None)
    else:
        _LAST[op] = last


def _find_ready(op: str, tensors, options, allocating: bool = False):
    """``(key, ready launch or None)`` for a call that no LastCall served; key None where no
    ready launch may serve it: tensors on a CUDA device other than the current one (they launch
    under a device guard), or arguments that are not what they should be (validation then says
    which). ``allocating``: the call allocates its outputs."""
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or (
            first.is_cuda and first.get_device() != torch.cuda.current_device()):
        return None, None
    # Per tensor: what validation and the plan read of it; anything else (None, a host scale,
    # "inline") as it is -- its value is part of the plan.
    key = (op, options, *[(t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15 == 0)
                          if isinstance(t, torch.Tensor) else t for t in tensors])
    try:
        ready = _READY.get(key)
    except TypeError:  # unhashable: not a tensor or a number
        return None, None
    if ready is not None:
        _remember(op, key, tensors, options, ready, allocating)
    return key, ready


def _launch(kernel, plan: LaunchPlan, backend: str, device: torch.device, names: tuple,
            operands: tuple, ready_key=None, new_outputs=None) -> None:
    """Launch through Triton's own entry point; keep it ready under ``ready_key``.

    ``operands``: the kernel's arrays, each named by ``names`` (a parameter name)."""
    sig = signature(kernel)
    call = bind(kernel, plan, {p: operands[_operand_index(names, p)]
                               for p in sig.inputs + sig.outputs})
    launch = ops.kernel_for(kernel, backend == INTERPRET)[plan.grid]
    options = dict(num_warps=plan.num_warps, enable_fp_fusion=plan.enable_fp_fusion)
    if backend == CUDA and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            launch(*call.args, **options, **call.constexprs)
        return
    launched = launch(*call.args, **options, **call.constexprs)
    if ready_key is not None and (backend == INTERPRET or hasattr(launched, "__getitem__")):
        if len(_READY) >= _READY_LIMIT:
            _READY.clear()
        _READY[ready_key] = _ReadyLaunch(kernel, launched, call, plan, backend, names, device,
                                         new_outputs)
        _PREVIOUS_KEY[ready_key[0]] = ready_key   # a repeat may make it the op's LastCall


def write_kv(key, value, key_cache, value_cache, slots, key_scale, value_scale, layout, fp8_format,
             exact=None, launch=True, key_scale_cache=None, value_scale_cache=None,
             scale_rounding="exact", check_bounds=False):
    """Validate, plan and launch one write. ``value_cache=None``: ``key_cache`` is combined.

    ``exact`` forces the exact (True) or hardware (False) conversions; ``launch=False`` only
    validates (the fake implementation of the custom op).
    """
    passed = (key, value, key_cache, value_cache, slots, key_scale, value_scale, key_scale_cache,
            value_scale_cache)
    ready_key = None
    if launch and exact is None and not check_bounds:
        options = (layout, fp8_format, scale_rounding)
        last = _LAST.get("write")
        if last is not None and (values := last.match(passed, options)) is not None:
            return last.launch(values)
        ready_key, ready = _find_ready("write", passed, options)
        if ready is not None:
            return ready.launch(_write_operands(*passed))
    arrays = dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slots=slots)
    args = check_write(**frontend_args(info, torch.Tensor, arrays, key_scale, value_scale,
                                       key_scale_cache, value_scale_cache),
                       layout=layout, fp8_format=fp8_format, scale_rounding=scale_rounding)
    if check_bounds:
        check_slots_in_range(host_values(slots, "slots"), args.key_cache.num_slots)
    backend = _backend(key, "key")
    plan = plan_write(args, backend, exact)
    if plan.empty or not launch:
        return
    _launch(ops._write_kv_kernel, plan, backend, key.device, WRITE_OPERANDS,
            _write_operands(*passed), ready_key)


WRITE_OPERANDS = ("key", "value", "key_cache", "value_cache", "slot", "key_scale", "value_scale")


def _write_operands(key, value, key_cache, value_cache, slots, key_scale, value_scale,
                    key_scale_cache=None, value_scale_cache=None) -> tuple:
    """The kernel's arrays, named by WRITE_OPERANDS. Each cache is read and written; a combined
    cache (``value_cache`` None) is both caches, the plan's offset finding V in it. A side scale
    array takes the static scale's place and is written too."""
    return (key, value, key_cache, key_cache if value_cache is None else value_cache, slots,
            _pointer_or(key_scale_cache, _pointer_or(key_scale, slots)),
            _pointer_or(value_scale_cache, _pointer_or(value_scale, slots)))


def _pointer_or(scale, placeholder):
    """A device scale, or a placeholder pointer that the plan's scale mode never reads."""
    return scale if isinstance(scale, torch.Tensor) else placeholder


DEQUANTIZE_OPERANDS = ("key_cache", "value_cache", "table", "key_scale", "value_scale", "key",
                       "value", "new_table")


def _dequantize_operands(key_cache, value_cache, block_table, key_scale, value_scale, outs,
                         key_scale_cache=None, value_scale_cache=None) -> tuple:
    """The kernel's arrays, named by DEQUANTIZE_OPERANDS (``key``/``value``: the outputs)."""
    key_out, value_out, table_out = outs
    return (key_cache, key_cache if value_cache is None else value_cache, block_table,
            _pointer_or(key_scale_cache, _pointer_or(key_scale, block_table)),
            _pointer_or(value_scale_cache, _pointer_or(value_scale, block_table)),
            key_out, key_out if value_out is None else value_out, table_out)


def _dequantize_operands_of(args: tuple, outs) -> tuple:
    """The operands from ``dequantize_pages``' tensor arguments as ``_find_ready`` sees them (the
    outputs last, where passed) and ``outs`` (None: take them from ``args``)."""
    return _dequantize_operands(*args[:5], args[7:] if outs is None else outs, *args[5:7])


# op -> operands_of(args, outs) for LastCall: which kernel operand each argument becomes.
_OPERANDS_OF = {"write": lambda args, outs: _write_operands(*args),
                "dequantize": _dequantize_operands_of}


@functools.cache
def _one_element(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty((), dtype=dtype, device=device)


def _empty_maker(shape: tuple, dtype: torch.dtype, device: torch.device, template: bool = True):
    """``() -> a new contiguous tensor`` of ``shape``, ``dtype`` on ``device``.

    ``torch.empty_like`` of a template parses one argument where ``torch.empty(shape, dtype=,
    device=)`` parses three: ~1.3 us less per tensor on an H200 host (``bench/NOTES.md`` item
    23). The template is one element expanded to ``shape`` (no memory of its own); it is used
    only where the tensor it makes has the very shape, strides, dtype and device that
    ``torch.empty`` gives (checked here, once per signature). ``template=False``: plain
    ``torch.empty``.
    """
    plain = functools.partial(torch.empty, shape, dtype=dtype, device=device)
    if not template:
        return plain
    expanded = _one_element(dtype, device).expand(shape)
    if _layout_of(torch.empty_like(expanded)) == _layout_of(plain()):
        return functools.partial(torch.empty_like, expanded)
    return plain


def _layout_of(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device, t.requires_grad


class _NewOutputs:
    """An allocating dequantize's outputs for one signature: ``make()`` returns new
    ``(key_out, value_out or None, table_out)`` (no value output for a combined cache), each a
    tensor of its own; ``exists`` says which of the three there are. ``templates=False``: plain
    ``torch.empty`` (while torch.compile traces with fake tensors, none of which may be kept)."""

    __slots__ = ("make", "exists")

    def __init__(self, pages_shape: tuple, dtype: torch.dtype, combined: bool,
                 table_shape: tuple, device: torch.device, templates: bool = True):
        pages = _empty_maker(pages_shape, dtype, device, templates)
        table = _empty_maker(table_shape, torch.int32, device, templates)
        self.make = (lambda: (pages(), None, table())) if combined else (
            lambda: (pages(), pages(), table()))
        self.exists = (True, not combined, True)


# Per signature; bounded like _READY, whose launches keep theirs.
_new_outputs = functools.lru_cache(maxsize=256)(_NewOutputs)


def dequantize_pages(key_cache, value_cache, block_table, key_scale, value_scale, dtype, layout,
                     fp8_format, null_page, outs=None, exact=None, launch=True,
                     key_scale_cache=None, value_scale_cache=None, head_dim=None,
                     check_bounds=False) -> tuple:
    """Validate, plan and launch one dequantize; returns ``(key_out, value_out, table_out)``.

    ``value_cache=None``: ``key_cache`` is a combined cache, and the output is combined too
    (``value_out`` None). ``outs``: preallocated ``(key_out, value_out, table_out)``, or None to
    allocate them.
    """
    ready_key = None
    if launch and exact is None and not check_bounds:
        passed = (key_cache, value_cache, block_table, key_scale, value_scale, key_scale_cache,
                value_scale_cache, *(outs or ()))
        allocating = outs is None
        options = (dtype, layout, fp8_format, null_page, head_dim, allocating)
        last = _LAST.get("dequantize")
        if last is not None and (values := last.match(passed, options)) is not None:
            if allocating:
                outs = last.new_outputs.make()
                values += last.new_values(outs)
            last.launch(values)
            return outs
        ready_key, ready = _find_ready("dequantize", passed, options, allocating)
        if ready is not None:
            outs = outs or ready.new_outputs.make()
            ready.launch(_dequantize_operands_of(passed, outs))
            return outs
    combined = value_cache is None
    arrays = dict(key_cache=key_cache, value_cache=value_cache, block_table=block_table)
    args = check_dequantize(**frontend_args(info, torch.Tensor, arrays, key_scale, value_scale,
                                            key_scale_cache, value_scale_cache),
                            dtype=dtype_name(dtype), layout=layout, fp8_format=fp8_format,
                            null_page=null_page, head_dim=head_dim)
    if check_bounds:
        check_table_in_range(host_values(block_table, "block_table"), args.key_cache.num_pages,
                             null_page)
    shape, table_shape = dequantized_shape(args, combined), (args.batch, args.pages_per_seq)
    new_outputs = None
    if outs is None:
        new_outputs = (_new_outputs(shape, dtype, combined, table_shape, key_cache.device)
                       if launch else _NewOutputs(shape, dtype, combined, table_shape,
                                                  key_cache.device, templates=False))
        outs = new_outputs.make()
    key_out, value_out, table_out = outs
    device = str(key_cache.device)
    key_info = info(key_out, "out[0]")
    value_info = None if combined else info(value_out, "out[1]")
    check_out(key_info, "out[0]", shape, args.out_dtype, device)
    if not combined:
        check_out(value_info, "out[1]", shape, args.out_dtype, device)
    check_out(info(table_out, "out[-1]"), "out[-1]", table_shape, "int32", device)
    if not table_out.is_contiguous():
        raise ValueError("out[-1]: expected a contiguous new_block_table")
    backend = _backend(key_cache, "key_cache")
    if not launch:  # validation only: no plan (plan_dequantize's lru_cache warns under Dynamo)
        return outs
    plan = plan_dequantize(args, key_info, value_info, backend, exact)
    if plan.empty:
        return outs
    _launch(ops._dequantize_pages_kernel, plan, backend, key_cache.device, DEQUANTIZE_OPERANDS,
            _dequantize_operands(key_cache, value_cache, block_table, key_scale, value_scale, outs,
                                 key_scale_cache, value_scale_cache),
            ready_key, new_outputs)
    return outs
