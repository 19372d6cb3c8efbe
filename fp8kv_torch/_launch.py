"""torch tensors -> core validation -> core plan and operand map -> launch. No decisions here.

Each op takes its arguments in one fixed order (:data:`ARGUMENTS`, the public names); the core's
operand map (:mod:`fp8kv.operands`) says which of them each kernel pointer takes, so this module
never says which array is read, written or aliased.

An engine repeats the same call signature every step, so each op keeps its launch ready per
signature (:class:`_ReadyLaunch`): a steady-state call costs a key of its arguments (tensor
metadata; every other argument with its type), one dict lookup and one launch. Everything that
validation or the plan read is in the key (shapes, strides, dtypes, devices, 16-byte alignment,
scale kinds and values, options), so a call that differs in any of them -- a value of another type
included -- is validated and planned afresh; a call that fails validation is never cached, and
fails the same way every time. A repeat of an op's last signature (one per layer of a step) is
recognised before the key is built, by a check in C (:class:`fp8kv_torch._fast.LastCall`), which
hands the call's pointers straight to the kernel. ``FP8KV_FAST=0`` turns that check and the
direct launch off (:mod:`fp8kv_torch._fast`).
"""
from __future__ import annotations

import functools
import operator

import torch

from fp8kv import ops
from fp8kv.arrays import ArrayInfo
from fp8kv.binding import BoundCall, bind
from fp8kv.operands import OperandMap, dequantize_operands, rope_write_operands, write_operands
from fp8kv.plan import CUDA, INTERPRET, LaunchPlan, plan_dequantize, plan_write
from fp8kv.plan_rope import plan_rope_write
from fp8kv.validate import (check_dequantize, check_layer_in_range, check_out,
                            check_slots_in_range, check_table_in_range, check_write,
                            dequantized_shape, frontend_args)
from fp8kv.validate_rope import check_positions_in_range, check_rope_write

from . import _fast

# Each op's arguments, in the order its launcher takes them: the arrays it must have, then the
# scales, then (dequantize) the outputs.
ARGUMENTS = {
    "write": ("key", "value", "key_cache", "value_cache", "slots", "key_scale", "value_scale",
              "key_scale_cache", "value_scale_cache", "layer"),
    "write_combined": ("key", "value", "kv_cache", "slots", "key_scale", "value_scale",
                       "key_scale_cache", "value_scale_cache", "layer"),
    "dequantize": ("key_cache", "value_cache", "block_table", "key_scale", "value_scale",
                   "key_scale_cache", "value_scale_cache", "out_scale", "layer", "key_out",
                   "value_out", "table_out"),
    "dequantize_combined": ("kv_cache", "block_table", "key_scale", "value_scale",
                            "key_scale_cache", "value_scale_cache", "out_scale", "layer",
                            "kv_out", "table_out"),
    # query_out last: an allocating call leaves it out and makes it per call.
    "rope_write": ("query", "key", "value", "key_cache", "value_cache", "slots", "positions",
                   "cos_sin_cache", "key_scale", "value_scale", "query_scale", "key_scale_cache",
                   "value_scale_cache", "key_out", "query_out"),
    "rope_write_combined": ("query", "key", "value", "kv_cache", "slots", "positions",
                            "cos_sin_cache", "key_scale", "value_scale", "query_scale",
                            "key_scale_cache", "value_scale_cache", "key_out", "query_out"),
}
_SCALES = ("key_scale", "value_scale", "key_scale_cache", "value_scale_cache", "out_scale")
# Optional arguments, passed to validation as they are or (a tensor) as its ArrayInfo.
_OPTIONAL = _SCALES + ("layer",)
_OUTPUTS = ("key_out", "value_out", "kv_out", "table_out")
_OUT_NAMES = {"key_out": "out[0]", "value_out": "out[1]", "kv_out": "out[0]",
              "table_out": "out[-1]"}


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


def check_layer_bounds(layer, layers) -> None:
    """``check_bounds``' check of ``layer=`` (an int or a tensor, read on the host)."""
    if layers is not None:
        check_layer_in_range(host_values(layer, "layer") if isinstance(layer, torch.Tensor)
                             else layer, layers.num_layers)


