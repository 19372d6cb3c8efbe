"""Host-cost savings for repeated eager calls, each on an internal that has no public API.

* :class:`LastCall`: a repeat of an op's last signature is recognised by one of torch's tensor
  guards (``torch._C._dynamo.guards.TensorGuards``: dtype, device, sizes, strides and more of every
  tensor, checked in C) instead of a metadata key built in Python (~6 us for 7 tensors on an H200
  host), and its tensors' pointers go straight into the kernel's arguments.
* :func:`direct_launcher`: Triton's compiled launcher called as Triton's own runner
  (``CompiledKernel[grid]``) calls it, without the runner's per-call Python (current stream,
  launch metadata and empty hook chains: ~3-4 us); on Triton 3.6, whose launcher source is pinned
  here, its C launch function itself (~1.3 us more).

Each is used only where a check made here passes -- a self-test of the guards on this torch, the
source of this Triton's runner making exactly the call made here, the launcher's source being the
pinned one -- and otherwise the frontend keeps its public path (a metadata key per call, Triton's
runner), which is correct, just slower. ``bench/NOTES.md`` items 21-22 have the numbers.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import operator

import torch


@functools.cache
def _tensor_guard():
    """``(make, check)`` of torch's TensorGuards over a list of distinct tensors, if they behave
    here as :class:`LastCall` relies on; else None."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def make(tensors):
            return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                dynamic_dims_strides=[list(t.stride()) for t in tensors])

        a, b = torch.zeros(4, 6), torch.zeros(3, dtype=torch.int32)
        guard, check = make([a, b]), TensorGuards.check
        same = (check(guard, a, b), check(guard, torch.ones(4, 6), b),
                check(guard, a, torch.ones(3, dtype=torch.int32)))
        # Each differs in one property: shape, strides, strides, dtype, device.
        changed = (check(guard, torch.zeros(4, 5), b), check(guard, torch.zeros(6, 4).t(), b),
                   check(guard, a, torch.zeros(6, dtype=torch.int32)[::2]),
                   check(guard, a, torch.zeros(3, dtype=torch.int64)),
                   check(guard, a, b.to("meta")))
        ok = all(s is True for s in same) and not any(changed)
        return (make, check) if ok else None
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


_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


