"""Framework-neutral test cases: ids, sizes and NumPy inputs shared by the torch and JAX suites.

Inputs are built with NumPy (+ ml_dtypes) from a seed, so every frontend and backend sees the very
same bytes and the parity tests can compare caches byte for byte.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from fp8kv.formats import FORMATS
from fp8kv.reference import np_dtype


class _CacheOptions:
    """What the API is told about a case's cache (``layout`` "3D" means a [num_slots, H, D] one)."""

    @property
    def api_layout(self) -> str:
        return "NHD" if self.layout == "3D" else self.layout

    @property
    def cache_dtype(self) -> str:
        return "uint8" if self.cache == "uint8" else FORMATS[self.fmt].dtype

    @property
    def fp8_format(self):
        return self.fmt if self.cache == "uint8" else None


@dataclass(frozen=True)
class WriteCase(_CacheOptions):
    tokens: int = 7
    heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    layout: str = "NHD"          # "NHD" | "HND" | "3D" ([num_slots, H, D])
    fmt: str = "e4m3"
    dtype: str = "bfloat16"
    cache: str = "typed"         # "typed" | "uint8"
    scale: str = "float"         # "none" | "float" | "tensor" | "tensor1" | "head"
    slots: str = "int64"
    num_pages: int = 0           # 0: just enough for the tokens, plus two spare pages

    @property
    def id(self) -> str:
        page = "" if self.layout == "3D" else f"-P{self.page_size}"
        return (f"T{self.tokens}-H{self.heads}-D{self.head_dim}{page}-{self.layout}-{self.fmt}-"
                f"{self.dtype}-{self.cache}-s{self.scale}-{self.slots}")

    @property
    def pages(self) -> int:
        page = 1 if self.layout == "3D" else self.page_size
        return self.num_pages or -(-self.tokens // page) + 2

    @property
    def cache_shape(self) -> tuple[int, ...]:
        if self.layout == "3D":
            return (self.pages, self.heads, self.head_dim)
        if self.layout == "NHD":
            return (self.pages, self.page_size, self.heads, self.head_dim)
        return (self.pages, self.heads, self.page_size, self.head_dim)


def _c(**kw) -> WriteCase:
    return WriteCase(**kw)


# Curated so that every option appears, with odd sizes; small enough for the CPU interpreter.
WRITE_CASES = [
    _c(),
    _c(tokens=0),
    _c(tokens=1, heads=1, head_dim=64, page_size=1),
    _c(tokens=257, heads=6, head_dim=96, page_size=64, layout="HND", fmt="e5m2"),
    _c(tokens=33, heads=6, head_dim=80, page_size=16, dtype="float16", cache="uint8", scale="head"),
    _c(tokens=19, heads=1, head_dim=256, page_size=16, layout="HND", dtype="float32", scale="tensor"),
    _c(tokens=9, heads=4, head_dim=128, layout="3D", cache="uint8", fmt="e5m2", scale="tensor1",
       slots="int32"),
    _c(tokens=65, heads=8, head_dim=64, page_size=256, dtype="float16", scale="none"),
    _c(tokens=40, heads=2, head_dim=96, page_size=3, layout="HND", scale="head", slots="int32"),
    _c(tokens=12, heads=6, head_dim=128, page_size=64, cache="uint8", fmt="e5m2", dtype="float32",
       scale="float"),
] + [
    _c(tokens=17, heads=h, head_dim=d, page_size=16, layout=lay, fmt=f, scale=s)
    for (h, d), lay, f, s in itertools.product([(1, 128), (6, 64)], ["NHD", "HND"], ["e4m3", "e5m2"],
                                               ["float", "head"])
]

SPECIALS = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1e30, -1e30, 448.0, 464.0, 465.0,
                     -480.0, 57344.0, 61440.0, -1e5, 2 ** -9, 2 ** -10, -(2 ** -12), 2 ** -16,
                     2 ** -17, 3e-39, -1e-40], dtype=np.float32)


def random_values(rng, shape, dtype: str, specials: bool = True) -> np.ndarray:
    """Values of ``dtype`` spanning fp8's range, its subnormals, and the special cases above."""
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(2.0) ** rng.integers(
        -14, 10, size=shape).astype(np.float32)
    if specials and x.size:
        flat = x.reshape(-1)
        where = rng.random(flat.size) < 0.05
        flat[where] = rng.choice(SPECIALS, size=int(where.sum()))
    with np.errstate(over="ignore"):  # fp16 overflows to inf on purpose
        return x.astype(np_dtype(dtype))


