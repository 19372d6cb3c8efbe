"""fp8kv_torch.rope_write_kv against fp8kv.reference, byte for byte, on every device: RoPE styles,
rotary dims, head dims, GQA/MQA, scale kinds, query outputs, padding and out-of-range positions,
fused QKV views, in place, combined caches, errors, torch.compile and CUDA graphs."""
from __future__ import annotations

import dataclasses
import re

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch")

from tests.cases import as_uint, random_values  # noqa: E402
from tests.helpers import bits, requires_cuda, to_torch, torch  # noqa: E402
from tests.rope_cases import (ROPE_CASES, RopeCase, cos_sin_cache, expected, options,  # noqa: E402
                              rope_inputs, with_)
from fp8kv import reference as ref  # noqa: E402
from fp8kv.modes import Division  # noqa: E402
from fp8kv.optable import OPS  # noqa: E402
from fp8kv.plan import CUDA  # noqa: E402
from fp8kv.rope_write import check_rope_write, plan_rope_write  # noqa: E402
from fp8kv_torch import _launch, rope_write_kv, rope_write_kv_combined  # noqa: E402


def _tensors(inputs: dict, device) -> dict:
    return {k: to_torch(v, device) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}


def run(case: RopeCase, inputs: dict, device, *, query_out=True, key_out=True, exact=None):
    """One call through fp8kv_torch (``exact`` not None: the launcher with the conversions
    forced); returns the bits of every output by name."""
    t = _tensors(inputs, device)
    arrays = [t[n] for n in ("query", "key", "value", "key_cache", "value_cache", "slots",
                             "positions", "cos_sin_cache", "key_scale", "value_scale")]
    kw = dict(query_scale=t["query_scale"], query_out=t["query_out"] if query_out else None,
              key_out=t["key_out"] if key_out else None, key_scale_cache=t["key_scale_cache"],
              value_scale_cache=t["value_scale_cache"], **options(case))
    if exact is None:
        q = rope_write_kv(*arrays, **kw)
    else:
        q = _launch.call("rope_write_kv", *arrays, **kw, exact=exact)
    if query_out:
        assert q is t["query_out"]
    out = {"query_out": q, "key_cache": t["key_cache"], "value_cache": t["value_cache"]}
    if isinstance(t["key_scale_cache"], torch.Tensor):
        out.update(key_scale_cache=t["key_scale_cache"], value_scale_cache=t["value_scale_cache"])
    if key_out:
        out["key_out"] = t["key_out"]
    return {k: bits(v) for k, v in out.items()}


def assert_outputs(got: dict, want: dict):
    for name, g in got.items():
        np.testing.assert_array_equal(g, as_uint(want[name]), err_msg=name)


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: c.id)
def test_matches_reference(case, device):
    """Whole outputs: caches (poisoned: every unwritten byte kept), scale caches, query_out and
    key_out (poisoned: every byte written)."""
    inputs = rope_inputs(case)
    assert_outputs(run(case, inputs, device), expected(case, inputs))


@pytest.mark.parametrize("case", [ROPE_CASES[i] for i in (0, 3, 5, 7)], ids=lambda c: c.id)
def test_query_out_made_when_not_given(case, device):
    inputs = rope_inputs(case, seed=1)
    want = expected(case, inputs)
    results = [run(case, inputs, device, query_out=False, key_out=False) for _ in range(3)]
    for got in results:   # validated, then from the ready launch, then by the last-call check
        assert got["query_out"].dtype == as_uint(want["query_out"]).dtype
        assert_outputs(got, want)


