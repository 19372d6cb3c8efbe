"""torch.library ops, torch.compile, CUDA graphs, and the GPU-only sizes (65,536 tokens, > 2**31)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from tests.cases import WriteCase, as_uint, write_inputs
from tests.helpers import bits, requires_cuda, to_torch, torch
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp8kv import reference as ref
from fp8kv.formats import FORMATS
from fp8kv.modes import Division
from fp8kv.ops._dual import jit
from fp8kv.ops.codec import reciprocal_rn
from fp8kv_torch import dequantize_pages, write_kv


def small_write_args(device):
    case = WriteCase(tokens=9, heads=2, head_dim=64, page_size=4, scale="head")
    x = write_inputs(case)
    t = {k: to_torch(v, device) for k, v in x.items()}
    return x, t, case


def test_opcheck_write_kv(device):
    _, t, _ = small_write_args(device)
    # uint8 caches: opcheck's own bookkeeping does arithmetic that fp8 tensors lack on CPU.
    torch.library.opcheck(torch.ops.fp8kv.write_kv.default,
                          (t["key"], t["value"], t["key_cache"].view(torch.uint8),
                           t["value_cache"].view(torch.uint8), t["slots"],
                           t["key_scale"], None, None, 0.5, "NHD", None, None, None, False, False,
                           "exact", None, None, None),
                          test_utils=("test_schema", "test_faketensor"))


def test_opcheck_dequantize_pages(device):
    cache = torch.randint(0, 256, (5, 4, 2, 64), dtype=torch.uint8, device=device)
    table = torch.tensor([[1, -1], [4, 0]], dtype=torch.int32, device=device)
    outs = (torch.empty(4, 4, 2, 64, dtype=torch.bfloat16, device=device),
            torch.empty(4, 4, 2, 64, dtype=torch.bfloat16, device=device),
            torch.empty(2, 2, dtype=torch.int32, device=device))
    torch.library.opcheck(torch.ops.fp8kv.dequantize_pages.default,
                          (cache, cache, table, None, None, 0.5, None, "NHD", "e5m2", 0, *outs,
                           None, None, False, False, None, None, None, None, None, None),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph(device):
    """A compiled function that computes K/V, writes the cache and reads pages back."""
    x, t, case = small_write_args(device)
    backend = "inductor" if device == "cuda" else "aot_eager"  # inductor on CPU needs a C++ build

    @torch.compile(fullgraph=True, backend=backend)
    def step(key, value, key_cache, value_cache, slots, key_scale, table):
        write_kv(key * 1, value, key_cache, value_cache, slots, key_scale, 0.5)
        k, v, new_table = dequantize_pages(key_cache, value_cache, table, key_scale, 0.5)
        return k.float().sum() + v.float().sum(), new_table

    table = torch.arange(4, dtype=torch.int32, device=device).reshape(2, 2)
    step(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slots"], t["key_scale"], table)
    want = ref.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"], x["slots"],
                        x["key_scale"], 0.5)
    np.testing.assert_array_equal(bits(t["key_cache"]), as_uint(want[0]))
    np.testing.assert_array_equal(bits(t["value_cache"]), as_uint(want[1]))


@requires_cuda
def test_cuda_graph_capture_and_replay_without_sync_or_allocation():
    x, t, _ = small_write_args("cuda")
    key, value = t["key"].clone(), t["value"].clone()
    k_cache, v_cache = t["key_cache"].clone(), t["value_cache"].clone()
    slots, scale = t["slots"].clone(), t["key_scale"].clone()
    table = torch.arange(6, dtype=torch.int32, device="cuda").reshape(2, 3)
    outs = tuple(torch.empty(6, 4, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2)) + (
        torch.empty(2, 3, dtype=torch.int32, device="cuda"),)

    def step():
        write_kv(key, value, k_cache, v_cache, slots, scale, 0.5)
        dequantize_pages(k_cache, v_cache, table, scale, 0.5, out=outs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the calls raises
    try:
        with torch.cuda.graph(graph):
            allocated = torch.cuda.memory_allocated()  # (capture itself allocates a little)
            step()
            assert torch.cuda.memory_allocated() == allocated  # the calls allocate nothing
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # New data and a new device scale, then replay: the kernel must read both at replay time.
    x2 = write_inputs(WriteCase(tokens=9, heads=2, head_dim=64, page_size=4, scale="head"), seed=9)
    key.copy_(to_torch(x2["key"], "cuda"))
    value.copy_(to_torch(x2["value"], "cuda"))
    slots.copy_(to_torch(x2["slots"], "cuda"))
    scale.copy_(to_torch(x2["key_scale"], "cuda"))
    k_cache.copy_(to_torch(x2["key_cache"], "cuda"))
    v_cache.copy_(to_torch(x2["value_cache"], "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = ref.write_kv(x2["key"], x2["value"], x2["key_cache"], x2["value_cache"], x2["slots"],
                        x2["key_scale"], 0.5)
    np.testing.assert_array_equal(bits(k_cache), as_uint(want[0]))
    np.testing.assert_array_equal(bits(v_cache), as_uint(want[1]))
    want_pages = ref.dequantize_pages(want[0], want[1], table.cpu().numpy(), x2["key_scale"], 0.5)
    np.testing.assert_array_equal(bits(outs[0]), as_uint(want_pages[0]))


@requires_cuda
@pytest.mark.parametrize("scale", ["float", "head", "none"])
def test_gpu_steady_state_launches_stay_exact(scale):
    """Repeat calls of one signature take the cached launch path; new data, same exact bytes."""
    case = WriteCase(tokens=100, heads=6, head_dim=96, page_size=16, scale=scale)
    for seed in range(3):
        x = write_inputs(case, seed)
        t = {k: to_torch(v, "cuda") for k, v in x.items()}
        write_kv(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slots"], t["key_scale"],
                 t["value_scale"])
        want = ref.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"], x["slots"],
                            x["key_scale"], x["value_scale"])
        np.testing.assert_array_equal(bits(t["key_cache"]), as_uint(want[0]))
        np.testing.assert_array_equal(bits(t["value_cache"]), as_uint(want[1]))
    # An unaligned view (offset by one element) must not reuse a launch compiled for alignment.
    buf = torch.zeros(2 * 100 * 6 * 96 + 1, dtype=torch.bfloat16, device="cuda")
    key = buf[1:1 + 100 * 6 * 96].view(100, 6, 96)
    key.copy_(t["key"])
    write_kv(key, t["value"], t["key_cache"], t["value_cache"], t["slots"], t["key_scale"],
             t["value_scale"])
    np.testing.assert_array_equal(bits(t["key_cache"]), as_uint(want[0]))


@requires_cuda
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_nan_byte_is_the_hardware_conversion(fmt):
    """SPEC: NaN is written as the byte cvt.rn.satfinite gives; pin it (both signs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, E5M2: tl.constexpr):
        i = tl.arange(0, 4)
        x = tl.load(x_ptr + i)
        if E5M2:
            y = x.to(tl.float8e5)
        else:
            y = x.to(tl.float8e4nv)
        tl.store(y_ptr + i, y.to(tl.uint8, bitcast=True))

    nan_bits = torch.tensor([0x7FC00000, -0x00400000, 0x7F800001, -1], dtype=torch.int32)  # +-NaNs
    x = nan_bits.view(torch.float32).cuda()
    y = torch.empty(4, dtype=torch.uint8, device="cuda")
    cast[(1,)](x, y, E5M2=fmt == "e5m2")
    assert y.tolist() == [FORMATS[fmt].nan_code] * 4
    assert ref.quantize(x.cpu().numpy(), 1.0, FORMATS[fmt]).tolist() == y.tolist()


