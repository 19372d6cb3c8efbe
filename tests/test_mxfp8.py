"""MXFP8 caches (docs/SPEC.md section 13a), torch: every path against fp8kv.reference, byte for
byte.

The kernels through the interpreter (compiled too in the GPU suite) on poisoned caches and
block-scale arrays in both layouts and rank 3, typed and uint8 caches, combined and stacked
caches, padding and out-of-range slots and table entries, every code byte with every scale byte;
argument errors (nothing written); torch and JAX writing the same bytes. The GPU suite also runs
every case, random values with extremes, and compares the fast path with the exact one on every
bf16 and fp16 pattern. The rule by hand is tests/test_reference_mxfp8.py, the JAX frontend
tests/test_mxfp8_jax.py.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.cases import as_uint, random_values  # noqa: E402
from tests.helpers import (bits, block_scaled_dequant_args, raises_and_writes_nothing,  # noqa: E402
                           requires_cuda, to_torch)
from tests.mxfp8_cases import CASES, MxCase, inputs, ref_write, table  # noqa: E402
from fp8kv import reference as ref  # noqa: E402
from fp8kv.reference import np_dtype  # noqa: E402
import fp8kv_torch  # noqa: E402
from fp8kv_torch import _launch  # noqa: E402

CPU_CASES = CASES[:2]   # the interpreter is slow: small cases on the CPU, all of them on a GPU
OUT_DTYPES = ["bfloat16", "float16", "float32"]


def _t(a, device):
    return a if a is None or isinstance(a, (float, str)) else to_torch(a, device)


def torch_write(case, x, device, exact=None):
    """The four written arrays' bits, through fp8kv_torch (or, with ``exact``, the launcher)."""
    t = {name: _t(a, device) for name, a in x.items()}
    if exact is None:
        fp8kv_torch.write_kv(**t, layout=case.api_layout, cache_format="mxfp8")
    else:
        _launch.call("write_kv", t["key"], t["value"], t["key_cache"], t["value_cache"], t["slots"],
                         None, None, case.api_layout, None, exact=exact,
                         key_scale_cache=t["key_scale_cache"],
                         value_scale_cache=t["value_scale_cache"], cache_format="mxfp8")
    return [bits(t[n]) for n in ("key_cache", "value_cache", "key_scale_cache",
                                  "value_scale_cache")]


def torch_dequantize(case, arrays, out, device, exact=None):
    tab = _t(table(case), device)
    kc, vc, ks, vs = (_t(a, device) for a in arrays)
    kw = dict(layout=case.api_layout, null_page=0, key_scale_cache=ks, value_scale_cache=vs,
              cache_format="mxfp8")
    if exact is None:
        return fp8kv_torch.dequantize_pages(kc, vc, tab, dtype=getattr(torch, out), **kw)
    return _launch.call("dequantize_pages", kc, vc, tab, None, None, getattr(torch, out),
                                    case.api_layout, None, 0, exact=exact,
                                    key_scale_cache=ks, value_scale_cache=vs,
                                    cache_format="mxfp8")


def ref_dequantize(case, arrays, out):
    return ref.dequantize_pages(*arrays[:2], table(case), layout=case.api_layout, null_page=0,
                                key_scale_cache=arrays[2], value_scale_cache=arrays[3],
                                cache_format="mxfp8", dtype=out)


def _bits(a) -> np.ndarray:
    return bits(a) if isinstance(a, torch.Tensor) else as_uint(np.asarray(a))


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):   # whole arrays: untouched poison bytes compared too
        np.testing.assert_array_equal(_bits(g), _bits(w))


# ---------------------------------------------------------------------------------------------
# Kernels (interpreter on the CPU; compiled too on a GPU) against the reference.

@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id)
def test_write_matches_reference(case, device):
    x = inputs(case)
    assert_same(torch_write(case, x, device), ref_write(case, x))


@pytest.mark.parametrize("case,out", [(CPU_CASES[0], "bfloat16"), (CPU_CASES[1], "float32"),
                                      (CPU_CASES[0], "float16")],
                         ids=lambda v: v.id if isinstance(v, MxCase) else v)