def test_query_out_is_a_new_tensor_every_call(device):
    case = ROPE_CASES[0]
    t = _tensors(rope_inputs(case), device)
    args = [t[n] for n in ("query", "key", "value", "key_cache", "value_cache", "slots",
                           "positions", "cos_sin_cache")]
    outs = [rope_write_kv(*args) for _ in range(4)]
    assert len({o.data_ptr() for o in outs}) == 4
    assert all(o.is_contiguous() and o.dtype == torch.bfloat16 for o in outs)
    for o in outs[1:]:
        assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16))


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_fused_qkv_views_in_place_into_a_combined_cache(style, device):
    """q, k, v: views of one projection output (plus 8 unused columns, poisoned); the query is
    rotated in place (query_out=q), the rotated key lands in k (key_out=k), K/V in kv[:, 0/1]."""
    rng = np.random.default_rng(3)
    t, hq, h, d, pages, page_size = 10, 6, 2, 96, 4, 8
    width = (hq + 2 * h) * d + 8
    qkv = random_values(rng, (t, width), "bfloat16")
    kv = rng.integers(0, 256, size=(pages, 2, page_size, h, d), dtype=np.uint8)
    slots = rng.permutation(pages * page_size)[:t]
    slots[2] = -1
    positions = rng.integers(0, 50, size=t)
    cs = cos_sin_cache(rng, 50, 64, "float32")
    t_qkv, t_kv = to_torch(qkv, device), to_torch(kv, device).view(torch.float8_e4m3fn)
    q = t_qkv[:, :hq * d].view(t, hq, d)
    k = t_qkv[:, hq * d:(hq + h) * d].view(t, h, d)
    v = t_qkv[:, (hq + h) * d:(hq + 2 * h) * d].view(t, h, d)
    out = rope_write_kv_combined(q, k, v, t_kv, to_torch(slots, device),
                                 to_torch(positions, device), to_torch(cs, device), 0.5, 0.25,
                                 rope_style=style, query_out=q, key_out=k)
    assert out is q
    np_q = qkv[:, :hq * d].reshape(t, hq, d)
    np_k = qkv[:, hq * d:(hq + h) * d].reshape(t, h, d)
    np_v = qkv[:, (hq + h) * d:(hq + 2 * h) * d].reshape(t, h, d)
    want_q, want_k, want_v, want_ko = ref.rope_write_kv(
        np_q, np_k, np_v, kv[:, 0].view(ml_dtypes.float8_e4m3fn),
        kv[:, 1].view(ml_dtypes.float8_e4m3fn), slots, positions, cs, 0.5, 0.25,
        rope_style=style, return_key=True)
    got = bits(t_qkv)
    np.testing.assert_array_equal(got[:, :hq * d], as_uint(want_q).reshape(t, -1))
    np.testing.assert_array_equal(got[:, hq * d:(hq + h) * d], as_uint(want_ko).reshape(t, -1))
    np.testing.assert_array_equal(got[:, (hq + h) * d:], as_uint(qkv)[:, (hq + h) * d:])
    got_kv = bits(t_kv)
    np.testing.assert_array_equal(got_kv[:, 0], as_uint(want_k))
    np.testing.assert_array_equal(got_kv[:, 1], as_uint(want_v))


@pytest.mark.parametrize("layout", ["NHD", "HND", "3D"])
@pytest.mark.parametrize("scales", ["static", "token_head"])
def test_combined_cache(layout, scales, device):
    """rope_write_kv_combined == rope_write_kv into the two halves (dynamic: the views
    sc[:, 0], sc[:, 1] of a combined scale buffer)."""
    case = RopeCase(tokens=9, q_heads=4, kv_heads=2, head_dim=64, page_size=4, layout=layout,
                    style="gptj", scale="head" if scales == "static" else "token_head")
    inputs = rope_inputs(case, seed=4)
    want = expected(case, inputs)
    t = _tensors(inputs, device)
    kv = torch.stack([t["key_cache"], t["value_cache"]], dim=1)
    sc = [None, None]
    if scales == "token_head":
        buffer = torch.stack([t["key_scale_cache"], t["value_scale_cache"]], dim=1)
        sc = [buffer[:, 0], buffer[:, 1]]
    q = rope_write_kv_combined(t["query"], t["key"], t["value"], kv, t["slots"], t["positions"],
                               t["cos_sin_cache"], t["key_scale"], t["value_scale"],
                               key_scale_cache=sc[0], value_scale_cache=sc[1], **options(case))
    np.testing.assert_array_equal(bits(q), as_uint(want["query_out"]))
    np.testing.assert_array_equal(bits(kv[:, 0]), as_uint(want["key_cache"]))
    np.testing.assert_array_equal(bits(kv[:, 1]), as_uint(want["value_cache"]))
    if scales == "token_head":
        np.testing.assert_array_equal(bits(buffer[:, 0]), as_uint(want["key_scale_cache"]))
        np.testing.assert_array_equal(bits(buffer[:, 1]), as_uint(want["value_scale_cache"]))


