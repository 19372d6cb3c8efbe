"""Framework-neutral ``rope_write_kv`` cases: ids, sizes and NumPy inputs for the torch and JAX
suites (as :mod:`tests.cases` for ``write_kv``).

Inputs are random values with specials (NaN, inf, -0, huge, tiny), poisoned caches, padding
slots, and cos/sin rows of real RoPE frequencies with special values sprinkled in.
``subnormals=False`` replaces every fp32 subnormal input by zero: XLA:CPU flushes them
(docs/SPEC.md, section 11), so the jnp path is compared on inputs without them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from fp8kv import reference as ref
from fp8kv.formats import FORMATS
from fp8kv.reference import np_dtype
from tests.cases import random_values, scale_values

# cos/sin specials: none subnormal, and none that makes a subnormal product with the inputs'
# normal values.
CS_SPECIALS = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -1.0, 1e30, -3e-20, 0.5],
                       np.float32)
PAD = {"inline4": 4, "inline16": 16}
FP8_QUERY = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "uint8": "uint8"}


@dataclass(frozen=True)
class RopeCase:
    tokens: int = 7
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    rotary_dim: int = 0          # 0: head_dim
    style: str = "neox"
    page_size: int = 16
    layout: str = "NHD"          # "NHD" | "HND" | "3D" ([num_slots, H, D])
    fmt: str = "e4m3"
    dtype: str = "bfloat16"
    cs_dtype: str = "float32"
    cache: str = "typed"         # "typed" | "uint8"
    scale: str = "float"         # tests.cases' kinds, "token", "token_head", "inline4", "inline16"
    rounding: str = "exact"
    q_out: str = "same"          # "same" (query's dtype) | "e4m3" | "e5m2" | "uint8" (FP8 codes)
    q_scale: str = "float"       # with an FP8 q_out: "float", "one" (1.0), "tensor", "tensor1"
    max_position: int = 64
    positions: str = "random"    # "random" | "oob" (some out of range) | "high" (near the top)
    slots: str = "int64"

    @property
    def id(self) -> str:
        page = "" if self.layout == "3D" else f"-P{self.page_size}"
        q = "" if self.q_out == "same" else f"-q{self.q_out}-{self.q_scale}"
        pos = "" if self.positions == "random" else f"-pos{self.positions}{self.max_position}"
        return (f"T{self.tokens}-Hq{self.q_heads}-H{self.kv_heads}-D{self.head_dim}-R{self.rot}-"
                f"{self.style}{page}-{self.layout}-{self.fmt}-{self.dtype}-cs{self.cs_dtype}-"
                f"{self.cache}-s{self.scale}{'-pow2' if self.rounding == 'pow2' else ''}{q}"
                f"{pos}-{self.slots}")

    @property
    def rot(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def api_layout(self) -> str:
        return "NHD" if self.layout == "3D" else self.layout

    @property
    def cache_dtype(self) -> str:
        return "uint8" if self.cache == "uint8" or self.scale in PAD else FORMATS[self.fmt].dtype

    @property
    def fp8_format(self):
        return self.fmt if self.cache_dtype == "uint8" else None

    @property
    def dynamic(self) -> bool:
        return self.scale in ("token", "token_head") or self.scale in PAD

    @property
    def pages(self) -> int:
        page = 1 if self.layout == "3D" else self.page_size
        return -(-self.tokens // page) + 2

    def cache_shape(self, width: int | None = None) -> tuple[int, ...]:
        d = (width or self.head_dim) + PAD.get(self.scale, 0)
        if self.layout == "3D":
            return (self.pages, self.kv_heads, d)
        if self.layout == "NHD":
            return (self.pages, self.page_size, self.kv_heads, d)
        return (self.pages, self.kv_heads, self.page_size, d)

    @property
    def query_out_dtype(self) -> str:
        return self.dtype if self.q_out == "same" else FP8_QUERY[self.q_out]


def _c(**kw) -> RopeCase:
    return RopeCase(**kw)


# Curated so that every option appears with odd sizes; small enough for the CPU interpreter
# (one or two programs each).
ROPE_CASES = [
    _c(),
    _c(style="gptj"),
    _c(tokens=9, q_heads=4, kv_heads=4, head_dim=128, rotary_dim=64, layout="HND", fmt="e5m2",
       cs_dtype="bfloat16", scale="head"),
    _c(tokens=11, q_heads=6, kv_heads=1, head_dim=80, rotary_dim=32, style="gptj", layout="3D",
       dtype="float16", cs_dtype="float16", cache="uint8", scale="tensor", slots="int32"),
    _c(tokens=1, q_heads=1, kv_heads=1, head_dim=64, page_size=1, style="gptj", scale="none"),
    _c(tokens=13, q_heads=8, kv_heads=4, head_dim=96, dtype="float32", scale="tensor1",
       q_out="e4m3", q_scale="tensor"),
    _c(tokens=5, q_heads=8, kv_heads=1, head_dim=256, rotary_dim=128, style="gptj",
       scale="token_head", q_out="e5m2", q_scale="float"),
    _c(tokens=6, q_heads=4, kv_heads=2, head_dim=80, layout="HND", scale="token", rounding="pow2",
       q_out="uint8", q_scale="tensor1"),
    _c(tokens=7, q_heads=4, kv_heads=2, head_dim=64, scale="inline4", q_out="e4m3",
       q_scale="one"),
    _c(tokens=7, q_heads=8, kv_heads=8, head_dim=64, rotary_dim=32, style="gptj",
       scale="inline16", rounding="pow2", fmt="e5m2"),
    _c(tokens=9, q_heads=4, kv_heads=2, head_dim=64, positions="oob", slots="int32",
       scale="head"),
    _c(tokens=6, q_heads=2, kv_heads=1, head_dim=64, rotary_dim=32, cs_dtype="bfloat16",
       max_position=131072, positions="high", style="gptj"),
    _c(tokens=0),
    _c(tokens=33, q_heads=4, kv_heads=1, head_dim=64, page_size=3, layout="HND",
       dtype="float16", scale="token_head", positions="oob"),
]


def _flush_subnormals(x: np.ndarray) -> np.ndarray:
    f = x.astype(np.float32)
    tiny = (np.abs(f) < np.float32(2.0 ** -126)) & (f != 0)
    return np.where(tiny, np.zeros_like(x), x)


def cos_sin_cache(rng, max_position: int, rotary_dim: int, dtype: str,
                  specials: bool = True) -> np.ndarray:
    """``[max_position, rotary_dim]``: cos then sin of ``p * 10000**(-2i / R)``, with a few
    special values (``specials``)."""
    inv_freq = 10000.0 ** (-np.arange(rotary_dim // 2) * 2.0 / rotary_dim)
    theta = np.arange(max_position)[:, None] * inv_freq[None, :]
    cs = np.concatenate([np.cos(theta), np.sin(theta)], axis=1).astype(np.float32)
    if specials and cs.size:
        where = rng.random(cs.shape) < 0.03
        cs[where] = rng.choice(CS_SPECIALS, size=int(where.sum()))
    with np.errstate(over="ignore"):   # 1e30 becomes inf in fp16, on purpose
        return cs.astype(np_dtype(dtype))


def positions_for(case: RopeCase, rng) -> np.ndarray:
    n, top = case.tokens, case.max_position
    if case.positions == "high":
        pos = top - 1 - rng.integers(0, 64, size=n)
        pos[0] = top - 1
    else:
        pos = rng.integers(0, max(top, 1), size=n)
    if case.positions == "oob" and n >= 4:
        big = 2 ** 40 if case.slots == "int64" else 2 ** 31 - 1
        pos[[0, n // 3, n // 2, n - 1]] = [-1, top, big, -(2 ** 31)]
    return pos.astype(case.slots)


def rope_inputs(case: RopeCase, seed: int = 0, subnormals: bool = True) -> dict:
    """NumPy inputs of one call, by the API's argument names (static scales included; the
    dynamic scale caches poisoned), plus ``query_out`` and ``key_out`` poisoned (what a caller
    may preallocate)."""
    rng = np.random.default_rng(seed)
    t, d = case.tokens, case.head_dim
    x = {name: random_values(rng, (t, h, d), case.dtype)
         for name, h in (("query", case.q_heads), ("key", case.kv_heads), ("value", case.kv_heads))}
    if not subnormals:
        x = {k: _flush_subnormals(v) for k, v in x.items()}
    num_slots = case.pages * (1 if case.layout == "3D" else case.page_size)
    slots = rng.permutation(num_slots)[:t].astype(case.slots)
    if t > 2:
        slots[rng.random(t) < 0.15] = -1
    caches = [rng.integers(0, 256, size=case.cache_shape(), dtype=np.uint8).view(
        np_dtype(case.cache_dtype)) for _ in range(2)]
    static = case.scale if not case.dynamic else "none"
    out = dict(**x, key_cache=caches[0], value_cache=caches[1], slots=slots,
               positions=positions_for(case, rng),
               cos_sin_cache=cos_sin_cache(rng, case.max_position, case.rot, case.cs_dtype),
               key_scale=scale_values(static, case.kv_heads, rng),
               value_scale=scale_values(static, case.kv_heads, rng),
               key_scale_cache=None, value_scale_cache=None)
    if case.scale in PAD:
        out.update(key_scale_cache="inline", value_scale_cache="inline")
    elif case.dynamic:
        shapes = ref.scale_cache_shapes(case.cache_shape(), case.api_layout)
        shape = shapes["token" if case.scale == "token" else "token_head"]
        out.update(key_scale_cache=rng.standard_normal(shape).astype(np.float32),
                   value_scale_cache=rng.standard_normal(shape).astype(np.float32))
    out["query_out"] = rng.integers(0, 256, size=(t, case.q_heads, d * np.dtype(
        np_dtype(case.query_out_dtype)).itemsize), dtype=np.uint8).view(
        np_dtype(case.query_out_dtype))
    out["key_out"] = rng.integers(0, 256, size=(t, case.kv_heads, d * np.dtype(
        np_dtype(case.dtype)).itemsize), dtype=np.uint8).view(np_dtype(case.dtype))
    out["query_scale"] = query_scale_value(case, rng)
    return out


def query_scale_value(case: RopeCase, rng):
    if case.q_out == "same":
        return None
    return {"float": 0.0625, "one": 1.0, "tensor": np.array(0.37, np.float32),
            "tensor1": np.array([3.5], np.float32)}[case.q_scale]


def options(case: RopeCase) -> dict:
    """The keyword options of the call (both frontends and the reference)."""
    return dict(rope_style=case.style, rotary_dim=case.rotary_dim or None,
                layout=case.api_layout, fp8_format=case.fp8_format,
                scale_rounding=case.rounding)


def expected(case: RopeCase, inputs: dict) -> dict:
    """The reference's outputs by name: ``query_out``, the caches, the scale caches (if side
    arrays) and ``key_out``."""
    args = {k: v for k, v in inputs.items() if k != "key_out"}
    got = ref.rope_write_kv(**args, return_key=True, **options(case))
    names = ["query_out", "key_cache", "value_cache"]
    if isinstance(inputs["key_scale_cache"], np.ndarray):
        names += ["key_scale_cache", "value_scale_cache"]
    return dict(zip(names + ["key_out"], got, strict=True))


def with_(case: RopeCase, **changes) -> RopeCase:
    return replace(case, **changes)
