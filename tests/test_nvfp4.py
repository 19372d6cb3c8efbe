"""NVFP4 caches (docs/SPEC.md section 13), torch: every path against fp8kv.reference, byte for
byte.

The kernels through the interpreter (compiled too in the GPU suite) on poisoned caches and
block-scale arrays in both layouts and rank 3, combined caches, padding and out-of-range slots and
table entries; dequantization to bf16/fp16/fp32 and to an FP8 workspace; argument errors (nothing
written); the custom ops; torch and JAX writing the same bytes. The GPU suite also compares the
reciprocal (fast) path with the exact one on every bf16 and fp16 pattern. The rule by hand is
tests/test_reference_nvfp4.py, the JAX frontend tests/test_nvfp4_jax.py.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.cases import as_uint, random_values  # noqa: E402
from tests.helpers import (bits, block_scaled_dequant_args, raises_and_writes_nothing,  # noqa: E402
                           requires_cuda, to_torch)
from tests.nvfp4_cases import CASES, E2M1, NvCase, inputs, ref_write  # noqa: E402
from fp8kv import reference as ref  # noqa: E402
from fp8kv.modes import Division  # noqa: E402
from fp8kv.reference import np_dtype  # noqa: E402
import fp8kv_torch  # noqa: E402
from fp8kv_torch import _launch  # noqa: E402

def _t(a, device):
    return a if a is None or isinstance(a, (float, str)) else to_torch(a, device)


def torch_write(case, x, device, exact=None, combined=False):
    """The four written arrays' bits, through fp8kv_torch (or, with ``exact``, the launcher)."""
    t = {name: _t(a, device) for name, a in x.items()}
    if exact is None:
        fp8kv_torch.write_kv(**t, layout=case.api_layout, cache_format="nvfp4")
    else:
        _launch.call("write_kv", t["key"], t["value"], t["key_cache"], t["value_cache"], t["slots"],
                         t["key_scale"], t["value_scale"], case.api_layout, None, exact=exact,
                         key_scale_cache=t["key_scale_cache"],
                         value_scale_cache=t["value_scale_cache"], cache_format="nvfp4")
    return [bits(t[n]) for n in ("key_cache", "value_cache", "key_scale_cache",
                                  "value_scale_cache")]


def _bits(a) -> np.ndarray:
    return bits(a) if isinstance(a, torch.Tensor) else as_uint(np.asarray(a))


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):   # whole arrays: untouched poison bytes compared too
        np.testing.assert_array_equal(_bits(g), _bits(w))


# ---------------------------------------------------------------------------------------------
# Kernels (interpreter on the CPU; compiled too on a GPU) against the reference.

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_write_matches_reference(case, device):
    x = inputs(case)
    assert_same(torch_write(case, x, device), ref_write(case, x))


@pytest.fixture
def blockwise(monkeypatch):
    """Plan every nvfp4 write as a small batch in the ``BLOCKWISE`` layout (blocks over two
    threads; ``fp8kv.write.NVFP4_WRITE_SIZES``); yields the BLOCKWISE constexpr of each plan
    made."""
    from fp8kv import plan, write

    for backend in (plan.CUDA, plan.INTERPRET):
        monkeypatch.setitem(write.NVFP4_WRITE_SIZES[backend], "small_batch_elems", 1 << 62)
        monkeypatch.setitem(write.NVFP4_WRITE_SIZES[backend], "small_blockwise", True)
    made = []
    planner = write._plan_write_nvfp4

    def recording(*args, **kwargs):
        launch = planner(*args, **kwargs)
        made.append(launch.constexprs["TILE"].BLOCKWISE)
        return launch

    monkeypatch.setattr(write, "_plan_write_nvfp4", recording)
    _launch.clear_launch_caches()
    yield made
    monkeypatch.undo()
    _launch.clear_launch_caches()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_blockwise_layout_matches_reference(case, device, blockwise):
    """Small batches' layout (each block of 16 over two threads): the same bytes, nothing
    else written (poisoned arrays)."""
    x = inputs(case)
    assert_same(torch_write(case, x, device), ref_write(case, x))
    assert blockwise and all(blockwise)


