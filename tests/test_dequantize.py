"""fp8kv_torch.dequantize_pages against fp8kv.reference, byte for byte, on every device."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from tests.attention_bound import attention_error_bound, prefill_block_table
from tests.cases import DEQUANT_CASES, DequantCase, as_uint, dequant_inputs
from tests.helpers import bits, requires_cuda, to_torch, torch, torch_dtype
from fp8kv import reference as ref
from fp8kv_torch import (_launch, dequantize_pages, dequantize_pages_combined, write_kv)

POISON = {1: 0xEE, 2: 0x7FBB, 4: 0x7FBBBBBB}  # a NaN-ish sentinel no correct output has


def poisoned(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    t.view(raw).fill_(POISON[t.element_size()])
    return t


def run_case(case: DequantCase, device: str, exact=None, seed: int = 0):
    x = dequant_inputs(case, seed)
    t = {k: to_torch(v, device) for k, v in x.items()}
    want = ref.dequantize_pages(x["key_cache"], x["value_cache"], x["block_table"], x["key_scale"],
                                x["value_scale"], dtype=case.out, layout=case.api_layout,
                                fp8_format=case.fp8_format, null_page=case.null_page)
    dtype = torch_dtype(case.out)
    outs = (poisoned(want[0].shape, dtype, device), poisoned(want[1].shape, dtype, device),
            poisoned(want[2].shape, torch.int32, device))
    if exact is None:
        got = dequantize_pages(t["key_cache"], t["value_cache"], t["block_table"], t["key_scale"],
                               t["value_scale"], dtype=dtype, layout=case.api_layout,
                               fp8_format=case.fp8_format, null_page=case.null_page, out=outs)
        assert all(g is o for g, o in zip(got, outs))
    else:
        _launch.call("dequantize_pages", t["key_cache"], t["value_cache"], t["block_table"], t["key_scale"],
                                 t["value_scale"], dtype, case.api_layout, case.fp8_format,
                                 case.null_page, outs, exact=exact)
    return tuple(bits(o) for o in outs), tuple(as_uint(w) for w in want)


@pytest.mark.parametrize("case", DEQUANT_CASES, ids=lambda c: c.id)
def test_dequantize_matches_reference(case, device):
    got, want = run_case(case, device)
    for g, w in zip(got, want):   # outputs were poisoned: every element must have been written
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("case", DEQUANT_CASES[:4], ids=lambda c: c.id)
def test_allocating_call_matches_out_call(case, device):
    x = dequant_inputs(case)
    t = {k: to_torch(v, device) for k, v in x.items()}
    got = dequantize_pages(t["key_cache"], t["value_cache"], t["block_table"], t["key_scale"],
                           t["value_scale"], dtype=torch_dtype(case.out), layout=case.api_layout,
                           fp8_format=case.fp8_format, null_page=case.null_page)
    want, _ = run_case(case, device)
    assert got[2].dtype == torch.int32 and got[0].dtype == torch_dtype(case.out)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), w)


@pytest.mark.parametrize("layout", ["NHD", "HND", "3D"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_combined_cache_and_output(layout, dtype, device):
    """``[P, 2, ...]`` in and out (FlashInfer TRT-LLM), and ``kv[:, 0]`` / ``kv[:, 1]`` views in."""
    rng = np.random.default_rng(5)
    pages, page_size, h, d = 9, 4, 3, 80
    shape = {"NHD": (pages, 2, page_size, h, d), "HND": (pages, 2, h, page_size, d),
             "3D": (pages, 2, h, d)}[layout]
    kv = rng.integers(0, 256, size=shape, dtype=np.uint8)
    table = np.array([[4, 0, -1], [8, 2, 2]], dtype=np.int32)
    scale = (rng.random(h) + 0.5).astype(np.float32)
    api_layout = "NHD" if layout == "3D" else layout
    want_k, want_v, want_t = ref.dequantize_pages(kv[:, 0], kv[:, 1], table, scale, 0.75,
                                                  dtype=dtype, layout=api_layout, null_page=0)
    t_kv, t_table = to_torch(kv, device), to_torch(table, device)
    kvp, new_table = dequantize_pages_combined(t_kv, t_table, to_torch(scale, device), 0.75,
                                               dtype=torch_dtype(dtype), layout=api_layout,
                                               null_page=0)
    np.testing.assert_array_equal(bits(kvp[:, 0]), as_uint(want_k))
    np.testing.assert_array_equal(bits(kvp[:, 1]), as_uint(want_v))
    np.testing.assert_array_equal(bits(new_table), want_t)
    k, v, _ = dequantize_pages(t_kv[:, 0], t_kv[:, 1], t_table, to_torch(scale, device), 0.75,
                               dtype=torch_dtype(dtype), layout=api_layout, null_page=0)
    np.testing.assert_array_equal(bits(k), as_uint(want_k))
    np.testing.assert_array_equal(bits(v), as_uint(want_v))


def test_strided_outputs(device):
    """``out=`` may be views, e.g. halves of a caller's combined buffer."""
    case = DequantCase(batch=2, pages_per_seq=3, heads=2, head_dim=64, page_size=4)
    x = dequant_inputs(case)
    t = {k: to_torch(v, device) for k, v in x.items()}
    buf = poisoned((6, 2, 4, 2, 64), torch.bfloat16, device)
    table = poisoned((2, 3), torch.int32, device)
    dequantize_pages(t["key_cache"], t["value_cache"], t["block_table"], t["key_scale"],
                     t["value_scale"], out=(buf[:, 0], buf[:, 1], table))
    want = ref.dequantize_pages(x["key_cache"], x["value_cache"], x["block_table"], x["key_scale"],
                                x["value_scale"])
    np.testing.assert_array_equal(bits(buf[:, 0]), as_uint(want[0]))
    np.testing.assert_array_equal(bits(buf[:, 1]), as_uint(want[1]))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_prefill_attention_within_fp8_bound(fmt, device):
    """write_kv -> dequantize_pages -> SDPA over the compact cache vs SDPA over the bf16 K/V.

    The error must stay within the bound derived in ``attention_bound`` for the chosen scales.
    """
    rng = np.random.default_rng(7)
    hkv, group, d, page_size, num_pages = 2, 3, 64, 16, 40
    lens = [37, 80, 5]
    table = prefill_block_table(rng, lens, page_size, num_pages)
    fmax = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    k_cache = torch.zeros(num_pages, page_size, hkv, d, dtype=torch.uint8, device=device)
    v_cache = torch.zeros_like(k_cache)
    seqs = []
    for b, n in enumerate(lens):
        k = torch.randn(n, hkv, d, dtype=torch.float32).to(torch.bfloat16)
        v = (torch.randn(n, hkv, d) * 3).to(torch.bfloat16)
        q = torch.randn(n, hkv * group, d).to(torch.bfloat16)
        seqs.append((q, k, v))
    k_scale = max(float(s[1].float().abs().max()) for s in seqs) / fmax * 1.01
    v_scale = max(float(s[2].float().abs().max()) for s in seqs) / fmax * 1.01
    for b, (q, k, v) in enumerate(seqs):
        pos = np.arange(len(k))
        slots = table[b, pos // page_size].astype(np.int64) * page_size + pos % page_size
        write_kv(k.to(device), v.to(device), k_cache, v_cache, torch.from_numpy(slots).to(device),
                 k_scale, v_scale, fp8_format=fmt)
    kp, vp, new_table = dequantize_pages(k_cache, v_cache, to_torch(table, device), k_scale, v_scale,
                                         fp8_format=fmt, null_page=0)
    for b, (q, k, v) in enumerate(seqs):
        n = len(k)
        pos = np.arange(n)
        rows = new_table[b].cpu().numpy()[pos // page_size]
        k_deq, v_deq = kp.cpu()[rows, pos % page_size], vp.cpu()[rows, pos % page_size]

        def sdpa(kk, vv):  # fp32 SDPA with GQA, causal: isolates the FP8 error
            qf = q.float().transpose(0, 1)
            kf = kk.float().repeat_interleave(group, dim=1).transpose(0, 1)
            vf = vv.float().repeat_interleave(group, dim=1).transpose(0, 1)
            return torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True)

        got, want = sdpa(k_deq, v_deq), sdpa(k, v)
        mask = np.tril(np.ones((n, n), dtype=bool))
        for hq in range(hkv * group):
            h = hq // group
            bound = attention_error_bound(
                q[:, hq].double().numpy(), k[:, h].double().numpy(), v[:, h].double().numpy(),
                v_deq[:, h].double().numpy(), k_scale, v_scale, fmt, mask)
            err = (got[hq] - want[hq]).abs().double().numpy()
            assert np.all(err <= bound), f"seq {b} head {hq}: max err/bound {np.max(err / bound)}"
            assert err.max() > 0  # the check is not vacuous: FP8 did change the result


@requires_cuda
@pytest.mark.parametrize("case", DEQUANT_CASES, ids=lambda c: c.id)
def test_gpu_exact_path_equals_fast_path(case):
    fast, want = run_case(case, "cuda", exact=False)
    exact, _ = run_case(case, "cuda", exact=True)
    for f, e, w in zip(fast, exact, want):
        np.testing.assert_array_equal(f, e)
        np.testing.assert_array_equal(e, w)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_code_every_output_dtype(fmt, dtype, device):
    """All 256 codes times scales that reach fp16 overflow, bf16 rounding ties and subnormals."""
    codes = np.tile(np.arange(256, dtype=np.uint8), 64).reshape(8, 16, 2, 64)
    table = np.arange(8, dtype=np.int32).reshape(2, 4)
    for scale in (1.0, 0.37, 1e-30, 3e4, 1.0 + 2.0 ** -8):
        got = dequantize_pages(to_torch(codes, device), to_torch(codes, device),
                               to_torch(table, device), scale, scale, dtype=torch_dtype(dtype),
                               fp8_format=fmt)
        want = ref.dequantize_pages(codes, codes, table, scale, scale, dtype=dtype, fp8_format=fmt)
        np.testing.assert_array_equal(bits(got[0]), as_uint(want[0]))
