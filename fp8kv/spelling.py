"""One set of spellings for both frontends: the options that are not arrays.

``fp8kv_torch`` and ``fp8kv_jax`` take the same option values and reject the others with the same
``TypeError``, raised before anything is launched or written:

* a flag (``check_bounds``) is a ``bool``: ``"yes"``, ``1`` or ``None`` are errors, not truthy;
* an output dtype is one of :data:`OUTPUT_DTYPES` as a string, or the framework's own dtype object
  of one (``torch.bfloat16``; ``jnp.bfloat16`` or a NumPy dtype). The frontend tells the core what
  name its object has; the core decides what is allowed and words the error.

No torch, no jax.
"""
from __future__ import annotations

from typing import Callable

# The output dtypes of a dequantize, by the names the core uses (and accepts as strings); each
# format says which of them its caches take (fp8kv.formats.Format.out_dtypes).
from .formats import OUTPUT_DTYPES


def check_flag(value, name: str) -> bool:
    """``value`` if it is a ``bool``; otherwise ``TypeError: <name>: expected a bool, got <type>``.

    >>> check_flag(True, "check_bounds")
    True
    >>> check_flag("yes", "check_bounds")
    Traceback (most recent call last):
    ...
    TypeError: check_bounds: expected a bool, got str ('yes')
    """
    if value is True or value is False:
        return value
    raise TypeError(f"{name}: expected a bool, got {type(value).__name__} ({value!r})")


def dtype_error(value, name: str = "dtype", allowed: tuple = OUTPUT_DTYPES) -> TypeError:
    """The error for an output dtype that is none of ``allowed``, the same in both frontends."""
    names = ", ".join(repr(a) for a in allowed)
    return TypeError(f"{name}: expected one of {names} (a string, or the framework's dtype of "
                     f"one), got {value!r}")


def output_dtype_name(value, framework_name: Callable[[object], str | None],
                      name: str = "dtype") -> str:
    """The core's name (one of :data:`OUTPUT_DTYPES`) of an output dtype however it is spelled.

    ``value`` is a string, or a framework dtype object that ``framework_name`` names (it returns
    the object's name, such as ``"bfloat16"``, or None for anything that is not a dtype of its
    framework). Anything else, and any name outside :data:`OUTPUT_DTYPES`, is a ``TypeError``
    that lists what is allowed.

    >>> output_dtype_name("float16", lambda d: None)
    'float16'
    >>> output_dtype_name("bf16", lambda d: None)
    Traceback (most recent call last):
    ...
    TypeError: dtype: expected one of 'bfloat16', 'float16', 'float32', 'float8_e4m3fn' (a string, or the framework's dtype of one), got 'bf16'
    """
    found = value if isinstance(value, str) else framework_name(value)
    if found not in OUTPUT_DTYPES:
        # A framework dtype is named as the core names dtypes (torch.int8 and jnp.int8 are both
        # "int8"), so both frontends word the same mistake the same way.
        raise dtype_error(value if found is None or isinstance(value, str) else found, name)
    return found
