"""Stacked-cache cases (``layer=``, docs/SPEC.md section 14): NumPy inputs and expected results
shared by the torch and JAX suites.

Each case stacks ``layers`` poisoned caches (and side scale arrays) of one layout; the expected
arrays come from :mod:`fp8kv.reference`, so every untouched byte -- other layers included -- is
compared.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fp8kv import reference
from fp8kv.reference import np_dtype
from tests.cases import WriteCase, random_values, write_inputs

# The dynamic scales each layout's dynamic case uses: both granularities of side arrays and both
# inline pads appear.
DYNAMIC_KIND = {("NHD", False): "token_head", ("HND", False): "token", ("3D", False): "inline4",
                ("NHD", True): "token_head", ("HND", True): "inline16", ("3D", True): "token"}


@dataclass(frozen=True)
class StackedCase:
    layout: str                  # "NHD" | "HND" | "3D"
    combined: bool
    scales: str                  # "static" | "dynamic"
    layers: int = 3
    tokens: int = 9
    heads: int = 3
    head_dim: int = 80
    page_size: int = 4
    fmt: str = "e4m3"

    @property
    def id(self) -> str:
        page = "" if self.layout == "3D" else f"-P{self.page_size}"
        dyn = f"-{DYNAMIC_KIND[self.layout, self.combined]}" if self.scales == "dynamic" else ""
        return (f"L{self.layers}-T{self.tokens}-H{self.heads}-D{self.head_dim}{page}-"
                f"{self.layout}-{'combined' if self.combined else 'separate'}-{self.fmt}-"
                f"{self.scales}{dyn}")

    @property
    def dynamic(self) -> str | None:
        return DYNAMIC_KIND[self.layout, self.combined] if self.scales == "dynamic" else None

    @property
    def pad(self) -> int:
        return {"inline4": 4, "inline16": 16}.get(self.dynamic, 0)

    @property
    def api_layout(self) -> str:
        return "NHD" if self.layout == "3D" else self.layout

    @property
    def base(self) -> WriteCase:
        """One layer's write case (a static one: the scales are chosen here)."""
        return WriteCase(tokens=self.tokens, heads=self.heads, head_dim=self.head_dim,
                         page_size=self.page_size, layout=self.layout, fmt=self.fmt,
                         scale="head", slots="int32", num_pages=12 if self.layout == "3D" else 5)

    @property
    def cache_shape(self) -> tuple[int, ...]:
        """One layer's K (or V) cache, inline scale bytes included."""
        shape = self.base.cache_shape
        return shape[:-1] + (shape[-1] + self.pad,)

    @property
    def scale_cache_shape(self) -> tuple[int, ...] | None:
        """One layer's side scale array, or None (static or inline scales)."""
        if self.dynamic not in ("token", "token_head"):
            return None
        shapes = reference.scale_cache_shapes(self.base.cache_shape, self.api_layout)
        return shapes[self.dynamic]


STACKED_CASES = [StackedCase(layout, combined, scales)
                 for layout in ("NHD", "HND", "3D") for combined in (False, True)
                 for scales in ("static", "dynamic")]

# (layer, where): in range and out of range, a host int and a device array.
LAYERS = [(1, "int"), (2, "array"), (3, "int"), (-1, "array")]


def layer_id(layer) -> str:
    value, where = layer
    return f"layer{value}-{where}"


def _stack(k, v, case: StackedCase):
    """K and V stacks ``[L, P, ...]`` as one combined stack ``[L, P, 2, ...]``."""
    return np.stack([k, v], axis=2)


def _halves(kv):
    return kv[:, :, 0], kv[:, :, 1]


def write_inputs_stacked(case: StackedCase, seed: int = 0) -> dict:
    """NumPy arguments of a stacked write, by name: K/V, slots, poisoned stacks, scales and
    (dynamic) side scale stacks or ``"inline"``, plus ``layout`` and ``fp8_format``."""
    one = write_inputs(case.base, seed)
    rng = np.random.default_rng(seed + 1)
    shape = (case.layers,) + case.cache_shape
    dtype = np_dtype(case.base.cache_dtype)
    k, v = (rng.integers(0, 256, shape, dtype=np.uint8).view(dtype) for _ in range(2))
    args = dict(key=one["key"], value=one["value"], slots=one["slots"], layout=case.api_layout,
                fp8_format=case.base.fp8_format)
    if case.combined:
        args["kv_cache"] = _stack(k, v, case)
    else:
        args.update(key_cache=k, value_cache=v)
    if case.scales == "static":
        args.update(key_scale=one["key_scale"], value_scale=np.float32(0.37).item())
    elif case.pad:
        args.update(key_scale_cache="inline", value_scale_cache="inline")
    else:
        sshape = (case.layers,) + case.scale_cache_shape
        args.update(key_scale_cache=rng.standard_normal(sshape).astype(np.float32),
                    value_scale_cache=rng.standard_normal(sshape).astype(np.float32))
    return args


def expected_write(case: StackedCase, args: dict, layer: int) -> dict:
    """The reference's arrays after the write, by argument name (caches and side arrays)."""
    call = {n: a for n, a in args.items() if n != "kv_cache"}
    if case.combined:
        call["key_cache"], call["value_cache"] = _halves(args["kv_cache"])
    out = reference.write_kv(**call, layer=layer)
    result = ({"kv_cache": _stack(out[0], out[1], case)} if case.combined
              else {"key_cache": out[0], "value_cache": out[1]})
    if len(out) == 4:
        result.update(key_scale_cache=out[2], value_scale_cache=out[3])
    return result


def dequant_inputs_stacked(case: StackedCase, seed: int = 0) -> dict:
    """NumPy arguments of a stacked dequantize: every slot of every layer written by the
    reference (valid codes and, for dynamic cases, valid stored scales), a block table with
    padding, the scales."""
    args = write_inputs_stacked(case, seed)
    rng = np.random.default_rng(seed + 2)
    num_slots = case.base.pages * (1 if case.layout == "3D" else case.page_size)
    for layer in range(case.layers):
        x = {n: random_values(rng, (num_slots, case.heads, case.head_dim), "bfloat16",
                              specials=False) for n in ("key", "value")}
        filled = expected_write(case, {**args, **x, "slots": np.arange(num_slots,
                                                                       dtype=np.int32)}, layer)
        args.update(filled)
    past = case.base.pages + 2                  # past the cache: padding
    table = np.array([[0, 4, -1], [2, past, 3]], np.int32)
    return dict(block_table=table, head_dim=case.head_dim if case.pad else None,
                **{n: a for n, a in args.items() if n not in ("key", "value", "slots")})


def expected_dequant(case: StackedCase, args: dict, layer: int, dtype: str = "bfloat16"):
    """The reference's ``(pages..., new_block_table)``: ``(kv_pages, table)`` when combined."""
    call = {n: a for n, a in args.items() if n != "kv_cache"}
    if case.combined:
        call["key_cache"], call["value_cache"] = _halves(args["kv_cache"])
    k, v, table = reference.dequantize_pages(**call, dtype=dtype, layer=layer)
    return (np.stack([k, v], axis=1), table) if case.combined else (k, v, table)
