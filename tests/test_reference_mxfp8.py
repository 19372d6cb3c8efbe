"""The MXFP8 rule itself (docs/SPEC.md section 13a) on hand-computed blocks: the reference's
block scales, codes and read-back."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fp8kv import reference as ref
from fp8kv.formats import E8M0, MXFP8

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def block(*head, fill=0.0):
    """One block of 32 fp32 elements: ``head`` first, then ``fill``."""
    x = np.full(32, fill, np.float32)
    x[:len(head)] = np.float32(head)
    return x


def e4m3(v) -> int:
    """The e4m3 byte of an exactly representable value."""
    return int(np.float32(v).astype(E4M3).view(np.uint8))


def test_row():
    assert MXFP8.block_scaled and not MXFP8.packed
    assert MXFP8.blocks.size == 32 and MXFP8.blocks.scale is E8M0
    assert MXFP8.blocks.dtypes == ("uint8",)
    assert (E8M0.bias, E8M0.nan_code, E8M0.man_bits, E8M0.signed) == (127, 0xFF, 0, False)
    assert MXFP8.codec.BLOCK_SIZE == 32 and MXFP8.codec.BLOCK_SCALE.NAN_CODE == 0xFF


def test_amax_zero():
    """An all-zero block (signed zeros too) takes the clamp: e = 0; codes keep the zeros' signs."""
    x = block(0.0, -0.0)
    codes, e = ref.quantize_mxfp8(x[None])
    assert e.tolist() == [[0]]
    assert codes[0, 0] == 0x00 and codes[0, 1] == 0x80 and not codes[0, 2:].any()
    out = ref.dequantize_mxfp8(codes, e, "float32")
    assert out.view(np.uint32)[0, 1] == 0x80000000 and not out[0].any()


@pytest.mark.parametrize("k", [-100, -3, 0, 1, 7, 100, 119])
def test_amax_448_times_power_of_two(k):
    """amax = 448 * 2**k: X = 2**k exactly (floor(log2(448)) = 8), the amax is code 0x7E."""
    amax = np.float32(np.ldexp(448.0, k))
    x = block(amax, -amax, np.ldexp(1.0, k), np.ldexp(-3.0, k - 2))
    codes, e = ref.quantize_mxfp8(x[None])
    assert e.tolist() == [[k + 127]]
    assert codes[0, :4].tolist() == [0x7E, 0xFE, e4m3(1.0), e4m3(-0.75)]
    back = ref.dequantize_mxfp8(codes, e, "float32")[0]
    np.testing.assert_array_equal(back, x)   # every element is an e4m3 value times X: exact


def test_amax_just_below_a_power_of_two():
    """amax = 2**k - ulp: floor(log2) = k - 1, so X = 2**(k - 9) and amax / X rounds to 512,
    which saturates to 448; 2**k itself takes the next scale."""
    below = np.nextafter(np.float32(256.0), np.float32(0))          # 255.99998
    codes, e = ref.quantize_mxfp8(block(below, 200.0)[None])
    assert e.tolist() == [[7 - 8 + 127]]                            # X = 2**-1
    assert codes[0, :2].tolist() == [0x7E, e4m3(384.0)]             # 511.99997 -> 448; 400: tie
    codes, e = ref.quantize_mxfp8(block(256.0, 200.0)[None])
    assert e.tolist() == [[8 - 8 + 127]]                            # X = 1
    assert codes[0, :2].tolist() == [e4m3(256.0), e4m3(192.0)]      # 200 -> 192 (RNE)


def test_saturation_and_rounding():
    """Within one block (X = 1): |x / X| up to 448 rounds (RNE), past it saturates; below
    e4m3's smallest subnormal 2**-9: 2**-10 is a tie (to 0), 0.75 * 2**-9 rounds up."""
    x = block(511.0, 464.0, 463.99, -500.0, 0.0009765625, 0.00048828125, 0.00146484375)
    codes, e = ref.quantize_mxfp8(x[None])
    assert e.tolist() == [[127]]
    assert codes[0, :7].tolist() == [0x7E, 0x7E, 0x7E, 0xFE, 0x00, 0x00, 0x01]


def test_subnormal_fp32_amax():
    """A subnormal fp32 amax (exponent field 0) clamps to e = 0 (X = 2**-127): its elements are
    multiplied by 2**127 exactly."""
    tiny = np.float32(np.ldexp(1.0, -140))                          # fp32 subnormal
    x = block(tiny, -np.float32(np.ldexp(3.0, -148)))
    codes, e = ref.quantize_mxfp8(x[None])
    assert e.tolist() == [[0]]
    # 2**-140 * 2**127 = 2**-13: below half of 2**-9, +0; -3 * 2**-148 * 2**127 = -1.5 * 2**-20: -0
    assert codes[0, :2].tolist() == [0x00, 0x80]
    x = block(np.float32(np.ldexp(1.0, -120)), np.float32(np.ldexp(1.0, -130)))
    codes, e = ref.quantize_mxfp8(x[None])
    assert e.tolist() == [[0]]                                      # -120 - 8 < -127: clamped
    assert codes[0, :2].tolist() == [e4m3(128.0), e4m3(0.125)]
    back = ref.dequantize_mxfp8(codes, e, "float32")[0, :2]
    np.testing.assert_array_equal(back, x[:2])


