"""Framework-neutral MXFP8 cases (docs/SPEC.md section 13a): ids, sizes and NumPy inputs shared
by the torch and JAX suites (poisoned caches and block-scale arrays, padding and out-of-range
slots, special blocks: zeros, NaN, inf, subnormal fp32, saturating amaxes)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tests.cases import random_values
from tests.nvfp4_cases import PagedRows
from fp8kv import reference as ref
from fp8kv.reference import np_dtype

BLOCK = 32   # written out here, not taken from the code


@dataclass(frozen=True)
class MxCase(PagedRows):
    tokens: int = 5
    heads: int = 3
    head_dim: int = 64
    page_size: int = 4
    layout: str = "NHD"        # "NHD" | "HND" | "3D" ([num_slots, H, D])
    dtype: str = "bfloat16"
    cache: str = "uint8"       # codes: "uint8" | "float8_e4m3fn"

    @property
    def id(self):
        page = "" if self.layout == "3D" else f"-P{self.page_size}"
        return (f"T{self.tokens}-H{self.heads}-D{self.head_dim}{page}-{self.layout}-{self.dtype}-"
                f"{self.cache}")

    @property
    def cache_shape(self):
        return self.shape(self.head_dim)

    @property
    def block_shape(self):
        return self.shape(self.head_dim // BLOCK)


# CPU runs the first two (interpreter: small); the GPU suite runs them all.
CASES = [
    MxCase(),
    MxCase(tokens=4, heads=2, head_dim=96, layout="3D", dtype="float32", cache="float8_e4m3fn"),
    MxCase(tokens=6, heads=5, head_dim=160, page_size=16, layout="HND", dtype="float16"),
    MxCase(tokens=3, heads=1, head_dim=32, page_size=1),
    MxCase(tokens=9, heads=8, head_dim=128, page_size=16, cache="float8_e4m3fn"),
    MxCase(tokens=37, heads=7, head_dim=256, page_size=16, layout="HND", dtype="float32"),
    MxCase(tokens=129, heads=4, head_dim=576, page_size=64),
]


def special_blocks(x):
    """The rule's special cases as the first blocks of the batch (token 0's, then token 1's),
    after token 1's values are scaled down by 2**-100 (amaxes near the clamp)."""
    x = x.copy()
    if x.shape[0] > 1:
        with np.errstate(over="ignore", under="ignore"):
            x[1] = (x[1].astype(np.float32) * np.float32(2.0 ** -100)).astype(x.dtype)
    ramp = np.arange(BLOCK, dtype=np.float32) - 16
    sign = np.sign(ramp + 0.5)
    tiny = np.where(np.arange(BLOCK) % 2, -1.0, 1.0) * np.float32(2.0 ** -40)
    specials = [np.where(np.arange(BLOCK) == 3, np.nan, 1.0),
                np.where(np.arange(BLOCK) == 5, -np.inf, 0.5),
                np.full(BLOCK, 3e-39) * sign,                 # subnormal fp32 amax
                ramp * 29.0,                                  # amax 464: top binade, saturation
                np.concatenate([[2.0 ** 100], tiny[1:]]),     # quotients below 2**-126: +-0
                np.concatenate([[-0.0] * 16, [0.0] * 16]),
                ramp * np.float32(2.0 ** -125),               # clamped exponent
                np.nextafter(np.float32(256), np.float32(0)) * sign,
                np.zeros(BLOCK)]
    flat = x.reshape(-1, BLOCK)
    for i, block in enumerate(specials[: flat.shape[0]]):
        with np.errstate(over="ignore"):
            flat[i] = np.asarray(block, np.float32).astype(x.dtype)
    return flat.reshape(x.shape)


def inputs(case: MxCase, seed=0, specials=True):
    rng = np.random.default_rng(seed)
    shape = (case.tokens, case.heads, case.head_dim)
    k, v = (random_values(rng, shape, case.dtype) for _ in range(2))
    if specials:
        k = special_blocks(k)
    slots = rng.permutation(case.num_slots)[: case.tokens].astype(np.int64)
    if case.tokens > 2:
        slots[2] = -1                          # padding
    if case.tokens > 3:
        slots[3] = case.num_slots + 3          # out of range
    caches = [rng.integers(0, 256, size=case.cache_shape, dtype=np.uint8).view(
        np_dtype(case.cache)) for _ in range(2)]
    blocks = [rng.integers(0, 256, size=case.block_shape, dtype=np.uint8) for _ in range(2)]
    return dict(key=k, value=v, key_cache=caches[0], value_cache=caches[1], slots=slots,
                key_scale_cache=blocks[0], value_scale_cache=blocks[1])


def ref_write(case, x):
    return ref.write_kv(**x, layout=case.api_layout, cache_format="mxfp8")


def table(case):
    """A block table with padding, a null page (0), an out-of-range entry and a repeat."""
    return np.array([[1, -1, 0], [case.pages - 1, case.pages + 3, 1]], np.int32)
