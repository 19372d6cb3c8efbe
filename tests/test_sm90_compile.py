"""Every kernel variant the suite uses compiles for Hopper (sm_90) -- without a GPU.

CI has no GPU, so this is where a kernel that the interpreter accepts but the CUDA backend rejects
fails. The PTX is also checked for what the design relies on: IEEE division, the saturating fp8
conversion, no flush-to-zero, and 16-byte global accesses on the packed bf16 path.
"""
from __future__ import annotations

import re
from dataclasses import replace

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tests.cases import DEQUANT_CASES, WRITE_CASES, scale_values
from fp8kv import ops
from fp8kv.arrays import ArrayInfo
from fp8kv.binding import bind
from fp8kv.dequantize import (check_dequantize, dequantize_operands, dequantized_shape,
                              plan_dequantize)
from fp8kv.modes import Division, ScaleKind
from fp8kv.plan import CUDA
from fp8kv.rope_write import check_rope_write, plan_rope_write, rope_write_operands
from fp8kv.write import check_write, plan_write, write_operands

POINTER_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32",
                 "float8_e4m3fn": "*fp8e4nv", "float8_e5m2": "*fp8e5", "uint8": "*u8",
                 "int32": "*i32", "int64": "*i64"}
HOPPER = GPUTarget("cuda", 90, 32)


