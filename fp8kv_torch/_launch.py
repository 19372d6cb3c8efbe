"""torch tensors -> core validation -> core plan and operand map -> launch. No decisions here.

Each op takes its arguments by their public names, as the op table (:mod:`fp8kv.optable`)
declares them, and launches on its arrays in one fixed order derived from it (:func:`_order`);
the core's operand map (:mod:`fp8kv.operands`) says which of them each kernel pointer takes, so
this module never says which array is read, written or aliased. One function, :func:`run`,
serves every op.

Each op keeps its launch ready per call signature (:class:`_ReadyLaunch`), under a key of all
that validation and the plan read, so a call that fails validation is never cached and fails the
same way every time; a repeat of an op's last signature is recognised before the key is built
(:mod:`fp8kv_torch._fast`, off with ``FP8KV_FAST=0``).
"""
from __future__ import annotations

import functools
import inspect
import operator

import torch

from fp8kv import ops
from fp8kv.arrays import ArrayInfo
from fp8kv.binding import bind, BoundCall
from fp8kv.dequantize import plan_dequantize
from fp8kv.optable import OPS, TORCH, Role
from fp8kv.plan import CUDA, INTERPRET, LaunchPlan
from fp8kv.rope_write import plan_rope_write
from fp8kv.validate import check_out, frontend_args
from fp8kv.write import plan_write

from . import _fast
from ._fast import getter


def _order(op) -> tuple[str, ...]:
    """The op's arrays in launch order: its array arguments, then the outputs a call may only be
    given, then those it makes where none is given (an allocating call leaves them out)."""
    arrays = [a for a in op.public(TORCH) if a.array and a.role is not Role.OUTPUT]
    given = [a for a in op.public(TORCH) if a.role is Role.OUTPUT and not a.made and not a.parts]
    return tuple(a.name for a in arrays + given) + _made(op)


def _made(op) -> tuple[str, ...]:
    """The outputs a torch call makes where it is given none (``out=``'s, or its own)."""
    return tuple(a.name for a in op.args if a.made and (TORCH in a.frontends or not a.frontends))


class _Spec:
    """How one op's launcher reads a call, derived once from the op table (no per-call work but
    C-level getters): its arrays in launch order, the outputs it makes, its options."""

    def __init__(self, op):
        self.names = _order(op)
        self.made = _made(op)
        holders = [a for a in op.public(TORCH) if a.parts]
        self.holder = holders[0].name if holders else ""   # out=: the made outputs as one tuple
        self.inputs = self.names[:len(self.names) - len(self.made)]
        self.args_of = getter(self.inputs)
        self.options = op.options(TORCH)
        self.options_of = getter(self.options)
        last = len(self.made) - 1
        self.labels = {n: f"{self.holder}[{-1 if i == last else i}]"
                       for i, n in enumerate(self.made)}

    def given(self, named: dict):
        """The call's made outputs as given (a tuple), or None to make them."""
        out = named[self.holder or self.made[0]] if self.made else None
        if out is None:
            return None
        return tuple(out) if self.holder else (out,)

    def result(self, outs):
        """What the torch function returns: ``out=``'s tuple, its one output, or None."""
        return outs if self.holder or outs is None else outs[0]


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


def validate(entry, named: dict):
    """The op's validated call (``named``: its arguments by name), bounds-checked on the host with
    ``check_bounds``. A given ``out`` is checked afterwards, against what the call makes."""
    options = {n: dtype_name(named[n]) if n == "dtype" else named[n] for n in entry.options(TORCH)}
    valid = entry.check(**frontend_args(
        info, torch.Tensor, {n: named[n] for n in entry.required(TORCH)},
        {n: named[n] for n in entry.optional(TORCH) if n != "out"}), **options)
    if named["check_bounds"]:
        entry.bounds(valid, lambda n: host_values(named[n], n)
                     if isinstance(named[n], torch.Tensor) else named[n])
    return valid


def _backend(t: torch.Tensor, name: str) -> str:
    if t.device.type == "cuda":
        return CUDA
    if t.device.type == "cpu":
        return INTERPRET
    raise ValueError(f"{name}: expected a CUDA or CPU tensor, got device {t.device}")


def typed(values: tuple) -> tuple:
    """``values`` with each one's type: ``True``, ``1`` and ``1.0`` hash and compare alike, and a
    call with one of them must not find the launch a call with another made."""
    return tuple(zip(map(type, values), values))


