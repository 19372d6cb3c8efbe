"""torch: ``paged_attention``'s launches -- its two kernels and their fp32 workspace.

This op's plan (:func:`fp8kv.attention.plan_attention`) has a second kernel where a call splits
its tokens, and the partials they hand each other, so :func:`fp8kv_torch._launch.run` hands its
calls here. Its launches are kept ready per signature as the other ops' are (everything the checks
and the plan read is in the key; a call that fails validation is never kept).
"""
from __future__ import annotations

import torch

from fp8kv import ops
from fp8kv.attention import attention_operands, check_out, merge_operands, plan_attention
from fp8kv.binding import bind
from fp8kv.optable import OPS
from fp8kv.plan import INTERPRET

from ._launch import _backend, info, typed, validate

_READY: dict = {}
_READY_LIMIT = 1024


class _Ready:
    """One signature's validated call, plan and bound kernels."""

    __slots__ = ("args", "plan", "launches")

    def __init__(self, args, plan, backend: str):
        self.args, self.plan = args, plan
        self.launches = []
        for kernel_plan, operands in ((plan.attention, attention_operands(args, plan)),
                                      (plan.merge, merge_operands(args, plan))):
            if kernel_plan is not None:
                kernel = getattr(ops, kernel_plan.kernel)
                launcher = ops.kernel_for(kernel, backend == INTERPRET)[kernel_plan.grid]
                self.launches.append((launcher, kernel, kernel_plan, operands))

    def run(self, given: dict) -> None:
        for launcher, kernel, kernel_plan, operands in self.launches:
            call = bind(kernel, kernel_plan, {o.param: given[o.source] for o in operands.params})
            pdl = dict(launch_pdl=True) if kernel_plan.launch_pdl else {}
            launcher(*call.args, num_warps=kernel_plan.num_warps,
                     enable_fp_fusion=kernel_plan.enable_fp_fusion, **pdl, **call.constexprs)


def run(op: str, named: dict):
    """One call of ``op`` (``paged_attention`` or its combined form): validate, plan, launch;
    returns ``out``. ``named`` as :func:`fp8kv_torch._launch.run` takes it."""
    entry = OPS[op]
    launch, exact = named.get("launch", True), named.get("exact")
    names = tuple(a.name for a in entry.public("torch") if a.name not in ("check_bounds", "out"))
    out = named.get("out")
    key = ready = None
    if launch and not named["check_bounds"]:
        try:
            key = (op, *[(t.shape, t.stride(), t.dtype, t.get_device())
                         if isinstance(t, torch.Tensor) else (type(t), t)
                         for t in (named[n] for n in names)], *typed((exact,)))
            ready = _READY.get(key)
        except TypeError:   # unhashable: validation says what is wrong
            key = None
    args = validate(entry, named) if ready is None else ready.args
    query = named["query"]
    if out is not None:
        check_out(info(out, "out"), args)
    else:
        out = torch.empty(args.out_shape, dtype=query.dtype, device=query.device)
    if not launch:   # the custom op's fake: validation and the output only
        return out
    if ready is None:
        backend = _backend(query, "query")
        ready = _Ready(args, plan_attention(args, backend, exact), backend)
        if key is not None:
            if len(_READY) >= _READY_LIMIT:
                _READY.clear()
            _READY[key] = ready
    plan = ready.plan
    if plan.empty:
        return out
    workspace = {n: torch.empty(getattr(plan, n), dtype=torch.float32, device=query.device)
                 for n in entry.workspace}
    given = dict(named, out=out, **workspace)
    if query.is_cuda and query.device.index != torch.cuda.current_device():
        with torch.cuda.device(query.device):
            ready.run(given)
    else:
        ready.run(given)
    return out


def clear() -> None:
    """Forget the ready launches and plans (after changing the plans' size tables)."""
    _READY.clear()
    plan_attention.cache_clear()