@pytest.mark.parametrize("q_out", ["same", "e4m3"])
def test_out_of_range_positions_write_nothing(q_out, device):
    """Every position outside the cos/sin cache (max_position 0 too): zero query and key rows,
    nothing written to the caches or the scale caches, whatever the slots."""
    for max_position in (0, 40):
        case = RopeCase(tokens=5, q_heads=2, kv_heads=1, head_dim=64, scale="token_head",
                        q_out=q_out, q_scale="tensor", max_position=max_position)
        inputs = rope_inputs(case, seed=5)
        inputs["positions"] = np.array([-1, 40, 2 ** 40, -(2 ** 40), 41])
        inputs["query_scale"] = np.array(np.nan, np.float32) if q_out != "same" else None
        inputs["cos_sin_cache"] = inputs["cos_sin_cache"][:max_position]
        got = run(case, inputs, device)
        for name in ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache"):
            np.testing.assert_array_equal(got[name], as_uint(inputs[name]), err_msg=name)
        assert not got["query_out"].any() and not got["key_out"].any()
        assert_outputs(got, expected(case, inputs))


def test_check_bounds(device):
    case = RopeCase(tokens=4, q_heads=2, kv_heads=1, head_dim=64)
    inputs = rope_inputs(case, seed=6)
    t = _tensors(inputs, device)
    args = [t[n] for n in ("query", "key", "value", "key_cache", "value_cache", "slots",
                           "positions", "cos_sin_cache")]
    poison = [bits(t[n]) for n in ("key_cache", "value_cache", "query_out")]
    t["positions"][2] = 64
    with pytest.raises(ValueError, match=re.escape(
            "positions: expected every position in [0, 64) (the rows of cos_sin_cache), got 1 "
            "outside, the first positions[2] = 64")):
        rope_write_kv(*args, query_out=t["query_out"], check_bounds=True)
    t["positions"][2] = 3
    t["slots"][1] = 10 ** 6
    with pytest.raises(ValueError, match=r"slots: expected every slot < 48 .* the first "
                                         r"slots\[1\] = 1000000"):
        rope_write_kv(*args, query_out=t["query_out"], check_bounds=True)
    for name, before in zip(("key_cache", "value_cache", "query_out"), poison):
        np.testing.assert_array_equal(bits(t[name]), before)
    t["slots"][1] = -1   # padding stays padding
    rope_write_kv(*args, check_bounds=True)


# ---------------------------------------------------------------------------------------------
# Errors: raised before anything is written.

T, HQ, H, D, P, S, R = 5, 4, 2, 64, 3, 4, 32


def good():
    return dict(query=torch.randn(T, HQ, D, dtype=torch.bfloat16),
                key=torch.randn(T, H, D, dtype=torch.bfloat16),
                value=torch.randn(T, H, D, dtype=torch.bfloat16),
                key_cache=torch.full((P, S, H, D), 0x11, dtype=torch.uint8),
                value_cache=torch.full((P, S, H, D), 0x11, dtype=torch.uint8),
                slots=torch.arange(T), positions=torch.arange(T),
                cos_sin_cache=torch.rand(16, R))


def with_args(**changes):
    args = good()
    args.update(changes)
    return args


