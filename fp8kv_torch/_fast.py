"""Two host-cost savings for repeated eager calls, each on an internal that has no public API.

* :class:`LastCall`: the signature of an op's last call, checked in C by torch's tensor guards
  (``torch._C._dynamo.guards.TensorGuards``: dtype, device, sizes, strides and more of every
  tensor) instead of a metadata key built in Python (~6 us for 7 tensors on an H200 host).
* :func:`direct_launcher`: Triton's compiled launcher called as Triton's own runner
  (``CompiledKernel[grid]``) calls it, without the runner's per-call Python (current stream,
  launch metadata and empty hook chains: ~3-4 us).

Each is used only where a check made here passes -- a self-test of the guards on this torch, and
the source of this Triton's runner making exactly the call made here -- and otherwise the
frontend keeps its public path (a metadata key per call, Triton's runner), which is correct,
just slower. ``bench/NOTES.md`` item 21 has the numbers.
"""
from __future__ import annotations

import functools
import inspect
import operator

import torch


@functools.cache
def _tensor_guard():
    """``(make, check)`` of torch's TensorGuards for one tensor each (a guard of several fails
    when one tensor is passed twice, as a shared scale is), if they behave here as
    :class:`LastCall` relies on; else None."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def make(t):
            return TensorGuards(t, dynamic_dims_sizes=[list(t.shape)],
                                dynamic_dims_strides=[list(t.stride())])

        a, b = torch.zeros(4, 6), torch.zeros(3, dtype=torch.int32)
        ga, gb = make(a), make(b)
        same = (ga.check(a), ga.check(torch.ones(4, 6)), gb.check(torch.ones(3, dtype=torch.int32)))
        # Each differs in one property: shape, strides, strides, dtype, device.
        changed = (ga.check(torch.zeros(4, 5)), ga.check(torch.zeros(6, 4).t()),
                   gb.check(torch.zeros(6, dtype=torch.int32)[::2]),
                   gb.check(torch.zeros(3, dtype=torch.int64)), gb.check(b.to("meta")))
        ok = all(s is True for s in same) and not any(changed)
        return (make, TensorGuards.check) if ok else None
    except Exception:  # not there, or another signature: the public path serves
        return None


def _getter(indices):
    """``args -> tuple of args[i]`` for these indices (itemgetter's result is always a tuple)."""
    if not indices:
        return lambda args: ()
    if len(indices) == 1:
        (i,) = indices
        return lambda args: (args[i],)
    return operator.itemgetter(*indices)


class LastCall:
    """One op's last ready call, matched before any key is built: the same options, argument
    types and non-tensor arguments (a host scale, None, "inline"), tensors accepted by a guard
    made of the last call's (dtype, device, sizes, strides, ...), and every tensor 16-byte
    aligned -- a call with one that is not never becomes a LastCall: the compiled kernel depends
    on each pointer's alignment."""

    __slots__ = ("options", "types", "others_of", "others", "tensors_of", "guards", "check",
                 "ready")

    @classmethod
    def make(cls, args: tuple, options, ready) -> "LastCall | None":
        guard = _tensor_guard()
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        tensors = [args[i] for i in positions]
        if guard is None or not tensors or _misaligned(tensors):
            return None
        last = cls()
        last.options, last.types, last.ready = options, tuple(map(type, args)), ready
        last.tensors_of = _getter(positions)
        last.others_of = _getter([i for i in range(len(args)) if i not in positions])
        last.others = last.others_of(args)
        make, last.check = guard
        last.guards = tuple(map(make, tensors))
        return last

    def matches(self, args: tuple, options) -> bool:
        if options != self.options or tuple(map(type, args)) != self.types:
            return False
        tensors = self.tensors_of(args)
        return (self.others_of(args) == self.others and all(map(self.check, self.guards, tensors))
                and not _misaligned(tensors))


def _misaligned(tensors) -> bool:
    return bool(functools.reduce(operator.or_, map(torch.Tensor.data_ptr, tensors), 0) & 15)


# What Triton's own runner (CompiledKernel.__getitem__) must call for direct_launcher to call
# the same: the grid, the stream, the kernel, its metadata, launch metadata and the two hook
# chains, then the arguments (Triton 3.6-3.9).
_RUNNER_CALL = ("self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, "
                "launch_metadata,")


@functools.cache
def _runner_matches(compiled_class) -> bool:
    try:
        source = " ".join(inspect.getsource(compiled_class.__getitem__).split())
        from triton import knobs
        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except Exception:
        return False
    return _RUNNER_CALL in source and all(isinstance(getattr(h, "calls", None), list)
                                          for h in hooks)


def direct_launcher(compiled, grid: tuple, device_index: int):
    """``launch(*args)`` for a compiled kernel on ``device_index``, or None where the check
    fails. While a launch hook is registered (a profiler), it goes through Triton's runner."""
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # Triton's own getter
    if raw_stream is None or not _runner_matches(type(compiled)):
        return None
    from triton import knobs

    runner = compiled[grid]   # also loads the kernel (the runner's _init_handles)
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    runtime = knobs.runtime
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    stream = functools.partial(raw_stream, device_index)
    g0, g1, g2 = grid

    def launch(*args):
        if (enter.calls or exit_.calls or runtime.launch_enter_hook is not enter
                or runtime.launch_exit_hook is not exit_):
            return runner(*args)   # hooks get their launch metadata from Triton's runner
        run(g0, g1, g2, stream(), function, metadata, None, None, None, *args)
    return launch