def scale_values(case_scale: str, heads: int, rng):
    """(host value used by the API, NumPy fp32 array or None) for a scale kind."""
    if case_scale == "none":
        return None
    if case_scale == "float":
        return 0.37
    if case_scale == "tensor":
        return np.array(0.0625, dtype=np.float32)
    if case_scale == "tensor1":
        return np.array([3.5], dtype=np.float32)
    return (rng.random(heads).astype(np.float32) * 4 + 0.05).astype(np.float32)


def write_inputs(case: WriteCase, seed: int = 0) -> dict:
    """NumPy inputs for one write: K/V, poisoned caches, slots (some padding), scales."""
    rng = np.random.default_rng(seed)
    shape = (case.tokens, case.heads, case.head_dim)
    num_slots = case.pages * (1 if case.layout == "3D" else case.page_size)
    slots = rng.permutation(num_slots)[: case.tokens].astype(case.slots)
    if case.tokens > 2:
        slots[rng.random(case.tokens) < 0.15] = -1   # padding tokens
    poison = rng.integers(0, 256, size=case.cache_shape, dtype=np.uint8)
    caches = [poison.copy(), rng.integers(0, 256, size=case.cache_shape, dtype=np.uint8)]
    caches = [c.view(np_dtype(case.cache_dtype)) for c in caches]
    return dict(key=random_values(rng, shape, case.dtype), value=random_values(rng, shape, case.dtype),
                key_cache=caches[0], value_cache=caches[1], slots=slots,
                key_scale=scale_values(case.scale, case.heads, rng),
                value_scale=scale_values("head" if case.scale == "head" else case.scale, case.heads, rng))


@dataclass(frozen=True)
class DequantCase(_CacheOptions):
    batch: int = 3
    pages_per_seq: int = 4
    heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    layout: str = "NHD"
    fmt: str = "e4m3"
    out: str = "bfloat16"
    cache: str = "typed"
    scale: str = "float"
    null_page: int | None = None
    num_pages: int = 13

    @property
    def id(self) -> str:
        page = "" if self.layout == "3D" else f"-P{self.page_size}"
        null = "" if self.null_page is None else f"-null{self.null_page}"
        return (f"B{self.batch}x{self.pages_per_seq}-H{self.heads}-D{self.head_dim}{page}-"
                f"{self.layout}-{self.fmt}-{self.out}-{self.cache}-s{self.scale}{null}")

    @property
    def cache_shape(self):
        return WriteCase(heads=self.heads, head_dim=self.head_dim, page_size=self.page_size,
                         layout=self.layout, num_pages=self.num_pages).cache_shape


def _d(**kw) -> DequantCase:
    return DequantCase(**kw)


DEQUANT_CASES = [
    _d(),
    _d(batch=0),
    _d(batch=2, pages_per_seq=3, heads=1, head_dim=64, page_size=1, null_page=0),
    _d(heads=6, head_dim=96, page_size=64, layout="HND", fmt="e5m2", out="float16", scale="head"),
    _d(heads=6, head_dim=80, page_size=16, cache="uint8", out="float32", scale="tensor"),
    _d(heads=4, head_dim=256, layout="3D", fmt="e5m2", cache="uint8", scale="none", null_page=3),
    _d(batch=1, pages_per_seq=7, heads=2, head_dim=128, page_size=3, layout="HND", scale="tensor1"),
    _d(batch=2, pages_per_seq=2, heads=8, head_dim=64, page_size=256, out="float16", scale="head",
       null_page=0),
]


def dequant_inputs(case: DequantCase, seed: int = 0) -> dict:
    """Caches holding every byte value, a block table with padding (-1, null, past the end)."""
    rng = np.random.default_rng(seed)
    caches = [rng.integers(0, 256, size=case.cache_shape, dtype=np.uint8).view(
        np_dtype(case.cache_dtype)) for _ in range(2)]
    table = rng.integers(0, case.num_pages, size=(case.batch, case.pages_per_seq)).astype(np.int32)
    if table.size > 2:
        table.reshape(-1)[rng.random(table.size) < 0.2] = -1
        table.reshape(-1)[-1] = case.num_pages + 5   # out of range: padding, never read
    return dict(key_cache=caches[0], value_cache=caches[1], block_table=table,
                key_scale=scale_values(case.scale, case.heads, rng),
                value_scale=scale_values(case.scale, case.heads, rng))


def as_uint(a: np.ndarray) -> np.ndarray:
    """The raw bits of ``a`` (for byte-exact comparison, NaNs included)."""
    return np.asarray(a).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[np.asarray(a).itemsize])
