"""A rigorous bound on attention error caused by an FP8 KV cache (framework-neutral NumPy).

For a cached element ``x`` with dequant scale ``s`` (and ``|x| / s`` within the format's max, so no
saturation) the path write -> fp8 -> dequantize -> bf16 gives ``x'`` with

    |x' - x| <= |x| * u + s * a,
    u = 2**-(m+1) + 2**-9 + 2**-12     (fp8 RNE with m mantissa bits, bf16 RNE, their product
                                        and the fp32 division, with room to spare)
    a = 2**(1 - bias - m - 1) * (1 + 2**-9)   (half the fp8 subnormal spacing, then bf16)

Attention over keys ``k_j`` and values ``v_j`` for a query ``q`` (logits ``l_j = q.k_j / sqrt(d)``):
each logit moves by at most ``delta = max_j sum_i |q_i| (|k_ji| u + s_k a) / sqrt(d)``, so every
softmax weight moves by a factor within ``exp(+-2 delta)``: ``|p'_j - p_j| <= p_j (e^{2 delta} - 1)``.
Then ``o' - o = sum_j (p'_j - p_j) v'_j + sum_j p_j (v'_j - v_j)`` gives, per output element,

    |o' - o| <= (e^{2 delta} - 1) sum_j p_j |v'_j| + sum_j p_j (|v_j| u + s_v a).

Both attentions are evaluated in fp32 on exactly representable inputs, so the only other error is
fp32 rounding, covered by a relative slack of 1e-5.
"""
from __future__ import annotations

import numpy as np

from fp8kv.formats import FORMATS


def fp8_error_terms(fmt: str):
    f = FORMATS[fmt]
    u = 2.0 ** -(f.man_bits + 1) + 2.0 ** -9 + 2.0 ** -12  # + cross terms and the fp32 division
    a = 2.0 ** (1 - f.bias - f.man_bits - 1) * (1 + 2.0 ** -9)
    return u, a


def attention_error_bound(q, k, v, v_deq, k_scale, v_scale, fmt: str, causal_mask=None):
    """Element-wise bound for ``softmax(q k^T / sqrt(d)) v`` of one head.

    q: [Lq, D], k / v / v_deq: [Lk, D] (float64 NumPy); scales: floats; causal_mask: [Lq, Lk] bool
    (True = attend) or None. Returns ``[Lq, D]``.
    """
    u, a = fp8_error_terms(fmt)
    d = q.shape[-1]
    logits = q @ k.T / np.sqrt(d)
    if causal_mask is not None:
        logits = np.where(causal_mask, logits, -np.inf)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    dk = np.abs(k) * u + k_scale * a                      # [Lk, D] per-element key error bound
    delta = (np.abs(q) @ dk.T / np.sqrt(d))                # [Lq, Lk]
    if causal_mask is not None:
        delta = np.where(causal_mask, delta, 0.0)
    delta = delta.max(axis=-1, keepdims=True)              # [Lq, 1]
    weight_term = np.expm1(2 * delta) * (p @ np.abs(v_deq))
    value_term = p @ (np.abs(v) * u + v_scale * a)
    out = p @ v
    return weight_term + value_term + 1e-5 * (np.abs(out) + (p @ np.abs(v)))


def prefill_block_table(rng, lens, page_size: int, num_pages: int) -> np.ndarray:
    """A block table giving each sequence of ``lens`` distinct random pages (page 0 unused: it is
    vLLM's null block), padded with 0."""
    pages_per_seq = max(-(-n // page_size) for n in lens)
    free = iter(rng.permutation(np.arange(1, num_pages)))
    table = np.zeros((len(lens), pages_per_seq), dtype=np.int32)
    for b, n in enumerate(lens):
        table[b, : -(-n // page_size)] = [next(free) for _ in range(-(-n // page_size))]
    return table