def _backend(t: torch.Tensor, name: str) -> str:
    if t.device.type == "cuda":
        return CUDA
    if t.device.type == "cpu":
        return INTERPRET
    raise ValueError(f"{name}: expected a CUDA or CPU tensor, got device {t.device}")


def typed(values: tuple) -> tuple:
    """``values`` with each one's type: ``True``, ``1`` and ``1.0`` hash and compare alike, and a
    call with one of them must not find the launch a call with another made."""
    return tuple((type(v), v) for v in values)


def operand_positions(names: tuple, operands: OperandMap) -> tuple[int, ...]:
    """Which of the op's arguments (``names``) each kernel array takes, in the kernel's order.

    An output the plan never writes takes the first input's tensor (a pointer, never
    dereferenced)."""
    inputs = [names.index(o.source) for o in operands.inputs]
    return tuple(inputs + [names.index(o.source) if o.source is not None else inputs[0]
                           for o in operands.outputs])


class _ReadyLaunch:
    """A kernel bound to its grid, scalars and constexprs: one launch per call.

    On CUDA ``runner`` is the launcher of the compiled kernel
    (:func:`fp8kv_torch._fast.direct_launcher`, or ``CompiledKernel[grid]``, the public entry
    point Triton returns from a launch), which skips ``kernel[grid](...)``'s per-call argument
    binding and specialization (~10 us), and takes pointers as ints; under the interpreter, the
    interpreted kernel, which takes the tensors. ``positions``: which of the call's values
    (its arguments, then an allocating call's new outputs) each kernel array takes.
    """

    __slots__ = ("runner", "pointers", "positions", "gather", "scalars", "consts", "select",
                 "new_outputs", "inputs")

    def __init__(self, kernel, launched, call: BoundCall, plan: LaunchPlan, backend: str,
                 positions: tuple, device: torch.device, new_outputs=None):
        self.new_outputs = new_outputs  # an allocating call's _NewOutputs
        self.positions = positions
        self.gather = operator.itemgetter(*positions)
        self.inputs = len(call.inputs)
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
        self.select = self.selector(range(len(positions)), len(positions))

    def selector(self, places, count: int):
        """``values + consts -> the kernel's arguments`` (inputs, scalars, outputs, constexprs),
        for ``values`` of ``count`` items in which kernel array ``i`` is at ``places[i]``: a
        C-level getter, nothing else per call."""
        n = len(places)
        order = ([places[i] for i in range(self.inputs)]
                 + [count + j for j in range(self.scalars)]
                 + [places[i] for i in range(self.inputs, n)]
                 + [count + j for j in range(self.scalars, len(self.consts))])
        return operator.itemgetter(*order)

    def launch(self, values: tuple) -> None:
        """Launch on the call's values (tensors on the planned device, as the call's validation
        or key ensured)."""
        operands = self.gather(values)
        if self.pointers:
            operands = tuple(map(torch.Tensor.data_ptr, operands))
        self.runner(*self.select(operands + self.consts))


_READY: dict = {}
_READY_LIMIT = 4096  # float scales that change every call would otherwise grow it without bound
_LAST: dict = {}     # op -> _fast.LastCall
_PREVIOUS_KEY: dict = {}  # op -> the key of its last call served from _READY


def clear_launch_caches() -> None:
    """Forget cached plans and launches (after changing ``fp8kv.plan``'s size tables)."""
    plan_write.cache_clear()
    plan_dequantize.cache_clear()
    plan_rope_write.cache_clear()
    _READY.clear()
    _LAST.clear()
    _PREVIOUS_KEY.clear()


def _remember(op: str, key, args: tuple, options, ready) -> None:
    """Make ``ready`` the op's last call once its key came twice in a row (a LastCall costs a few
    us to make: calls that alternate between signatures keep the key path alone)."""
    if _PREVIOUS_KEY.get(op) != key:
        _PREVIOUS_KEY[op] = key
        return
    new_count = 0 if ready.new_outputs is None else len(ARGUMENTS[op]) - len(args)
    last = _fast.LastCall.make(args, options, ready, new_count)
    if last is None:
        _LAST.pop(op, None)
    else:
        _LAST[op] = last