class _ReadyLaunch:
    """A kernel bound to its grid, scalars and constexprs: one launch per call. ``runner``: on
    CUDA the compiled kernel's launcher (taking pointers as ints), under the interpreter the
    interpreted kernel; ``positions``: which of the call's values (its arguments, then an
    allocating call's new outputs) each kernel array takes."""

    __slots__ = ("runner", "pointers", "positions", "gather", "scalars", "consts", "select",
                 "new_outputs", "inputs")

    def __init__(self, kernel, launched, call: BoundCall, plan: LaunchPlan, backend: str,
                 positions: tuple, device: torch.device, new_outputs=None):
        self.new_outputs = new_outputs  # an allocating call's maker of them
        self.positions = positions
        self.gather = operator.itemgetter(*positions)
        self.inputs = len(call.inputs)
        self.scalars = len(call.scalars)
        self.consts = (*call.scalars, *call.constexprs.values())
        # Pointers as ints on CUDA: Triton's launcher then neither calls each tensor's data_ptr
        # nor asks the driver about each pointer (a host cost per tensor).
        self.pointers = backend == CUDA
        if self.pointers:
            grid = plan.grid + (1,) * (3 - len(plan.grid))
            self.runner = _fast.direct_launcher(launched, grid, device.index) or launched[grid]
        else:
            self.runner = functools.partial(ops.kernel_for(kernel, True)[plan.grid],
                                            num_warps=plan.num_warps)
        self.select = self.selector(range(len(positions)), len(positions))

    def selector(self, places, count: int):
        """A C-level getter: ``values + consts -> the kernel's arguments`` (inputs, scalars,
        outputs, constexprs), for ``values`` of ``count`` items with kernel array ``i`` at
        ``places[i]``."""
        places, consts = list(places), [count + j for j in range(len(self.consts))]
        order = (places[:self.inputs] + consts[:self.scalars] + places[self.inputs:]
                 + consts[self.scalars:])
        return operator.itemgetter(*order)

    def launch(self, values: tuple) -> None:
        """Launch on the call's values (on the planned device, as validation or the key ensured)."""
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
    for planner in (plan_write, plan_dequantize, plan_rope_write):
        planner.cache_clear()
    _READY.clear()
    _LAST.clear()
    _PREVIOUS_KEY.clear()
    from . import _attention   # imported here: it imports this module
    _attention.clear()


def _cached_launch(op: str, args: tuple, options: tuple):
    """Serve a call from the op's LastCall or a ready launch: ``(True, outputs or None)``; else
    ``(False, key)``, the key to keep its validated launch under (None where none may serve it:
    tensors off the current CUDA device, or arguments of a wrong kind)."""
    last = _LAST.get(op)
    if last is not None and (values := last.match(args, options)) is not None:
        outs = last.new_outputs() if last.new_outputs is not None else None
        last.launch(values + last.new_values(outs) if outs else values)
        return True, outs
    first = args[0]
    if not isinstance(first, torch.Tensor) or (
            first.is_cuda and first.get_device() != torch.cuda.current_device()):
        return False, None
    # Per tensor: what validation and the plan read of it; anything else (None, a host scale,
    # "inline") with its type -- its value is part of the plan.
    key = (op, options, *[(t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15 == 0)
                          if isinstance(t, torch.Tensor) else (type(t), t) for t in args])
    try:
        ready = _READY.get(key)
    except TypeError:  # unhashable: not a tensor or a number
        return False, None
    if ready is None:
        return False, key
    # A key that came twice in a row makes its launch the op's LastCall (which costs more to make
    # than a key: calls that alternate between signatures keep the key path alone).
    if _fast.ENABLED and _PREVIOUS_KEY.get(op) != key:
        _PREVIOUS_KEY[op] = key
    elif _fast.ENABLED:
        new_count = 0 if ready.new_outputs is None else len(SPECS[op].made)
        last = _fast.LastCall.make(args, options, ready, new_count)
        if last is None:
            _LAST.pop(op, None)
        else:
            _LAST[op] = last
    outs = ready.new_outputs() if ready.new_outputs is not None else None
    ready.launch(args + (outs or ()))
    return True, outs


def _launch(kernel, plan: LaunchPlan, backend: str, device: torch.device, operands,
            names: tuple, values: tuple, ready_key=None, new_outputs=None) -> None:
    """Launch through Triton's own entry point on ``values`` (the op's arguments, ``names``, then
    an allocating call's new outputs); keep it ready under ``ready_key``."""
    # Which value each kernel array takes, in the kernel's order; an output the plan never
    # writes takes the first input's tensor (a pointer, never dereferenced).
    inputs = [names.index(o.source) for o in operands.inputs]
    positions = tuple(inputs + [names.index(o.source) if o.source is not None else inputs[0]
                                for o in operands.outputs])
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


SPECS = {name: _Spec(op) for name, op in OPS.items()}


