"""``torch.compile(fullgraph=True)`` of functions that call fp8kv's ops warns about nothing of
fp8kv's (Dynamo warns, for instance, when it traces through an ``lru_cache``-wrapped function:
the frontends' trace-time code must not call one)."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
import fp8kv_torch  # noqa: E402


def _ours(w: warnings.WarningMessage) -> bool:
    text = f"{w.filename} {w.message}"
    return "fp8kv" in text or "lru_cache" in text


def test_compile_fullgraph_without_warnings():
    torch._dynamo.reset()
    key = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    k_cache = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.zeros(4, 2, 4, 2, 16, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([0, 5, 9])
    table = torch.tensor([[1, 2]], dtype=torch.int32)

    def write(k, kc, vc, kv, s):
        fp8kv_torch.write_kv(k, k, kc, vc, s, 0.5, 0.5)
        fp8kv_torch.write_kv_combined(k, k, kv, s, 0.5, 0.5)
        return kc

    def dequantize(kc, vc, kv, t):   # allocating: the outputs are made in the trace
        return (fp8kv_torch.dequantize_pages(kc, vc, t, 0.5, 0.5, dtype="float16"),
                fp8kv_torch.dequantize_pages_combined(kv, t, 0.5, 0.5))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(write, fullgraph=True)(key, k_cache, v_cache, kv, slots)
        (k, v, new_table), (pages, _) = torch.compile(dequantize, fullgraph=True)(
            k_cache, v_cache, kv, table)
    ours = [f"{w.category.__name__}: {w.message}" for w in caught if _ours(w)]
    assert ours == []
    # The compiled calls ran: what was written reads back as the eager calls give it.
    want = fp8kv_torch.dequantize_pages(k_cache, v_cache, table, 0.5, 0.5, dtype=torch.float16)
    assert k.dtype == torch.float16 and torch.equal(k, want[0]) and torch.equal(v, want[1])
    assert k[0].abs().sum() > 0 and pages.shape == (2, 2, 4, 2, 16)