def test_write_bf16_pattern_sample(device):
    """A sample of bf16 bit patterns (NaN, inf, subnormals included), per-head global scales."""
    case = NvCase(tokens=2, heads=8, head_dim=128, page_size=2, scale="head")
    rng = np.random.default_rng(3)
    x = inputs(case, specials=False)
    patterns = rng.permutation(1 << 16)[: 2 * 2 * 8 * 128].astype(np.uint16)
    x["key"], x["value"] = (p.view(np_dtype("bfloat16")).reshape(2, 8, 128)
                            for p in np.split(patterns, 2))
    x["key_scale"] = np.float32(2.0) ** np.arange(-12, 12, 3).astype(np.float32)
    x["value_scale"] = np.float32(0.37)
    x["slots"] = np.array([1, 2])
    assert_same(torch_write(case, x, device), ref_write(case, x))


def test_special_global_scales_on_device(device):
    """Device global scales are not checked: +0, +inf, NaN, negative and subnormal per head."""
    case = NvCase(tokens=3, heads=6, head_dim=32, page_size=4, scale="head")
    x = inputs(case)
    x["key_scale"] = np.float32([0.0, np.inf, np.nan, -0.37, 2.0 ** -140, 1e-3])
    want = ref_write(case, x)
    assert_same(torch_write(case, x, device), want)
    table = np.array([[1, 0, -1]], np.int32)
    got = fp8kv_torch.dequantize_pages(
        *(_t(a, device) for a in want[:2]), _t(table, device), _t(x["key_scale"], device),
        _t(x["value_scale"], device), key_scale_cache=_t(want[2], device),
        value_scale_cache=_t(want[3], device), cache_format="nvfp4", dtype=torch.float32)
    assert_same(got, ref.dequantize_pages(*want[:2], table, x["key_scale"], x["value_scale"],
                                          key_scale_cache=want[2], value_scale_cache=want[3],
                                          cache_format="nvfp4", dtype="float32"))


DEQUANT = [(CASES[0], "bfloat16", None), (CASES[1], "float32", None),
           (CASES[2], "float16", None), (CASES[3], "float8_e4m3fn", 0.75),
           (CASES[4], "float8_e4m3fn", None), (CASES[5], "float8_e4m3fn", "tensor"),
           # FP8 by lookup: head_dim 16 (one block a row), 80 (an odd count of blocks), 64
           (CASES[1], "float8_e4m3fn", 0.37), (CASES[2], "float8_e4m3fn", "tensor"),
           (CASES[0], "float8_e4m3fn", None)]


@pytest.mark.parametrize("case,out,out_scale", DEQUANT,
                         ids=[f"{c.id}-{o}-o{s}" for c, o, s in DEQUANT])
