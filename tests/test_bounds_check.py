"""The opt-in bounds check (``check_bounds=True``): out-of-range slots and block-table entries
raise instead of being skipped / giving zero pages; padding (and ``null_page``) stays padding;
nothing is written before the error; off by default, when the results are the reference's
(out-of-range slots skipped, every other byte unchanged; zero pages); refused where a host read is
not allowed."""
from __future__ import annotations

import numpy as np
import pytest

from fp8kv import reference
from tests.cases import as_uint
from tests.helpers import HAS_CUDA, bits, requires_cuda, torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fp8kv_jax  # noqa: E402

H, D, P, S = 2, 16, 3, 4      # 12 slots, 3 pages
SLOTS_BAD = np.array([0, -1, 12, 5, 20], dtype=np.int32)
TABLE_BAD = np.array([[0, -1], [3, 2]], dtype=np.int32)
# Every page different (and no NaN code): a page read from the wrong place shows.
PAGES = (np.arange(P * S * H * D) % 0x77).astype(np.uint8).reshape(P, S, H, D)
SLOT_ERROR = (r"slots: expected every slot < 12 \(num_pages \* page_size\) or < 0 \(padding\), "
              r"got 2 past the cache, the first slots\[2\] = 12")
TABLE_ERROR = (r"block_table: expected every entry < 3 \(num_pages\) or < 0 \(padding\), got 1 "
               r"past the cache, the first block_table\[1, 0\] = 3")


def _write_args(n):
    x = np.ones((n, H, D), np.float32)
    x[:, 1] = -0.5                     # K and V rows differ from each other and from the cache
    cache = np.full((P, S, H, D), 0x11, np.uint8)
    return x, cache


def _assert_bytes(got, expected):
    """Frontend arrays (JAX or torch) hold the reference's bytes, shape and dtype."""
    assert len(got) == len(expected)
    for g, want in zip(got, expected):
        data = bits(g) if torch is not None and isinstance(g, torch.Tensor) else as_uint(
            np.asarray(g))
        assert data.shape == want.shape
        np.testing.assert_array_equal(data, as_uint(want))


def _expected_write(x, cache, slots):
    """The reference's caches; in-range slots written, every other byte the cache's."""
    expected = reference.write_kv(x, -x, cache, cache, slots)
    written = np.zeros(P * S, bool)
    written[[s for s in slots if 0 <= s < P * S]] = True
    for want in expected:
        rows = want.reshape(P * S, H, D)
        assert not np.any(rows[written] == 0x11)          # the written rows changed ...
        assert np.all(rows[~written] == 0x11)             # ... and no other byte
    return expected


def _expected_pages(table, **kwargs):
    """The reference's pages; entries < 0, past the cache or == null_page give zero pages."""
    expected = reference.dequantize_pages(PAGES, PAGES[::-1].copy(), table, **kwargs)
    entries = np.asarray(table).reshape(-1)
    padding = (entries < 0) | (entries >= P) | (entries == kwargs.get("null_page", -1))
    assert padding.any() and not padding.all()
    for pages in expected[:2]:
        assert not np.any(pages[padding].astype(np.float32))
        assert np.all(np.any(pages[~padding].astype(np.float32) != 0, axis=(1, 2, 3)))
    return expected


def test_jax_write_raises_and_padding_passes():
    x, cache = _write_args(5)
    with pytest.raises(ValueError, match=SLOT_ERROR):
        fp8kv_jax.write_kv(x, -x, cache, cache, SLOTS_BAD, check_bounds=True)
    ok = np.array([0, -1, 11, 5, -7], dtype=np.int32)
    got = fp8kv_jax.write_kv(x, -x, cache, cache, ok, check_bounds=True)
    _assert_bytes(got, _expected_write(x, cache, ok))


def test_jax_write_off_by_default_skips_out_of_range_slots():
    x, cache = _write_args(5)
    got = fp8kv_jax.write_kv(x, -x, cache, cache, SLOTS_BAD)
    _assert_bytes(got, _expected_write(x, cache, SLOTS_BAD))
    got = fp8kv_jax.write_kv(x, -x, cache, cache, SLOTS_BAD, check_bounds=False)
    _assert_bytes(got, _expected_write(x, cache, SLOTS_BAD))


