"""End to end, as the README's rope_write_kv example: a GQA layer's prefill and one decode step
with a fused QKV projection -- rope_write_kv (query rotated in place, K/V into FP8 pages), then
attention over the pages via dequantize_pages -- against attention over the exactly rotated bf16
keys and values, within the FP8 error bound of tests/attention_bound.py. torch and JAX, on the
CPU with small sizes."""
from __future__ import annotations

import numpy as np
import pytest

from fp8kv import reference as ref
from fp8kv.reference import np_dtype
from tests.attention_bound import attention_error_bound

HQ, HKV, D, S, PAGES = 4, 2, 64, 4, 16
LENS = [9, 3]                                 # tokens already in each sequence
TABLE = np.array([[5, 9, 2], [7, 0, 0]], np.int32)
SCALE = 0.02                                  # |rotated K|, |V| / 0.02 stay below e4m3's 448


def _cos_sin() -> np.ndarray:
    inv_freq = 500000.0 ** (-np.arange(0, D, 2) / D)
    angles = np.arange(64)[:, None] * inv_freq
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def _tokens(rng):
    """``(qkv, positions, seqs)`` of the prefill, then of the decode step."""
    prefill = (np.concatenate([np.arange(n) for n in LENS]),
               np.repeat(np.arange(len(LENS)), LENS))
    decode = (np.array(LENS), np.arange(len(LENS)))
    return [((rng.standard_normal((len(p), (HQ + 2 * HKV) * D))).astype(np_dtype("bfloat16")),
             p, s) for p, s in (prefill, decode)]


def _check_attention(q, k_pages, v_pages, new_table, calls):
    """Attention of each sequence's new token over its cached tokens (fp64): FP8 pages against
    the exactly rotated bf16 keys and the bf16 values, within the bound."""
    cs = _cos_sin()
    for b, n in enumerate(LENS):
        keys, values = [], []
        for qkv, positions, seqs in calls:   # every token of sequence b, in position order
            mine = seqs == b
            x = qkv[mine].reshape(-1, HQ + 2 * HKV, D)
            keys.append(ref.rope(x[:, HQ:HQ + HKV], positions[mine], cs))
            values.append(x[:, HQ + HKV:].astype(np.float32))
        k, v = np.concatenate(keys), np.concatenate(values)            # [n + 1, Hkv, D]
        pos = np.arange(n + 1)
        rows, offsets = new_table[b][pos // S], pos % S
        k_deq = k_pages[rows, offsets].astype(np.float64)
        v_deq = v_pages[rows, offsets].astype(np.float64)
        for hq in range(HQ):
            h = hq // (HQ // HKV)
            qh = q[b, hq][None].astype(np.float64)

            def attend(kk, vv):
                logits = qh @ kk.T / np.sqrt(D)
                p = np.exp(logits - logits.max())
                return (p / p.sum()) @ vv

            got = attend(k_deq[:, h], v_deq[:, h])
            want = attend(k[:, h].astype(np.float64), v[:, h].astype(np.float64))
            bound = attention_error_bound(qh, k[:, h].astype(np.float64),
                                          v[:, h].astype(np.float64), v_deq[:, h], SCALE, SCALE,
                                          "e4m3")
            err = np.abs(got - want)
            assert np.all(err <= bound), f"seq {b} head {hq}: max err/bound {np.max(err / bound)}"
            assert err.max() > 0


def test_torch_decode_step():
    torch = pytest.importorskip("torch")
    import fp8kv_torch
    from tests.helpers import bits, to_torch

    dev = "cpu"
    cos_sin = torch.from_numpy(_cos_sin())
    k_cache = torch.zeros(PAGES, S, HKV, D, dtype=torch.float8_e4m3fn, device=dev)
    v_cache = torch.zeros_like(k_cache)
    k_scale = v_scale = torch.tensor(SCALE, device=dev)
    table = torch.from_numpy(TABLE)

    def rope_write(qkv, positions, seqs):
        q, k, v = qkv.view(len(qkv), HQ + 2 * HKV, D).split([HQ, HKV, HKV], dim=1)
        slots = table[seqs, positions // S].long() * S + positions % S
        return fp8kv_torch.rope_write_kv(q, k, v, k_cache, v_cache, slots, positions, cos_sin,
                                         k_scale, v_scale, query_out=q)   # q rotated in place

    calls = _tokens(np.random.default_rng(0))
    for qkv, positions, seqs in calls:
        t_qkv = to_torch(qkv, dev)
        q = rope_write(t_qkv, torch.from_numpy(positions), torch.from_numpy(seqs))
        assert q.data_ptr() == t_qkv.data_ptr()
    k_pages, v_pages, new_table = fp8kv_torch.dequantize_pages(k_cache, v_cache, table, k_scale,
                                                               v_scale)
    # The README runs torch's SDPA on the gathered pages; here it must at least run.
    pos = torch.arange(LENS[0] + 1)
    rows, offsets = new_table[0].long()[pos // S], pos % S
    torch.nn.functional.scaled_dot_product_attention(
        q[0][:, None], k_pages[rows, offsets].transpose(0, 1),
        v_pages[rows, offsets].transpose(0, 1), enable_gqa=True)
    as_np = lambda t: bits(t).view(np_dtype("bfloat16"))  # noqa: E731
    _check_attention(as_np(q), as_np(k_pages), as_np(v_pages), new_table.numpy(), calls)


def test_jax_decode_step():
    jax = pytest.importorskip("jax")
    import functools

    import jax.numpy as jnp

    import fp8kv_jax

    cos_sin = jnp.asarray(_cos_sin())
    table = jnp.asarray(TABLE)
    scale = jnp.float32(SCALE)

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def rope_write(qkv, k_cache, v_cache, positions, seqs):
        q, k, v = jnp.split(qkv.reshape(len(qkv), HQ + 2 * HKV, D), [HQ, HQ + HKV], axis=1)
        slots = table[seqs, positions // S] * S + positions % S
        return fp8kv_jax.rope_write_kv(q, k, v, k_cache, v_cache, slots, positions, cos_sin,
                                       scale, scale)

    k_cache = jnp.zeros((PAGES, S, HKV, D), jnp.float8_e4m3fn)
    v_cache = jnp.zeros_like(k_cache)
    calls = _tokens(np.random.default_rng(0))
    for qkv, positions, seqs in calls:
        q, k_cache, v_cache = rope_write(jnp.asarray(qkv), k_cache, v_cache,
                                         jnp.asarray(positions, jnp.int32),
                                         jnp.asarray(seqs, jnp.int32))
    k_pages, v_pages, new_table = fp8kv_jax.dequantize_pages(k_cache, v_cache, table, scale,
                                                             scale)
    pos = jnp.arange(LENS[0] + 1)
    rows, offsets = new_table[0][pos // S], pos % S
    jax.nn.dot_product_attention(q[0][None, None], k_pages[rows, offsets][None],
                                 v_pages[rows, offsets][None])
    _check_attention(np.asarray(q), np.asarray(k_pages), np.asarray(v_pages),
                     np.asarray(new_table), calls)
