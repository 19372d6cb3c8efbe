"""The opt-in bounds check (``check_bounds=True``): out-of-range slots and block-table entries
raise instead of being skipped / giving zero pages; padding stays padding; nothing is written
before the error; off by default; refused where a host read is not allowed."""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import HAS_CUDA, requires_cuda, torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fp8kv_jax  # noqa: E402

H, D, P, S = 2, 16, 3, 4      # 12 slots, 3 pages
SLOTS_BAD = np.array([0, -1, 12, 5, 20], dtype=np.int32)
TABLE_BAD = np.array([[0, -1], [3, 2]], dtype=np.int32)
SLOT_ERROR = (r"slots: expected every slot < 12 \(num_pages \* page_size\) or < 0 \(padding\), "
              r"got 2 past the cache, the first slots\[2\] = 12")
TABLE_ERROR = (r"block_table: expected every entry < 3 \(num_pages\) or < 0 \(padding\), got 1 "
               r"past the cache, the first block_table\[1, 0\] = 3")


def _write_args(n):
    x = np.ones((n, H, D), np.float32)
    cache = np.full((P, S, H, D), 0x11, np.uint8)
    return x, cache


def test_jax_write_raises_and_padding_passes():
    x, cache = _write_args(5)
    with pytest.raises(ValueError, match=SLOT_ERROR):
        fp8kv_jax.write_kv(x, x, cache, cache, SLOTS_BAD, check_bounds=True)
    ok = np.array([0, -1, 11, 5, -7], dtype=np.int32)
    kc, _ = fp8kv_jax.write_kv(x, x, cache, cache, ok, check_bounds=True)
    assert int(np.asarray(kc)[2, 3, 0, 0]) == 0x38   # slot 11 written (1.0 in e4m3)
    # Off by default: the out-of-range slots are skipped silently.
    fp8kv_jax.write_kv(x, x, cache, cache, SLOTS_BAD)


def test_jax_dequantize_raises_and_null_page_is_padding():
    cache = np.full((P, S, H, D), 0x38, np.uint8)
    with pytest.raises(ValueError, match=TABLE_ERROR):
        fp8kv_jax.dequantize_pages(cache, cache, TABLE_BAD, check_bounds=True)
    fp8kv_jax.dequantize_pages(cache, cache, TABLE_BAD, null_page=3, check_bounds=True)
    fp8kv_jax.dequantize_pages(cache, cache, TABLE_BAD)


def test_jax_check_bounds_under_jit_is_refused():
    x, cache = _write_args(5)
    step = jax.jit(lambda s: fp8kv_jax.write_kv(x, x, cache, cache, s, check_bounds=True))
    with pytest.raises(TypeError, match=r"check_bounds: reads slots on the host, which needs a "
                                        r"concrete array"):
        step(jnp.asarray(SLOTS_BAD))


@pytest.fixture(params=["cpu"] + (["cuda"] if HAS_CUDA else []))
def device(request):
    pytest.importorskip("torch")
    return request.param


def test_torch_write_raises_before_writing(device):
    import fp8kv_torch
    x = torch.ones(5, H, D, device=device)
    kc = torch.full((P, S, H, D), 0x11, dtype=torch.uint8, device=device)
    vc = kc.clone()
    slots = torch.tensor(SLOTS_BAD, device=device)
    for _ in range(2):   # the same error every time, and the caches untouched
        with pytest.raises(ValueError, match=SLOT_ERROR):
            fp8kv_torch.write_kv(x, x, kc, vc, slots, check_bounds=True)
        assert bool((kc == 0x11).all()) and bool((vc == 0x11).all())
    fp8kv_torch.write_kv(x, x, kc, vc, slots)   # off: out-of-range slots skipped
    assert int(kc[0, 0, 0, 0]) == 0x38


def test_torch_dequantize_raises(device):
    import fp8kv_torch
    cache = torch.full((P, S, H, D), 0x38, dtype=torch.uint8, device=device)
    table = torch.tensor(TABLE_BAD, device=device)
    with pytest.raises(ValueError, match=TABLE_ERROR):
        fp8kv_torch.dequantize_pages(cache, cache, table, check_bounds=True)
    kv = torch.stack([cache, cache], 1)
    with pytest.raises(ValueError, match=TABLE_ERROR):
        fp8kv_torch.dequantize_pages_combined(kv, table, check_bounds=True)
    k, _, _ = fp8kv_torch.dequantize_pages(cache, cache, table, null_page=3, check_bounds=True)
    assert float(k[2].abs().sum()) == 0.0   # entry 3 (the null page): a zero page


def test_torch_check_bounds_refused_under_compile():
    pytest.importorskip("torch")
    import fp8kv_torch
    x = torch.ones(5, H, D)
    kc = torch.zeros(P, S, H, D, dtype=torch.uint8)

    @torch.compile(fullgraph=True, backend="eager")
    def step(slots):
        fp8kv_torch.write_kv(x, x, kc, kc.clone(), slots, check_bounds=True)

    with pytest.raises(Exception, match=r"check_bounds: reads slots on the host, which "
                                        r"torch.compile cannot trace"):
        step(torch.tensor(SLOTS_BAD))


@requires_cuda
def test_torch_check_bounds_refused_in_cuda_graph_capture():
    import fp8kv_torch
    x = torch.ones(5, H, D, device="cuda")
    kc = torch.zeros(P, S, H, D, dtype=torch.uint8, device="cuda")
    vc = kc.clone()
    slots = torch.tensor([0, 1, 2, 3, 4], device="cuda")
    fp8kv_torch.write_kv(x, x, kc, vc, slots)   # warm up outside capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"CUDA-graph capture does not allow"):
        with torch.cuda.graph(graph):
            fp8kv_torch.write_kv(x, x, kc, vc, slots, check_bounds=True)