@requires_cuda
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("scale", [1.0, 0.37, 3e-3, 1e5, 2.0 ** -20])
def test_gpu_every_16bit_pattern_fast_equals_exact(fmt, dtype, scale):
    from fp8kv_torch import _launch
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(
        getattr(torch, dtype)).reshape(64, 8, 128).cuda()
    caches = []
    for exact in (False, True):
        k = torch.zeros(64, 8, 128, dtype=torch.uint8, device="cuda")
        _launch.call("write_kv", x, x, k, k.clone(), torch.arange(64, device="cuda"), scale, scale, "NHD", fmt,
                         exact=exact)
        caches.append(bits(k))
    np.testing.assert_array_equal(caches[0], caches[1])


@requires_cuda
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_random_fp32_fast_equals_exact(fmt):
    from fp8kv_torch import _launch
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(-2 ** 31, 2 ** 31, (4096, 8, 128), dtype=torch.int64, generator=g)
    x = raw.to(torch.int32).view(torch.float32)
    x[::2] = torch.randn(2048, 8, 128, generator=g) * 100  # half in fp8's range, half raw bits
    x = x.cuda()
    for scale in (1.0, 0.37, 1e-30, torch.rand(8, generator=g).cuda() + 0.1):
        got = []
        for exact in (False, True):
            k = torch.zeros(4096, 8, 128, dtype=torch.uint8, device="cuda")
            _launch.call("write_kv", x, x, k, k.clone(), torch.arange(4096, device="cuda"), scale, scale,
                             "NHD", fmt, exact=exact)
            got.append(bits(k))
        np.testing.assert_array_equal(got[0], got[1])
        s = scale.cpu().numpy()[:, None] if isinstance(scale, torch.Tensor) else np.float32(scale)
        np.testing.assert_array_equal(got[1], ref.quantize(x.cpu().numpy(), s, FORMATS[fmt]))