ERRORS = [
    ("rotary-odd", with_args(cos_sin_cache=torch.rand(16, 31)), {}, ValueError,
     r"cos_sin_cache: expected an even number of columns \(rotary_dim\) in \[2, 64\] "
     r"\(head_dim\), got shape \[16, 31\]"),
    ("rotary-above-head-dim", with_args(cos_sin_cache=torch.rand(16, 66)), {}, ValueError,
     r"cos_sin_cache: expected an even number of columns .* got shape \[16, 66\]"),
    ("rotary-dim-mismatch", good(), dict(rotary_dim=64), ValueError,
     r"cos_sin_cache: expected rotary_dim=64 columns \(cos then sin\), got shape \[16, 32\]"),
    # rotary_dim's own rule before the cache's width: the cache is 32 wide in these three.
    ("rotary-dim-odd", good(), dict(rotary_dim=7), ValueError,
     r"rotary_dim: expected an even int in \[2, 64\] \(head_dim\), got 7"),
    ("rotary-dim-above-head-dim", good(), dict(rotary_dim=66), ValueError,
     r"rotary_dim: expected an even int in \[2, 64\] \(head_dim\), got 66"),
    ("rotary-dim-zero", good(), dict(rotary_dim=0), ValueError,
     r"rotary_dim: expected an even int in \[2, 64\] \(head_dim\), got 0"),
    ("rotary-dim-float", good(), dict(rotary_dim=32.0), TypeError,
     r"rotary_dim: expected None or an int, got float"),
    ("rotary-dim-bool", good(), dict(rotary_dim=True), TypeError,
     r"rotary_dim: expected None or an int, got bool"),
    ("cos-sin-int", with_args(cos_sin_cache=torch.zeros(16, R, dtype=torch.int32)), {},
     TypeError, r"cos_sin_cache: expected dtype float32 or bfloat16 or float16, got int32"),
    ("cos-sin-fp64", with_args(cos_sin_cache=torch.zeros(16, R, dtype=torch.float64)), {},
     TypeError, r"cos_sin_cache: expected dtype float32 or bfloat16 or float16, got float64"),
    ("cos-sin-rank", with_args(cos_sin_cache=torch.zeros(16 * R)), {}, ValueError,
     r"cos_sin_cache: expected rank 2 \[max_position, rotary_dim\], got shape \[512\]"),
    ("cos-sin-stride", with_args(cos_sin_cache=torch.zeros(R, 16).t()), {}, ValueError,
     r"cos_sin_cache: expected a unit-stride last dimension"),
    ("heads-not-multiple", with_args(query=torch.zeros(T, 3, D, dtype=torch.bfloat16)), {},
     ValueError, r"query: expected a number of heads that is a positive multiple of "
                 r"num_kv_heads=2, got 3"),
    ("query-dtype", with_args(query=torch.zeros(T, HQ, D, dtype=torch.float16)), {}, TypeError,
     r"query: expected the dtype of key \(bfloat16\), got float16"),
    ("query-int", with_args(query=torch.zeros(T, HQ, D, dtype=torch.int32)), {}, TypeError,
     r"query: expected dtype bfloat16 or float16 or float32, got int32"),
    ("query-head-dim", with_args(query=torch.zeros(T, HQ, 32, dtype=torch.bfloat16)), {},
     ValueError, r"query: expected \[5, num_heads, 64\] \(num_tokens and head_dim of key\), "
                 r"got shape \[5, 4, 32\]"),
    ("query-rank", with_args(query=torch.zeros(T, HQ * D, dtype=torch.bfloat16)), {},
     ValueError, r"query: expected rank 3 \[num_tokens, num_heads, head_dim\], got shape"),
    ("positions-float", with_args(positions=torch.arange(T, dtype=torch.float32)), {},
     TypeError, r"positions: expected dtype int32 or int64, got float32"),
    ("positions-shape", with_args(positions=torch.arange(T + 1)), {}, ValueError,
     r"positions: expected shape \[5\] \(one per token\), got \[6\]"),
    ("positions-strided", with_args(positions=torch.arange(2 * T)[::2]), {}, ValueError,
     r"positions: expected a contiguous array, got strides \[2\]"),
    ("positions-list", with_args(positions=list(range(T))), {}, TypeError,
     r"positions: expected a torch.Tensor, got list"),
    ("rope-style", good(), dict(rope_style="llama"), ValueError,
     r"rope_style: expected 'neox' or 'gptj', got 'llama'"),
    ("query-scale-bool", good(), dict(query_scale=True), TypeError,
     r"query_scale: expected None, a float or a float32 array, got bool"),
    ("query-scale-zero", good(), dict(query_scale=0.0), ValueError,
     r"query_scale: expected a finite scale > 0, got 0.0"),
    ("query-scale-shape", good(), dict(query_scale=torch.ones(HQ)), ValueError,
     r"query_scale: expected shape \[\] or \[1\], got \[4\]"),
    ("query-scale-dtype", good(), dict(query_scale=torch.ones((), dtype=torch.float16)),
     TypeError, r"query_scale: expected dtype float32, got float16"),
    ("query-out-dtype", good(), dict(query_out=torch.zeros(T, HQ, D)), TypeError,
     r"query_out: expected dtype bfloat16, got float32"),
    ("query-out-fp8-dtype", good(),
     dict(query_scale=0.5, query_out=torch.zeros(T, HQ, D, dtype=torch.bfloat16)), TypeError,
     r"query_out: expected dtype float8_e4m3fn or float8_e5m2 or uint8, got bfloat16"),
    ("query-out-shape", good(), dict(query_out=torch.zeros(T, HQ, 32, dtype=torch.bfloat16)),
     ValueError, r"query_out: expected shape \[5, 4, 64\], got \[5, 4, 32\]"),
    ("query-out-stride", good(),
     dict(query_out=torch.zeros(T, D, HQ, dtype=torch.bfloat16).transpose(1, 2)), ValueError,
     r"query_out: expected a unit-stride last dimension"),
    ("query-out-type", good(), dict(query_out=np.zeros((T, HQ, D))), TypeError,
     r"query_out: expected None or an array, got ndarray"),
    ("key-out-dtype", good(), dict(key_out=torch.zeros(T, H, D)), TypeError,
     r"key_out: expected dtype bfloat16, got float32"),
    ("key-out-shape", good(), dict(key_out=torch.zeros(T, HQ, D, dtype=torch.bfloat16)),
     ValueError, r"key_out: expected shape \[5, 2, 64\], got \[5, 4, 64\]"),
    ("check-bounds-int", good(), dict(check_bounds=1), TypeError,
     r"check_bounds: expected a bool, got int"),
    ("write-error", with_args(slots=torch.arange(T, dtype=torch.int16)), {}, TypeError,
     r"slots: expected dtype int32 or int64, got int16"),
    ("cache-heads", with_args(key_cache=torch.zeros(P, S, 4, D, dtype=torch.uint8),
                              value_cache=torch.zeros(P, S, 4, D, dtype=torch.uint8)), {},
     ValueError, r"key_cache: expected num_kv_heads=2 and head_dim=64 \(those of key\)"),
]


