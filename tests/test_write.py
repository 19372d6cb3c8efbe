"""fp8kv_torch.write_kv against fp8kv.reference, byte for byte, on every device."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from tests.cases import WRITE_CASES, WriteCase, as_uint, random_values, write_inputs
from tests.helpers import bits, requires_cuda, to_torch, torch
from fp8kv import reference as ref
from fp8kv.formats import FORMATS
from fp8kv.modes import Division
from fp8kv.plan import CUDA
from fp8kv.write import check_write, plan_write
from fp8kv_torch import _launch, write_kv, write_kv_combined


def run_case(case: WriteCase, device: str, seed: int = 0, exact=None):
    """Write one case through torch and through the reference; return both caches' bits."""
    x = write_inputs(case, seed)
    t = {k: to_torch(v, device) for k, v in x.items()}
    if exact is None:
        write_kv(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slots"], t["key_scale"],
                 t["value_scale"], layout=case.api_layout, fp8_format=case.fp8_format)
    else:
        _launch.call("write_kv", t["key"], t["value"], t["key_cache"], t["value_cache"], t["slots"],
                         t["key_scale"], t["value_scale"], case.api_layout, case.fp8_format,
                         exact=exact)
    want = ref.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"], x["slots"],
                        x["key_scale"], x["value_scale"], layout=case.api_layout,
                        fp8_format=case.fp8_format)
    return (bits(t["key_cache"]), bits(t["value_cache"])), tuple(as_uint(w) for w in want)


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_write_matches_reference(case, device):
    got, want = run_case(case, device)
    # Whole caches: written rows are exact, every other byte keeps its poison.
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.fixture
def split_rows(monkeypatch):
    """Plan every static-scale write as a small batch whose rows are split over programs
    (``fp8kv.write.WRITE_SIZES``: chunks of 128 columns); yields a function that sets the
    division of such programs."""
    from fp8kv.plan import INTERPRET
    from fp8kv.write import WRITE_SIZES

    def use(division):
        for backend in (CUDA, INTERPRET):
            for name, value in dict(small_batch_elems=1 << 62, split_batch_tokens=1 << 30,
                                    split_chunk=128, split_division=division).items():
                monkeypatch.setitem(WRITE_SIZES[backend], name, value)
        _launch.clear_launch_caches()
        plan_write.cache_clear()

    yield use
    monkeypatch.undo()
    _launch.clear_launch_caches()
    plan_write.cache_clear()


# 8 x 128 rows in 8 chunks; 6 x 80 in 4 with a masked tail; 1 x 256 HND in 2; rank 3 in 4;
# 2 x 96 rows (page 3) in 2 with a masked tail; per-head, per-tensor and float scales.
SPLIT_CASES = [WRITE_CASES[i] for i in (0, 4, 5, 6, 8)]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.id)
def test_rows_split_over_programs(split_rows, case, device):
    """A small batch's rows split over several programs (grid axis 1) write the same bytes, and
    nothing else (poisoned caches), with each division of the GPU (the interpreter divides
    exactly, whichever the plan names)."""
    x = write_inputs(case, 0)
    backend = CUDA if device == "cuda" else "interpret"

    def info(name):
        v = x[name]
        return v if v is None or isinstance(v, float) else _launch.info(to_torch(v, device), name)

    for division in list(Division) if device == "cuda" else [Division.DIV_RN]:
        split_rows(division)
        args = check_write(*map(info, ("key", "value", "key_cache", "value_cache", "slots",
                                       "key_scale", "value_scale")),
                           layout=case.api_layout, fp8_format=case.fp8_format)
        launch = plan_write(args, backend)
        assert launch.grid[1] > 1 and launch.constexprs["TILE"].RECIPROCAL_DIV == division
        got, want = run_case(case, device)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3e-3, 1e5, 2.0 ** -20])
