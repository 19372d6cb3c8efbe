"""Triton kernels, one op per module; see :func:`fp8kv.ops._dual.kernel_for` for the CPU twin.

Which kernel a call launches is its plan's ``kernel`` (:class:`fp8kv.plan.LaunchPlan`), a name
that this package resolves from whichever of its modules defines it: a new kernel's module needs
no entry here.
"""
import importlib
import pkgutil

from ._dual import interpreted, kernel_for

__all__ = ["kernel_for", "interpreted"]


def __getattr__(name: str):
    if name.startswith("_") and name.endswith("_kernel"):
        for module in pkgutil.iter_modules(__path__):
            found = vars(importlib.import_module(f"{__name__}.{module.name}")).get(name)
            if found is not None:
                globals()[name] = found
                return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
