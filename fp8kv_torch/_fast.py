"""Host-cost savings for repeated eager calls, each on an internal that has no public API.

* :class:`LastCall`: a repeat of an op's last signature is recognised by torch's tensor guards
  (``torch._C._dynamo.guards.TensorGuards``, checked in C) instead of a metadata key built in
  Python, and its tensors' pointers go straight into the kernel's arguments.
* :func:`direct_launcher`: Triton's compiled launcher called as Triton's own runner
  (``CompiledKernel[grid]``) calls it, without the runner's per-call Python; on Triton 3.6, whose
  launcher source is pinned here, its C launch function itself.

Each is used only where a check made here passes (a self-test of the guards, the source of
Triton's runner and launcher); otherwise the public path serves (the same bytes, the same errors,
just slower), and the failed check warns once per process (:class:`FastPathWarning`).
``FP8KV_FAST=0`` in the environment (read at import) turns both off.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import operator
import os
import warnings

import torch

ENABLED = os.environ.get("FP8KV_FAST", "1").strip().lower() not in ("0", "false", "off", "no")


class FastPathWarning(UserWarning):
    """A check of a private torch / Triton interface failed: calls take the public path."""


_WARNED: set = set()


def warn_fallback(check: str, why: str) -> None:
    """Say once per process that ``check`` failed and the public path serves instead."""
    if check in _WARNED:
        return
    _WARNED.add(check)
    warnings.warn(f"fp8kv: fast-path check {check!r} failed ({why}); repeated calls take the "
                  "public path (correct, a few microseconds slower). FP8KV_FAST=0 turns the fast "
                  "path off.", FastPathWarning, stacklevel=3)


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
        why = "their self-test gave other answers"
    except Exception as e:  # not there, or another signature: the public path serves
        ok, why = False, f"{type(e).__name__}: {e}"
    if not ok:
        warn_fallback("torch_tensor_guards", f"torch {torch.__version__}'s TensorGuards: {why}")
        return None
    return make, check


def getter(indices):
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

    A call matches with the same options, argument types and non-tensor arguments; its distinct
    tensors passing one guard made of the last call's; a tensor passed at several places last
    time passed at the same places again; the same current device; and every tensor 16-byte
    aligned (the compiled kernel depends on it).
    """

    __slots__ = ("options", "types", "others_of", "others", "tensors_of", "alias_of", "source_of",
                 "guard", "check", "device", "pointers", "launch", "new_outputs")

    @classmethod
    def make(cls, args: tuple, options, ready, new_count: int = 0) -> "LastCall | None":
        """A LastCall of ``ready`` (a ``_ReadyLaunch``) for a call of ``args``, then ``new_count``
        new outputs where the op allocates them on each call."""
        guard = _tensor_guard()
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if guard is None or not tensors or misaligned(tensors):
            return None
        first, distinct, aliases = {}, [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                j = first.setdefault(id(a), i)
                (distinct if j == i else aliases).append((i, j))
        # Each kernel array's place among the values a matched call passes: its distinct
        # tensors' values, then its new outputs'.
        slot_of = {i: k for k, (i, _) in enumerate(distinct)}
        places = [slot_of[first[id(args[p])]] if p < len(args) else len(distinct) + p - len(args)
                  for p in ready.positions]
        last = cls()
        last.options, last.types = options, tuple(map(type, args))
        last.new_outputs = ready.new_outputs
        last.others_of = getter([i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)])
        last.others = last.others_of(args)
        last.tensors_of = getter([i for i, _ in distinct])
        last.alias_of = getter([i for i, _ in aliases]) if aliases else None
        last.source_of = getter([j for _, j in aliases])
        make, last.check = guard
        last.guard = make([args[i] for i, _ in distinct])
        last.device = tensors[0].get_device() if tensors[0].is_cuda else None
        last.pointers = ready.pointers
        select = ready.selector(places, len(distinct) + new_count)
        consts, runner = ready.consts, ready.runner
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
        return tuple(map(torch.Tensor.data_ptr, outs)) if self.pointers else outs


def misaligned(tensors) -> bool:
    """Whether any of ``tensors`` starts off a multiple of 16 bytes."""
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
# scratch buffers where it has them, then calls the launcher's C function. Where the installed
# launcher is exactly this and the kernel has no scratch, direct_launcher makes that call itself.
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
    if not _launcher_matches(type(run)):
        import triton
        warn_fallback("triton_c_launcher", f"Triton {triton.__version__}'s launcher is not the "
                      "pinned 3.6 source; its launcher object is called instead")
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    return run.launch, run.launch_cooperative_grid, run.launch_pdl


def direct_launcher(compiled, grid: tuple, device_index: int):
    """``launch(*args)`` for a compiled kernel on ``device_index``, or None where the check
    fails. While a launch hook is registered (a profiler), it goes through Triton's runner."""
    if not ENABLED:
        return None
    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # Triton's own getter
    if raw_stream is None or not _runner_matches(type(compiled)):
        import triton
        warn_fallback("triton_runner", f"torch {torch.__version__} / Triton {triton.__version__}: "
                      "no raw-stream getter, or the compiled kernel's runner makes another call")
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
