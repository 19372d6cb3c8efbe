"""Kernel arguments are bound by name: every plan names exactly the kernel's parameters.

A parameter added to a kernel without its plan entry (or dropped from one) must fail here, on any
machine, rather than shift the positional arguments of a launch.
"""
from __future__ import annotations

import pytest
import triton.language as tl

from tests.cases import DEQUANT_CASES, WRITE_CASES
from fp8kv import ops
from fp8kv.arrays import ArrayInfo
from fp8kv.binding import bind, BoundCall, check_names, signature
from fp8kv.dequantize import (check_dequantize, dequantize_operands, dequantized_shape,
                              plan_dequantize)
from fp8kv.ops._dual import jit
from fp8kv.plan import CUDA, INTERPRET, LaunchPlan
from fp8kv.write import check_write, plan_write, write_operands

WRITE_ARRAYS = ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr", "slot_ptr",
                "key_scale_ptr", "value_scale_ptr", "layer_ptr", "key_cache_out_ptr",
                "value_cache_out_ptr", "key_scale_out_ptr", "value_scale_out_ptr")
DEQUANT_ARRAYS = ("key_cache_ptr", "value_cache_ptr", "table_ptr", "key_scale_ptr",
                  "value_scale_ptr", "layer_ptr", "key_out_ptr", "value_out_ptr", "new_table_ptr")


def _write_args(case, combined=False):
    x = ArrayInfo.contiguous((case.tokens, case.heads, case.head_dim), case.dtype, "cuda:0")
    shape = case.cache_shape
    slots = ArrayInfo.contiguous((case.tokens,), case.slots, "cuda:0")
    if combined:
        kv = ArrayInfo.contiguous((shape[0], 2) + tuple(shape[1:]), case.cache_dtype, "cuda:0")
        args = check_write(x, x, None, None, slots, 0.5, 2.0, layout=case.api_layout,
                           fp8_format=case.fp8_format, kv_cache=kv)
    else:
        cache = ArrayInfo.contiguous(shape, case.cache_dtype, "cuda:0")
        args = check_write(x, x, cache, cache, slots, 0.5, 2.0, layout=case.api_layout,
                           fp8_format=case.fp8_format)
    return args


def _write_plan(case, backend, combined=False):
    return plan_write(_write_args(case, combined), backend)


def _dequant_args(case, combined=False):
    cache = ArrayInfo.contiguous(case.cache_shape, case.cache_dtype, "cuda:0")
    table = ArrayInfo.contiguous((case.batch, case.pages_per_seq), "int32", "cuda:0")
    caches = (dict(kv_cache=ArrayInfo.contiguous((cache.shape[0], 2) + cache.shape[1:],
                                                 cache.dtype, "cuda:0"))
              if combined else dict(key_cache=cache, value_cache=cache))
    return check_dequantize(**caches, block_table=table, value_scale=0.5, dtype=case.out,
                            layout=case.api_layout, fp8_format=case.fp8_format,
                            null_page=case.null_page)


def _dequant_plan(case, backend, combined=False):
    args = _dequant_args(case, combined)
    out = ArrayInfo.contiguous(dequantized_shape(args, combined), case.out, "cuda:0")
    return plan_dequantize(args, out, None if combined else out, backend)


@pytest.mark.parametrize("backend", [CUDA, INTERPRET])
@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
def test_every_write_plan_names_the_kernel_parameters(backend, combined):
    for case in WRITE_CASES:
        plan = _write_plan(case, backend, combined)
        check_names(ops._write_kv_kernel, plan.scalars, plan.constexprs, dict.fromkeys(WRITE_ARRAYS))
        assert plan.constexprs["CACHE"].COMBINED == combined


@pytest.mark.parametrize("backend", [CUDA, INTERPRET])
@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
def test_every_dequantize_plan_names_the_kernel_parameters(backend, combined):
    for case in DEQUANT_CASES:
        plan = _dequant_plan(case, backend, combined)
        check_names(ops._dequantize_pages_kernel, plan.scalars, plan.constexprs,
                    dict.fromkeys(DEQUANT_ARRAYS))
        assert plan.constexprs["CACHE"].COMBINED == combined


