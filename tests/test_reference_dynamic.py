"""The reference rule for dynamic per-token / per-token-head scales, and its cache placements.

Hand-computed cases pin the rule itself (floor, NaN, inf, subnormals, the fp32 division, pow2);
the placement tests check ``fp8kv.reference.write_kv`` / ``dequantize_pages`` against an
independent element-by-element computation with its own slot arithmetic, on poisoned caches.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from tests.cases import as_uint, random_values
from fp8kv import reference as ref
from fp8kv.formats import FORMATS
from fp8kv.reference import dynamic_scales, np_dtype

E4M3 = FORMATS["e4m3"]
FLOOR = np.float32(1e-6)


def f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def group(*values, dtype=np.float32) -> np.ndarray:
    """One token, one head: ``[1, 1, D]``."""
    return np.array(values, dtype=np.float32).astype(dtype).reshape(1, 1, -1)


# ---------------------------------------------------------------------------------------------
# The rule, by hand
# ---------------------------------------------------------------------------------------------

# (id, values, format, expected exact scale, expected pow2 scale)
HAND = [
    ("zeros-e4m3", [0.0, -0.0, 0.0], "e4m3", FLOOR, np.float32(2.0 ** -19)),
    ("zeros-e5m2", [0.0, 0.0], "e5m2", FLOOR, np.float32(2.0 ** -19)),
    ("all-nan", [np.nan, -np.nan], "e4m3", FLOOR, np.float32(2.0 ** -19)),
    ("nan-ignored", [np.nan, 3.0, -448.0, np.nan], "e4m3", np.float32(1.0), np.float32(1.0)),
    ("amax-896-e4m3", [1.0, -896.0], "e4m3", np.float32(2.0), np.float32(2.0)),
    ("amax-4xmax-e5m2", [229376.0, 5.0], "e5m2", np.float32(4.0), np.float32(4.0)),
    # 1/448 = 2**-9 * 8/7 = 2**-9 * 1.001001001...b: RNE to 23 bits rounds up -> 0x3B124925
    ("one-e4m3", [1.0, -0.5], "e4m3", f32(0x3B124925), np.float32(2.0 ** -8)),
    # 1/57344 = 2**-16 * 8/7: the same mantissa, 7 binades lower
    ("one-e5m2", [-1.0], "e5m2", f32(0x37924925), np.float32(2.0 ** -15)),
    # 448 * 2**-20 / 448 = 2**-20 < 1e-6: floored; 448 * 2**-19 gives 2**-19 > 1e-6: kept
    ("below-floor", [448.0 * 2.0 ** -20], "e4m3", FLOOR, np.float32(2.0 ** -19)),
    ("above-floor", [448.0 * 2.0 ** -19], "e4m3", np.float32(2.0 ** -19), np.float32(2.0 ** -19)),
    # subnormal fp32 inputs: amax / 448 underflows further; the floor applies
    ("subnormal", [1e-40, -3e-39], "e4m3", FLOOR, np.float32(2.0 ** -19)),
    # 3 * 448: s = 3 exactly; pow2 rounds up to 4
    ("pow2-up", [1344.0], "e4m3", np.float32(3.0), np.float32(4.0)),
    ("inf", [1.0, np.inf, np.nan], "e4m3", np.float32(np.inf), np.float32(np.inf)),
    ("minus-inf", [-np.inf], "e5m2", np.float32(np.inf), np.float32(np.inf)),
]


@pytest.mark.parametrize("values,fmt,exact,pow2", [h[1:] for h in HAND], ids=[h[0] for h in HAND])
def test_hand_computed_scales(values, fmt, exact, pow2):
    x = group(*values)
    for rounding, want in (("exact", exact), ("pow2", pow2)):
        for granularity, shape in (("token_head", (1, 1)), ("token", (1,))):
            s = dynamic_scales(x, fmt, granularity, rounding)
            assert s.dtype == np.float32 and s.shape == shape
            assert as_uint(s).item() == as_uint(np.float32(want)).item(), (rounding, granularity)


def test_floor_is_fp32_one_millionth():
    s = dynamic_scales(np.zeros((2, 3, 8), np.float32), "e4m3", "token_head", "exact")
    assert (as_uint(s) == 0x358637BD).all()   # float32(1e-6)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_subnormal_bf16_inputs_are_not_flushed(fmt):
    """bf16 subnormals count at their value: amax = 2**-130 is below the floor; 2**-127 * 448
    (normal) just above it is not."""
    tiny = group(2.0 ** -130, -(2.0 ** -133), dtype=ml_dtypes.bfloat16)
    assert dynamic_scales(tiny, fmt, "token", "exact")[0] == FLOOR
    codes = ref.quantize(tiny, FLOOR, FORMATS[fmt])
    assert set(codes.reshape(-1).tolist()) <= {0x00, 0x80}   # +-0: far below fp8's subnormals


def test_inf_group_codes_and_readback():
    """s = inf: finite -> +-0 codes, +-inf -> NaN code (inf / inf), NaN -> NaN code; readback is
    NaN everywhere (0 * inf)."""
    x = group(2.0, -3.0, np.inf, -np.inf, np.nan, 0.0)
    s = dynamic_scales(x, "e4m3", "token_head", "exact")
    codes = ref.quantize(x, s[:, :, None], E4M3)
    assert codes.reshape(-1).tolist() == [0x00, 0x80, 0x7F, 0x7F, 0x7F, 0x00]
    out = ref.dequantize(codes, s[:, :, None], E4M3, "bfloat16")
    assert (as_uint(out) == 0x7FC0).all()


def test_nan_does_not_change_other_groups():
    x = np.ones((2, 2, 4), np.float32)
    x[0, 0] = np.nan
    x[1, 1, 2] = np.inf
    s = dynamic_scales(x, "e4m3", "token_head", "exact")
    one = np.float32(1) / np.float32(448)
    assert s.tolist() == [[FLOOR, one], [one, np.inf]]
    assert dynamic_scales(x, "e4m3", "token", "exact").tolist() == [one, np.inf]


def test_empty_and_bad_arguments():
    assert dynamic_scales(np.zeros((0, 3, 8), np.float32), "e5m2", "token", "pow2").shape == (0,)
    x = np.ones((1, 1, 4), np.float32)
    with pytest.raises(ValueError,
                       match="granularity: expected 'token' or 'token_head', got 'head'"):
        dynamic_scales(x, "e4m3", "head", "exact")
    with pytest.raises(ValueError, match="rounding: expected 'exact' or 'pow2', got 'ceil'"):
        dynamic_scales(x, "e4m3", "token", "ceil")
    with pytest.raises(ValueError, match="fmt: expected"):
        dynamic_scales(x, "e3m4", "token", "exact")
    with pytest.raises(ValueError, match=r"x: expected rank 3 .* got shape \[4\]"):
        dynamic_scales(np.ones(4, np.float32), "e4m3", "token", "exact")


# ---------------------------------------------------------------------------------------------
# The rule against an independent scalar computation, on random data
# ---------------------------------------------------------------------------------------------

def naive_scale(values, fmt: str, rounding: str) -> np.float32:
    """One group's scale in plain Python floats (float64 then fp32 is exact RNE here: the
    divisors are 7 * 2**k, so no quotient lies near an fp32 rounding boundary)."""
    finite_or_inf = [abs(float(v)) for v in np.asarray(values, np.float32).reshape(-1)
                     if not np.isnan(v)]
    amax = max(finite_or_inf, default=0.0)
    s = max(np.float32(amax / FORMATS[fmt].max_value), FLOOR)
    if rounding == "pow2" and np.isfinite(s):
        p = 2.0 ** -40
        while p < s:
            p *= 2
        s = np.float32(p)
    return np.float32(s)


def random_kv(rng, tokens, heads, head_dim, dtype, specials=False):
    """Values spanning many binades, plus an all-zero head, an all-NaN head and (``specials``)
    a head holding an inf, so that every branch of the rule is hit."""
    x = random_values(rng, (tokens, heads, head_dim), "float32", specials=specials)
    x *= np.float32(2.0) ** rng.integers(-12, 12, size=(tokens, heads, 1)).astype(np.float32)
    if tokens >= 3:
        x[1, heads - 1] = 0.0
        x[2, 0] = np.nan
        x[2, 0, 0] = 0.0    # NaNs and one zero: amax 0
    if specials and tokens >= 4:
        x[3, heads // 2, head_dim // 2] = -np.inf
    with np.errstate(over="ignore"):
        return x.astype(np_dtype(dtype))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["exact", "pow2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_scales_match_scalar_rule(fmt, rounding, dtype):
    x = random_kv(np.random.default_rng(3), 9, 3, 40, dtype, specials=True)
    s_th = dynamic_scales(x, fmt, "token_head", rounding)
    s_t = dynamic_scales(x, fmt, "token", rounding)
    want_th = [[naive_scale(x[t, h], fmt, rounding) for h in range(3)] for t in range(9)]
    want_t = [naive_scale(x[t], fmt, rounding) for t in range(9)]
    np.testing.assert_array_equal(as_uint(s_th), as_uint(np.array(want_th, np.float32)))
    np.testing.assert_array_equal(as_uint(s_t), as_uint(np.array(want_t, np.float32)))
    # per token is the max over the token's heads (rounding is monotone)
    np.testing.assert_array_equal(s_t, s_th.max(axis=1))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_exact_scale_maps_amax_to_the_largest_code(fmt):
    """With rounding="exact", every group whose amax is finite and above the floor has an
    element coded as +-fmt.max_value, and no group saturates beyond it."""
    f = FORMATS[fmt]
    x = random_kv(np.random.default_rng(4), 16, 4, 72, "float32")
    s = dynamic_scales(x, fmt, "token_head", "exact")
    codes = ref.quantize(x, s[:, :, None], f)
    largest = (codes & 0x7F).max(axis=2)
    amax = np.nanmax(np.where(np.isnan(x), 0, np.abs(x)), axis=2)
    live = amax / f.max_value > FLOOR
    assert live.sum() > 50
    assert (largest[live] == f.max_code).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["token", "token_head"])
def test_pow2_dequantization_is_exact(fmt, granularity):
    """With pow2 scales, dequantize(q, 2**k) == decode(q) * 2**k exactly, in fp32 and in bf16."""
    f = FORMATS[fmt]
    x = random_kv(np.random.default_rng(5), 12, 3, 96, "bfloat16")
    s = dynamic_scales(x, fmt, granularity, "pow2")
    mant, _ = np.frexp(s)
    assert (mant == 0.5).all()                                  # powers of two
    sb = s[:, :, None] if granularity == "token_head" else s[:, None, None]
    codes = ref.quantize(x, sb, f)
    decoded = codes.view(np_dtype(f.dtype)).astype(np.float64)   # exact in float64
    want = decoded * sb.astype(np.float64)                       # exact: a power of two
    for out in ("float32", "bfloat16"):
        got = ref.dequantize(codes, sb, f, out).astype(np.float64)
        finite = np.isfinite(want)
        np.testing.assert_array_equal(got[finite], want[finite])


# ---------------------------------------------------------------------------------------------
# Placement: side caches and inline, written and read back through the reference API
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DynCase:
    tokens: int
    heads: int
    head_dim: int
    page_size: int
    layout: str          # "NHD" | "HND" | "3D"
    fmt: str
    rounding: str
    place: str           # "token_head" | "token" | "inline4" | "inline16"
    dtype: str
    cache: str           # "typed" | "uint8"

    @property
    def id(self) -> str:
        page = "" if self.layout == "3D" else f"-P{self.page_size}"
        place = self.place.replace("_", "")
        return (f"T{self.tokens}-H{self.heads}-D{self.head_dim}{page}-{self.layout}-{self.fmt}-"
                f"{self.rounding}-{place}-{self.dtype}-{self.cache}")

    @property
    def api_layout(self) -> str:
        return "NHD" if self.layout == "3D" else self.layout

    @property
    def pad(self) -> int:
        return {"inline4": 4, "inline16": 16}.get(self.place, 0)

    @property
    def num_slots(self) -> int:
        return self.pages * self.page_size

    @property
    def pages(self) -> int:
        return -(-self.tokens // self.page_size) + 2

    def cache_shape(self):
        w = self.head_dim + self.pad
        if self.layout == "3D":
            return (self.num_slots, self.heads, w)
        if self.layout == "NHD":
            return (self.pages, self.page_size, self.heads, w)
        return (self.pages, self.heads, self.page_size, w)

    def scale_shape(self):
        shape = self.cache_shape()[:-1]
        if self.place == "token_head":
            return shape
        return shape[:1] if self.layout == "3D" else (shape[0], self.page_size)

    def index(self, slot: int, head: int) -> tuple:
        """Where (slot, head)'s row lives in the cache: the slot arithmetic, written out."""
        if self.layout == "3D":
            return (slot, head)
        page, offset = slot // self.page_size, slot % self.page_size
        return (page, offset, head) if self.layout == "NHD" else (page, head, offset)

    def scale_index(self, slot: int, head: int) -> tuple:
        if self.place == "token_head":
            return self.index(slot, head)
        return (slot,) if self.layout == "3D" else (slot // self.page_size, slot % self.page_size)


def _dyn_cases():
    dims, heads = [40, 72, 80, 96, 192, 256], [1, 3, 8]
    out, i = [], 0
    for place in ("token_head", "token", "inline4", "inline16"):
        for layout in ("NHD", "HND", "3D"):
            for rounding in ("exact", "pow2"):
                out.append(DynCase(
                    tokens=[7, 19, 1, 33][i % 4], heads=heads[i % 3], head_dim=dims[(i // 3) % 6],
                    page_size=1 if layout == "3D" else [16, 1, 32][(i // 2 + i // 6) % 3],
                    layout=layout,
                    fmt=["e4m3", "e5m2"][(i // 2) % 2], rounding=rounding, place=place,
                    dtype=["bfloat16", "float16", "float32"][i % 3],
                    cache=["typed", "uint8"][(i // 3) % 2]))
                i += 1
    out.append(DynCase(0, 3, 80, 16, "NHD", "e4m3", "exact", "token_head", "bfloat16", "typed"))
    return out


DYN_CASES = _dyn_cases()


def dyn_inputs(case: DynCase, seed: int = 0) -> dict:
    """K/V, poisoned caches and scale caches (random bits, NaNs included), slots with padding."""
    rng = np.random.default_rng(seed)
    slots = rng.permutation(case.num_slots)[: case.tokens].astype(np.int64)
    if case.tokens > 2:
        slots[0] = -1                   # padding
        slots[-1] = case.num_slots + 3  # past the cache: padding too
    cache_dtype = "uint8" if case.cache == "uint8" else FORMATS[case.fmt].dtype
    caches = [rng.integers(0, 256, size=case.cache_shape(), dtype=np.uint8).view(
        np_dtype(cache_dtype)) for _ in range(2)]
    scales = [None, None]
    if not case.pad:
        scales = [rng.integers(0, 2 ** 32, size=case.scale_shape(), dtype=np.uint64).astype(
            np.uint32).view(np.float32) for _ in range(2)]
    # keys with specials (inf groups, 1e30 ...), values without
    kv = [random_kv(rng, case.tokens, case.heads, case.head_dim, case.dtype, specials=sp)
          for sp in (True, False)]
    return dict(key=kv[0], value=kv[1], key_cache=caches[0], value_cache=caches[1], slots=slots,
                key_scale_cache=scales[0], value_scale_cache=scales[1])


def run_write(case: DynCase, x: dict):
    place = "inline" if case.pad else None
    got = ref.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"], x["slots"],
                       layout=case.api_layout,
                       fp8_format=case.fmt if case.cache == "uint8" else None,
                       key_scale_cache=place or x["key_scale_cache"],
                       value_scale_cache=place or x["value_scale_cache"],
                       scale_rounding=case.rounding)
    assert len(got) == (2 if case.pad else 4)
    return got


@pytest.mark.parametrize("case", DYN_CASES, ids=lambda c: c.id)
def test_write_places_codes_and_scales(case):
    x = dyn_inputs(case)
    got = run_write(case, x)
    f, d = FORMATS[case.fmt], case.head_dim
    for side in (0, 1):
        kv = x[("key", "value")[side]]
        old_cache = as_uint(x[("key_cache", "value_cache")[side]])
        new_cache = as_uint(got[side])
        want_cache = old_cache.copy()
        old_scales = new_scales = want_scales = None
        if not case.pad:
            old_scales = as_uint(x[("key_scale_cache", "value_scale_cache")[side]])
            new_scales = as_uint(got[2 + side])
            want_scales = old_scales.copy()
        for t, slot in enumerate(x["slots"]):
            if not 0 <= slot < case.num_slots:
                continue
            for h in range(case.heads):
                members = kv[t] if case.place == "token" else kv[t, h]   # the scale's group
                s = naive_scale(members, case.fmt, case.rounding)
                row = want_cache[case.index(slot, h)]
                row[:d] = ref.quantize(kv[t, h], s, f)
                if case.pad:   # fp32 little-endian scale, then zeros
                    row[d:] = np.frombuffer(struct.pack("<f", s) + bytes(case.pad - 4), np.uint8)
                else:
                    want_scales[case.scale_index(slot, h)] = as_uint(np.float32(s))
        np.testing.assert_array_equal(new_cache, want_cache)   # untouched bytes keep the poison
        if not case.pad:
            np.testing.assert_array_equal(new_scales, want_scales)
    # the inputs were not modified
    assert (as_uint(x["key_cache"]) == as_uint(dyn_inputs(case)["key_cache"])).all()


@pytest.mark.parametrize("case", DYN_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("out", ["bfloat16", "float32"])
def test_dequantize_reads_scales(case, out):
    """Every element of every page the table names, against decode(byte) * its slot's scale."""
    x = dyn_inputs(case)
    got = run_write(case, x)
    kc, vc = got[:2]
    kw = dict(key_scale_cache="inline", value_scale_cache="inline", head_dim=case.head_dim) \
        if case.pad else dict(key_scale_cache=got[2], value_scale_cache=got[3])
    rng = np.random.default_rng(1)
    table = np.concatenate([rng.permutation(case.pages), [-1, case.pages + 1]]).astype(np.int32)
    table = table.reshape(2, -1) if table.size % 2 == 0 else table.reshape(1, -1)
    kp, vp, new_table = ref.dequantize_pages(kc, vc, table, dtype=out, layout=case.api_layout,
                                             fp8_format=case.fmt if case.cache == "uint8" else None,
                                             **kw)
    assert new_table.reshape(-1).tolist() == list(range(table.size))
    f, d = FORMATS[case.fmt], case.head_dim
    for side, (cache, pages) in enumerate(((kc, kp), (vc, vp))):
        raw = as_uint(cache)
        assert pages.shape[-1] == d and pages.dtype == np_dtype(out)
        want = np.zeros(pages.shape, pages.dtype)
        for i, page in enumerate(table.reshape(-1)):
            if not 0 <= page < case.pages:
                continue       # padding: zeros
            for o in range(case.page_size):
                slot = page * case.page_size + o
                for h in range(case.heads):
                    row = raw[case.index(slot, h)]
                    if case.pad:
                        s = np.float32(struct.unpack("<f", row[d:d + 4].tobytes())[0])
                    else:
                        s = got[2 + side][case.scale_index(slot, h)]
                    if case.layout == "3D":
                        dst = (i, h)
                    elif case.layout == "NHD":
                        dst = (i, o, h)
                    else:
                        dst = (i, h, o)
                    want[dst] = ref.dequantize(row[:d], s, f, out)
        np.testing.assert_array_equal(as_uint(pages), as_uint(want))


@pytest.mark.parametrize("pad", [4, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND", "3D"])
def test_inline_equals_side_cache(pad, layout):
    """The same write through "inline" and through a per token-head side array: identical codes,
    identical scales, identical dequantized pages."""
    case = DynCase(21, 3, 80, 1 if layout == "3D" else 8, layout, "e5m2", "pow2", "token_head",
                   "bfloat16", "uint8")
    inline = DynCase(**{**case.__dict__, "place": f"inline{pad}"})
    xs, xi = dyn_inputs(case), dyn_inputs(inline)
    # start both from zeroed caches so that the unwritten slots agree as well
    zero = lambda c: np.zeros(c.cache_shape(), np.uint8)  # noqa: E731
    xs.update(key_cache=zero(case), value_cache=zero(case),
              key_scale_cache=np.zeros(case.scale_shape(), np.float32),
              value_scale_cache=np.zeros(case.scale_shape(), np.float32))
    xi.update(key=xs["key"], value=xs["value"], slots=xs["slots"], key_cache=zero(inline),
              value_cache=zero(inline))
    side, inl = run_write(case, xs), run_write(inline, xi)
    for c_side, c_inl, sc in zip(side[:2], inl[:2], side[2:]):
        np.testing.assert_array_equal(c_inl[..., :80], c_side)
        np.testing.assert_array_equal(np.ascontiguousarray(c_inl[..., 80:84]).view("<f4")[..., 0],
                                      sc)
        assert not c_inl[..., 84:].any()
    table = np.arange(case.pages, dtype=np.int32)[None]
    a = ref.dequantize_pages(*side[:2], table, layout=case.api_layout, fp8_format="e5m2",
                             key_scale_cache=side[2], value_scale_cache=side[3])
    b = ref.dequantize_pages(*inl[:2], table, layout=case.api_layout, fp8_format="e5m2",
                             key_scale_cache="inline", value_scale_cache="inline", head_dim=80)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(as_uint(u), as_uint(v))


def test_inline_bytes_by_hand():
    """One token, one head, head_dim 2, +16: codes (896/2 = 448 -> 0x7E, -1/2 -> 0xB0), then 2.0
    as fp32 little-endian (00 00 00 40), then 12 zeros."""
    key = np.array([[[896.0, -1.0]]], np.float32)
    cache = np.full((1, 1, 18), 0xAB, np.uint8)
    kc, _ = ref.write_kv(key, key, cache, cache, [0], fp8_format="e4m3",
                         key_scale_cache="inline", value_scale_cache="inline")
    assert kc[0, 0].tolist() == [0x7E, 0xB0] + [0x00, 0x00, 0x00, 0x40] + [0] * 12
    kp, _, _ = ref.dequantize_pages(kc, kc, [[0]], dtype="float32", fp8_format="e4m3",
                                    key_scale_cache="inline", value_scale_cache="inline",
                                    head_dim=2)
    assert kp.tolist() == [[[896.0, -1.0]]]


def test_mixed_static_and_dynamic():
    """K dynamic (side array), V static: a 4-tuple whose value entry is None."""
    rng = np.random.default_rng(6)
    key = random_kv(rng, 5, 2, 40, "bfloat16")
    cache = np.zeros((3, 4, 2, 40), np.uint8)
    ks = np.full((3, 4), -1.0, np.float32)
    kc, vc, ks_new, vs_new = ref.write_kv(key, key, cache, cache, np.arange(5), value_scale=0.5,
                                          key_scale_cache=ks)
    assert vs_new is None and (ks == -1).all()
    np.testing.assert_array_equal(vc[:1].reshape(4, 2, 40)[:4], ref.quantize(key[:4], 0.5, E4M3))
    np.testing.assert_array_equal(ks_new.reshape(-1)[:5],
                                  dynamic_scales(key, E4M3, "token", "exact"))
    assert (ks_new.reshape(-1)[5:] == -1).all()


def test_static_write_still_returns_two_caches():
    key = np.ones((2, 1, 8), np.float32)
    cache = np.zeros((4, 1, 8), np.uint8)
    assert len(ref.write_kv(key, key, cache, cache, [0, 1], 1.0, 1.0)) == 2


def test_bad_arguments_name_themselves():
    key = np.ones((2, 2, 8), np.float32)
    cache = np.zeros((2, 4, 2, 8), np.uint8)
    side = np.zeros((2, 4, 2), np.float32)
    slots = [0, 1]
    with pytest.raises(ValueError, match="key_scale: expected None when key_scale_cache is given"):
        ref.write_kv(key, key, cache, cache, slots, 0.5, None, key_scale_cache=side)
    with pytest.raises(ValueError, match=r"value_scale_cache: expected shape \[2, 4, 2\] \(per "
                                         r"token-head\) or \[2, 4\] \(per token\) .* got \[2, 2\]"):
        ref.write_kv(key, key, cache, cache, slots, value_scale_cache=np.zeros((2, 2), np.float32))
    with pytest.raises(TypeError, match="key_scale_cache: expected dtype float32, got float64"):
        ref.write_kv(key, key, cache, cache, slots, key_scale_cache=np.zeros((2, 4, 2)))
    with pytest.raises(ValueError, match="key_scale_cache: expected None, 'inline' or a float32 "
                                         "array, got 'inline16'"):
        ref.write_kv(key, key, cache, cache, slots, key_scale_cache="inline16")
    with pytest.raises(TypeError, match="key_scale_cache: expected None, 'inline' or a float32 "
                                        "array, got list"):
        ref.write_kv(key, key, cache, cache, slots, key_scale_cache=[1.0])
    with pytest.raises(ValueError, match=r"key_cache: expected a last dimension of head_dim \+ 4 "
                                         r"\(12\) or head_dim \+ 16 \(24\) .* got 8"):
        ref.write_kv(key, key, cache, cache, slots, key_scale_cache="inline")
    with pytest.raises(ValueError, match="scale_rounding: expected 'exact' or 'pow2', got 'e8m0'"):
        ref.write_kv(key, key, cache, cache, slots, key_scale_cache=side, scale_rounding="e8m0")
    table = np.zeros((1, 1), np.int32)
    wide = np.zeros((2, 4, 2, 24), np.uint8)
    with pytest.raises(ValueError, match="head_dim: expected an int with an inline scale cache"):
        ref.dequantize_pages(wide, wide, table, key_scale_cache="inline",
                             value_scale_cache="inline")
    with pytest.raises(TypeError, match="head_dim: expected None or an int, got float"):
        ref.dequantize_pages(wide, wide, table, key_scale_cache="inline", head_dim=8.0)
    with pytest.raises(ValueError, match=r"head_dim: expected the last dimension of value_cache "
                                         r"\(24\) without an inline scale cache, got 8"):
        ref.dequantize_pages(wide, wide, table, key_scale_cache="inline", head_dim=8)
    with pytest.raises(ValueError, match=r"key_cache: expected a last dimension of head_dim \+ 4 "
                                         r"\(14\)"):
        ref.dequantize_pages(wide, wide, table, key_scale_cache="inline",
                             value_scale_cache="inline", head_dim=10)
    with pytest.raises(ValueError, match="value_scale: expected None when value_scale_cache"):
        ref.dequantize_pages(cache, cache, table, None, 2.0, value_scale_cache=side)
