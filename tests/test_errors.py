"""Bad input gets a clear TypeError / ValueError before anything is written."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tests.helpers import requires_cuda, torch
from fp8kv_torch import dequantize_pages, dequantize_pages_combined, write_kv, write_kv_combined

T, H, D, P, S = 5, 2, 64, 3, 4


def good():
    return dict(key=torch.randn(T, H, D, dtype=torch.bfloat16),
                value=torch.randn(T, H, D, dtype=torch.bfloat16),
                key_cache=torch.full((P, S, H, D), 0x11, dtype=torch.uint8),
                value_cache=torch.full((P, S, H, D), 0x11, dtype=torch.uint8),
                slots=torch.arange(T))


def with_(**changes):
    args = good()
    args.update(changes)
    return args


WRITE_ERRORS = [
    ("key-int", with_(key=torch.zeros(T, H, D, dtype=torch.int32)), TypeError,
     r"key: expected dtype bfloat16 or float16 or float32, got int32"),
    ("value-dtype", with_(value=torch.zeros(T, H, D, dtype=torch.float16)), TypeError,
     r"value: expected the dtype of key \(bfloat16\), got float16"),
    ("key-rank", with_(key=torch.zeros(T, H * D, dtype=torch.bfloat16)), ValueError,
     r"key: expected rank 3 \[num_tokens, num_kv_heads, head_dim\], got shape \[5, 128\]"),
    ("value-shape", with_(value=torch.zeros(T, H, 32, dtype=torch.bfloat16)), ValueError,
     r"value: expected the shape of key \[5, 2, 64\], got \[5, 2, 32\]"),
    ("key-stride", with_(key=torch.zeros(T, D, H, dtype=torch.bfloat16).transpose(1, 2)), ValueError,
     r"key: expected a unit-stride last dimension, got strides \[128, 1, 2\]"),
    ("cache-dtype", with_(key_cache=torch.zeros(P, S, H, D, dtype=torch.bfloat16)), TypeError,
     r"key_cache: expected dtype float8_e4m3fn or float8_e5m2 or uint8, got bfloat16"),
    ("cache-rank", with_(key_cache=torch.zeros(P, S * H * D, dtype=torch.uint8)), ValueError,
     r"key_cache: expected rank 3 .* or rank 4 .*, got shape \[3, 512\]"),
    ("cache-heads", with_(key_cache=torch.zeros(P, S, 4, D, dtype=torch.uint8),
                          value_cache=torch.zeros(P, S, 4, D, dtype=torch.uint8)), ValueError,
     r"key_cache: expected num_kv_heads=2 and head_dim=64 \(those of key\), got num_kv_heads=4"),
    ("cache-pair-shape", with_(value_cache=torch.zeros(P + 1, S, H, D, dtype=torch.uint8)), ValueError,
     r"value_cache: expected the shape of key_cache \[3, 4, 2, 64\], got \[4, 4, 2, 64\]"),
    ("cache-pair-dtype", with_(value_cache=torch.zeros(P, S, H, D, dtype=torch.float8_e4m3fn)),
     TypeError, r"value_cache: expected the dtype of key_cache \(uint8\), got float8_e4m3fn"),
    ("cache-stride", with_(key_cache=torch.zeros(P, S, D, H, dtype=torch.uint8).transpose(2, 3)),
     ValueError, r"key_cache: expected a unit-stride last dimension"),
    ("slots-dtype", with_(slots=torch.arange(T, dtype=torch.int16)), TypeError,
     r"slots: expected dtype int32 or int64, got int16"),
    ("slots-float", with_(slots=torch.arange(T, dtype=torch.float32)), TypeError,
     r"slots: expected dtype int32 or int64, got float32"),
    ("slots-shape", with_(slots=torch.arange(T + 1)), ValueError,
     r"slots: expected shape \[5\] \(one per token\), got \[6\]"),
    ("slots-list", with_(slots=[0, 1, 2, 3, 4]), TypeError,
     r"slots: expected a torch.Tensor, got list"),
    ("slots-strided", with_(slots=torch.arange(2 * T)[::2]), ValueError,
     r"slots: expected a contiguous array, got strides \[2\]"),
    ("scale-strided", with_(key_scale=torch.ones(2 * H)[::2]), ValueError,
     r"key_scale: expected a contiguous array, got strides \[2\]"),
    ("scale-tiny", with_(key_scale=1e-40), ValueError,
     r"key_scale: expected a scale in the normal fp32 range \[2\*\*-126, 3.40282e\+38\], got 1e-40"),
    ("scale-huge", with_(value_scale=1e39), ValueError,
     r"value_scale: expected a scale in the normal fp32 range"),
    ("layout-mismatch", with_(key_cache=torch.zeros(P, H, S, D, dtype=torch.uint8),
                              value_cache=torch.zeros(P, H, S, D, dtype=torch.uint8)), ValueError,
     r"got num_kv_heads=4 and head_dim=64 with layout='NHD'; these shapes fit layout='HND'"),
    ("scale-dtype", with_(key_scale=torch.ones((), dtype=torch.float64)), TypeError,
     r"key_scale: expected dtype float32, got float64"),
    ("scale-shape", with_(value_scale=torch.ones(3)), ValueError,
     r"value_scale: expected shape \[\], \[1\] or \[2\] \(num_kv_heads\), got \[3\]"),
    ("scale-zero", with_(key_scale=0.0), ValueError, r"key_scale: expected a finite scale > 0, got 0.0"),
    ("scale-nan", with_(key_scale=float("nan")), ValueError, r"key_scale: expected a finite scale > 0"),
    ("scale-kind", with_(key_scale="1.0"), TypeError,
     r"key_scale: expected None, a float or a float32 array, got str"),
    ("layout", with_(layout="NDH"), ValueError, r"layout: expected 'NHD' or 'HND', got 'NDH'"),
    ("format", with_(fp8_format="e3m4"), ValueError,
     r"fp8_format: expected 'e4m3', 'e5m2' or None, got 'e3m4'"),
    ("format-mismatch", with_(key_cache=torch.zeros(P, S, H, D, dtype=torch.float8_e5m2),
                              value_cache=torch.zeros(P, S, H, D, dtype=torch.float8_e5m2),
                              fp8_format="e4m3"), ValueError,
     r"fp8_format: key_cache is float8_e5m2, which is 'e5m2', got fp8_format='e4m3'"),
]


@pytest.mark.parametrize("name,args,exc,match", WRITE_ERRORS, ids=[e[0] for e in WRITE_ERRORS])
def test_write_kv_rejects(name, args, exc, match):
    before = [args[c].clone() for c in ("key_cache", "value_cache")]
    with pytest.raises(exc, match=match):
        write_kv(**args)
    for b, c in zip(before, ("key_cache", "value_cache")):   # nothing was written
        assert torch.equal(b, args[c])


def test_write_kv_combined_rejects_a_non_combined_cache():
    args = good()
    with pytest.raises(ValueError, match=r"kv_cache: expected a combined cache \[num_pages, 2, \.\.\.\]"):
        write_kv_combined(args["key"], args["value"], args["key_cache"], args["slots"])


@requires_cuda
def test_mixed_devices_rejected():
    args = with_(key_cache=torch.zeros(P, S, H, D, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match=r"key_cache: expected device cpu \(that of key\), got cuda:0"):
        write_kv(**args)
    cache = torch.zeros(P, S, H, D, dtype=torch.uint8, device="cuda")
    args = good()
    args.update(key=args["key"].cuda(), value=args["value"].cuda(), key_cache=cache,
                value_cache=cache.clone(), slots=args["slots"].cuda(), key_scale=torch.ones(1))
    with pytest.raises(ValueError, match=r"key_scale: expected device cuda:0 \(that of the cache\), got cpu"):
        write_kv(**args)


def dq_good():
    c = torch.zeros(P, S, H, D, dtype=torch.float8_e4m3fn)
    return dict(key_cache=c, value_cache=c.clone(), block_table=torch.zeros(2, 2, dtype=torch.int32))


def dq_with(**changes):
    args = dq_good()
    args.update(changes)
    return args


DEQUANT_ERRORS = [
    ("dtype", dq_with(dtype=torch.int8), TypeError,
     r"dtype: expected one of 'bfloat16', 'float16', 'float32' \(a string, or the framework's "
     r"dtype of one\), got torch.int8"),
    ("dtype-str", dq_with(dtype="bf16"), TypeError,
     r"dtype: expected one of 'bfloat16', 'float16', 'float32' .*, got 'bf16'"),
    ("table-dtype", dq_with(block_table=torch.zeros(2, 2, dtype=torch.float32)), TypeError,
     r"block_table: expected dtype int32 or int64, got float32"),
    ("table-rank", dq_with(block_table=torch.zeros(4, dtype=torch.int32)), ValueError,
     r"block_table: expected rank 2 \[batch, pages_per_seq\], got shape \[4\]"),
    ("null-page", dq_with(null_page=0.5), TypeError, r"null_page: expected None or an int, got float"),
    ("cache-dtype", dq_with(value_cache=torch.zeros(P, S, H, D, dtype=torch.float8_e5m2)), TypeError,
     r"value_cache: expected the dtype of key_cache \(float8_e4m3fn\), got float8_e5m2"),
    ("layout", dq_with(layout="nhd"), ValueError, r"layout: expected 'NHD' or 'HND', got 'nhd'"),
    ("scale-shape", dq_with(key_scale=torch.ones(2, 2)), ValueError,
     r"key_scale: expected shape \[\], \[1\] or \[2\] \(num_kv_heads\), got \[2, 2\]"),
    ("out-count", dq_with(out=(torch.empty(4, S, H, D),)), ValueError,
     r"out: expected \(key_pages, value_pages, new_block_table\), got 1 tensors"),
    ("out-dtype", dq_with(out=(torch.empty(4, S, H, D), torch.empty(4, S, H, D),
                               torch.empty(2, 2, dtype=torch.int32))), TypeError,
     r"out\[0\]: expected dtype torch.bfloat16 \(the dtype argument\), got torch.float32"),
    ("out-shape", dq_with(out=(torch.empty(4, S, H, D, dtype=torch.bfloat16),
                               torch.empty(5, S, H, D, dtype=torch.bfloat16),
                               torch.empty(2, 2, dtype=torch.int32))), ValueError,
     r"out\[1\]: expected shape \[4, 4, 2, 64\], got \[5, 4, 2, 64\]"),
    ("out-table", dq_with(out=(torch.empty(4, S, H, D, dtype=torch.bfloat16),
                               torch.empty(4, S, H, D, dtype=torch.bfloat16),
                               torch.empty(2, 2, dtype=torch.int64))), TypeError,
     r"out\[-1\]: expected dtype int32, got int64"),
]


@pytest.mark.parametrize("name,args,exc,match", DEQUANT_ERRORS, ids=[e[0] for e in DEQUANT_ERRORS])
def test_dequantize_pages_rejects(name, args, exc, match):
    outs = args.get("out")
    before = [o.clone() for o in outs] if outs else []
    with pytest.raises(exc, match=match):
        dequantize_pages(**args)
    for b, o in zip(before, outs or ()):
        assert torch.equal(b.view(torch.uint8), o.view(torch.uint8))


def test_dequantize_pages_combined_rejects_a_non_combined_cache():
    with pytest.raises(ValueError, match=r"kv_cache: expected a combined cache"):
        dequantize_pages_combined(torch.zeros(P, S, H, D, dtype=torch.uint8),
                                  torch.zeros(1, 1, dtype=torch.int32))
