"""The torch side of :mod:`fp8kv.spelling`: torch dtypes and the core's dtype names."""
from __future__ import annotations

import torch

from fp8kv.spelling import OUTPUT_DTYPES, output_dtype_name

# Each allowed spelling of an output dtype (the torch.dtype and its name) -> the torch.dtype.
_OUTPUT_DTYPES = {spelling: getattr(torch, name) for name in OUTPUT_DTYPES
                  for spelling in (name, getattr(torch, name))}


def _torch_name(dtype) -> str | None:
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None


def output_dtype(dtype) -> torch.dtype:
    """``torch.bfloat16`` or ``"bfloat16"`` (and so on) -> ``torch.bfloat16``; anything else is
    the core's ``TypeError``, which lists the allowed values."""
    try:
        return _OUTPUT_DTYPES[dtype]
    except (KeyError, TypeError):   # TypeError: not hashable
        return getattr(torch, output_dtype_name(dtype, _torch_name))