def test_smallest_normal_amax_bound():
    """The largest amax that clamps: exponent field 8 (2**-119) gives e = 0 as do all below."""
    for k, want in ((-119, 0), (-118, 1), (127, 246)):
        codes, e = ref.quantize_mxfp8(block(np.float32(np.ldexp(1.0, k)))[None])
        assert e.tolist() == [[want]]
    codes, e = ref.quantize_mxfp8(block(np.float32(3.4028235e38))[None])
    assert e.tolist() == [[246]] and codes[0, 0] == 0x7E       # 1.99.. * 2**8 saturates


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_in_a_block(bad):
    """A NaN or an infinity makes the block's scale 0xFF (NaN) and every code 0x7F; the other
    blocks of the row are untouched; the NaN scale reads back as the canonical NaN."""
    row = np.concatenate([block(1.0, bad), block(2.0)])[None]
    codes, e = ref.quantize_mxfp8(row)
    assert e.tolist() == [[0xFF, 1 - 8 + 127]]
    assert (codes[0, :32] == 0x7F).all()
    assert codes[0, 32] == e4m3(256.0)                        # 2 / 2**-7
    for dtype, nan in (("bfloat16", 0x7FC0), ("float16", 0x7E00), ("float32", 0x7FC00000)):
        out = ref.dequantize_mxfp8(codes, e, dtype)
        bits = out.view(np.uint16 if out.itemsize == 2 else np.uint32)[0]
        assert (bits[:32] == nan).all()
        assert float(out[0, 32]) == 2.0


def test_nan_scale_reads_nan_for_zero_codes():
    out = ref.dequantize_mxfp8(np.zeros((1, 32), np.uint8), np.uint8([[0xFF]]), "float32")
    assert (out.view(np.uint32) == 0x7FC00000).all()


def test_read_rounding_and_overflow():
    """Read: the exact product rounded once to the output; e past 246 may overflow to inf."""
    codes = np.zeros((1, 32), np.uint8)
    codes[0, :3] = [0x7E, 0x01, 0x39]                         # 448, 2**-9, 1.125
    out = ref.dequantize_mxfp8(codes, np.uint8([[254]]), "float32")[0]
    assert np.isinf(out[0]) and out[1] == np.float32(np.ldexp(1.0, 118))
    out = ref.dequantize_mxfp8(codes, np.uint8([[0]]), "float32")[0]
    assert out[1] == np.float32(np.ldexp(1.0, -136))          # fp32 subnormal, exact
    bf = ref.dequantize_mxfp8(codes, np.uint8([[0]]), "bfloat16")[0]
    assert float(bf[1]) == 0.0                                 # below half of bf16's 2**-133
    bf = ref.dequantize_mxfp8(codes, np.uint8([[3]]), "bfloat16")[0]
    assert float(bf[1]) == np.ldexp(1.0, -133)                 # bf16's smallest subnormal
    assert float(ref.dequantize_mxfp8(codes, np.uint8([[0]]), "float16")[0, 1]) == 0.0


def test_head_dim_not_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        ref.quantize_mxfp8(np.zeros((1, 48), np.float32))


def test_write_and_read_caches():
    """reference.write_kv / dequantize_pages with cache_format="mxfp8": codes and block scales at
    the valid slots only, read back exactly for values on the grid."""
    rng = np.random.default_rng(0)
    t, h, d = 3, 2, 64
    x = (rng.integers(-8, 9, (t, h, d)) * 0.25).astype(np.float32)
    kc = np.full((4, 2, h, d), 0xAB, np.uint8)
    ks = np.full((4, 2, h, d // 32), 0xCD, np.uint8)
    slots = np.array([5, -1, 0])
    k, v, kb, vb = ref.write_kv(x, x, kc, kc.copy(), slots, key_scale_cache=ks,
                                value_scale_cache=ks.copy(), cache_format="mxfp8")
    codes, e = ref.quantize_mxfp8(x)
    assert (k[2, 1] == codes[0]).all() and (kb[2, 1] == e[0]).all()
    assert (k[0, 0] == codes[2]).all() and (kb[0, 0] == e[2]).all()
    assert (k[1] == 0xAB).all() and (kb[1] == 0xCD).all()
    with pytest.raises(ValueError, match="key_scale"):
        ref.write_kv(x, x, kc, kc, slots, 1.0, key_scale_cache=ks, value_scale_cache=ks,
                     cache_format="mxfp8")
    kp, vp, _ = ref.dequantize_pages(k, v, np.array([[2, 0]]), key_scale_cache=kb,
                                     value_scale_cache=vb, cache_format="mxfp8", dtype="float32")
    np.testing.assert_array_equal(kp[0, 1], x[0])
    np.testing.assert_array_equal(vp[1, 0], x[2])