def _find_ready(op: str, args: tuple, options: tuple):
    """``(key, ready launch or None)`` for a call that no LastCall served; key None where no
    ready launch may serve it: tensors on a CUDA device other than the current one (they launch
    under a device guard), or arguments that are not what they should be (validation then says
    which). ``options``: already :func:`typed`."""
    first = args[0]
    if not isinstance(first, torch.Tensor) or (
            first.is_cuda and first.get_device() != torch.cuda.current_device()):
        return None, None
    # Per tensor: what validation and the plan read of it; anything else (None, a host scale,
    # "inline") with its type -- its value is part of the plan.
    key = (op, options, *[(t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15 == 0)
                          if isinstance(t, torch.Tensor) else (type(t), t) for t in args])
    try:
        ready = _READY.get(key)
    except TypeError:  # unhashable: not a tensor or a number
        return None, None
    if ready is not None and _fast.ENABLED:
        _remember(op, key, args, options, ready)
    return key, ready


def _launch(kernel, plan: LaunchPlan, backend: str, device: torch.device, operands: OperandMap,
            names: tuple, values: tuple, ready_key=None, new_outputs=None) -> None:
    """Launch through Triton's own entry point; keep it ready under ``ready_key``.

    ``values``: the op's arguments (``names``), then an allocating call's new outputs."""
    positions = operand_positions(names, operands)
    call = bind(kernel, plan, {o.param: values[p] for o, p in zip(operands.params, positions)})
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
        _READY[ready_key] = _ReadyLaunch(kernel, launched, call, plan, backend, positions,
                                         device, new_outputs)
        _PREVIOUS_KEY[ready_key[0]] = ready_key   # a repeat may make it the op's LastCall


def _cached_launch(op: str, args: tuple, options: tuple):
    """Serve a call from the op's LastCall or a ready launch: ``(True, outputs or None)``;
    otherwise ``(False, key)``, the key under which the validated launch is to be kept."""
    last = _LAST.get(op)
    if last is not None and (values := last.match(args, options)) is not None:
        outs = None
        if last.new_outputs is not None:
            outs = last.new_outputs.make()
            values += last.new_values(outs)
        last.launch(values)
        return True, outs
    key, ready = _find_ready(op, args, options)
    if ready is None:
        return False, key
    outs = ready.new_outputs.make() if ready.new_outputs is not None else None
    ready.launch(args + (outs or ()))
    return True, outs


def _split(op: str, args: tuple) -> tuple[dict, dict]:
    """The call's arrays and scales by name, as :func:`fp8kv.validate.frontend_args` takes
    them (outputs apart)."""
    named = dict(zip(ARGUMENTS[op], args))
    arrays = {n: a for n, a in named.items() if n not in _OPTIONAL and n not in _OUTPUTS}
    return arrays, {n: named[n] for n in _OPTIONAL if n in named}


def _write(op: str, args: tuple, layout, fp8_format, scale_rounding, exact, launch,
           check_bounds, cache_format=None) -> None:
    ready_key = None
    if launch and exact is None and not check_bounds:
        served, ready_key = _cached_launch(op, args, typed((layout, fp8_format, scale_rounding,
                                                            cache_format)))
        if served:
            return
    arrays, scales = _split(op, args)
    valid = check_write(**frontend_args(info, torch.Tensor, arrays, scales), layout=layout,
                        fp8_format=fp8_format, scale_rounding=scale_rounding,
                        cache_format=cache_format)
    if check_bounds:
        check_layer_bounds(scales["layer"], valid.layers)
        check_slots_in_range(host_values(arrays["slots"], "slots"), valid.key_cache.num_slots)
    key = arrays["key"]
    backend = _backend(key, "key")
    if not launch:   # the custom op's fake: validation only
        return
    plan = plan_write(valid, backend, exact)
    if plan.empty:
        return
    _launch(getattr(ops, plan.kernel), plan, backend, key.device, write_operands(valid),
            ARGUMENTS[op], args, ready_key)