@pytest.mark.parametrize("name,args,kwargs,error,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_raises_and_writes_nothing(name, args, kwargs, error, message):
    args = dict(args)
    query_out = kwargs.get("query_out")
    before = [(t, bits(t)) for t in (args["key_cache"], args["value_cache"], args["query"],
                                     query_out) if isinstance(t, torch.Tensor)]
    for _ in range(2):   # the same error again (no ready launch may serve a bad call)
        with pytest.raises(error, match=message):
            rope_write_kv(**args, **kwargs)
    for t, saved in before:
        np.testing.assert_array_equal(bits(t), saved)


SAME_ERROR_OPTIONS = [   # (function, option, good value, bad value), as tests/test_same_error.py
    ("rope_write_kv", "query_scale", 1.0, True),
    ("rope_write_kv", "key_scale", 1, True),
    ("rope_write_kv", "rotary_dim", 16, 16.0),
    ("rope_write_kv", "rope_style", "neox", "NEOX"),
    ("rope_write_kv", "check_bounds", False, 0),
    ("rope_write_kv_combined", "query_scale", 1.0, True),
]


@pytest.mark.parametrize("option", SAME_ERROR_OPTIONS, ids=lambda o: f"{o[0]}-{o[1]}-{o[3]!r}")
def test_fails_the_same_after_equal_values_of_another_type(option, device):
    import fp8kv_torch
    from tests.test_same_error import _check

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 16)).astype(np.float32)
    cache = np.zeros((4, 4, 2, 16), np.uint8)
    rest = (np.array([0, 5, 9]), np.array([1, 2, 3]), rng.random((8, 16)).astype(np.float32))
    arrays = {"rope_write_kv": (x, x, x, cache, cache.copy()) + rest,
              "rope_write_kv_combined": (x, x, x, np.stack([cache, cache], 1)) + rest}
    arrays = {k: tuple(to_torch(a, device) for a in v) for k, v in arrays.items()}
    _check(fp8kv_torch, arrays, _launch.clear_launch_caches, option)