def call(op: str, *args, exact=None, launch=True, **kwargs):
    """``op`` called with its public function's arguments (and defaults), plus ``exact`` and
    ``launch`` as :func:`run` takes them: for tests and benchmarks."""
    import fp8kv_torch

    params = inspect.signature(getattr(fp8kv_torch, op)).parameters
    named = {name: p.default for name, p in params.items()}
    named.update(zip(params, args))
    named.update(kwargs, exact=exact, launch=launch)
    return run(op, named)


def run(op: str, named: dict):
    """Validate, plan and launch one call of ``op``; returns what its torch function returns.

    ``named``: the call's arguments by name -- a public function's, those of a launcher below
    (``exact`` forces the exact (True) or hardware (False) conversions; ``launch=False`` only
    validates and makes the outputs: the fake implementation of the custom op)."""
    if OPS[op].workspace:   # several kernels and their scratch arrays: a launcher of its own
        from . import _attention
        return _attention.run(op, named)
    spec = SPECS[op]
    launch, exact = named.get("launch", True), named.get("exact")
    # (torch.compile traces a launch=False call, and cannot trace an itemgetter.)
    args = spec.args_of(named) if launch else tuple(named[n] for n in spec.inputs)
    outs = spec.given(named)
    allocating = outs is None and bool(spec.made)
    ready_key = None
    if launch and exact is None and not named["check_bounds"]:
        options = spec.options_of(named)
        served, result = _cached_launch(op, args + outs if outs else args,
                                        typed(options + (allocating,) if spec.made else options))
        if served:
            return spec.result(outs or result)
        ready_key = result
    entry = OPS[op]
    valid = validate(entry, named)
    first = args[0]
    made = entry.made(valid) if spec.made else {}
    new_outputs = None
    if allocating:
        shapes = tuple((tuple(made[n][0]), getattr(torch, made[n][1])) for n in spec.made)
        new_outputs = (_new_outputs(shapes, first.device) if launch
                       else _output_maker(shapes, first.device, templates=False))
        outs = new_outputs()
    out_info = {}
    if spec.holder:   # out=: each output as the call would make it
        for name, out in zip(spec.made, outs):
            label = spec.labels[name]
            out_info[name] = info(out, label)
            shape, dtype = made[name]
            check_out(out_info[name], label, shape, (dtype,), str(first.device))
            if entry.arg(name).contiguous and not out.is_contiguous():
                raise ValueError(f"{label}: expected a contiguous {entry.arg(name).result}")
    backend = _backend(first, spec.names[0])
    if not launch:   # the custom op's fake: validation (and the outputs) only
        return spec.result(outs)
    values = args + (outs or ())
    # The ready key holds each tensor's 16-byte alignment, so the plan serves such calls only.
    aligned = not _fast.misaligned([v for v in values if isinstance(v, torch.Tensor)])
    plan = entry.plan(valid, out_info, backend, exact, aligned)
    if not plan.empty:
        _launch(getattr(ops, plan.kernel), plan, backend, first.device, entry.operands(valid),
                spec.names, values, ready_key, new_outputs)
    return spec.result(outs)


@functools.cache
def _one_element(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty((), dtype=dtype, device=device)


def _empty_maker(shape: tuple, dtype: torch.dtype, device: torch.device, template: bool = True):
    """``() -> a new contiguous tensor`` of ``shape``, ``dtype`` on ``device``: ``torch.empty_like``
    of one element expanded to ``shape`` (fewer arguments to parse than ``torch.empty``'s) where
    it makes what ``torch.empty`` makes (checked once per signature), else ``torch.empty``."""
    plain = functools.partial(torch.empty, shape, dtype=dtype, device=device)
    if not template:
        return plain
    expanded = _one_element(dtype, device).expand(shape)
    if _layout_of(torch.empty_like(expanded)) == _layout_of(plain()):
        return functools.partial(torch.empty_like, expanded)
    return plain


def _layout_of(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device, t.requires_grad


def _output_maker(outputs: tuple, device: torch.device, templates: bool = True):
    """``() -> new tensors``, one per ``(shape, dtype)`` of ``outputs`` (in launch order), as a
    tuple display (the least per-call work). ``templates=False``: plain ``torch.empty`` (while
    torch.compile traces with fake tensors, none of which may be kept)."""
    makers = [_empty_maker(shape, dtype, device, templates) for shape, dtype in outputs]
    if len(makers) == 1:
        (a,) = makers
        return lambda: (a(),)
    if len(makers) == 2:
        a, b = makers
        return lambda: (a(), b())
    a, b, c = makers
    return lambda: (a(), b(), c())


# Per signature; bounded like _READY, whose launches keep theirs.
_new_outputs = functools.lru_cache(maxsize=256)(_output_maker)