@requires_cuda
def test_gpu_65536_tokens():
    case = WriteCase(tokens=65536, heads=8, head_dim=128, page_size=16, scale="head")
    x = write_inputs(case)
    t = {k: to_torch(v, "cuda") for k, v in x.items()}
    write_kv(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slots"], t["key_scale"],
             t["value_scale"])
    # The reference is vectorized here: quantize all rows, then scatter by slot.
    for name, x_in, s in (("key_cache", x["key"], x["key_scale"]), ("value_cache", x["value"], x["value_scale"])):
        want = x[name].view(np.uint8).reshape(-1, 8, 128).copy()
        keep = x["slots"] >= 0
        want[x["slots"][keep]] = ref.quantize(x_in[keep], s[:, None], FORMATS["e4m3"])
        np.testing.assert_array_equal(bits(t[name]).reshape(-1, 8, 128), want)


@requires_cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gpu_cache_beyond_2_31_elements(layout):
    """A 2.2 GiB uint8 cache (> 2**31 elements): slots near its end land where they should."""
    h, d, page_size = 8, 128, 16
    num_pages = (2 ** 31) // (page_size * h * d) + 64
    shape = (num_pages, page_size, h, d) if layout == "NHD" else (num_pages, h, page_size, d)
    k_cache = torch.zeros(shape, dtype=torch.uint8, device="cuda")
    v_cache = torch.zeros(shape, dtype=torch.uint8, device="cuda")
    assert k_cache.numel() > 2 ** 31
    num_slots = num_pages * page_size
    slots = torch.tensor([num_slots - 1, num_slots - 17, 5, num_slots - page_size * 63], device="cuda")
    x = torch.randn(4, h, d, device="cuda", dtype=torch.bfloat16)
    write_kv(x, -x, k_cache, v_cache, slots, 0.5, 0.5, layout=layout)
    want = ref.quantize(x.float().cpu().numpy(), 0.5, FORMATS["e4m3"])
    for i, slot in enumerate(slots.tolist()):
        page, off = divmod(slot, page_size)
        row = k_cache[page, off] if layout == "NHD" else k_cache[page, :, off]
        np.testing.assert_array_equal(bits(row), want[i])
    # The dequantized pages of the tail come back: read path is 64-bit too.
    table = torch.tensor([[num_pages - 1, num_pages - 2, 0]], dtype=torch.int32, device="cuda")
    kp, vp, _ = dequantize_pages(k_cache, v_cache, table, 0.5, 0.5, dtype=torch.float32, layout=layout)
    page, off = divmod(num_slots - 1, page_size)
    got = kp[0, off] if layout == "NHD" else kp[0, :, off]
    np.testing.assert_array_equal(got.cpu().numpy(), np.float32(0.5) * want[0].view(np.uint8).view(
        __import__("ml_dtypes").float8_e4m3fn).astype(np.float32))
    del k_cache, v_cache
    torch.cuda.empty_cache()


@pytest.fixture(params=[Division.FMA, Division.FP64], ids=["fma", "fp64"])
def reciprocal_division(request):
    """Plan writes with one of the reciprocal divisions (fp8kv.ops.codec.divide_by_scalar,
    divide_fp64) for one test."""
    from fp8kv import write
    from fp8kv_torch._launch import clear_launch_caches
    sizes = write.WRITE_SIZES["cuda"]
    saved = dict(sizes)
    # every batch counts as small, and its rows stay whole (one program per 1,024 columns)
    sizes.update(reciprocal_div=request.param, small_batch_elems=1 << 62, split_batch_tokens=0)
    clear_launch_caches()
    yield
    sizes.update(saved)
    clear_launch_caches()