def test_repeated_calls_validate_once(device, monkeypatch):
    """A repeat of a signature skips validation (ready launch, then the last-call check) and
    still writes the call's own tensors exactly; another option is validated afresh."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return check_rope_write(*args, **kwargs)

    monkeypatch.setitem(OPS, "rope_write_kv", dataclasses.replace(OPS["rope_write_kv"],
                                                                  check=counting))
    _launch.clear_launch_caches()
    case = RopeCase(tokens=5, q_heads=4, kv_heads=2, head_dim=64, scale="tensor")
    for seed in range(4):
        inputs = rope_inputs(case, seed=seed)
        assert_outputs(run(case, inputs, device), expected(case, inputs))
    assert len(calls) == 1
    gptj = with_(case, style="gptj")
    inputs = rope_inputs(gptj, seed=9)
    assert_outputs(run(gptj, inputs, device), expected(gptj, inputs))
    assert len(calls) == 2
    _launch.clear_launch_caches()


# ---------------------------------------------------------------------------------------------
# torch.library op, torch.compile, CUDA graphs.

def _small(device, seed=0):
    case = RopeCase(tokens=6, q_heads=4, kv_heads=2, head_dim=32, page_size=4, scale="head",
                    max_position=16)
    inputs = rope_inputs(case, seed=seed)
    return case, inputs, _tensors(inputs, device)


def test_opcheck(device):
    _, _, t = _small(device)
    torch.library.opcheck(
        torch.ops.fp8kv.rope_write_kv.default,
        (t["query"], t["key"], t["value"], t["key_cache"].view(torch.uint8),
         t["value_cache"].view(torch.uint8), t["slots"], t["positions"], t["cos_sin_cache"],
         t["key_scale"], None, None, None, 0.5, 0.25, "gptj", None, "NHD", None,
         torch.empty(6, 4, 32, dtype=torch.uint8, device=device), t["key_out"], None, None,
         False, False, "exact"),
        test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph(device):
    """A compiled step: the query slice of a fused projection rotated in place, the cache
    written, the key returned rotated; and a second one making an FP8 query."""
    case, inputs, t = _small(device)
    backend = "inductor" if device == "cuda" else "aot_eager"  # inductor on CPU needs a C++ build
    hq, h, d = 4, 2, 32
    qkv = torch.cat([t["query"].flatten(1), t["key"].flatten(1), t["value"].flatten(1)], 1)

    @torch.compile(fullgraph=True, backend=backend)
    def step(qkv, key_cache, value_cache, slots, positions, cos_sin, key_scale, key_out):
        q = qkv[:, :hq * d].view(-1, hq, d)
        k = qkv[:, hq * d:(hq + h) * d].view(-1, h, d)
        v = qkv[:, (hq + h) * d:].view(-1, h, d)
        out = rope_write_kv(q, k, v, key_cache, value_cache, slots, positions, cos_sin,
                            key_scale, 0.75, query_out=q, key_out=key_out)
        # The query, rotated in place above, rotated again into FP8 codes.
        fp8 = rope_write_kv(q * 1, k, v, key_cache, value_cache, slots, positions, cos_sin,
                            key_scale, 0.75, query_scale=0.5)
        return out.float().sum(), fp8

    inputs["value_scale"] = 0.75
    want = expected(case, inputs)
    _, fp8 = step(qkv, t["key_cache"], t["value_cache"], t["slots"], t["positions"],
                  t["cos_sin_cache"], t["key_scale"], t["key_out"])
    np.testing.assert_array_equal(bits(qkv[:, :hq * d].view(-1, hq, d)),
                                  as_uint(want["query_out"]))
    np.testing.assert_array_equal(bits(t["key_out"]), as_uint(want["key_out"]))
    np.testing.assert_array_equal(bits(t["key_cache"]), as_uint(want["key_cache"]))
    np.testing.assert_array_equal(bits(t["value_cache"]), as_uint(want["value_cache"]))
    assert fp8.dtype == torch.float8_e4m3fn
    yq = ref.rope(want["query_out"], inputs["positions"], inputs["cos_sin_cache"])
    np.testing.assert_array_equal(bits(fp8), ref.quantize(yq, 0.5, ref.FORMATS["e4m3"]))


@requires_cuda
def test_cuda_graph_capture_and_replay():
    case, inputs, t = _small("cuda")
    query_out = torch.empty(6, 4, 32, dtype=torch.float8_e5m2, device="cuda")
    scale = torch.tensor(0.25, device="cuda")

    def step():
        rope_write_kv(t["query"], t["key"], t["value"], t["key_cache"], t["value_cache"],
                      t["slots"], t["positions"], t["cos_sin_cache"], t["key_scale"], 0.5,
                      query_scale=scale, query_out=query_out, key_out=t["key_out"],
                      rope_style="gptj")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            allocated = torch.cuda.memory_allocated()
            step()
            assert torch.cuda.memory_allocated() == allocated
    finally:
        torch.cuda.set_sync_debug_mode("default")
    new = rope_inputs(case, seed=8)
    for name in ("query", "key", "value", "key_cache", "value_cache", "slots", "positions",
                 "cos_sin_cache", "key_scale"):
        t[name].copy_(to_torch(new[name], "cuda"))
    scale.fill_(0.125)
    graph.replay()
    torch.cuda.synchronize()
    new.update(query_scale=np.array(0.125, np.float32), value_scale=0.5,
               query_out=np.zeros((6, 4, 32), ml_dtypes.float8_e5m2))
    want = ref.rope_write_kv(**{k: v for k, v in new.items() if k != "key_out"},
                             rope_style="gptj", return_key=True)
    for got, w in zip((query_out, t["key_cache"], t["value_cache"], t["key_out"]), want):
        np.testing.assert_array_equal(bits(got), as_uint(w))


# ---------------------------------------------------------------------------------------------
# GPU only: the hardware conversions against the exact path on every bf16 pattern, large sizes.

@requires_cuda
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("q_out", ["same", "e4m3"])
def test_gpu_every_bf16_pattern(style, q_out):
    """All 65,536 bf16 patterns as query and key elements, rotated with cos/sin rows of exact
    and inexact values (1/0, 0/1, 0.6/0.8, cos 1/sin 1 rounded to bf16, -0.5/huge): the fast
    (hardware) and exact paths give the reference's bytes."""
    patterns = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
    t, d = 64, 128
    x = patterns.reshape(t, 8, d)
    cs = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8], [np.cos(1.0), np.sin(1.0)],
                   [-0.5, 3e38]], np.float32).astype(ml_dtypes.bfloat16)
    cs = np.repeat(cs, d // 2, axis=1).reshape(5, 2, d // 2).reshape(5, d)
    case = RopeCase(tokens=t, q_heads=8, kv_heads=8, head_dim=d, style=style, q_out=q_out,
                    q_scale="tensor", scale="float", cs_dtype="bfloat16", max_position=5)
    for shift in range(5):   # each token takes every cos/sin row in turn
        inputs = rope_inputs(case, seed=shift)
        inputs.update(query=x, key=np.roll(x, 1, axis=1), cos_sin_cache=cs,
                      positions=(np.arange(t) + shift) % 5, slots=np.arange(t))
        want = expected(case, inputs)
        for exact in (False, True):
            assert_outputs(run(case, inputs, "cuda", exact=exact), want)


@requires_cuda
@pytest.mark.parametrize("scales", ["static", "token_head", "token"])
def test_gpu_large_batch(scales):
    """65,536 tokens of the Llama-3-8B shape from one fused QKV buffer: the fast path equals
    the exact path everywhere, and the reference on a sample of 512 tokens."""
    t, hq, h, d, page = 65536, 32, 8, 128, 16
    rng = np.random.default_rng(11)
    qkv = torch.randn(t, (hq + 2 * h) * d, device="cuda").to(torch.bfloat16)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + h) * d].view(t, h, d)
    v = qkv[:, (hq + h) * d:].view(t, h, d)
    num_pages = t // page + 8
    slots = torch.randperm(num_pages * page, device="cuda")[:t]
    positions = torch.randint(0, 131072, (t,), device="cuda")
    cs = cos_sin_cache(rng, 131072, d, "float32")
    static = (0.05, 0.03) if scales == "static" else (None, None)
    side_shape = {"token_head": (num_pages, page, h), "token": (num_pages, page)}.get(scales)
    results = []
    for exact in (False, True):
        kc = torch.full((num_pages, page, h, d), 0x5A, dtype=torch.uint8, device="cuda")
        vc = kc.clone()
        sc = ([torch.zeros(side_shape, device="cuda") for _ in range(2)] if side_shape
              else [None, None])
        out = _launch.call("rope_write_kv", q, k, v, kc, vc, slots, positions,
                                    torch.from_numpy(cs).cuda(), *static,
                                    key_scale_cache=sc[0], value_scale_cache=sc[1], exact=exact)
        results.append([out, kc, vc] + [s for s in sc if s is not None])
    for fast, exact in zip(*results):
        assert torch.equal(fast.view(torch.uint8), exact.view(torch.uint8))
    # The reference on a sample, written to slots 0..511 of a [512, 1, H, D] cache.
    sample = torch.from_numpy(rng.choice(t, 512, replace=False)).cuda()
    host = lambda x: bits(x[sample]).view(ml_dtypes.bfloat16)  # noqa: E731
    zeros = np.zeros((512, 1, h, d), np.uint8)
    side = ([np.zeros((512, 1) + side_shape[2:], np.float32) for _ in range(2)] if side_shape
            else [None, None])
    want = ref.rope_write_kv(host(q), host(k), host(v), zeros, zeros, np.arange(512),
                             positions[sample].cpu().numpy(), cs, *static,
                             key_scale_cache=side[0], value_scale_cache=side[1])
    written = slots[sample]
    np.testing.assert_array_equal(bits(results[0][0][sample]), as_uint(want[0]))
    for i, array in enumerate(results[0][1:]):
        flat = array.view(-1, *array.shape[2:])    # [num_slots, ...]
        np.testing.assert_array_equal(bits(flat[written]), as_uint(want[1 + i])[:, 0])