def test_dequantize_matches_reference(case, out, out_scale, device):
    """Poisoned caches (every byte value, NaN block scales included) read through a table with
    padding, a null page and an entry past the cache."""
    x = inputs(case)
    table = np.array([[1, -1, 0], [case.pages - 1, case.pages + 4, 1]], np.int32)
    scale = np.array(0.125, np.float32) if out_scale == "tensor" else out_scale
    want = ref.dequantize_pages(x["key_cache"], x["value_cache"], table, x["key_scale"],
                                x["value_scale"], layout=case.api_layout, null_page=0,
                                key_scale_cache=x["key_scale_cache"],
                                value_scale_cache=x["value_scale_cache"], cache_format="nvfp4",
                                dtype=out, out_scale=scale)
    got = fp8kv_torch.dequantize_pages(
        _t(x["key_cache"], device), _t(x["value_cache"], device), _t(table, device),
        _t(x["key_scale"], device), _t(x["value_scale"], device), layout=case.api_layout,
        null_page=0, key_scale_cache=_t(x["key_scale_cache"], device),
        value_scale_cache=_t(x["value_scale_cache"], device), cache_format="nvfp4",
        dtype=getattr(torch, out), out_scale=_t(scale, device))
    assert got[0].shape == (6,) + case.shape(case.head_dim)[1:]
    assert_same(got, want)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_combined_cache_and_block_scale_views(layout, device):
    """A combined cache [P, 2, ...] and block scales as views of one [P, 2, ..., D/16] buffer
    (FlashInfer's stacked kv_cache_sf), written and read back (combined output)."""
    rng = np.random.default_rng(5)
    tokens, h, d, pages, ps = 6, 3, 48, 3, 4
    shape = (pages, 2, ps, h) if layout == "NHD" else (pages, 2, h, ps)
    kv = rng.integers(0, 256, size=shape + (d // 2,), dtype=np.uint8)
    sc = rng.integers(0, 256, size=shape + (d // 16,), dtype=np.uint8).view(np_dtype("float8_e4m3fn"))
    key, value = (random_values(rng, (tokens, h, d), "bfloat16") for _ in range(2))
    slots = rng.permutation(pages * ps)[:tokens]
    slots[1] = -1
    t_kv, t_sc = to_torch(kv, device), to_torch(sc, device)
    fp8kv_torch.write_kv_combined(to_torch(key, device), to_torch(value, device), t_kv,
                                  to_torch(slots, device), 0.01, 0.02, layout=layout,
                                  key_scale_cache=t_sc[:, 0], value_scale_cache=t_sc[:, 1],
                                  cache_format="nvfp4")
    wk, wv, wks, wvs = ref.write_kv(key, value, kv[:, 0], kv[:, 1], slots, 0.01, 0.02,
                                    layout=layout, key_scale_cache=sc[:, 0],
                                    value_scale_cache=sc[:, 1], cache_format="nvfp4")
    got_kv, got_sc = bits(t_kv), bits(t_sc)
    assert_same([got_kv[:, 0], got_kv[:, 1], got_sc[:, 0], got_sc[:, 1]], [wk, wv, wks, wvs])
    table = torch.tensor([[2, 0, -1]], dtype=torch.int32, device=device)
    pages_out, _ = fp8kv_torch.dequantize_pages_combined(
        t_kv, table, 0.01, 0.02, layout=layout, key_scale_cache=t_sc[:, 0],
        value_scale_cache=t_sc[:, 1], cache_format="nvfp4")
    rk, rv, _ = ref.dequantize_pages(wk, wv, table.cpu().numpy(), 0.01, 0.02, layout=layout,
                                     key_scale_cache=wks, value_scale_cache=wvs,
                                     cache_format="nvfp4")
    assert_same([pages_out[:, 0], pages_out[:, 1]], [rk, rv])


def test_every_byte_decodes_through_the_kernel(device):
    """All 256 code bytes with block scale 1.0 (0x38) and no global scale, to fp32."""
    codes = np.arange(256, dtype=np.uint8).reshape(1, 1, 4, 64)     # 4 rows of 128 elements
    blocks = np.full((1, 1, 4, 8), 0x38, np.uint8)
    table = np.zeros((1, 1), np.int32)
    k, _, _ = fp8kv_torch.dequantize_pages(
        _t(codes, device), _t(codes, device), _t(table, device), key_scale_cache=_t(blocks, device),
        value_scale_cache=_t(blocks, device), cache_format="nvfp4", dtype=torch.float32)
    want = [(-1.0 if c & 8 else 1.0) * E2M1[c & 7] for b in range(256) for c in (b & 15, b >> 4)]
    np.testing.assert_array_equal(bits(k).reshape(-1), as_uint(np.float32(want)))


# Every code byte with every block scale, to FP8, against the reference's per-element rule, under
# global scales per head (K, V): products sv * g all normal up to 2**125, 0, NaN or infinite as g
# is (the kernel's table from three quotients scaled by powers of two), or subnormal and
# overflowing ones in every program (eight quotients per block; fp8kv.ops.codec.nvfp4_e4m3_table).
EVERY_G = {"normal": ([1.0, 0.37, -2.5, np.inf, np.nan, 0.0, 1e-30, 1e30],
                      [6.0, -1e-20, 448.0, 5e-10, 2.0 ** -100, 1e20, -np.inf, 0.75]),
           "extreme": ([1.0, 0.37, -2.5, np.inf, np.nan, 0.0, 1e-30, 3e38],
                       [1.0, 2e-39, 1e-38, -3e-39, 6.0, 1e-20, 448.0, 5e-10])}
EVERY_OUT_SCALE = [None, 0.25, 0.37, 1e-30, 3e38, np.float32(0.0), np.float32(np.inf),
                   np.float32(np.nan), np.float32(-0.5), np.float32(1e-38)]


def _every_code_and_block_scale():
    """Caches [8 pages, 16 slots, 8 heads, 64 bytes] whose 8,192 blocks hold each of the 256
    block scales with each 8-byte run of the 256 code bytes, and a table of every page."""
    blocks = np.arange(8 * 16 * 8 * 8)
    codes = ((blocks[:, None] % 32) * 8 + np.arange(8)).astype(np.uint8).reshape(8, 16, 8, 64)
    scales = (blocks // 32).astype(np.uint8).reshape(8, 16, 8, 8)
    return codes, scales, np.arange(8, dtype=np.int32).reshape(1, 8)


@pytest.mark.parametrize("out_scale", EVERY_OUT_SCALE,
                         ids=lambda s: "none" if s is None else f"{type(s).__name__}{s}")
@pytest.mark.parametrize("products", ["normal", "extreme"])
def test_fp8_output_of_every_code_and_block_scale(products, out_scale, device):
    codes, scales, table = _every_code_and_block_scale()
    gk, gv = (np.array(g, np.float32) for g in EVERY_G[products])
    want = ref.dequantize_pages(codes, codes, table, gk, gv,
                                key_scale_cache=scales, value_scale_cache=scales,
                                cache_format="nvfp4", dtype="float8_e4m3fn", out_scale=out_scale)
    got = fp8kv_torch.dequantize_pages(
        _t(codes, device), _t(codes, device), _t(table, device), _t(gk, device), _t(gv, device),
        key_scale_cache=_t(scales, device), value_scale_cache=_t(scales, device),
        cache_format="nvfp4", dtype=torch.float8_e4m3fn,
        out_scale=out_scale if out_scale is None or isinstance(out_scale, float)
        else _t(np.array(out_scale), device))
    assert_same(got, want)


def test_misaligned_arrays_take_the_per_element_path(device):
    """A cache that starts off a 4-byte boundary cannot be read as words: the plan turns the
    lookup off for the call (its ready launch is keyed on alignment) and the bytes are the
    same."""
    codes, scales, table = _every_code_and_block_scale()
    flat = torch.zeros(codes.size + 1, dtype=torch.uint8, device=device)
    shifted = flat[1:].view(codes.shape)
    shifted.copy_(to_torch(codes, device))
    g = np.array(EVERY_G["normal"][0], np.float32)
    args = (_t(table, device), _t(g, device), _t(g, device))
    kw = dict(key_scale_cache=_t(scales, device), value_scale_cache=_t(scales, device),
              cache_format="nvfp4", dtype=torch.float8_e4m3fn, out_scale=0.37)
    want = ref.dequantize_pages(codes, codes, table, g, g, key_scale_cache=scales,
                                value_scale_cache=scales, cache_format="nvfp4",
                                dtype="float8_e4m3fn", out_scale=0.37)
    aligned = _t(codes, device)
    for _ in range(2):   # first call and ready launch, both arrangements
        assert_same(fp8kv_torch.dequantize_pages(shifted, shifted, *args, **kw), want)
        assert_same(fp8kv_torch.dequantize_pages(aligned, aligned, *args, **kw), want)


# ---------------------------------------------------------------------------------------------
# Errors: raised before anything is written.

T, H, D, P, S = 5, 2, 64, 3, 4


def _good():
    return dict(key=torch.randn(T, H, D, dtype=torch.bfloat16),
                value=torch.randn(T, H, D, dtype=torch.bfloat16),
                key_cache=torch.full((P, S, H, D // 2), 0x11, dtype=torch.uint8),
                value_cache=torch.full((P, S, H, D // 2), 0x11, dtype=torch.uint8),
                slots=torch.arange(T), key_scale=0.5,
                key_scale_cache=torch.full((P, S, H, D // 16), 0x22, dtype=torch.uint8),
                value_scale_cache=torch.full((P, S, H, D // 16), 0x22, dtype=torch.uint8),
                cache_format="nvfp4")


def _with(**changes):
    args = _good()
    args.update(changes)
    return args


WRITE_ERRORS = [
    ("odd-head-dim", _with(key=torch.zeros(T, H, 63, dtype=torch.bfloat16),
                           value=torch.zeros(T, H, 63, dtype=torch.bfloat16)), ValueError,
     r"key: expected a head_dim that is a multiple of 16 for cache_format='nvfp4' .*got 63"),
    ("head-dim-40", _with(key=torch.zeros(T, H, 40, dtype=torch.bfloat16),
                          value=torch.zeros(T, H, 40, dtype=torch.bfloat16)), ValueError,
     r"key: expected a head_dim that is a multiple of 16 .*got 40"),
    ("data-width", _with(key_cache=torch.zeros(P, S, H, D, dtype=torch.uint8),
                         value_cache=torch.zeros(P, S, H, D, dtype=torch.uint8)), ValueError,
     r"key_cache: expected num_kv_heads=2 and head_dim=64 \(those of key\), got num_kv_heads=2 "
     r"and head_dim=128 \(a last dimension of 64 bytes, 2 codes per byte\)"),
    ("typed-cache", _with(key_cache=torch.zeros(P, S, H, D // 2, dtype=torch.float8_e4m3fn),
                          value_cache=torch.zeros(P, S, H, D // 2, dtype=torch.float8_e4m3fn)),
     TypeError, r"key_cache: expected dtype uint8 for cache_format='nvfp4' \(two 4-bit codes per "
     r"byte\), got float8_e4m3fn"),
    ("block-shape", _with(value_scale_cache=torch.zeros(P, S, H, D // 8, dtype=torch.uint8)),
     ValueError, r"value_scale_cache: expected an array \[3, 4, 2, 4\] of float8_e4m3fn or uint8 "
     r".*, got shape \[3, 4, 2, 8\]"),
    ("block-dtype", _with(key_scale_cache=torch.zeros(P, S, H, D // 16)), TypeError,
     r"key_scale_cache: expected dtype float8_e4m3fn or uint8, got float32"),
    ("block-missing", _with(value_scale_cache=None), ValueError,
     r"value_scale_cache: expected the block scales of an nvfp4 cache, an array \[3, 4, 2, 4\]"),
    ("block-inline", _with(key_scale_cache="inline", value_scale_cache="inline"), ValueError,
     r"key_scale_cache: expected the block scales of an nvfp4 cache, .*got 'inline'"),
    ("block-list", _with(key_scale_cache=[1]), TypeError,
     r"key_scale_cache: expected an array of nvfp4 block scales \(float8_e4m3fn or uint8\), got "
     r"list"),
    ("block-stride", _with(key_scale_cache=torch.zeros(P, S, D // 16, H, dtype=torch.uint8)
                           .transpose(2, 3)), ValueError,
     r"key_scale_cache: expected a unit-stride last dimension"),
    ("fp8-format-nvfp4", _with(cache_format=None, fp8_format="nvfp4"), ValueError,
     r"fp8_format: expected 'e4m3', 'e5m2' or None \(name it with cache_format='nvfp4'\), got "
     r"'nvfp4'"),
    ("both-formats", _with(fp8_format="e4m3"), ValueError,
     r"cache_format: expected None when fp8_format is given"),
    ("unknown-format", _with(cache_format="fp4"), ValueError,
     r"cache_format: expected 'e4m3', 'e5m2', 'nvfp4', 'mxfp8' or None, got 'fp4'"),
    ("pow2", _with(scale_rounding="pow2"), ValueError,
     r"scale_rounding: expected 'exact' for cache_format='nvfp4'"),
    ("scale-zero", _with(value_scale=0.0), ValueError,
     r"value_scale: expected a finite scale > 0, got 0.0"),
    ("scale-shape", _with(key_scale=torch.ones(3)), ValueError,
     r"key_scale: expected shape \[\], \[1\] or \[2\] \(num_kv_heads\), got \[3\]"),
]


@pytest.mark.parametrize("name,args,exc,match", WRITE_ERRORS, ids=[e[0] for e in WRITE_ERRORS])
def test_write_errors_write_nothing(name, args, exc, match):
    raises_and_writes_nothing(fp8kv_torch.write_kv, args, exc, match)


def _dq(**changes):
    return block_scaled_dequant_args(_good(), "nvfp4", **changes)


DEQUANT_ERRORS = [
    ("out-scale-without-fp8", _dq(out_scale=0.5), ValueError,
     r"out_scale: expected None unless dtype is float8_e4m3fn \(it scales the FP8 output\), got "
     r"0.5 with dtype bfloat16"),
    ("fp8-out-of-fp8-cache", _dq(cache_format=None, key_scale_cache=None, value_scale_cache=None,
                                 dtype=torch.float8_e4m3fn), TypeError,
     r"dtype: expected bfloat16, float16 or float32 \(float8_e4m3fn output is for "
     r"cache_format='nvfp4'\), got float8_e4m3fn"),
    ("dtype", _dq(dtype=torch.int8), TypeError,
     r"dtype: expected one of 'bfloat16', 'float16', 'float32', 'float8_e4m3fn' \(a string, or "
     r"the framework's dtype of one\), got 'int8'"),
    ("out-scale-shape", _dq(dtype=torch.float8_e4m3fn, out_scale=torch.ones(2)), ValueError,
     r"out_scale: expected shape \[\] or \[1\], got \[2\]"),
    ("out-scale-dtype", _dq(dtype=torch.float8_e4m3fn, out_scale=torch.ones((), dtype=torch.float64)),
     TypeError, r"out_scale: expected dtype float32, got float64"),
    ("out-scale-negative", _dq(dtype=torch.float8_e4m3fn, out_scale=-1.0), ValueError,
     r"out_scale: expected a finite scale > 0, got -1.0"),
    ("out-scale-kind", _dq(dtype=torch.float8_e4m3fn, out_scale="1"), TypeError,
     r"out_scale: expected None, a float or a float32 array, got str"),
    ("head-dim", _dq(head_dim=32), ValueError,
     r"head_dim: expected that of key_cache \(64: 32 bytes of 2 codes\), got 32"),
    ("width", _dq(key_cache=torch.zeros(P, S, H, 12, dtype=torch.uint8),
                  value_cache=torch.zeros(P, S, H, 12, dtype=torch.uint8)), ValueError,
     r"key_cache: expected a head_dim that is a multiple of 16 .*got 24"),
    ("block-shape", _dq(key_scale_cache=torch.zeros(P, S, H, 3, dtype=torch.uint8)), ValueError,
     r"key_scale_cache: expected an array \[3, 4, 2, 4\]"),
]


@pytest.mark.parametrize("name,args,exc,match", DEQUANT_ERRORS, ids=[e[0] for e in DEQUANT_ERRORS])
def test_dequantize_errors(name, args, exc, match):
    with pytest.raises(exc, match=match):
        fp8kv_torch.dequantize_pages(**args)


# ---------------------------------------------------------------------------------------------
# torch.library custom ops: opcheck and torch.compile.

def test_opcheck_nvfp4_ops():
    from fp8kv_torch._ops import dequantize_pages_op, write_kv_op
    a = _good()
    torch.library.opcheck(write_kv_op, (a["key"], a["value"], a["key_cache"], a["value_cache"],
                                        a["slots"], None, None, 0.5, None, "NHD", None,
                                        a["key_scale_cache"], a["value_scale_cache"], False,
                                        False, "exact", "nvfp4", None, None),
                          test_utils=("test_schema", "test_faketensor"))
    # bf16 pages: opcheck's own bookkeeping does arithmetic that fp8 tensors lack on CPU (the
    # FP8 output goes through torch.compile below).
    outs = [torch.empty(2, S, H, D, dtype=torch.bfloat16) for _ in range(2)]
    torch.library.opcheck(dequantize_pages_op,
                          (a["key_cache"], a["value_cache"], torch.tensor([[0, 2]]).int(), None,
                           None, 0.5, None, "NHD", None, None, outs[0], outs[1],
                           torch.empty(1, 2, dtype=torch.int32), a["key_scale_cache"],
                           a["value_scale_cache"], False, False, None, "nvfp4", None, None,
                           None, None),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph(device):
    case = NvCase(tokens=4, heads=2, head_dim=32, page_size=4)
    x = inputs(case)
    want = ref_write(case, x)
    t = {name: _t(a, device) for name, a in x.items()}
    backend = "inductor" if device == "cuda" else "aot_eager"   # inductor on CPU needs a C++ build

    @torch.compile(fullgraph=True, backend=backend)
    def step(key, value, kc, vc, slots, ksc, vsc, table):
        fp8kv_torch.write_kv(key * 1, value, kc, vc, slots, 0.0213, 0.0213, key_scale_cache=ksc,
                             value_scale_cache=vsc, cache_format="nvfp4")
        return fp8kv_torch.dequantize_pages(kc, vc, table, 0.0213, 0.0213, key_scale_cache=ksc,
                                            value_scale_cache=vsc, cache_format="nvfp4",
                                            dtype=torch.float8_e4m3fn, out_scale=0.5)

    table = torch.tensor([[0, 1, -1]], dtype=torch.int32, device=device)
    k, v, _ = step(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slots"],
                   t["key_scale_cache"], t["value_scale_cache"], table)
    assert_same([bits(t[n]) for n in ("key_cache", "value_cache", "key_scale_cache",
                                      "value_scale_cache")], want)
    rk, rv, _ = ref.dequantize_pages(*want[:2], table.cpu().numpy(), 0.0213, 0.0213,
                                     key_scale_cache=want[2], value_scale_cache=want[3],
                                     cache_format="nvfp4", dtype="float8_e4m3fn", out_scale=0.5)
    assert_same([bits(k), bits(v)], [rk, rv])


def test_torch_and_jax_write_the_same_bytes():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import fp8kv_jax
    case = CASES[2]
    x = inputs(case)
    with jax.default_device(jax.devices("cpu")[0]):
        got = fp8kv_jax.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"],
                                 x["slots"].astype(np.int32), jnp.asarray(x["key_scale"]),
                                 jnp.asarray(x["value_scale"]), layout=case.api_layout,
                                 key_scale_cache=x["key_scale_cache"],
                                 value_scale_cache=x["value_scale_cache"], cache_format="nvfp4")
    assert_same(got, torch_write(case, x, "cpu"))


# ---------------------------------------------------------------------------------------------
# GPU only: the reciprocal path against the exact one and the reference.

def _all_patterns(dtype: str, arrangement: str) -> np.ndarray:
    """Every bit pattern of ``dtype`` as ``[64, 8, 128]``: grouped by magnitude (each block of
    16 holds neighbours, so that its scale suits them) or shuffled."""
    p = np.arange(1 << 16, dtype=np.uint16)
    if arrangement == "sorted":
        p = p[np.argsort(p & 0x7FFF, kind="stable")]
    else:
        p = np.random.default_rng(7).permutation(p)
    return p.view(np_dtype(dtype)).reshape(64, 8, 128)


@pytest.fixture(params=["groups", "blocks"])
def write_layout(request, monkeypatch):
    """The small-batch write layout: whole groups per thread, or ``BLOCKWISE``."""
    from fp8kv import plan, write

    monkeypatch.setitem(write.NVFP4_WRITE_SIZES[plan.CUDA], "small_blockwise",
                        request.param == "blocks")
    _launch.clear_launch_caches()
    yield request.param
    monkeypatch.undo()
    _launch.clear_launch_caches()


@requires_cuda
@pytest.mark.parametrize("arrangement", ["sorted", "shuffled"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("g", ["none", 2.0 ** -20, 0.0371, 1.7, 2.0 ** 20, "head"])
def test_gpu_every_pattern_fast_equals_exact(g, dtype, arrangement, write_layout):
    case = NvCase(tokens=64, heads=8, head_dim=128, page_size=16, dtype=dtype)
    x = inputs(case, specials=False)
    x["key"] = _all_patterns(dtype, arrangement)
    x["value"] = -x["key"]
    x["slots"] = np.random.default_rng(8).permutation(case.num_slots)[:64]
    x["key_scale"] = (None if g == "none" else np.float32(2.0) ** np.arange(-28, 28, 7).astype(
        np.float32) if g == "head" else g)
    x["value_scale"] = x["key_scale"]
    want = ref_write(case, x)
    for exact in (False, True):
        assert_same(torch_write(case, x, "cuda", exact=exact), want)


@requires_cuda
@pytest.mark.parametrize("g", [1.0, 0.0213, 3.1e-5, 917.0])
def test_gpu_fp32_near_every_boundary(g, write_layout):
    """fp32 elements within 8 ulps of every boundary times each block's d, for blocks whose
    amax gives many block scales: the reciprocal path's quotient is the correctly rounded one."""
    rng = np.random.default_rng(9)
    rows = []
    for amax in rng.random(512).astype(np.float32) * np.float32(12) * np.float32(g) + np.float32(1e-6):
        _, sf = ref.quantize_nvfp4(np.concatenate([[amax], np.zeros(15, np.float32)])[None], np.float32(g))
        d = np.float32(sf.view(np_dtype("float8_e4m3fn")).astype(np.float32)[0, 0] * np.float32(g))
        t = np.float32(rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], size=15))
        base = (t * d).astype(np.float32).view(np.int32) + rng.integers(-8, 9, size=15).astype(np.int32)
        block = np.concatenate([[amax], base.view(np.float32) * np.where(rng.random(15) < 0.5, -1, 1)])
        rows.append(block.astype(np.float32))
    x = np.stack(rows).reshape(-1, 8, 128)
    case = NvCase(tokens=x.shape[0], heads=8, head_dim=128, page_size=16, dtype="float32")
    arrays = inputs(case, specials=False)
    arrays.update(key=x, value=x, key_scale=g, value_scale=g,
                  slots=np.arange(case.tokens, dtype=np.int64))
    want = ref_write(case, arrays)
    for exact in (False, True):
        assert_same(torch_write(case, arrays, "cuda", exact=exact), want)


@requires_cuda
@pytest.mark.parametrize("out,out_scale", [("bfloat16", None), ("float16", None),
                                           ("float32", None), ("float8_e4m3fn", None),
                                           ("float8_e4m3fn", 0.25), ("float8_e4m3fn", 0.37),
                                           ("float8_e4m3fn", "tensor")])
@pytest.mark.parametrize("division", [Division.FMA, Division.FP64], ids=["fma", "fp64"])
def test_gpu_dequantize_fast_equals_exact(out, out_scale, division, monkeypatch):
    from fp8kv import dequantize, plan

    monkeypatch.setitem(dequantize.NVFP4_DEQUANT_SIZES[plan.CUDA], "reciprocal_div", division)
    _launch.clear_launch_caches()
    case = NvCase(tokens=64, heads=8, head_dim=128, page_size=16, scale="head")
    x = inputs(case)
    table = np.random.default_rng(10).integers(-1, case.pages + 1, size=(4, 8)).astype(np.int32)
    scale = np.array(0.37, np.float32) if out_scale == "tensor" else out_scale
    want = ref.dequantize_pages(x["key_cache"], x["value_cache"], table, x["key_scale"],
                                x["value_scale"], key_scale_cache=x["key_scale_cache"],
                                value_scale_cache=x["value_scale_cache"], cache_format="nvfp4",
                                dtype=out, out_scale=scale)
    t = {n: _t(a, "cuda") for n, a in x.items()}
    for exact in (False, True):
        got = _launch.call("dequantize_pages", t["key_cache"], t["value_cache"], _t(table, "cuda"),
                                       t["key_scale"], t["value_scale"], getattr(torch, out),
                                       "NHD", None, None, exact=exact,
                                       key_scale_cache=t["key_scale_cache"],
                                       value_scale_cache=t["value_scale_cache"],
                                       cache_format="nvfp4", out_scale=_t(scale, "cuda"))
        assert_same(got, want)
    monkeypatch.undo()
    _launch.clear_launch_caches()


@requires_cuda
def test_gpu_cuda_graph_capture():
    case = NvCase(tokens=16, heads=8, head_dim=128, page_size=16)
    x = inputs(case)
    want = ref_write(case, x)
    t = {n: _t(a, "cuda") for n, a in x.items()}
    fresh = {n: a.clone() for n, a in t.items() if isinstance(a, torch.Tensor)}
    table = torch.tensor([[0, 1, -1]], dtype=torch.int32, device="cuda")

    def step():
        fp8kv_torch.write_kv(**t, cache_format="nvfp4")
        return fp8kv_torch.dequantize_pages(t["key_cache"], t["value_cache"], table,
                                            t["key_scale"], t["value_scale"],
                                            key_scale_cache=t["key_scale_cache"],
                                            value_scale_cache=t["value_scale_cache"],
                                            cache_format="nvfp4")

    step()   # warm up (compiles)
    for n, a in fresh.items():
        t[n].copy_(a)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pages = step()
    for n, a in fresh.items():
        t[n].copy_(a)
    graph.replay()
    torch.cuda.synchronize()
    assert_same([bits(t[n]) for n in ("key_cache", "value_cache", "key_scale_cache",
                                      "value_scale_cache")], want)
    rk, rv, _ = ref.dequantize_pages(*want[:2], table.cpu().numpy(), x["key_scale"],
                                     x["value_scale"], key_scale_cache=want[2],
                                     value_scale_cache=want[3], cache_format="nvfp4")
    assert_same(pages[:2], [rk, rv])


def test_stacked_caches_are_fp8_only():
    """layer= (stacked caches) is refused for an nvfp4 cache, naming the argument, nothing
    written: the nvfp4 kernels address one layer's caches (pass cache[layer])."""
    a = _good()
    stacked = {n: a[n][None].repeat(2, *([1] * a[n].ndim)) for n in
               ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache")}
    before = {n: t.clone() for n, t in stacked.items()}
    with pytest.raises(ValueError, match=r"layer: expected None with cache_format='nvfp4'"):
        fp8kv_torch.write_kv(a["key"], a["value"], stacked["key_cache"], stacked["value_cache"],
                             a["slots"], 0.5, key_scale_cache=stacked["key_scale_cache"],
                             value_scale_cache=stacked["value_scale_cache"],
                             cache_format="nvfp4", layer=1)
    for n, t in stacked.items():
        assert torch.equal(t, before[n])