class LastCall:
    """One op's last ready call, matched before any key is built.

    A call matches when it has the same options, argument types and non-tensor arguments (a host
    scale, None, "inline"); its tensors pass one guard made of the last call's (dtype, device,
    sizes, strides, ...; the guard also requires them to be distinct objects); a tensor passed at
    several places last time is passed at the same places again; the current device is still
    the tensors' device; and every tensor is 16-byte aligned (the compiled kernel depends on it;
    a call with a misaligned tensor never becomes a LastCall). Its launch then takes the
    tensors' pointers straight into the kernel's arguments: which operand reads which argument
    was worked out once, from the op's own operand list.
    """

    __slots__ = ("options", "types", "others_of", "others", "tensors_of", "alias_of", "source_of",
                 "guard", "check", "device", "pointers", "new_of", "launch", "new_outputs")

    @classmethod
    def make(cls, args: tuple, options, ready, operands_of, new_outputs=()) -> "LastCall | None":
        """``operands_of(args, outs)``: the op's kernel operands (``ready``'s order) from its
        arguments; ``outs`` is None, or for an op that allocates its outputs on each call the
        new outputs (``new_outputs``: which of them exist, e.g. no value output for a combined
        cache)."""
        guard = _tensor_guard()
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if guard is None or not tensors or _misaligned(tensors):
            return None
        first, distinct, aliases = {}, [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                j = first.setdefault(id(a), i)
                (distinct if j == i else aliases).append((i, j))
        # Stand-ins, one per distinct tensor, find each operand's place among the values a call
        # passes: its distinct tensors' values, then its new outputs'.
        stand = list(args)
        for i, _ in distinct:
            stand[i] = torch.empty(0)
        for i, j in aliases:
            stand[i] = stand[j]
        outs = tuple(torch.empty(0) if exists else None for exists in new_outputs) or None
        places = [stand[i] for i, _ in distinct] + [o for o in outs or () if o is not None]
        positions = [next(k for k, p in enumerate(places) if p is op)
                     for op in operands_of(tuple(stand), outs)]
        last = cls()
        last.options, last.types = options, tuple(map(type, args))
        last.new_outputs = ready.new_outputs
        last.others_of = _getter([i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)])
        last.others = last.others_of(args)
        last.tensors_of = _getter([i for i, _ in distinct])
        last.alias_of = _getter([i for i, _ in aliases]) if aliases else None
        last.source_of = _getter([j for _, j in aliases])
        make, last.check = guard
        last.guard = make([args[i] for i, _ in distinct])
        last.device = tensors[0].get_device() if tensors[0].is_cuda else None
        last.pointers = ready.pointers
        last.new_of = _getter([k for k, o in enumerate(outs or ()) if o is not None])
        select, consts, runner = ready.selector(positions, len(places)), ready.consts, ready.runner
        last.launch = lambda values: runner(*select(values + consts))
        return last

    def match(self, args: tuple, options):
        """The values to launch with (pointers on CUDA, the tensors under the interpreter) if
        ``args`` is a repeat of this call's signature; else None."""
        if (options != self.options or tuple(map(type, args)) != self.types
                or self.others_of(args) != self.others):
            return None
        tensors = self.tensors_of(args)
        if not self.check(self.guard, *tensors) or (
                self.alias_of is not None
                and not all(map(operator.is_, self.alias_of(args), self.source_of(args)))) or (
                self.device is not None and _current_device() != self.device):
            return None
        pointers = tuple(map(torch.Tensor.data_ptr, tensors))
        if functools.reduce(operator.or_, pointers) & 15:
            return None
        return pointers if self.pointers else tensors

    def new_values(self, outs: tuple) -> tuple:
        """The values of an allocating call's new outputs, to append to :meth:`match`'s."""
        outs = self.new_of(outs)
        return tuple(map(torch.Tensor.data_ptr, outs)) if self.pointers else outs


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


# Triton 3.6's CudaLauncher.__call__ (whitespace-normalized source): it allocates the kernel's
# global and profile scratch buffers where the kernel has them, then calls the launcher's C
# function with the grid, stream, kernel, two launch flags and the two buffers. Where the
# installed Triton's launcher is exactly this and the kernel has no scratch, direct_launcher
# makes that C call itself (another Triton's launcher is called as its runner calls it).
_LAUNCHER_SHA256 = "b5e4d84a36af22efc4017e23f5873393dc885ae5ca6077a545182aa971d8d324"


@functools.cache
def _launcher_matches(launcher_class) -> bool:
    try:
        source = " ".join(inspect.getsource(launcher_class.__call__).split())
    except Exception:
        return False
    return hashlib.sha256(source.encode()).hexdigest() == _LAUNCHER_SHA256


def _c_launch(run):
    """``run``'s C launch function and its two launch flags, where calling that function is all
    that ``run`` would do for this kernel (the pinned source, no scratch buffers); else None."""
    if (not _launcher_matches(type(run)) or getattr(run, "global_scratch_size", 1)
            or getattr(run, "profile_scratch_size", 1)):
        return None
    return run.launch, run.launch_cooperative_grid, run.launch_pdl


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
    c_function, cooperative, pdl = _c_launch(run) or (None, None, None)

    def launch(*args):
        if (enter.calls or exit_.calls or runtime.launch_enter_hook is not enter
                or runtime.launch_exit_hook is not exit_):
            return runner(*args)   # hooks get their launch metadata from Triton's runner
        if c_function is None:
            run(g0, g1, g2, stream(), function, metadata, None, None, None, *args)
        else:
            c_function(g0, g1, g2, stream(), function, cooperative, pdl, None, None, metadata,
                       None, None, None, *args)
    return launch