def test_bind_orders_by_the_kernel_signature():
    plan = _write_plan(WRITE_CASES[0], CUDA)
    arrays = {name: name for name in reversed(WRITE_ARRAYS)}
    call = bind(ops._write_kv_kernel, plan, arrays)
    assert isinstance(call, BoundCall)
    sig = signature(ops._write_kv_kernel)
    assert call.inputs == sig.inputs and call.outputs == sig.outputs
    assert call.inputs[-1] == "layer_ptr" and call.outputs == (
        "key_cache_out_ptr", "value_cache_out_ptr", "key_scale_out_ptr", "value_scale_out_ptr")
    assert call.scalars == tuple(plan.scalars[n] for n in sig.scalars)
    assert list(call.constexprs) == list(sig.constexprs)


def test_a_plan_that_drifts_from_the_kernel_fails_by_name():
    plan = _write_plan(WRITE_CASES[0], CUDA)
    arrays = dict.fromkeys(WRITE_ARRAYS)
    renamed = dict(plan.scalars)
    renamed["n_slots"] = renamed.pop("num_slots")
    with pytest.raises(TypeError, match=r"no scalar for \['num_slots'\].*"
                                        r"scalars \['n_slots'\] are not parameters"):
        bind(ops._write_kv_kernel, LaunchPlan(plan.grid, plan.num_warps, renamed, plan.constexprs),
             arrays)
    extra = {**plan.constexprs, "UNUSED": 1}
    with pytest.raises(TypeError, match=r"constexprs \['UNUSED'\] are not parameters"):
        bind(ops._write_kv_kernel, LaunchPlan(plan.grid, plan.num_warps, plan.scalars, extra),
             arrays)
    with pytest.raises(TypeError, match=r"no array for \['slot_ptr'\]"):
        bind(ops._write_kv_kernel, plan, {n: None for n in WRITE_ARRAYS if n != "slot_ptr"})


def test_kernel_parameters_must_come_in_jax_triton_order():
    @jit
    def _scalar_after_output(x_ptr, n, y_ptr, m, BLOCK: tl.constexpr):
        pass

    @jit
    def _constexpr_before_output(x_ptr, n, BLOCK: tl.constexpr, y_ptr):
        pass

    with pytest.raises(TypeError, match=r"'m' \(scalar\) comes after the outputs"):
        signature(_scalar_after_output)
    with pytest.raises(TypeError, match=r"'y_ptr' \(output\) comes after the constexprs"):
        signature(_constexpr_before_output)


@pytest.mark.parametrize("backend", [CUDA, INTERPRET])
@pytest.mark.parametrize("dynamic", ["token_head", "token", "inline"])
def test_dynamic_scale_plans_name_the_kernel_parameters(backend, dynamic):
    x = ArrayInfo.contiguous((5, 3, 80), "bfloat16", "cuda:0")
    width = 84 if dynamic == "inline" else 80
    cache = ArrayInfo.contiguous((4, 16, 3, width), "uint8", "cuda:0")
    slots = ArrayInfo.contiguous((5,), "int32", "cuda:0")
    sc = ("inline" if dynamic == "inline" else
          ArrayInfo.contiguous((4, 16, 3) if dynamic == "token_head" else (4, 16), "float32",
                               "cuda:0"))
    args = check_write(x, x, cache, cache, slots, None, None, layout="NHD", fp8_format=None,
                       key_scale_cache=sc, value_scale_cache=sc, scale_rounding="pow2")
    plan = plan_write(args, backend)
    check_names(ops._write_kv_kernel, plan.scalars, plan.constexprs, dict.fromkeys(WRITE_ARRAYS))
    assert plan.constexprs["CACHE"].SCALE_POW2 and plan.constexprs["CACHE"].HEAD_DIM == 80
    assert plan.constexprs["CACHE"].INLINE_PAD == (4 if dynamic == "inline" else 0)
    table = ArrayInfo.contiguous((2, 3), "int32", "cuda:0")
    dargs = check_dequantize(cache, cache, table, None, None, dtype="bfloat16", layout="NHD",
                             fp8_format=None, null_page=None, key_scale_cache=sc,
                             value_scale_cache=sc, head_dim=80 if dynamic == "inline" else None)
    out = ArrayInfo.contiguous(dequantized_shape(dargs, False), "bfloat16", "cuda:0")
    assert out.shape == (6, 16, 3, 80)
    plan = plan_dequantize(dargs, out, out, backend)
    check_names(ops._dequantize_pages_kernel, plan.scalars, plan.constexprs,
                dict.fromkeys(DEQUANT_ARRAYS))