def compile_for_hopper(kernel, arrays: dict, plan, int_divisibility=True):
    """Compile like a launch with 16-byte-aligned tensors would (Triton's default specialization).

    ``arrays`` maps each array parameter to its dtype name; the plan's names are bound exactly as
    the frontends bind them. ``int_divisibility=False`` compiles as jax-triton does: integer
    arguments carry no divisibility-by-16 attribute.
    """
    call = bind(kernel, plan, arrays)
    sig = call.signature
    runtime = dict(zip(sig.inputs + sig.scalars + sig.outputs, call.args))
    signature, attrs, consts = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in call.constexprs:
            signature[name], consts[(index,)] = "constexpr", call.constexprs[name]
            continue
        value = runtime[name]
        if name in sig.scalars:
            if isinstance(value, int) and value == 1:   # Triton makes ints equal to 1 constexprs
                signature[name], consts[(index,)] = "constexpr", 1
                continue
            signature[name] = "fp32" if isinstance(value, float) else (
                "i32" if -2**31 <= value < 2**31 else "i64")
            if int_divisibility and isinstance(value, int) and value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = POINTER_TYPES[value]
            attrs[(index,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=HOPPER, options=dict(num_warps=plan.num_warps,
                                                          enable_fp_fusion=plan.enable_fp_fusion))


def write_arrays(args, x, cache, slots, scale):
    """Each array parameter's dtype, through the core's operand map (what the frontends do)."""
    return write_operands(args).arrays(dict(
        key=x, value=x, key_cache=cache, value_cache=cache, kv_cache=cache, slots=slots,
        key_scale=scale, value_scale=scale, key_scale_cache=scale, value_scale_cache=scale,
        layer="int32"))


def dequant_arrays(args, cache, table, scale, out):
    return dequantize_operands(args).arrays(dict(
        key_cache=cache, value_cache=cache, kv_cache=cache, block_table=table, key_scale=scale,
        value_scale=scale, key_scale_cache=scale, value_scale_cache=scale, key_out=out,
        value_out=out, kv_out=out, table_out="int32", layer="int32"))


def scale_arg(kind, heads):
    s = scale_values(kind, heads, None if kind != "head" else __import__("numpy").random.default_rng(0))
    if s is None or isinstance(s, float):
        return s
    return ArrayInfo.contiguous(s.shape, "float32", "cuda:0")


def ptx_ops(compiled) -> set:
    return set(re.findall(r"\b(?:ld|st)\.global[.\w]*|\bcvt\.rn\.satfinite[.\w]*|\bdiv\.[.\w]*",
                          compiled.asm["ptx"]))


# One compile per distinct constexpr set: the cases repeat many.
WRITE_VARIANTS = {}
for case in WRITE_CASES:
    if case.tokens:
        WRITE_VARIANTS.setdefault((case.dtype, case.fmt, case.layout, case.scale, case.heads,
                                   case.head_dim, case.page_size), case)


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("case", list(WRITE_VARIANTS.values()), ids=lambda c: c.id)
def test_write_kernel_compiles_for_sm90(case, exact):
    x = ArrayInfo.contiguous((case.tokens, case.heads, case.head_dim), case.dtype, "cuda:0")
    cache = ArrayInfo.contiguous(case.cache_shape, case.cache_dtype, "cuda:0")
    slots = ArrayInfo.contiguous((case.tokens,), case.slots, "cuda:0")
    ks = scale_arg(case.scale, case.heads)
    args = check_write(x, x, cache, cache, slots, ks, ks, layout=case.api_layout,
                       fp8_format=case.fp8_format)
    plan = plan_write(args, CUDA, exact)
    scale_dtype = "float32" if isinstance(ks, ArrayInfo) else case.slots
    compiled = compile_for_hopper(
        ops._write_kv_kernel,
        write_arrays(args, case.dtype, case.cache_dtype, case.slots, scale_dtype), plan)
    found = ptx_ops(compiled)
    assert "ftz" not in " ".join(found)
    if not exact:  # the fast path relies on the saturating conversion (no clamp of its own)
        assert any(op.startswith("cvt.rn.satfinite") for op in found)
    division = plan.constexprs["TILE"].RECIPROCAL_DIV
    if args.key_scale.kind is ScaleKind.HEAD or (args.key_scale.kind is not ScaleKind.NONE and (
            exact or division == Division.DIV_RN)):
        assert "div.rn.f32" in found   # IEEE division
    elif args.key_scale.kind is not ScaleKind.NONE:
        # One scale, small batch: no div.rn and so no branch to its slow path, but the
        # reciprocal refined in fp64, then the FMA corrections (codec.divide_by_scalar), or
        # one fp64 reciprocal and an fp64 product (codec.divide_fp64).
        ptx = compiled.asm["ptx"]
        assert "div.rn.f32" not in found
        if division == Division.FMA:
            assert "fma.rn.f64" in ptx and "fma.rn.f32" in ptx
        else:
            assert "div.rn.f64" in ptx and "mul.rn.f64" in ptx
    if (case.dtype == "bfloat16" and case.layout == "NHD" and case.head_dim % 64 == 0
            and not exact and plan.grid[1] == 1):
        # Each thread loads its consecutive K/V elements of a row at once: 16 bytes for large
        # batches' programs, 8 for small batches' 8 warps, 4 for a decode batch's 16 warps
        # (split rows: test_split_rows_compile_for_sm90).
        per_thread = (plan.constexprs["TILE"].BLOCK_T * plan.constexprs["TILE"].BLOCK_HD
                      // (32 * plan.num_warps))
        if per_thread >= 4:
            assert any(op.startswith("ld.global.v") for op in found), found
        else:
            assert f"ld.global.b{16 * per_thread}" in found, found


@pytest.mark.parametrize("division", list(Division), ids=lambda d: d.name.lower())
@pytest.mark.parametrize("tokens,warps", [(1, 1), (1, 4), (16, 2), (3, 4)])
def test_split_rows_compile_for_sm90(tokens, warps, division, monkeypatch):
    """A small batch whose rows are split over programs (grid axis 1) compiles for sm_90, with
    each division and each thread's elements of a chunk in one load."""
    from fp8kv.write import WRITE_SIZES

    for name, value in dict(split_batch_tokens=16, split_chunk=128, split_warps=warps,
                            split_division=division).items():
        monkeypatch.setitem(WRITE_SIZES[CUDA], name, value)
    plan_write.cache_clear()
    try:
        x = ArrayInfo.contiguous((tokens, 8, 128), "bfloat16", "cuda:0")
        cache = ArrayInfo.contiguous((300, 16, 8, 128), "float8_e4m3fn", "cuda:0")
        slots = ArrayInfo.contiguous((tokens,), "int64", "cuda:0")
        scale = ArrayInfo.contiguous((), "float32", "cuda:0")
        args = check_write(x, x, cache, cache, slots, scale, scale, layout="NHD",
                           fp8_format=None)
        plan = plan_write(args, CUDA)
        assert plan.grid == (tokens, 8) and plan.num_warps == warps
        assert plan.constexprs["TILE"].ROW_CHUNK == plan.constexprs["TILE"].BLOCK_HD == 128
        compiled = compile_for_hopper(
            ops._write_kv_kernel, write_arrays(args, "bfloat16", "float8_e4m3fn", "int64",
                                               "float32"), plan)
        found = ptx_ops(compiled)
        # Each thread loads its 128 / (32 warps) consecutive bf16 of K and of V at once.
        assert f"ld.global.b{16 * 128 // (32 * warps)}" in found
        assert ("div.rn.f32" in found) == (division is Division.DIV_RN)
        assert ("div.rn.f64" in compiled.asm["ptx"]) == (division is Division.FP64)
    finally:
        monkeypatch.undo()
        plan_write.cache_clear()


def test_write_combined_kernel_compiles_for_sm90():
    x = ArrayInfo.contiguous((64, 8, 128), "bfloat16", "cuda:0")
    kv = ArrayInfo.contiguous((10, 2, 16, 8, 128), "float8_e4m3fn", "cuda:0")
    slots = ArrayInfo.contiguous((64,), "int64", "cuda:0")
    args = check_write(x, x, None, None, slots, 0.5, 0.5, layout="NHD", fp8_format=None, kv_cache=kv)
    plan = plan_write(args, CUDA)
    cache = plan.constexprs["CACHE"]
    assert cache.COMBINED and cache.VALUE.CODES.OFFSET == 16 * 8 * 128
    compile_for_hopper(ops._write_kv_kernel,
                       write_arrays(args, "bfloat16", "float8_e4m3fn", "int64", "int64"), plan)


@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("case", [c for c in DEQUANT_CASES if c.batch], ids=lambda c: c.id)
def test_dequantize_kernel_compiles_for_sm90(case, exact, combined):
    cache = ArrayInfo.contiguous(case.cache_shape, case.cache_dtype, "cuda:0")
    table = ArrayInfo.contiguous((case.batch, case.pages_per_seq), "int32", "cuda:0")
    ks = scale_arg(case.scale, case.heads)
    caches = (dict(kv_cache=ArrayInfo.contiguous((cache.shape[0], 2) + cache.shape[1:],
                                                 cache.dtype, "cuda:0"))
              if combined else dict(key_cache=cache, value_cache=cache))
    args = check_dequantize(**caches, block_table=table, key_scale=ks, value_scale=ks,
                            dtype=case.out, layout=case.api_layout, fp8_format=case.fp8_format,
                            null_page=case.null_page)
    out = ArrayInfo.contiguous(dequantized_shape(args, combined), case.out, "cuda:0")
    plan = plan_dequantize(args, out, None if combined else out, CUDA, exact)
    scale_dtype = "float32" if isinstance(ks, ArrayInfo) else "int32"
    found = ptx_ops(compile_for_hopper(
        ops._dequantize_pages_kernel,
        dequant_arrays(args, case.cache_dtype, "int32", scale_dtype, case.out), plan))
    assert "ftz" not in " ".join(found)


@pytest.mark.parametrize("int_divisibility", [True, False], ids=["torch-style", "jax-triton-style"])
def test_default_shapes_get_16_byte_accesses(int_divisibility):
    """8 heads x 128, page 16, bf16: 16-byte loads and stores, also where jax-triton launches.

    Strides are constexprs, so the compiler proves alignment and contiguity itself where
    jax-triton gives integers no divisibility hints (a build without such proofs fell back to
    byte stores: H200 137 us vs 100 us).
    """
    x = ArrayInfo.contiguous((4096, 8, 128), "bfloat16", "cuda:0")
    cache = ArrayInfo.contiguous((300, 16, 8, 128), "float8_e4m3fn", "cuda:0")
    slots = ArrayInfo.contiguous((4096,), "int32", "cuda:0")
    scale = ArrayInfo.contiguous((), "float32", "cuda:0")
    plan_args = check_write(x, x, cache, cache, slots, scale, scale, layout="NHD",
                            fp8_format=None)
    plan = plan_write(plan_args, CUDA)
    found = ptx_ops(compile_for_hopper(
        ops._write_kv_kernel,
        write_arrays(plan_args, "bfloat16", "float8_e4m3fn", "int32", "float32"), plan,
        int_divisibility))
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= found, found

    table = ArrayInfo.contiguous((16, 512), "int32", "cuda:0")
    args = check_dequantize(cache, cache, table, scale, scale, dtype="bfloat16", layout="NHD",
                            fp8_format=None, null_page=None)
    out = ArrayInfo.contiguous(dequantized_shape(args, False), "bfloat16", "cuda:0")
    plan = plan_dequantize(args, out, out, CUDA)
    found = ptx_ops(compile_for_hopper(
        ops._dequantize_pages_kernel,
        dequant_arrays(args, "float8_e4m3fn", "int32", "float32", "bfloat16"), plan,
        int_divisibility))
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= found, found


DYNAMIC_VARIANTS = [  # (dtype, fmt, layout, granularity, rounding, heads, head_dim, page_size)
    ("bfloat16", "e4m3", "NHD", "token_head", "exact", 8, 128, 16),
    ("float16", "e5m2", "HND", "token", "pow2", 3, 80, 16),
    ("float32", "e4m3", "3D", "token_head", "pow2", 1, 40, 1),
    ("bfloat16", "e4m3", "NHD", "inline4", "pow2", 8, 128, 16),
    ("bfloat16", "e5m2", "HND", "inline16", "exact", 3, 72, 32),
]


def _dynamic_args(variant, tokens=64):
    dtype, fmt, layout, gran, rounding, heads, head_dim, page_size = variant
    pad = {"inline4": 4, "inline16": 16}.get(gran, 0)
    api_layout = "NHD" if layout == "3D" else layout
    if layout == "3D":
        shape = (100, heads, head_dim + pad)
        sshape = {"token_head": (100, heads), "token": (100,)}.get(gran)
    elif layout == "NHD":
        shape = (10, page_size, heads, head_dim + pad)
        sshape = {"token_head": (10, page_size, heads), "token": (10, page_size)}.get(gran)
    else:
        shape = (10, heads, page_size, head_dim + pad)
        sshape = {"token_head": (10, heads, page_size), "token": (10, page_size)}.get(gran)
    cache = ArrayInfo.contiguous(shape, FORMATS_DTYPE[fmt], "cuda:0")
    sc = "inline" if pad else ArrayInfo.contiguous(sshape, "float32", "cuda:0")
    x = ArrayInfo.contiguous((tokens, heads, head_dim), dtype, "cuda:0")
    slots = ArrayInfo.contiguous((tokens,), "int64", "cuda:0")
    args = check_write(x, x, cache, cache, slots, None, None, layout=api_layout, fp8_format=None,
                       key_scale_cache=sc, value_scale_cache=sc, scale_rounding=rounding)
    table = ArrayInfo.contiguous((4, 8), "int32", "cuda:0")
    dargs = check_dequantize(cache, cache, table, None, None, dtype="bfloat16", layout=api_layout,
                             fp8_format=None, null_page=None, key_scale_cache=sc,
                             value_scale_cache=sc, head_dim=head_dim if pad else None)
    return args, dargs, cache.dtype, "uint8" if pad else "float32"


FORMATS_DTYPE = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("variant", DYNAMIC_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_dynamic_scale_kernels_compile_for_sm90(variant, exact):
    args, dargs, cache_dtype, scale_dtype = _dynamic_args(variant)
    plan = plan_write(args, CUDA, exact)
    found = ptx_ops(compile_for_hopper(
        ops._write_kv_kernel, write_arrays(args, variant[0], cache_dtype, "int64", scale_dtype), plan))
    assert "ftz" not in " ".join(found)
    assert "div.rn.f32" in found   # amax / fmax and x / s: IEEE division
    out = ArrayInfo.contiguous(dequantized_shape(dargs, False), "bfloat16", "cuda:0")
    dplan = plan_dequantize(dargs, out, out, CUDA, exact)
    found = ptx_ops(compile_for_hopper(
        ops._dequantize_pages_kernel, dequant_arrays(dargs, cache_dtype, "int32", scale_dtype, "bfloat16"),
        dplan))
    assert "ftz" not in " ".join(found)


# rope_write_kv: (style, rotary_dim, head_dim, q_heads, kv_heads, dtype, cos/sin dtype, K/V
# scales, query out, key_out, layout, tokens)
ROPE_VARIANTS = [
    ("neox", 128, 128, 32, 8, "bfloat16", "float32", "tensor", "bfloat16", False, "NHD", 65536),
    ("gptj", 128, 128, 32, 8, "bfloat16", "bfloat16", "float", "float8_e4m3fn", True, "NHD", 16),
    ("neox", 64, 128, 8, 8, "float16", "float16", "head", "float8_e5m2", False, "HND", 64),
    ("gptj", 32, 80, 6, 1, "float32", "float32", "none", "float32", True, "3D", 7),
    ("neox", 96, 96, 4, 2, "bfloat16", "float32", "token_head", "uint8", False, "NHD", 300),
    ("gptj", 64, 256, 8, 2, "bfloat16", "float32", "token", "bfloat16", True, "HND", 5),
    ("neox", 128, 128, 32, 8, "bfloat16", "float32", "inline16", "bfloat16", False, "NHD", 4096),
]


def _rope_args(variant):
    """Validated arguments of a variant (query, K and V as views of one fused QKV buffer) and
    the dtype of each array parameter."""
    style, rotary, d, hq, h, dtype, cs_dtype, scale, q_out, key_out, layout, t = variant
    pad = {"inline4": 4, "inline16": 16}.get(scale, 0)
    page = 1 if layout == "3D" else 16
    pages = t // page + 4
    shape = {"3D": (pages, h, d + pad), "NHD": (pages, page, h, d + pad),
             "HND": (pages, h, page, d + pad)}[layout]
    cache = ArrayInfo.contiguous(shape, "uint8" if pad else "float8_e4m3fn", "cuda:0")
    row = (hq + 2 * h) * d
    q = ArrayInfo((t, hq, d), (row, d, 1), dtype, "cuda:0")
    k = ArrayInfo((t, h, d), (row, d, 1), dtype, "cuda:0")
    ints = ArrayInfo.contiguous((t,), "int64", "cuda:0")
    cs = ArrayInfo.contiguous((4096, rotary), cs_dtype, "cuda:0")
    dynamic = pad or scale in ("token", "token_head")
    scale_info = scale_arg("none" if dynamic else scale, h)
    side = None
    if pad:
        side = "inline"
    elif scale in ("token", "token_head"):
        full = {"NHD": shape[:3], "HND": shape[:3], "3D": shape[:2]}[layout]
        side = ArrayInfo.contiguous(full if scale == "token_head" else
                                    ((pages,) if layout == "3D" else (pages, page)),
                                    "float32", "cuda:0")
    fp8 = q_out not in ("bfloat16", "float16", "float32")
    args = check_rope_write(
        q, k, k, cache, cache, ints, ints, cs, scale_info, scale_info, rope_style=style,
        rotary_dim=rotary, query_scale=0.5 if fp8 else None,
        query_out=ArrayInfo.contiguous((t, hq, d), q_out, "cuda:0"),
        key_out=ArrayInfo.contiguous((t, h, d), dtype, "cuda:0") if key_out else None,
        layout="NHD" if layout == "3D" else layout, fp8_format=None, key_scale_cache=side,
        value_scale_cache=side)
    scale_dtype = "float32" if isinstance(scale_info, ArrayInfo) or isinstance(side, ArrayInfo) \
        else "int64"
    arrays = rope_write_operands(args).arrays(dict(
        query=dtype, key=dtype, value=dtype, key_cache=cache.dtype, value_cache=cache.dtype,
        kv_cache=cache.dtype, slots="int64", positions="int64", cos_sin_cache=cs_dtype,
        key_scale=scale_dtype, value_scale=scale_dtype, query_scale="float32",
        key_scale_cache=scale_dtype, value_scale_cache=scale_dtype, query_out=q_out,
        key_out=dtype))
    return args, arrays


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("variant", ROPE_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_rope_write_kernel_compiles_for_sm90(variant, exact):
    args, arrays = _rope_args(variant)
    plan = plan_rope_write(args, CUDA, exact)
    compiled = compile_for_hopper(ops._rope_write_kv_kernel, arrays, plan)
    found = ptx_ops(compiled)
    assert "ftz" not in " ".join(found)
    if not exact:
        assert any(op.startswith("cvt.rn.satfinite") for op in found)
    if variant[7] != "none" or variant[8] != variant[5]:   # a scale: IEEE division
        # div_rn, or (one scale, small batch) the reciprocal refined in fp64 and corrected, or
        # the fp64 reciprocal and product
        division = plan.constexprs["TILE"].RECIPROCAL_DIV
        ptx = compiled.asm["ptx"]
        assert "div.rn.f32" in found or (not exact and (
            (division == Division.FMA and "fma.rn.f64" in ptx)
            or (division == Division.FP64 and "div.rn.f64" in ptx and "mul.rn.f64" in ptx)))


@pytest.mark.parametrize("int_divisibility", [True, False], ids=["torch-style", "jax-triton-style"])
@pytest.mark.parametrize("tokens", [65536, 16])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_default_shape_gets_16_byte_accesses(style, tokens, int_divisibility):
    """Llama-3-8B (32 query heads, 8 kv heads x 128) from one fused QKV buffer, bf16 -> e4m3, a
    device scale: 16-byte loads and stores (8-byte stores of neox halves in the tiny-batch
    tier's programs of 2 kv heads: 8 query half-rows over 4 warps), the rotation's pair formed in registers (no
    shared memory, for the gptj reshape/split either), and at large batches no FMA (the
    products are rounded on their own; small batches use FMAs only for the reciprocal
    division)."""
    variant = (style, 128, 128, 32, 8, "bfloat16", "float32", "tensor", "bfloat16", False,
               "NHD", tokens)
    args, arrays = _rope_args(variant)
    plan = plan_rope_write(args, CUDA)
    compiled = compile_for_hopper(ops._rope_write_kv_kernel, arrays, plan, int_divisibility)
    found = ptx_ops(compiled)
    assert "ld.global.v4.b32" in found, found
    if plan.constexprs["TILE"].KV_HEADS < 8 and style == "neox":
        assert "st.global.v2.b32" in found, found
    else:
        assert "st.global.v4.b32" in found, found
    ptx = compiled.asm["ptx"]
    assert "ld.shared" not in ptx and "st.shared" not in ptx
    assert "ftz" not in ptx
    if not plan.constexprs["TILE"].RECIPROCAL_DIV:
        assert not re.search(r"\bfma\.", ptx)


@pytest.mark.parametrize("entries", [
    dict(small_kv_heads_per_program=2), dict(small_kv_heads_per_program=1, small_batch_warps=4),
    dict(small_block_t=2), dict(small_batch_warps=16),
    dict(small_reciprocal_div=Division.DIV_RN), dict(small_reciprocal_div=Division.FP64),
    dict(tiny_batch_tokens=0), dict(tiny_kv_heads_per_program=1, tiny_reciprocal_div=Division.FMA),
], ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_rope_small_batch_plan_variants_compile_for_sm90(entries, monkeypatch):
    """The small-batch size-table entries the bench tries (bench/rope.py) compile for sm_90."""
    from fp8kv.rope_write import ROPE_SIZES

    for name, value in entries.items():
        monkeypatch.setitem(ROPE_SIZES[CUDA], name, value)
    plan_rope_write.cache_clear()
    try:
        variant = ("neox", 128, 128, 32, 8, "bfloat16", "float32", "tensor", "float8_e4m3fn",
                   False, "NHD", 16)
        args, arrays = _rope_args(variant)
        compiled = compile_for_hopper(ops._rope_write_kv_kernel, arrays,
                                      plan_rope_write(args, CUDA))
        assert "ld.shared" not in compiled.asm["ptx"]
    finally:
        monkeypatch.undo()
        plan_rope_write.cache_clear()


# ---------------------------------------------------------------------------------------------
# NVFP4 (docs/SPEC.md section 13): _write_nvfp4_kernel and _dequantize_nvfp4_kernel.

NVFP4_WRITE_VARIANTS = [  # (dtype, layout, global scale, heads, head_dim, page_size, tokens)
    ("bfloat16", "NHD", "tensor", 8, 128, 16, 4096),   # the bench's shape, large batch
    ("bfloat16", "HND", "float", 8, 128, 16, 16),      # small batch
    ("float16", "HND", "head", 6, 80, 16, 64),
    ("float32", "3D", "none", 1, 16, 1, 7),
    ("bfloat16", "NHD", "float", 3, 256, 64, 16),
]


def _nvfp4_shape(layout, pages, page_size, heads, width):
    if layout == "3D":
        return (pages * page_size, heads, width)
    if layout == "NHD":
        return (pages, page_size, heads, width)
    return (pages, heads, page_size, width)


def _nvfp4_scale(kind, heads):
    if kind == "none":
        return None
    if kind == "float":
        return 0.02
    return ArrayInfo.contiguous((heads,) if kind == "head" else (), "float32", "cuda:0")


def _nvfp4_args(variant, combined=False):
    dtype, layout, scale, heads, head_dim, page_size, tokens = variant
    api_layout = "NHD" if layout == "3D" else layout
    pages = tokens // page_size + 8
    shape = _nvfp4_shape(layout, pages, page_size, heads, head_dim // 2)
    blocks = ArrayInfo.contiguous(shape[:-1] + (head_dim // 16,), "float8_e4m3fn", "cuda:0")
    cache = ArrayInfo.contiguous(shape, "uint8", "cuda:0")
    caches = (dict(kv_cache=ArrayInfo.contiguous((shape[0], 2) + shape[1:], "uint8", "cuda:0"))
              if combined else dict(key_cache=cache, value_cache=cache))
    x = ArrayInfo.contiguous((tokens, heads, head_dim), dtype, "cuda:0")
    slots = ArrayInfo.contiguous((tokens,), "int64", "cuda:0")
    s = _nvfp4_scale(scale, heads)
    args = check_write(x, x, slots=slots, key_scale=s, value_scale=s, layout=api_layout,
                       fp8_format=None, cache_format="nvfp4", key_scale_cache=blocks,
                       value_scale_cache=blocks, **caches)
    arrays = write_operands(args).arrays(dict(
        key=dtype, value=dtype, key_cache="uint8", value_cache="uint8", kv_cache="uint8",
        slots="int64", key_scale="float32", value_scale="float32",
        key_scale_cache="float8_e4m3fn", value_scale_cache="float8_e4m3fn"))
    return args, arrays


# The small-batch layout (blocks over two threads) for the small variants, separate caches.
NVFP4_LAYOUTS = [
    pytest.param(v, c, b, id="-".join(map(str, v)) + ("-combined" if c else "-separate")
                 + ("-blocks" if b else "-groups"))
    for v in NVFP4_WRITE_VARIANTS for c, b in ((False, False), (True, False), (False, True))
    if not b or v is not NVFP4_WRITE_VARIANTS[0]]


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("variant,combined,blockwise", NVFP4_LAYOUTS)
def test_nvfp4_write_kernel_compiles_for_sm90(variant, exact, combined, blockwise, monkeypatch):
    from fp8kv.write import NVFP4_WRITE_SIZES

    monkeypatch.setitem(NVFP4_WRITE_SIZES[CUDA], "small_blockwise", blockwise)
    plan_write.cache_clear()
    try:
        args, arrays = _nvfp4_args(variant, combined)
        plan = plan_write(args, CUDA, exact)
    finally:
        monkeypatch.undo()
        plan_write.cache_clear()
    small = variant[-1] * variant[3] * variant[4] <= NVFP4_WRITE_SIZES[CUDA]["small_batch_elems"]
    assert plan.constexprs["TILE"].BLOCKWISE == (blockwise and small)
    assert plan.kernel == "_write_nvfp4_kernel"
    found = ptx_ops(compile_for_hopper(ops._write_nvfp4_kernel, arrays, plan))
    assert "ftz" not in " ".join(found)
    assert "div.rn.f32" in found   # amax / (6 g) and the block reciprocals: IEEE division
    if not exact:   # e4m3 block scales by the saturating conversion
        assert any(op.startswith("cvt.rn.satfinite.e4m3x2") for op in found)


@pytest.mark.parametrize("int_divisibility", [True, False], ids=["torch-style", "jax-triton-style"])
def test_nvfp4_default_shapes_get_16_byte_accesses(int_divisibility):
    """8 heads x 128, bf16: 16-byte loads of K/V and 16-byte stores of codes (each thread owns a
    group of two blocks); dequantizing 16 x 512 pages: 16-byte code loads and output stores (to
    FP8 by lookup: a block's 8 bytes of codes in, 16 bytes out)."""
    args, arrays = _nvfp4_args(NVFP4_WRITE_VARIANTS[0])
    found = ptx_ops(compile_for_hopper(ops._write_nvfp4_kernel, arrays, plan_write(args, CUDA),
                                       int_divisibility))
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= found, found
    for out in ("bfloat16", "float8_e4m3fn"):
        dargs, darrays, plan = _nvfp4_dequant(("NHD", "tensor", 8, 128, 16, out,
                                               "float" if out == "float8_e4m3fn" else None))
        found = ptx_ops(compile_for_hopper(ops._dequantize_nvfp4_kernel, darrays, plan,
                                           int_divisibility))
        loads = "ld.global.v2.b32" if plan.constexprs["TILE"].LOOKUP else "ld.global.v4.b32"
        assert {loads, "st.global.v4.b32"} <= found, (out, found)


NVFP4_DEQUANT_VARIANTS = [  # (layout, global scale, heads, head_dim, page_size, out, out_scale)
    ("NHD", "tensor", 8, 128, 16, "bfloat16", None),
    ("HND", "head", 6, 80, 16, "float16", None),
    ("3D", "none", 1, 16, 1, "float32", None),
    ("NHD", "float", 3, 256, 64, "float8_e4m3fn", "tensor"),
    ("HND", "tensor", 8, 128, 16, "float8_e4m3fn", "float"),
    ("NHD", "head", 2, 64, 16, "float8_e4m3fn", None),
]


def _nvfp4_dequant(variant, combined=False, exact=None):
    layout, scale, heads, head_dim, page_size, out, out_scale = variant
    api_layout = "NHD" if layout == "3D" else layout
    shape = _nvfp4_shape(layout, 64, page_size, heads, head_dim // 2)
    blocks = ArrayInfo.contiguous(shape[:-1] + (head_dim // 16,), "float8_e4m3fn", "cuda:0")
    cache = ArrayInfo.contiguous(shape, "uint8", "cuda:0")
    caches = (dict(kv_cache=ArrayInfo.contiguous((shape[0], 2) + shape[1:], "uint8", "cuda:0"))
              if combined else dict(key_cache=cache, value_cache=cache))
    table = ArrayInfo.contiguous((16, 512), "int32", "cuda:0")
    s = _nvfp4_scale(scale, heads)
    os_ = {"float": 0.25, "tensor": ArrayInfo.contiguous((), "float32", "cuda:0")}.get(out_scale)
    args = check_dequantize(block_table=table, key_scale=s, value_scale=s, dtype=out,
                            layout=api_layout, fp8_format=None, null_page=None,
                            cache_format="nvfp4", key_scale_cache=blocks, value_scale_cache=blocks,
                            out_scale=os_, **caches)
    pages = ArrayInfo.contiguous(dequantized_shape(args, combined), out, "cuda:0")
    plan = plan_dequantize(args, pages, None if combined else pages, CUDA, exact)
    arrays = dequantize_operands(args).arrays(dict(
        key_cache="uint8", value_cache="uint8", kv_cache="uint8", block_table="int32",
        key_scale="float32", value_scale="float32", key_scale_cache="float8_e4m3fn",
        value_scale_cache="float8_e4m3fn", out_scale="float32", key_out=out, value_out=out,
        kv_out=out, table_out="int32"))
    return args, arrays, plan


@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("variant", NVFP4_DEQUANT_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_nvfp4_dequantize_kernel_compiles_for_sm90(variant, exact, combined):
    args, arrays, plan = _nvfp4_dequant(variant, combined, exact)
    assert plan.kernel == "_dequantize_nvfp4_kernel"
    found = ptx_ops(compile_for_hopper(ops._dequantize_nvfp4_kernel, arrays, plan))
    assert "ftz" not in " ".join(found)
    if variant[5] == "float8_e4m3fn" and not exact:
        assert any(op.startswith("cvt.rn.satfinite.e4m3x2") for op in found)


@pytest.mark.parametrize("variant", [v for v in NVFP4_DEQUANT_VARIANTS if v[5] == "float8_e4m3fn"],
                         ids=lambda v: "-".join(map(str, v)))
def test_nvfp4_fp8_output_looks_codes_up_where_words_align(variant):
    """The FP8 output's lookup (prmt on words of codes) is planned for 16-byte aligned arrays
    whose byte strides are multiples of 4, and not otherwise (a misaligned torch tensor, a
    cache view 2 bytes into its rows); both compile."""
    args, arrays, plan = _nvfp4_dequant(variant)
    assert plan.constexprs["TILE"].LOOKUP
    sign_select = "0x9D8C"   # a prmt selector of the lookup's (fp8kv.ops.codec)
    assert sign_select in compile_for_hopper(ops._dequantize_nvfp4_kernel, arrays, plan).asm["ptx"]
    pages = ArrayInfo.contiguous(dequantized_shape(args, False), "float8_e4m3fn", "cuda:0")
    off = plan_dequantize(args, pages, pages, CUDA, None, aligned=False)
    assert not off.constexprs["TILE"].LOOKUP
    assert sign_select not in compile_for_hopper(ops._dequantize_nvfp4_kernel, arrays,
                                                 off).asm["ptx"]
    kc = args.key_cache
    shifted = replace(args, key_cache=replace(kc, stride_head=kc.stride_head + 2))
    assert not plan_dequantize(shifted, pages, pages, CUDA).constexprs["TILE"].LOOKUP


# Stacked caches (layer=): a host layer (a scalar) or a device one (loaded); each kernel offsets
# its stacked base pointers by layer * a constexpr stride, which keeps the 16-byte accesses.
# "host-1": jax-triton (and Triton without do_not_specialize) makes an int 1 a constexpr.
STACKED = [("host", "static"), ("host-1", "static"), ("device", "static"), ("device", "dynamic")]


def _stacked_args(where, scales, layers=4):
    x = ArrayInfo.contiguous((4096, 8, 128), "bfloat16", "cuda:0")
    cache = ArrayInfo.contiguous((layers, 300, 16, 8, 128), "float8_e4m3fn", "cuda:0")
    slots = ArrayInfo.contiguous((4096,), "int32", "cuda:0")
    layer = {"host": 2, "host-1": 1}.get(where) or ArrayInfo.contiguous((), "int32", "cuda:0")
    if scales == "static":
        scale = ArrayInfo.contiguous((), "float32", "cuda:0")
        kw = dict(key_scale=scale, value_scale=scale)
    else:
        side = ArrayInfo.contiguous((layers, 300, 16, 8), "float32", "cuda:0")
        kw = dict(key_scale_cache=side, value_scale_cache=side)
    write = check_write(x, x, cache, cache, slots, layout="NHD", fp8_format=None, layer=layer, **kw)
    table = ArrayInfo.contiguous((16, 512), "int32", "cuda:0")
    dequant = check_dequantize(cache, cache, table, dtype="bfloat16", layout="NHD",
                               fp8_format=None, null_page=None, layer=layer, **kw)
    return write, dequant


@pytest.mark.parametrize("int_divisibility", [True, False], ids=["torch-style", "jax-triton-style"])
@pytest.mark.parametrize("where, scales", STACKED, ids=lambda v: v)
def test_stacked_kernels_compile_for_sm90_with_16_byte_accesses(where, scales, int_divisibility):
    args, dargs = _stacked_args(where, scales)
    plan = plan_write(args, CUDA)
    assert plan.constexprs["CACHE"].NUM_LAYERS == 4
    assert plan.scalars["layer"] == {"host": 2, "host-1": 1}.get(where, 0)
    found = ptx_ops(compile_for_hopper(
        ops._write_kv_kernel, write_arrays(args, "bfloat16", "float8_e4m3fn", "int32", "float32"),
        plan, int_divisibility))
    assert "ftz" not in " ".join(found)
    assert {"ld.global.v4.b32"} <= found or scales == "dynamic", found
    assert any(op.startswith("st.global.v") for op in found), found
    out = ArrayInfo.contiguous(dequantized_shape(dargs, False), "bfloat16", "cuda:0")
    dplan = plan_dequantize(dargs, out, out, CUDA)
    found = ptx_ops(compile_for_hopper(
        ops._dequantize_pages_kernel,
        dequant_arrays(dargs, "float8_e4m3fn", "int32", "float32", "bfloat16"), dplan,
        int_divisibility))
    assert "ftz" not in " ".join(found)
    if scales == "static":
        assert {"ld.global.v4.b32", "st.global.v4.b32"} <= found, found


# MXFP8 (docs/SPEC.md section 13a): the FP8 kernels with E8M0 block scales (a dynamic kind).
MXFP8_VARIANTS = [  # (dtype, layout, cache dtype, heads, head_dim, page_size, tokens, layer)
    ("bfloat16", "NHD", "float8_e4m3fn", 8, 128, 16, 4096, None),
    ("float16", "HND", "uint8", 5, 160, 16, 7, None),
    ("float32", "3D", "uint8", 1, 32, 1, 3, None),
    ("bfloat16", "NHD", "uint8", 1, 576, 64, 64, "device"),
    ("bfloat16", "HND", "float8_e4m3fn", 4, 64, 16, 16, "host"),
]


def _mxfp8_args(variant, combined=False):
    dtype, layout, cache_dtype, heads, head_dim, page_size, tokens, layer = variant
    api_layout = "NHD" if layout == "3D" else layout
    pages = tokens // page_size + 8
    shape = _nvfp4_shape(layout, pages, page_size, heads, head_dim)
    stack = (3,) if layer else ()
    blocks = ArrayInfo.contiguous(stack + shape[:-1] + (head_dim // 32,), "uint8", "cuda:0")
    cache = ArrayInfo.contiguous(stack + shape, cache_dtype, "cuda:0")
    caches = (dict(kv_cache=ArrayInfo.contiguous((shape[0], 2) + shape[1:], cache_dtype,
                                                 "cuda:0"))
              if combined else dict(key_cache=cache, value_cache=cache))
    x = ArrayInfo.contiguous((tokens, heads, head_dim), dtype, "cuda:0")
    slots = ArrayInfo.contiguous((tokens,), "int64", "cuda:0")
    where = (None if layer is None else 1 if layer == "host"
             else ArrayInfo.contiguous((), "int32", "cuda:0"))
    kw = dict(layout=api_layout, fp8_format=None, cache_format="mxfp8", key_scale_cache=blocks,
              value_scale_cache=blocks, layer=where)
    args = check_write(x, x, slots=slots, **caches, **kw)
    table = ArrayInfo.contiguous((4, 8), "int32", "cuda:0")
    dcaches = ({"kv_cache": caches["kv_cache"]} if combined
               else dict(key_cache=cache, value_cache=cache))
    dargs = check_dequantize(block_table=table, dtype="bfloat16", null_page=None, **dcaches, **kw)
    return args, dargs


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("variant", MXFP8_VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_mxfp8_kernels_compile_for_sm90(variant, combined, exact):
    if combined and variant[-1] is not None:
        pytest.skip("stacked caches are separate here (the FP8 stacked tests cover combined)")
    args, dargs = _mxfp8_args(variant, combined)
    cache_dtype = variant[2]
    plan = plan_write(args, CUDA, exact)
    assert plan.kernel == "_write_kv_kernel"
    assert plan.constexprs["CACHE"].KEY.DYNAMIC == ScaleKind.BLOCK.id
    compiled = compile_for_hopper(
        ops._write_kv_kernel, write_arrays(args, variant[0], cache_dtype, "int64", "uint8"), plan)
    found = ptx_ops(compiled)
    assert ".ftz" not in compiled.asm["ptx"]   # subnormal inputs and quotients kept
    if not exact:   # e4m3 codes by the saturating conversion; no division at all
        assert any(op.startswith("cvt.rn.satfinite.e4m3") for op in found), found
        assert not any(op.startswith("div.") for op in found), found
    out = ArrayInfo.contiguous(dequantized_shape(dargs, combined), "bfloat16", "cuda:0")
    dplan = plan_dequantize(dargs, out, None if combined else out, CUDA, exact)
    assert dplan.kernel == "_dequantize_pages_kernel"
    compiled = compile_for_hopper(
        ops._dequantize_pages_kernel, dequant_arrays(dargs, cache_dtype, "int32", "uint8",
                                                     "bfloat16"), dplan)
    assert ".ftz" not in compiled.asm["ptx"]   # the subnormal scale 2**-127 and products kept