def test_every_16bit_pattern(fmt, dtype, scale, device):
    """All 65,536 bf16 / fp16 bit patterns (NaNs, infs, subnormals, -0) as one 64x8x128 write."""
    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(
        ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16).reshape(64, 8, 128)
    cache = torch.zeros(64, 8, 128, dtype=torch.uint8, device=device)
    key = to_torch(x, device)
    write_kv(key, key, cache, cache.clone(), torch.arange(64, device=device), scale, scale,
             fp8_format=fmt)
    np.testing.assert_array_equal(bits(cache), ref.quantize(x, scale, FORMATS[fmt]))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_random_fp32(fmt, device):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 2 ** 32, size=(64, 4, 256), dtype=np.uint64).astype(np.uint32).view(np.float32)
    x[::3] = random_values(rng, x[::3].shape, "float32")  # raw bits are mostly huge/tiny: mix in
    for scale in (1.0, 0.37, 1e-30):
        cache = torch.zeros(64, 4, 256, dtype=torch.uint8, device=device)
        key = to_torch(x, device)
        write_kv(key, key, cache, cache.clone(), torch.arange(64, device=device), scale, scale,
                 fp8_format=fmt)
        np.testing.assert_array_equal(bits(cache), ref.quantize(x, np.float32(scale), FORMATS[fmt]))


def test_strided_views_combined_buffer_and_fused_qkv(device):
    """K/V sliced out of a fused QKV output, written into kv[:, 0] / kv[:, 1] of a combined buffer."""
    rng = np.random.default_rng(2)
    tokens, hq, hkv, d, pages, page_size = 21, 6, 2, 96, 5, 8
    qkv = random_values(rng, (tokens, (hq + 2 * hkv) * d), "bfloat16")
    kv = rng.integers(0, 256, size=(pages, 2, page_size, hkv, d), dtype=np.uint8)
    slots = rng.permutation(pages * page_size)[:tokens].astype(np.int32)
    t_qkv, t_kv = to_torch(qkv, device), to_torch(kv, device).view(torch.float8_e4m3fn)
    key = t_qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    value = t_qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    assert key.stride() == ((hq + 2 * hkv) * d, d, 1)
    write_kv(key, value, t_kv[:, 0], t_kv[:, 1], to_torch(slots, device), 0.5, 0.25)
    k_np = qkv[:, hq * d:(hq + hkv) * d].reshape(tokens, hkv, d)
    v_np = qkv[:, (hq + hkv) * d:].reshape(tokens, hkv, d)
    want_k, want_v = ref.write_kv(k_np, v_np, kv[:, 0], kv[:, 1], slots, 0.5, 0.25)
    got = bits(t_kv)
    np.testing.assert_array_equal(got[:, 0], want_k)
    np.testing.assert_array_equal(got[:, 1], want_v)


@pytest.mark.parametrize("layout", ["NHD", "HND", "3D"])
def test_write_kv_combined(layout, device):
    rng = np.random.default_rng(3)
    tokens, h, d, pages, page_size = 13, 3, 64, 4, 4
    shape = {"NHD": (pages, 2, page_size, h, d), "HND": (pages, 2, h, page_size, d),
             "3D": (pages * page_size, 2, h, d)}[layout]
    kv = rng.integers(0, 256, size=shape, dtype=np.uint8).view(ml_dtypes.float8_e5m2)
    key, value = (random_values(rng, (tokens, h, d), "float16") for _ in range(2))
    slots = rng.permutation(pages * page_size)[:tokens]
    slots[::4] = -1
    scale = rng.random(h).astype(np.float32) + 0.5
    t_kv = to_torch(kv, device)
    api_layout = "NHD" if layout == "3D" else layout
    write_kv_combined(to_torch(key, device), to_torch(value, device), t_kv, to_torch(slots, device),
                      to_torch(scale, device), 2.0, layout=api_layout)
    want_k, want_v = ref.write_kv(key, value, kv[:, 0], kv[:, 1], slots, scale, 2.0,
                                  layout=api_layout)
    got = bits(t_kv)
    np.testing.assert_array_equal(got[:, 0], as_uint(want_k))
    np.testing.assert_array_equal(got[:, 1], as_uint(want_v))


def test_padding_and_out_of_range_slots_write_nothing(device):
    cache = torch.full((4, 16, 2, 64), 0xAB, dtype=torch.uint8, device=device)
    key = torch.ones(3, 2, 64, device=device)
    slots = torch.tensor([-1, 64, 2 ** 40], device=device)  # padding, one past the end, far past
    write_kv(key, key, cache, cache, slots)
    assert bool((cache == 0xAB).all())