def test_dequantize_matches_reference(case, out, device):
    """Poisoned caches (every byte value: NaN codes, NaN scales 0xFF, scales past 246 that
    overflow) read through a table with padding, a null page and an entry past the cache."""
    x = inputs(case)
    arrays = [x[n] for n in ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache")]
    got = torch_dequantize(case, arrays, out, device)
    assert got[0].shape == (6,) + case.shape(case.head_dim)[1:]
    assert_same(got, ref_dequantize(case, arrays, out))


def test_every_code_with_every_scale(device):
    """All 256 code bytes under each of the 256 scale bytes, to fp32 and bf16."""
    codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1)).reshape(1, 256, 1, 256)
    scales = np.repeat(np.arange(256, dtype=np.uint8), 8).reshape(1, 256, 1, 8)
    tab = np.zeros((1, 1), np.int32)
    for out in ("float32", "bfloat16"):
        got = fp8kv_torch.dequantize_pages(
            _t(codes, device), _t(codes, device), _t(tab, device),
            key_scale_cache=_t(scales, device), value_scale_cache=_t(scales, device),
            cache_format="mxfp8", dtype=getattr(torch, out))
        assert_same(got, ref.dequantize_pages(codes, codes, tab, key_scale_cache=scales,
                                              value_scale_cache=scales, cache_format="mxfp8",
                                              dtype=out))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_combined_cache(layout, device):
    """A combined cache [P, 2, ...] with its block scales as views of one [P, 2, ..., D/32]
    buffer, written and read back (combined output)."""
    rng = np.random.default_rng(5)
    tokens, h, d, pages, ps = 5, 2, 64, 3, 2
    shape = (pages, 2, ps, h) if layout == "NHD" else (pages, 2, h, ps)
    kv = rng.integers(0, 256, size=shape + (d,), dtype=np.uint8).view(np_dtype("float8_e4m3fn"))
    sc = rng.integers(0, 256, size=shape + (d // 32,), dtype=np.uint8)
    key, value = (random_values(rng, (tokens, h, d), "bfloat16") for _ in range(2))
    slots = rng.permutation(pages * ps)[:tokens]
    slots[1] = -1
    t_kv, t_sc = to_torch(kv, device), to_torch(sc, device)
    fp8kv_torch.write_kv_combined(to_torch(key, device), to_torch(value, device), t_kv,
                                  to_torch(slots, device), layout=layout,
                                  key_scale_cache=t_sc[:, 0], value_scale_cache=t_sc[:, 1],
                                  cache_format="mxfp8")
    wk, wv, wks, wvs = ref.write_kv(key, value, kv[:, 0], kv[:, 1], slots, layout=layout,
                                    key_scale_cache=sc[:, 0], value_scale_cache=sc[:, 1],
                                    cache_format="mxfp8")
    got_kv, got_sc = bits(t_kv), bits(t_sc)
    assert_same([got_kv[:, 0], got_kv[:, 1], got_sc[:, 0], got_sc[:, 1]], [wk, wv, wks, wvs])
    tab = torch.tensor([[2, 0, -1]], dtype=torch.int32, device=device)
    pages_out, _ = fp8kv_torch.dequantize_pages_combined(
        t_kv, tab, layout=layout, key_scale_cache=t_sc[:, 0], value_scale_cache=t_sc[:, 1],
        cache_format="mxfp8")
    rk, rv, _ = ref.dequantize_pages(wk, wv, tab.cpu().numpy(), layout=layout,
                                     key_scale_cache=wks, value_scale_cache=wvs,
                                     cache_format="mxfp8")
    assert_same([pages_out[:, 0], pages_out[:, 1]], [rk, rv])


@pytest.mark.parametrize("layer", [1, "tensor", 3])
def test_stacked_caches(layer, device):
    """layer=: codes and block scales of one layer of [L, ...] stacks; an out-of-range layer
    writes nothing and reads zero pages."""
    case = MxCase(tokens=3, heads=2, head_dim=32, page_size=2)
    x = inputs(case, seed=3)
    stacks = {n: np.stack([x[n]] * 3) for n in ("key_cache", "value_cache", "key_scale_cache",
                                                 "value_scale_cache")}
    arg = torch.tensor(1, dtype=torch.int32, device=device) if layer == "tensor" else layer
    index = 1 if layer == "tensor" else layer
    t = {n: _t(a, device) for n, a in {**x, **stacks}.items()}
    fp8kv_torch.write_kv(**t, cache_format="mxfp8", layer=arg)
    want = ref.write_kv(**{**x, **stacks}, cache_format="mxfp8", layer=index)
    assert_same([t[n] for n in stacks], want)
    tab = table(case)
    got = fp8kv_torch.dequantize_pages(t["key_cache"], t["value_cache"], _t(tab, device),
                                       key_scale_cache=t["key_scale_cache"],
                                       value_scale_cache=t["value_scale_cache"],
                                       cache_format="mxfp8", layer=arg, dtype=torch.float32)
    assert_same(got, ref.dequantize_pages(*want[:2], tab, key_scale_cache=want[2],
                                          value_scale_cache=want[3], cache_format="mxfp8",
                                          layer=index, dtype="float32"))


def test_torch_and_jax_write_the_same_bytes():
    jax = pytest.importorskip("jax")
    import fp8kv_jax
    case = CASES[0]
    x = inputs(case)
    with jax.default_device(jax.devices("cpu")[0]):
        got = fp8kv_jax.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"],
                                 x["slots"].astype(np.int32), layout=case.api_layout,
                                 key_scale_cache=x["key_scale_cache"],
                                 value_scale_cache=x["value_scale_cache"], cache_format="mxfp8")
    assert_same(got, torch_write(case, x, "cpu"))


# ---------------------------------------------------------------------------------------------
# Errors: raised before anything is written.

T, H, D, P, S = 5, 2, 64, 3, 4


def _good():
    return dict(key=torch.randn(T, H, D, dtype=torch.bfloat16),
                value=torch.randn(T, H, D, dtype=torch.bfloat16),
                key_cache=torch.full((P, S, H, D), 0x11, dtype=torch.uint8),
                value_cache=torch.full((P, S, H, D), 0x11, dtype=torch.uint8),
                slots=torch.arange(T),
                key_scale_cache=torch.full((P, S, H, D // 32), 0x22, dtype=torch.uint8),
                value_scale_cache=torch.full((P, S, H, D // 32), 0x22, dtype=torch.uint8),
                cache_format="mxfp8")


def _with(**changes):
    args = _good()
    args.update(changes)
    return args


WRITE_ERRORS = [
    ("head-dim-48", _with(key=torch.zeros(T, H, 48, dtype=torch.bfloat16),
                          value=torch.zeros(T, H, 48, dtype=torch.bfloat16)), ValueError,
     r"key: expected a head_dim that is a multiple of 32 for cache_format='mxfp8' .*got 48"),
    ("typed-e5m2", _with(key_cache=torch.zeros(P, S, H, D, dtype=torch.float8_e5m2),
                         value_cache=torch.zeros(P, S, H, D, dtype=torch.float8_e5m2)),
     TypeError, r"key_cache: expected dtype uint8 or float8_e4m3fn for cache_format='mxfp8' "
     r"\(float8_e4m3fn codes\), got float8_e5m2"),
    ("block-shape", _with(value_scale_cache=torch.zeros(P, S, H, D // 16, dtype=torch.uint8)),
     ValueError, r"value_scale_cache: expected an array \[3, 4, 2, 2\] of uint8 .*, got shape "
     r"\[3, 4, 2, 4\]"),
    ("block-dtype", _with(key_scale_cache=torch.zeros(P, S, H, D // 32)), TypeError,
     r"key_scale_cache: expected dtype uint8, got float32"),
    ("block-dtype-e4m3", _with(key_scale_cache=torch.zeros(P, S, H, D // 32,
                                                           dtype=torch.float8_e4m3fn)),
     TypeError, r"key_scale_cache: expected dtype uint8, got float8_e4m3fn"),
    ("block-missing", _with(value_scale_cache=None), ValueError,
     r"value_scale_cache: expected the block scales of an mxfp8 cache, an array \[3, 4, 2, 2\]"),
    ("block-inline", _with(key_scale_cache="inline", value_scale_cache="inline"), ValueError,
     r"key_scale_cache: expected the block scales of an mxfp8 cache, .*got 'inline'"),
    ("key-scale", _with(key_scale=0.5), ValueError,
     r"key_scale: expected None when key_scale_cache is given"),
    ("value-scale", _with(value_scale=torch.ones(())), ValueError,
     r"value_scale: expected None when value_scale_cache is given"),
    ("fp8-format-mxfp8", _with(cache_format=None, fp8_format="mxfp8"), ValueError,
     r"fp8_format: expected 'e4m3', 'e5m2' or None \(name it with cache_format='mxfp8'\)"),
    ("pow2", _with(scale_rounding="pow2"), ValueError,
     r"scale_rounding: expected 'exact' for cache_format='mxfp8'"),
]


@pytest.mark.parametrize("name,args,exc,match", WRITE_ERRORS, ids=[e[0] for e in WRITE_ERRORS])
def test_write_errors_write_nothing(name, args, exc, match):
    raises_and_writes_nothing(fp8kv_torch.write_kv, args, exc, match)


def _dq(**changes):
    return block_scaled_dequant_args(_good(), "mxfp8", **changes)


DEQUANT_ERRORS = [
    ("key-scale", _dq(key_scale=2.0), ValueError,
     r"key_scale: expected None when key_scale_cache is given"),
    ("fp8-output", _dq(dtype=torch.float8_e4m3fn), TypeError,
     r"dtype: expected bfloat16, float16 or float32 \(float8_e4m3fn output is for "
     r"cache_format='nvfp4'\), got float8_e4m3fn"),
    ("head-dim", _dq(head_dim=32), ValueError,
     r"head_dim: expected that of key_cache \(64: 64 bytes of 1 codes\), got 32"),
    ("width", _dq(key_cache=torch.zeros(P, S, H, 48, dtype=torch.uint8),
                  value_cache=torch.zeros(P, S, H, 48, dtype=torch.uint8)), ValueError,
     r"key_cache: expected a head_dim that is a multiple of 32 .*got 48"),
    ("block-shape", _dq(key_scale_cache=torch.zeros(P, S, H, 3, dtype=torch.uint8)), ValueError,
     r"key_scale_cache: expected an array \[3, 4, 2, 2\]"),
]


@pytest.mark.parametrize("name,args,exc,match", DEQUANT_ERRORS, ids=[e[0] for e in DEQUANT_ERRORS])
def test_dequantize_errors(name, args, exc, match):
    with pytest.raises(exc, match=match):
        fp8kv_torch.dequantize_pages(**args)


def test_rope_write_kv_rejects_mxfp8():
    """rope_write_kv writes the FP8 formats only (as for nvfp4): naming mxfp8 is a ValueError."""
    a = _good()
    with pytest.raises(ValueError, match=r"fp8_format: expected 'e4m3', 'e5m2' or None "
                                         r"\(rope_write_kv writes the FP8 formats and takes no "
                                         r"cache_format; .*cache_format='mxfp8'.*got 'mxfp8'"):
        fp8kv_torch.rope_write_kv(a["key"], a["key"], a["value"], a["key_cache"],
                                  a["value_cache"], a["slots"], torch.arange(T),
                                  torch.ones(8, D), fp8_format="mxfp8")


# ---------------------------------------------------------------------------------------------
# GPU only: every case, the fast path against the exact one and the reference.

@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gpu_every_case_fast_and_exact(case):
    for seed in range(3):
        x = inputs(case, seed=seed)
        want = ref_write(case, x)
        for exact in (False, True):
            written = torch_write(case, x, "cuda", exact=exact)
            assert_same(written, want)
        arrays = [x[n] for n in ("key_cache", "value_cache", "key_scale_cache",
                                 "value_scale_cache")]
        for out in OUT_DTYPES:
            for source in (arrays, want):   # poisoned bytes, and what the write wrote
                for exact in (False, True):
                    assert_same(torch_dequantize(case, source, out, "cuda", exact=exact),
                                ref_dequantize(case, source, out))


def _all_patterns(dtype: str, arrangement: str) -> np.ndarray:
    """Every bit pattern of ``dtype`` as ``[64, 8, 128]``: grouped by magnitude (each block of
    32 holds neighbours) or shuffled."""
    p = np.arange(1 << 16, dtype=np.uint16)
    if arrangement == "sorted":
        p = p[np.argsort(p & 0x7FFF, kind="stable")]
    else:
        p = np.random.default_rng(7).permutation(p)
    return p.view(np_dtype(dtype)).reshape(64, 8, 128)


@requires_cuda
@pytest.mark.parametrize("arrangement", ["sorted", "shuffled"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_every_pattern_fast_equals_exact(dtype, arrangement):
    case = MxCase(tokens=64, heads=8, head_dim=128, page_size=16, dtype=dtype)
    x = inputs(case, specials=False)
    x["key"] = _all_patterns(dtype, arrangement)
    x["value"] = -x["key"]
    x["slots"] = np.random.default_rng(8).permutation(case.num_slots)[:64]
    want = ref_write(case, x)
    for exact in (False, True):
        assert_same(torch_write(case, x, "cuda", exact=exact), want)


@requires_cuda
def test_gpu_random_fp32_extremes():
    """fp32 values over the whole exponent range (subnormals, the largest finite values,
    NaN, inf), with blocks of one binade and blocks spanning many."""
    rng = np.random.default_rng(11)
    shape = (256, 4, 256)
    u = rng.integers(0, 1 << 32, size=shape, dtype=np.uint64).astype(np.uint32)
    x = u.view(np.float32).copy()
    narrow = x.reshape(256, 4, 8, 32)[:128]   # a view: blocks of one binade around 1
    with np.errstate(all="ignore"):
        narrow *= np.float32(2.0) ** -np.floor(np.log2(np.abs(narrow[..., :1]) + 1e-45)).clip(
            -120, 120)
    case = MxCase(tokens=256, heads=4, head_dim=256, page_size=16, dtype="float32")
    arrays = inputs(case, specials=False)
    arrays.update(key=x, value=x[::-1].copy(), slots=np.arange(256, dtype=np.int64))
    want = ref_write(case, arrays)
    for exact in (False, True):
        assert_same(torch_write(case, arrays, "cuda", exact=exact), want)