@requires_cuda
def test_gpu_rows_past_2_31_elements():
    """A cache of more than 2**31 elements takes int64 offsets: rows on both sides of element
    2**31 get the reference's bytes; every other byte keeps its poison."""
    heads, d = 2, 128
    row = heads * d
    num_slots = 2 ** 31 // row + 8
    slots = np.array([0, 2 ** 31 // row - 1, 2 ** 31 // row, num_slots - 1, -1, 7])
    case = RopeCase(tokens=len(slots), q_heads=4, kv_heads=heads, head_dim=d, layout="3D")
    inputs = rope_inputs(case, seed=12)
    caches = [torch.full((num_slots, heads, d), 0xAB, dtype=torch.uint8, device="cuda")
              for _ in range(2)]
    t = _tensors(inputs, "cuda")
    slots_t = torch.tensor(slots, device="cuda")
    args = check_rope_write(*[_launch.info(x, "x") for x in (
        t["query"], t["key"], t["value"], *caches, slots_t, t["positions"], t["cos_sin_cache"])],
        0.37, 0.37, rope_style="neox", rotary_dim=None, query_scale=None, query_out=None,
        layout="NHD", fp8_format=None)
    assert plan_rope_write(args, CUDA).constexprs["TILE"].OFFSETS_64
    q = rope_write_kv(t["query"], t["key"], t["value"], *caches, slots_t, t["positions"],
                      t["cos_sin_cache"], 0.37, 0.37)
    small = np.where(slots < 0, -1, np.arange(len(slots)))
    zeros = np.zeros((len(slots), heads, d), np.uint8)
    want = ref.rope_write_kv(inputs["query"], inputs["key"], inputs["value"], zeros, zeros, small,
                             inputs["positions"], inputs["cos_sin_cache"], 0.37, 0.37)
    np.testing.assert_array_equal(bits(q), as_uint(want[0]))
    index = torch.tensor(slots[slots >= 0], device="cuda")
    for i, cache in enumerate(caches):
        np.testing.assert_array_equal(bits(cache[index]), as_uint(want[1 + i])[small >= 0])
        cache[index] = 0xAB
        assert bool((cache == 0xAB).all())


# The tiny-batch tier is off in the first three (the GPU would plan every test case as tiny).
NO_TINY = dict(tiny_batch_tokens=0, tiny_batch_tokens_dynamic=0, tiny_batch_tokens_fp8q=0)


@pytest.mark.parametrize("entries", [
    dict(NO_TINY, kv_heads_per_program=1, small_kv_heads_per_program=1, q_tile=64,
         small_q_tile=64, fp8q_q_tile=64, small_fp8q_q_tile=64, v_tile=64),
    dict(NO_TINY, kv_heads_per_program=2, small_kv_heads_per_program=2, tile=2048),
    dict(NO_TINY, small_batch_tokens=0),
    dict(tiny_batch_tokens=1 << 30, tiny_batch_tokens_dynamic=1 << 30,
         tiny_batch_tokens_fp8q=1 << 30, tiny_kv_heads_per_program=1, tiny_batch_warps=4,
         tiny_reciprocal_div=Division.FP64),
], ids=["1-kv-head-per-program-small-tiles", "2-kv-heads-per-program-2048-element-tiles",
        "large-batch-tier", "tiny-tier-1-kv-head-fp64-division"])
@pytest.mark.parametrize("case", [ROPE_CASES[i] for i in (0, 3, 5, 6, 9, 10)],
                         ids=lambda c: c.id)
def test_plan_variants_give_the_same_bytes(case, entries, device, monkeypatch):
    """Other size-table entries (as the GPU bench tries them): kv-head groups over several
    programs, several query steps and value chunks per program, several programs of tokens, the
    large-batch and tiny-batch tiers, the fp64 division -- the same bytes (interpreter and
    GPU)."""
    from fp8kv.plan import CUDA, INTERPRET
    from fp8kv.rope_write import ROPE_SIZES

    for name, value in entries.items():
        monkeypatch.setitem(ROPE_SIZES[CUDA if device == "cuda" else INTERPRET], name, value)
    _launch.clear_launch_caches()
    try:
        inputs = rope_inputs(case, seed=7)
        assert_outputs(run(case, inputs, device), expected(case, inputs))
    finally:
        monkeypatch.undo()
        _launch.clear_launch_caches()