@pytest.mark.parametrize("backend", [CUDA, INTERPRET])
def test_write_offsets_are_int64_only_past_int32_reach(backend):
    """OFFSETS_64 turns on where some array of the call (masked lanes included) reaches past
    2**31 - 1 elements: the caches, a strided input, a side scale array."""
    def plan(num_slots=1024, key_stride=256, scale_stride=None):
        key = ArrayInfo((6, 2, 128), (key_stride, 128, 1), "bfloat16", "cuda:0")
        cache = ArrayInfo.contiguous((num_slots, 2, 128), "uint8", "cuda:0")
        slots = ArrayInfo.contiguous((6,), "int64", "cuda:0")
        sc = None if scale_stride is None else ArrayInfo((num_slots, 2), (scale_stride, 1),
                                                         "float32", "cuda:0")
        args = check_write(key, key, cache, cache, slots, None if sc else 1.0, None if sc else 1.0,
                           layout="NHD", fp8_format=None, key_scale_cache=sc, value_scale_cache=sc)
        return plan_write(args, backend).constexprs["TILE"].OFFSETS_64

    assert not plan()
    assert not plan(num_slots=2 ** 31 // 256 - 2)   # the cache ends 512 elements below 2**31
    assert plan(num_slots=2 ** 31 // 256)            # 2**31 elements: int64 (a row's margin)
    assert plan(key_stride=2 ** 31 // 4)             # a token stride: token 5 is past 2**31
    assert not plan(scale_stride=2)
    assert not plan(scale_stride=2 ** 21)            # slot 1023 of the side scales: below 2**31
    assert plan(scale_stride=2 ** 22)                # ... past it


@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
def test_the_operand_maps_name_every_kernel_array_once(combined):
    """The core's operand map (what both frontends launch from) names each array parameter of
    the kernel once, in the kernel's order; written outputs alias the input holding the same
    argument; a combined cache is one argument, read twice and written once."""
    for case in WRITE_CASES:
        args = _write_args(case, combined)
        operands = write_operands(args)
        sig = signature(ops._write_kv_kernel)
        assert tuple(o.param for o in operands.inputs) == sig.inputs
        assert tuple(o.param for o in operands.outputs) == sig.outputs
        by_param = {o.param: o for o in operands.params}
        for o in operands.outputs:
            if o.aliases:
                assert by_param[o.aliases].source == o.source
        cache = "kv_cache" if combined else "key_cache"
        assert by_param["key_cache_ptr"].source == cache
        assert operands.updated == ((cache,) if combined else ("key_cache", "value_cache"))
        assert not by_param["value_cache_out_ptr"].used if combined else True
        assert not by_param["key_scale_ptr"].used    # host scales: nothing read
    for case in DEQUANT_CASES:
        operands = dequantize_operands(_dequant_args(case, combined))
        sig = signature(ops._dequantize_pages_kernel)
        assert tuple(o.param for o in operands.params) == sig.inputs + sig.outputs
        assert operands.updated == ()
        assert operands.new_outputs == (("kv_out", "table_out") if combined
                                        else ("key_out", "value_out", "table_out"))


def test_device_and_side_scales_are_read_through_the_scale_parameter():
    x = ArrayInfo.contiguous((5, 3, 80), "bfloat16", "cuda:0")
    cache = ArrayInfo.contiguous((4, 16, 3, 80), "uint8", "cuda:0")
    slots = ArrayInfo.contiguous((5,), "int32", "cuda:0")
    tensor = ArrayInfo.contiguous((3,), "float32", "cuda:0")
    side = ArrayInfo.contiguous((4, 16, 3), "float32", "cuda:0")
    args = check_write(x, x, cache, cache, slots, tensor, None, layout="NHD", fp8_format=None,
                       value_scale_cache=side)
    by_param = {o.param: o for o in write_operands(args).params}
    assert by_param["key_scale_ptr"].source == "key_scale" and by_param["key_scale_ptr"].used
    assert not by_param["key_scale_out_ptr"].used
    assert by_param["value_scale_ptr"].source == "value_scale_cache"
    assert by_param["value_scale_out_ptr"].aliases == "value_scale_ptr"
