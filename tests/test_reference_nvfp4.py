"""The NVFP4 rule (docs/SPEC.md section 13) in fp8kv.reference, by hand: E2M1 codes and their
boundaries, special blocks (zeros, -0, NaN, inf, ties, scales rounding to 0) and special global
scales."""
from __future__ import annotations

import numpy as np

from tests.cases import as_uint, random_values
from tests.nvfp4_cases import E2M1
from fp8kv import reference as ref


def test_every_code_pair_decodes():
    codes = np.arange(256, dtype=np.uint8)
    want = [[(-1.0 if c & 8 else 1.0) * E2M1[c & 7] for c in (b & 0xF, b >> 4)] for b in range(256)]
    got = ref.e2m1_values(codes).reshape(256, 2)
    np.testing.assert_array_equal(as_uint(got), as_uint(np.float32(want)))
    assert as_uint(got[0x08, 0]) == 0x80000000    # 0x8 is -0.0


def boundary_code(a):
    """The magnitude code as the number of boundaries passed (SPEC 13.1's table)."""
    a = np.asarray(a, np.float32)
    return sum(((a >= b) if up else (a > b)).astype(np.uint8) for b, up in
               ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                (3.5, True), (5.0, False)))


def test_e2m1_rounding_nearest_ties_to_even_saturating():
    points = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + E2M1 + [7.0, 1e30, np.inf])
    neighbours = np.concatenate([points, np.nextafter(points, np.float32(0)),
                                 np.nextafter(points, np.float32(np.inf))]).astype(np.float32)
    rng = np.random.default_rng(1)
    sample = (rng.random(20000) * 8).astype(np.float32)
    for a in (neighbours, sample):
        np.testing.assert_array_equal(ref.e2m1_magnitude(a), boundary_code(a))
    assert ref.e2m1_magnitude(np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == [
        0, 2, 2, 4, 4, 6, 6]


def _one_block(values, g=None):
    codes, sf = ref.quantize_nvfp4(np.float32(values).reshape(1, 16), g)
    nibbles = np.stack([codes & 0xF, codes >> 4], -1).reshape(16)
    return nibbles.tolist(), int(sf[0, 0])


def test_reference_special_blocks():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    # amax 6, g 1: sf = e4m3(1.0) = 0x38, d = 1: the ties land on the boundaries.
    assert _one_block(ties + [-t for t in ties]) == ([0, 2, 2, 4, 4, 6, 6, 7,
                                                     8, 10, 10, 12, 12, 14, 14, 15], 0x38)
    assert _one_block([0.0] * 16) == ([0] * 16, 0x00)                 # d = 0: all 0x0
    assert _one_block([-0.0] * 16) == ([0] * 16, 0x00)                # not 0x8: d = 0
    assert _one_block([np.nan] * 16) == ([0] * 16, 0x00)              # amax 0 (NaN as 0)
    codes, sf = _one_block([np.nan, -6.0] + [-0.0] * 14)              # NaN -> 0x0, -0 -> 0x8
    assert (codes, sf) == ([0, 15] + [8] * 14, 0x38)
    codes, sf = _one_block([np.inf, -np.inf, 1.0, -1.0] + [0.0] * 12)  # amax inf -> 448
    assert (codes, sf) == ([7, 15, 0, 8] + [0] * 12, 0x7E)
    # A block far below the global scale: sf rounds to 0, d = 0, codes 0 (sign dropped).
    assert _one_block([-1e-6] * 16, np.float32(1.0)) == ([0] * 16, 0x00)


def test_reference_special_global_scales():
    """SPEC 13.2's table: g = +0, +inf, NaN, negative."""
    rng = np.random.default_rng(2)
    x = random_values(rng, (4, 1, 64), "float32", specials=False)
    x[0, 0, :16] = 0.0
    x[1, 0, 16] = np.inf
    for g, codes_zero, sf_bytes in ((0.0, True, {0x7E, 0x7F}), (np.inf, True, {0x00, 0x7F}),
                                    (np.nan, True, {0x7F})):
        codes, sf = ref.quantize_nvfp4(x, np.float32(g))
        assert codes_zero and not codes.any(), g
        assert set(np.unique(sf).tolist()) == sf_bytes, g
        values = ref.dequantize_nvfp4(codes, sf, np.float32(g), "float32")
        if g == 0.0:
            assert (np.isnan(values) == np.repeat(sf == 0x7F, 16, axis=-1)).all()
            assert (values[~np.isnan(values)] == 0).all()
        else:
            assert np.isnan(values).all()
    pos, neg = ref.quantize_nvfp4(x, np.float32(0.37)), ref.quantize_nvfp4(x, np.float32(-0.37))
    np.testing.assert_array_equal(neg[0], pos[0])
    np.testing.assert_array_equal(neg[1], pos[1] | 0x80)
    np.testing.assert_array_equal(ref.dequantize_nvfp4(*neg, np.float32(-0.37), "float32"),
                                  ref.dequantize_nvfp4(*pos, np.float32(0.37), "float32"))