def write_kv(key, value, key_cache, value_cache, slots, key_scale, value_scale, layout, fp8_format,
             exact=None, launch=True, key_scale_cache=None, value_scale_cache=None,
             scale_rounding="exact", check_bounds=False, cache_format=None, layer=None):
    """Validate, plan and launch one write.

    ``exact`` forces the exact (True) or hardware (False) conversions; ``launch=False`` only
    validates (the fake implementation of the custom op).
    """
    _write("write", (key, value, key_cache, value_cache, slots, key_scale, value_scale,
                     key_scale_cache, value_scale_cache, layer),
           layout, fp8_format, scale_rounding, exact, launch, check_bounds, cache_format)


def write_kv_combined(key, value, kv_cache, slots, key_scale, value_scale, layout, fp8_format,
                      exact=None, launch=True, key_scale_cache=None, value_scale_cache=None,
                      scale_rounding="exact", check_bounds=False, cache_format=None,
                      layer=None):
    """:func:`write_kv` into one combined ``kv_cache``."""
    _write("write_combined", (key, value, kv_cache, slots, key_scale, value_scale,
                              key_scale_cache, value_scale_cache, layer),
           layout, fp8_format, scale_rounding, exact, launch, check_bounds, cache_format)


@functools.cache
def _one_element(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty((), dtype=dtype, device=device)


def _empty_maker(shape: tuple, dtype: torch.dtype, device: torch.device, template: bool = True):
    """``() -> a new contiguous tensor`` of ``shape``, ``dtype`` on ``device``.

    ``torch.empty_like`` of a template parses one argument where ``torch.empty(shape, dtype=,
    device=)`` parses three: ~1.3 us less per tensor on an H200 host (``bench/NOTES.md``). The
    template is one element expanded to ``shape`` (no memory of its own); it is used only where
    the tensor it makes has the very shape, strides, dtype and device that ``torch.empty`` gives
    (checked here, once per signature). ``template=False``: plain ``torch.empty``.
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
    """An allocating dequantize's outputs for one signature: ``make()`` returns new tensors,
    one per output argument of the op (``(key_out, value_out, table_out)`` or ``(kv_out,
    table_out)``), each its own allocation. ``templates=False``: plain ``torch.empty`` (while
    torch.compile traces with fake tensors, none of which may be kept)."""

    __slots__ = ("make",)

    def __init__(self, pages_shape: tuple, dtype: torch.dtype, combined: bool,
                 table_shape: tuple, device: torch.device, templates: bool = True):
        pages = _empty_maker(pages_shape, dtype, device, templates)
        table = _empty_maker(table_shape, torch.int32, device, templates)
        self.make = (lambda: (pages(), table())) if combined else (
            lambda: (pages(), pages(), table()))


# Per signature; bounded like _READY, whose launches keep theirs.
_new_outputs = functools.lru_cache(maxsize=256)(_NewOutputs)


def _dequantize(op: str, args: tuple, outs, dtype, layout, fp8_format, null_page, head_dim,
                exact, launch, check_bounds, cache_format=None) -> tuple:
    ready_key = None
    allocating = outs is None
    if launch and exact is None and not check_bounds:
        options = typed((dtype, layout, fp8_format, null_page, head_dim, allocating,
                         cache_format))
        served, result = _cached_launch(op, args + (outs or ()), options)
        if served:
            return outs or result
        ready_key = result
    combined = op == "dequantize_combined"
    arrays, scales = _split(op, args)
    valid = check_dequantize(**frontend_args(info, torch.Tensor, arrays, scales),
                             dtype=dtype_name(dtype), layout=layout, fp8_format=fp8_format,
                             null_page=null_page, head_dim=head_dim, cache_format=cache_format)
    if check_bounds:
        check_layer_bounds(scales["layer"], valid.layers)
        check_table_in_range(host_values(arrays["block_table"], "block_table"),
                             valid.key_cache.num_pages, null_page)
    first = args[0]
    shape, table_shape = dequantized_shape(valid, combined), (valid.batch, valid.pages_per_seq)
    new_outputs = None
    if allocating:
        new_outputs = (_new_outputs(shape, dtype, combined, table_shape, first.device)
                       if launch else _NewOutputs(shape, dtype, combined, table_shape,
                                                  first.device, templates=False))
        outs = new_outputs.make()
    out_names = ARGUMENTS[op][len(args):]
    device = str(first.device)
    out_info = {}
    for name, out in zip(out_names, outs):
        label = _OUT_NAMES[name]
        out_info[name] = info(out, label)
        if name == "table_out":
            check_out(out_info[name], label, table_shape, ("int32",), device)
            if not out.is_contiguous():
                raise ValueError(f"{label}: expected a contiguous new_block_table")
        else:
            check_out(out_info[name], label, shape, (valid.out_dtype,), device)
    backend = _backend(first, ARGUMENTS[op][0])
    if not launch:   # the custom op's fake: validation only (no plan, which Dynamo would trace)
        return outs
    # The ready key holds each tensor's 16-byte alignment, so this plan serves aligned calls only.
    tensors = [a for a in args if isinstance(a, torch.Tensor)] + list(outs)
    plan = plan_dequantize(valid, out_info.get("kv_out") or out_info["key_out"],
                           out_info.get("value_out"), backend, exact,
                           aligned=not _fast.misaligned(tensors))
    if plan.empty:
        return outs
    values = args + tuple(outs)
    _launch(getattr(ops, plan.kernel), plan, backend, first.device, dequantize_operands(valid),
            ARGUMENTS[op], values, ready_key, new_outputs)
    return outs


def dequantize_pages(key_cache, value_cache, block_table, key_scale, value_scale, dtype, layout,
                     fp8_format, null_page, outs=None, exact=None, launch=True,
                     key_scale_cache=None, value_scale_cache=None, head_dim=None,
                     check_bounds=False, cache_format=None, out_scale=None,
                     layer=None) -> tuple:
    """Validate, plan and launch one dequantize; returns ``(key_out, value_out, table_out)``.

    ``outs``: preallocated ``(key_out, value_out, table_out)``, or None to allocate them.
    """
    return _dequantize("dequantize", (key_cache, value_cache, block_table, key_scale, value_scale,
                                      key_scale_cache, value_scale_cache, out_scale, layer),
                       None if outs is None else tuple(outs), dtype, layout, fp8_format,
                       null_page, head_dim, exact, launch, check_bounds, cache_format)


def dequantize_pages_combined(kv_cache, block_table, key_scale, value_scale, dtype, layout,
                              fp8_format, null_page, outs=None, exact=None, launch=True,
                              key_scale_cache=None, value_scale_cache=None, head_dim=None,
                              check_bounds=False, cache_format=None, out_scale=None,
                              layer=None) -> tuple:
    """:func:`dequantize_pages` of a combined ``kv_cache``: returns ``(kv_out, table_out)``;
    ``outs``: preallocated ``(kv_out, table_out)`` or None."""
    return _dequantize("dequantize_combined", (kv_cache, block_table, key_scale, value_scale,
                                               key_scale_cache, value_scale_cache, out_scale,
                                               layer),
                       None if outs is None else tuple(outs), dtype, layout, fp8_format,
                       null_page, head_dim, exact, launch, check_bounds, cache_format)


# rope_write_kv: the arguments validation takes as they are (not necessarily arrays).
_ROPE_OPTIONAL = ("key_scale", "value_scale", "query_scale", "key_scale_cache",
                  "value_scale_cache", "key_out", "query_out")


class _QueryOut:
    """An allocating rope_write_kv's ``query_out`` for one signature: ``make()`` returns a new
    contiguous tensor in a 1-tuple (``templates=False``: plain ``torch.empty``, as
    :class:`_NewOutputs`)."""

    __slots__ = ("make",)

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device,
                 templates: bool = True):
        empty = _empty_maker(shape, dtype, device, templates)
        self.make = lambda: (empty(),)


_query_outs = functools.lru_cache(maxsize=256)(_QueryOut)


def _rope_write(op: str, args: tuple, query_out, rope_style, rotary_dim, layout, fp8_format,
                scale_rounding, exact, launch, check_bounds):
    """Validate, plan and launch one rope_write_kv; returns ``query_out`` (made when None)."""
    allocating = query_out is None
    values = args if allocating else args + (query_out,)
    ready_key = None
    if launch and exact is None and not check_bounds:
        options = typed((rope_style, rotary_dim, layout, fp8_format, scale_rounding, allocating))
        served, result = _cached_launch(op, values, options)
        if served:
            return result[0] if allocating else query_out
        ready_key = result
    named = dict(zip(ARGUMENTS[op], values))
    arrays = {n: a for n, a in named.items() if n not in _ROPE_OPTIONAL}
    others = {n: named.get(n) for n in _ROPE_OPTIONAL}
    valid = check_rope_write(**frontend_args(info, torch.Tensor, arrays, others),
                             rope_style=rope_style, rotary_dim=rotary_dim, layout=layout,
                             fp8_format=fp8_format, scale_rounding=scale_rounding)
    if check_bounds:
        check_positions_in_range(host_values(arrays["positions"], "positions"),
                                 valid.max_position)
        check_slots_in_range(host_values(arrays["slots"], "slots"),
                             valid.write.key_cache.num_slots)
    query = arrays["query"]
    backend = _backend(query, "query")
    new_outputs = None
    if allocating:
        shape, dtype = tuple(query.shape), getattr(torch, valid.query_out.dtype)
        new_outputs = (_query_outs(shape, dtype, query.device) if launch
                       else _QueryOut(shape, dtype, query.device, templates=False))
        (query_out,) = new_outputs.make()
    if not launch:   # the custom op's fake: validation (and the output) only
        return query_out
    plan = plan_rope_write(valid, backend, exact)
    if not plan.empty:
        _launch(ops._rope_write_kv_kernel, plan, backend, query.device, rope_write_operands(valid),
                ARGUMENTS[op], values + ((query_out,) if allocating else ()), ready_key,
                new_outputs)
    return query_out


def rope_write_kv(query, key, value, key_cache, value_cache, slots, positions, cos_sin_cache,
                  key_scale, value_scale, query_scale=None, query_out=None, key_out=None, *,
                  rope_style="neox", rotary_dim=None, layout="NHD", fp8_format=None,
                  key_scale_cache=None, value_scale_cache=None, scale_rounding="exact",
                  exact=None, launch=True, check_bounds=False):
    """Validate, plan and launch one rope_write_kv; returns ``query_out``.

    ``exact`` forces the exact (True) or hardware (False) conversions; ``launch=False`` only
    validates and makes ``query_out`` (the fake implementation of the custom op).
    """
    return _rope_write("rope_write", (query, key, value, key_cache, value_cache, slots,
                                      positions, cos_sin_cache, key_scale, value_scale,
                                      query_scale, key_scale_cache, value_scale_cache, key_out),
                       query_out, rope_style, rotary_dim, layout, fp8_format, scale_rounding,
                       exact, launch, check_bounds)


def rope_write_kv_combined(query, key, value, kv_cache, slots, positions, cos_sin_cache,
                           key_scale, value_scale, query_scale=None, query_out=None,
                           key_out=None, *, rope_style="neox", rotary_dim=None, layout="NHD",
                           fp8_format=None, key_scale_cache=None, value_scale_cache=None,
                           scale_rounding="exact", exact=None, launch=True, check_bounds=False):
    """:func:`rope_write_kv` into one combined ``kv_cache``."""
    return _rope_write("rope_write_combined", (query, key, value, kv_cache, slots, positions,
                                               cos_sin_cache, key_scale, value_scale,
                                               query_scale, key_scale_cache, value_scale_cache,
                                               key_out),
                       query_out, rope_style, rotary_dim, layout, fp8_format, scale_rounding,
                       exact, launch, check_bounds)