def test_zero_tokens_is_a_no_op(device):
    cache = torch.full((2, 4, 1, 64), 7, dtype=torch.uint8, device=device)
    empty = torch.empty(0, 1, 64, dtype=torch.bfloat16, device=device)
    write_kv(empty, empty, cache, cache, torch.empty(0, dtype=torch.int32, device=device))
    assert bool((cache == 7).all())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens=st.integers(1, 40), heads=st.integers(1, 5), head_dim=st.sampled_from([16, 48, 64, 80]),
       page_size=st.sampled_from([1, 2, 5, 16]), layout=st.sampled_from(["NHD", "HND", "3D"]),
       fmt=st.sampled_from(["e4m3", "e5m2"]), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
       scale=st.sampled_from(["none", "float", "tensor", "head"]), seed=st.integers(0, 2 ** 16))
def test_property_matches_reference(tokens, heads, head_dim, page_size, layout, fmt, dtype, scale,
                                    seed):
    case = WriteCase(tokens=tokens, heads=heads, head_dim=head_dim, page_size=page_size,
                     layout=layout, fmt=fmt, dtype=dtype, scale=scale, cache="uint8")
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        got, want = run_case(case, device, seed)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


@requires_cuda
@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_gpu_exact_path_equals_fast_path(case):
    """The interpreter's (exact) conversions, compiled, give the hardware conversions' bytes."""
    fast, _ = run_case(case, "cuda", exact=False)
    exact, want = run_case(case, "cuda", exact=True)
    for f, e, w in zip(fast, exact, want):
        np.testing.assert_array_equal(f, e)
        np.testing.assert_array_equal(e, w)


@requires_cuda
@pytest.mark.parametrize("scales", ["static", "token_head"])
def test_gpu_rows_past_2_31_elements(scales):
    """A cache of more than 2**31 elements takes int64 offsets (the plan's OFFSETS_64): rows on
    both sides of element 2**31 get the reference's bytes (and scales); every other byte keeps
    its poison. Two 2 GiB caches."""
    heads, head_dim = 2, 128
    row = heads * head_dim
    num_slots = 2 ** 31 // row + 8
    slots = np.array([0, 2 ** 31 // row - 1, 2 ** 31 // row, num_slots - 1, -1, 7])
    rng = np.random.default_rng(5)
    x = [rng.standard_normal((len(slots), heads, head_dim)).astype(ml_dtypes.bfloat16)
         for _ in range(2)]
    caches = [torch.full((num_slots, heads, head_dim), 0xAB, dtype=torch.uint8, device="cuda")
              for _ in range(2)]
    dynamic = scales == "token_head"
    scale_caches = ([torch.full((num_slots, heads), -3.0, device="cuda") for _ in range(2)]
                    if dynamic else [None, None])
    static = [None, None] if dynamic else [0.37, 2.5]
    key, value = (to_torch(a, "cuda") for a in x)
    slots_t = torch.tensor(slots, device="cuda")
    infos = [_launch.info(t, "x") for t in (key, value, *caches, slots_t)]
    args = check_write(*infos, *static, layout="NHD", fp8_format=None,
                       **{f"{side}_scale_cache": _launch.info(sc, side) if dynamic else None
                          for side, sc in zip(("key", "value"), scale_caches)})
    assert plan_write(args, CUDA).constexprs["TILE"].OFFSETS_64
    write_kv(key, value, *caches, slots_t, *static, key_scale_cache=scale_caches[0],
             value_scale_cache=scale_caches[1])
    # The reference on a small cache: slot i for token i (padding stays padding).
    small = np.where(slots < 0, -1, np.arange(len(slots)))
    zeros = np.zeros((len(slots), heads, head_dim), np.uint8)
    side = [np.zeros((len(slots), heads), np.float32) if dynamic else None for _ in range(2)]
    want = ref.write_kv(*x, zeros, zeros, small, *static, layout="NHD", key_scale_cache=side[0],
                        value_scale_cache=side[1])
    written = slots[slots >= 0]
    index = torch.tensor(written, device="cuda")
    for i, cache in enumerate(caches):
        np.testing.assert_array_equal(bits(cache[index]), as_uint(want[i])[small >= 0])
        cache[index] = 0xAB
        assert bool((cache == 0xAB).all())
        if dynamic:
            sc = scale_caches[i]
            np.testing.assert_array_equal(bits(sc[index]), bits(torch.from_numpy(want[2 + i]))[small >= 0])
            sc[index] = -3.0
            assert bool((sc == -3.0).all())