def test_jax_dequantize_raises_and_null_page_is_padding():
    with pytest.raises(ValueError, match=TABLE_ERROR):
        fp8kv_jax.dequantize_pages(PAGES, PAGES[::-1].copy(), TABLE_BAD, check_bounds=True)
    got = fp8kv_jax.dequantize_pages(PAGES, PAGES[::-1].copy(), TABLE_BAD, null_page=3,
                                     check_bounds=True)
    _assert_bytes(got, _expected_pages(TABLE_BAD, null_page=3))


def test_jax_dequantize_off_by_default_gives_zero_pages_past_the_cache():
    got = fp8kv_jax.dequantize_pages(PAGES, PAGES[::-1].copy(), TABLE_BAD)
    _assert_bytes(got, _expected_pages(TABLE_BAD))
    kv = np.stack([PAGES, PAGES[::-1]], 1)
    pages, table = fp8kv_jax.dequantize_pages_combined(kv, TABLE_BAD, check_bounds=False)
    k, v, new_table = _expected_pages(TABLE_BAD)
    _assert_bytes([pages, table], [np.stack([k, v], 1), new_table])


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
    x, cache = _write_args(5)
    tx = torch.from_numpy(x).to(device)
    kc = torch.from_numpy(cache).to(device)
    vc = kc.clone()
    slots = torch.tensor(SLOTS_BAD, device=device)
    for _ in range(2):   # the same error every time, and the caches untouched
        with pytest.raises(ValueError, match=SLOT_ERROR):
            fp8kv_torch.write_kv(tx, -tx, kc, vc, slots, check_bounds=True)
        _assert_bytes([kc, vc], [cache, cache])
    fp8kv_torch.write_kv(tx, -tx, kc, vc, slots)   # off: out-of-range slots skipped
    _assert_bytes([kc, vc], _expected_write(x, cache, SLOTS_BAD))


def test_torch_write_combined_off_skips_out_of_range_slots(device):
    import fp8kv_torch
    x, cache = _write_args(5)
    tx = torch.from_numpy(x).to(device)
    kv = torch.from_numpy(np.stack([cache, cache], 1)).to(device)
    slots = torch.tensor(SLOTS_BAD, device=device)
    with pytest.raises(ValueError, match=SLOT_ERROR):
        fp8kv_torch.write_kv_combined(tx, -tx, kv, slots, check_bounds=True)
    _assert_bytes([kv], [np.stack([cache, cache], 1)])
    fp8kv_torch.write_kv_combined(tx, -tx, kv, slots, check_bounds=False)
    _assert_bytes([kv], [np.stack(_expected_write(x, cache, SLOTS_BAD), 1)])


def test_torch_dequantize_raises(device):
    import fp8kv_torch
    kc = torch.from_numpy(PAGES).to(device)
    vc = torch.from_numpy(PAGES[::-1].copy()).to(device)
    table = torch.tensor(TABLE_BAD, device=device)
    with pytest.raises(ValueError, match=TABLE_ERROR):
        fp8kv_torch.dequantize_pages(kc, vc, table, check_bounds=True)
    kv = torch.stack([kc, vc], 1)
    with pytest.raises(ValueError, match=TABLE_ERROR):
        fp8kv_torch.dequantize_pages_combined(kv, table, check_bounds=True)
    # Entry 3 is the null page: padding, so the bounds check passes; its page is zero.
    got = fp8kv_torch.dequantize_pages(kc, vc, table, null_page=3, check_bounds=True)
    _assert_bytes(got, _expected_pages(TABLE_BAD, null_page=3))


def test_torch_dequantize_off_by_default_gives_zero_pages_past_the_cache(device):
    import fp8kv_torch
    kc = torch.from_numpy(PAGES).to(device)
    vc = torch.from_numpy(PAGES[::-1].copy()).to(device)
    table = torch.tensor(TABLE_BAD, device=device)
    expected = _expected_pages(TABLE_BAD)
    _assert_bytes(fp8kv_torch.dequantize_pages(kc, vc, table), expected)
    k, v, new_table = expected
    pages, got_table = fp8kv_torch.dequantize_pages_combined(torch.stack([kc, vc], 1), table,
                                                             check_bounds=False)
    _assert_bytes([pages, got_table], [np.stack([k, v], 1), new_table])


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
