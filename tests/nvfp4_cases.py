"""Framework-neutral NVFP4 cases (docs/SPEC.md section 13): ids, sizes and NumPy inputs shared
by the torch and JAX suites (poisoned caches and block-scale arrays, padding and out-of-range
slots, special blocks)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tests.cases import random_values
from fp8kv import reference as ref
from fp8kv.reference import np_dtype

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]   # written out here, not taken from the code


class PagedRows:
    """The geometry of a block-scaled case's cache (``tokens``, ``heads``, ``page_size`` and
    ``layout`` fields): its pages (two more than the tokens need) and array shapes."""

    @property
    def api_layout(self):
        return "NHD" if self.layout == "3D" else self.layout

    @property
    def pages(self):
        return -(-self.tokens // (1 if self.layout == "3D" else self.page_size)) + 2

    @property
    def num_slots(self):
        return self.pages * (1 if self.layout == "3D" else self.page_size)

    def shape(self, width):
        if self.layout == "3D":
            return (self.pages, self.heads, width)
        if self.layout == "NHD":
            return (self.pages, self.page_size, self.heads, width)
        return (self.pages, self.heads, self.page_size, width)


@dataclass(frozen=True)
class NvCase(PagedRows):
    tokens: int = 5
    heads: int = 3
    head_dim: int = 64
    page_size: int = 4
    layout: str = "NHD"        # "NHD" | "HND" | "3D" ([num_slots, H, D/2])
    dtype: str = "bfloat16"
    scale: str = "float"       # global scale: "none" | "float" | "tensor" | "head"
    blocks: str = "e4m3"       # block-scale arrays: "e4m3" (float8_e4m3fn) | "uint8"

    @property
    def id(self):
        page = "" if self.layout == "3D" else f"-P{self.page_size}"
        return (f"T{self.tokens}-H{self.heads}-D{self.head_dim}{page}-{self.layout}-{self.dtype}-"
                f"s{self.scale}-{self.blocks}")

    @property
    def cache_shape(self):
        return self.shape(self.head_dim // 2)

    @property
    def block_shape(self):
        return self.shape(self.head_dim // 16)

    @property
    def block_dtype(self):
        return "float8_e4m3fn" if self.blocks == "e4m3" else "uint8"


CASES = [
    NvCase(),
    NvCase(tokens=3, heads=1, head_dim=16, page_size=1, scale="none", blocks="uint8"),
    NvCase(tokens=6, heads=6, head_dim=80, page_size=16, layout="HND", dtype="float16",
           scale="head"),
    NvCase(tokens=4, heads=2, head_dim=128, layout="3D", dtype="float32", scale="tensor"),
    NvCase(tokens=4, heads=1, head_dim=256, page_size=16, layout="HND", blocks="uint8"),
    NvCase(tokens=9, heads=8, head_dim=128, page_size=16, scale="head"),
]


def global_scale(kind, heads, rng):
    """A global scale of ``kind`` as every path takes it: None, a float or a float32 array."""
    if kind == "none":
        return None
    if kind == "float":
        return 0.0213
    if kind == "tensor":
        return np.array(0.0625, np.float32)
    return (rng.random(heads) * 0.1 + 0.004).astype(np.float32)


def special_blocks(x, head_dim):
    """Blocks of token 0 (and 1) with the rule's special cases, scaled like their neighbours."""
    flat = x.reshape(x.shape[0], -1, 16)
    ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    specials = [np.zeros(16), np.concatenate([ties, -ties]) / 3,
                np.where(np.arange(16) % 3 == 0, np.nan, 1.0),
                np.full(16, np.nan), np.where(np.arange(16) == 5, -np.inf, 0.5),
                np.full(16, -3e-39), np.concatenate([[-0.0] * 8, [0.0] * 8])]
    for i, block in enumerate(specials[: flat.shape[1]]):
        flat[0, i] = np.asarray(block, np.float32).astype(x.dtype)
    if x.shape[0] > 1:
        flat[1] = (flat[1].astype(np.float32) * np.float32(2.0 ** -30)).astype(x.dtype)
    return flat.reshape(x.shape)


def inputs(case: NvCase, seed=0, specials=True):
    rng = np.random.default_rng(seed)
    shape = (case.tokens, case.heads, case.head_dim)
    k, v = (random_values(rng, shape, case.dtype) for _ in range(2))
    if specials:
        k = special_blocks(k, case.head_dim)
    slots = rng.permutation(case.num_slots)[: case.tokens].astype(np.int64)
    if case.tokens > 2:
        slots[2] = -1                          # padding
    if case.tokens > 3:
        slots[3] = case.num_slots + 3          # out of range
    caches = [rng.integers(0, 256, size=case.cache_shape, dtype=np.uint8) for _ in range(2)]
    blocks = [rng.integers(0, 256, size=case.block_shape, dtype=np.uint8).view(
        np_dtype(case.block_dtype)) for _ in range(2)]
    return dict(key=k, value=v, key_cache=caches[0], value_cache=caches[1], slots=slots,
                key_scale=global_scale(case.scale, case.heads, rng),
                value_scale=global_scale("float" if case.scale == "none" else case.scale,
                                         case.heads, rng),
                key_scale_cache=blocks[0], value_scale_cache=blocks[1])


def ref_write(case, x):
    return ref.write_kv(**x, layout=case.api_layout, cache_format="nvfp4")