@requires_cuda
@pytest.mark.parametrize("fmt,scale", [
    ("e4m3", 0.37), ("e4m3", 1 / 448), ("e4m3", 2 - 2 ** -23), ("e4m3", 1 + 2 ** -23),
    ("e4m3", 3e-3), ("e4m3", 1e5), ("e4m3", 0.1), ("e4m3", 7.0), ("e4m3", 2.0 ** -40),
    ("e4m3", 2.0 ** 40 * (1 - 2 ** -24)), ("e4m3", 2.0 ** -41), ("e5m2", 0.37), ("e5m2", 1.7e-4),
    ("e5m2", 2 - 2 ** -23),
    # Every kind of scale the kernels accept unchecked (device tensors): the branch-free division
    # scales x by powers of two to bring any of them to [1, 2).
    ("e4m3", -0.37), ("e5m2", -3e-3), ("e4m3", 1e-40), ("e5m2", 2.0 ** -149), ("e4m3", 2.0 ** -126),
    ("e5m2", 2.0 ** -100), ("e4m3", 2.0 ** 100), ("e5m2", 2.0 ** 127 * 1.5),
    ("e4m3", 3.4028234663852886e38), ("e4m3", 0.0), ("e5m2", float("inf")), ("e4m3", float("nan"))])
def test_gpu_reciprocal_division_on_all_fp32_inputs(reciprocal_division, fmt, scale):
    """The fast division gives the exact path's bytes for every one of the 2**32 fp32 inputs."""
    from fp8kv_torch import _launch
    n = 1 << 26
    slots = torch.arange(n // 1024, device="cuda")
    fast = torch.empty(n // 1024, 8, 128, dtype=torch.uint8, device="cuda")
    exact = torch.empty_like(fast)
    scale_t = torch.tensor(scale, dtype=torch.float32, device="cuda")
    for start in range(0, 1 << 32, n):
        x = torch.arange(start, start + n, dtype=torch.int64, device="cuda").to(torch.int32)
        x = x.view(torch.float32).view(n // 1024, 8, 128)
        _launch.call("write_kv", x, x, fast, fast, slots, scale_t, scale_t, "NHD", fmt, exact=False)
        _launch.call("write_kv", x, x, exact, exact, slots, scale_t, scale_t, "NHD", fmt, exact=True)
        assert torch.equal(fast, exact), f"inputs {start:#x}..{start + n - 1:#x} differ"


@jit
def _reciprocal_kernel(s_ptr, fast_ptr, exact_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    s = tl.load(s_ptr + i, mask=mask, other=1.0)
    tl.store(fast_ptr + i, reciprocal_rn(s), mask=mask)
    tl.store(exact_ptr + i, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), mask=mask)


@requires_cuda
def test_gpu_branch_free_reciprocal_of_every_scale_in_one_binade():
    """codec.reciprocal_rn equals div_rn's 1/s for every fp32 s in [1, 2) and (-2, -1], and for
    +-0, +-inf and NaN (IEEE's results)."""
    mantissas = torch.arange(1 << 23, dtype=torch.int32, device="cuda")
    ones = (mantissas | 0x3F800000).view(torch.float32)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")], device="cuda")
    s = torch.cat([ones, -ones, specials])
    fast, exact = torch.empty_like(s), torch.empty_like(s)
    _reciprocal_kernel[(triton.cdiv(s.numel(), 1024),)](s, fast, exact, s.numel(), BLOCK=1024,
                                                        enable_fp_fusion=False)
    assert torch.equal(fast.view(torch.int32), exact.view(torch.int32))


@requires_cuda
@pytest.mark.parametrize("fusion", ["0", "1"])
def test_bytes_do_not_depend_on_the_fp_fusion_default(fusion):
    """The byte-exact write and dequantize suites (CUDA half) pass under either Triton default:
    every launch sets ``enable_fp_fusion`` itself."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": fusion}
    tests = Path(__file__).resolve().parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-k",
         "cuda and not property", str(tests / "test_write.py"), str(tests / "test_dequantize.py")],
        env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout.splitlines()[-1]


@pytest.mark.parametrize("call, message", [
    (lambda f, a: f.write_kv(*a, None, None, None), r"write_kv\(\) takes 7 positional arguments but 8"),
    (lambda f, a: f.write_kv(*a, layuot="NHD"), r"unexpected keyword argument 'layuot'"),
    (lambda f, a: f.write_kv(*a, key=a[0]), r"multiple values for argument 'key'"),
    (lambda f, a: f.write_kv(*a[:4]), r"missing required argument: 'slots'"),
], ids=["too-many-positional", "unknown-keyword", "twice", "missing"])
def test_public_functions_bind_their_arguments_like_python(call, message):
    """The public functions bind their arguments by hand (torch.compile of torch 2.11 cannot
    trace ``locals()``): a wrong call raises Python's TypeError, before anything runs."""
    import fp8kv_torch

    x = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    cache = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    args = (x, x, cache, cache, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(TypeError, match=message):
        call(fp8kv_torch, args)
    assert not cache.any()
