"""Paged-attention test cases as NumPy arrays: caches written by the reference ``write_kv``,
poisoned where nothing may be read, and the reference output with the spec's bound.

A case is an :class:`AttentionCase`; :func:`build` gives its arrays and keyword arguments
(framework-neutral), which the torch and JAX tests turn into their own arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import ml_dtypes
import numpy as np

from fp8kv import reference
from fp8kv.attention import error_bound, paged_attention as reference_attention

POISON_PAGE = 2**30   # block-table entries past a sequence's pages: never read


@dataclass(frozen=True)
class AttentionCase:
    cache: str = "e4m3"          # e4m3 | e5m2 | nvfp4 | mxfp8 | bfloat16 | float16
    scale: str = "value"         # value | tensor | head | token | token_head | inline | inline16
    query_dtype: str = "bfloat16"
    layout: str = "NHD"
    rank: int = 4
    combined: bool = False
    layers: int = 0              # stacked caches: that many layers (0: none)
    layer: int = 0
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    seq_lens: tuple = (37, 5)
    query_lens: tuple | None = None   # None: one decode token per sequence
    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    seed: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def id(self) -> str:
        parts = [self.cache, self.scale if self.cache not in ("bfloat16", "float16") else "",
                 self.layout if self.rank == 4 else "rank3", f"g{self.num_heads // self.num_kv_heads}",
                 f"d{self.head_dim}", f"p{self.page_size}"]
        if self.combined:
            parts.append("combined")
        if self.layers:
            parts.append(f"layer{self.layer}of{self.layers}")
        if self.query_lens is not None:
            parts.append("q" + "-".join(map(str, self.query_lens)))
        if self.window:
            parts.append(f"window{self.window}")
        if self.soft_cap:
            parts.append("cap")
        if self.sinks:
            parts.append("sinks")
        parts.append("lens" + "-".join(map(str, self.seq_lens)))
        return "-".join(p for p in parts if p)


FP8_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def gpu_infos(call: dict) -> dict:
    """A built call's arrays as CUDA array descriptions (what a plan reads), for planning
    without a GPU."""
    from fp8kv.arrays import ArrayInfo
    return {n: ArrayInfo.contiguous(v.shape, v.dtype.name, "cuda:0")
            if isinstance(v, np.ndarray) else v for n, v in call.items()}


def _page_shape(case: AttentionCase, num_pages: int, width: int) -> tuple:
    h, s = case.num_kv_heads, case.page_size
    if case.rank == 3:
        return (num_pages * s, h, width)
    return (num_pages, s, h, width) if case.layout == "NHD" else (num_pages, h, s, width)


def build(case: AttentionCase) -> dict:
    """``dict(arrays=..., kwargs=..., ref=..., bound=...)``: the call's arrays by argument name
    (NumPy; host scales and options in ``kwargs``), the reference output and its bound."""
    rng = np.random.default_rng(case.seed)
    lens = np.asarray(case.seq_lens, np.int32)
    num_seqs = len(lens)
    ps = case.page_size if case.rank == 4 else 1
    pages = [-(-int(n) // ps) for n in lens]
    width = max(max(pages), 1) + 1                        # every row has padding entries
    num_pages = sum(pages) + 3                           # some pages no sequence names
    slots = np.arange(num_pages * ps, dtype=np.int32)
    h, d = case.num_kv_heads, case.head_dim
    kx = (rng.standard_normal((len(slots), h, d)) * 0.7).astype(ml_dtypes.bfloat16)
    vx = (rng.standard_normal((len(slots), h, d)) * 0.7).astype(ml_dtypes.bfloat16)
    args, kwargs = {}, {}
    plain = case.cache in NP_DTYPES
    if plain:
        dt = NP_DTYPES[case.cache]
        kc = _scatter(kx.astype(dt), case, num_pages)
        vc = _scatter(vx.astype(dt), case, num_pages)
        sides = (None, None)
    elif case.cache == "nvfp4":
        kc = np.zeros(_page_shape(case, num_pages, d // 2), np.uint8)
        kb = np.zeros(_page_shape(case, num_pages, d // 16), np.uint8)
        g_k, g_v = 0.011, 0.013
        kc, vc, kb, vb = reference.write_kv(kx, vx, kc, kc.copy(), slots, g_k, g_v,
                                            layout=case.layout, key_scale_cache=kb,
                                            value_scale_cache=kb.copy(), cache_format="nvfp4")
        kwargs.update(key_scale=g_k, value_scale=g_v, cache_format="nvfp4")
        sides = (kb, vb)
    elif case.cache == "mxfp8":
        # Blocks of 32 at powers of two 2**-12 .. 2**12 apart: block scales that vary along a row.
        blocks = (len(slots), h, d // 32, 1)
        kx, vx = ((x.astype(np.float32).reshape(blocks[:3] + (32,))
                   * np.float32(2.0) ** rng.integers(-12, 13, blocks)).reshape(x.shape)
                  for x in (kx, vx))
        kc = np.zeros(_page_shape(case, num_pages, d), np.uint8).view(FP8_DTYPES["e4m3"])
        kb = np.zeros(_page_shape(case, num_pages, d // 32), np.uint8)
        kc, vc, kb, vb = reference.write_kv(kx, vx, kc, kc.copy(), slots, layout=case.layout,
                                            key_scale_cache=kb, value_scale_cache=kb.copy(),
                                            cache_format="mxfp8")
        kwargs.update(cache_format="mxfp8")
        sides = (kb, vb)
    else:
        fmt_dtype = FP8_DTYPES[case.cache]
        inline = case.scale.startswith("inline")
        pad = (16 if case.scale == "inline16" else 4) if inline else 0
        kc = np.zeros(_page_shape(case, num_pages, d + pad), np.uint8)
        if not inline:
            kc = kc.view(fmt_dtype)
        ks, vs, ksc, vsc = _scales(case, rng, kc)
        kc, vc, *rest = _write(kx, vx, kc, slots, ks, vs, ksc, vsc, case)
        sides = tuple(rest) if rest else (None, None)
        if inline:
            kwargs.update(key_scale_cache="inline", value_scale_cache="inline", head_dim=d,
                          cache_format=case.cache)
            sides = (None, None)
        for name, v in (("key_scale", ks), ("value_scale", vs)):
            if isinstance(v, float):
                kwargs[name] = v
            elif v is not None:
                args[name] = v
    table = np.full((num_seqs, width), POISON_PAGE, np.int32)
    order = rng.permutation(num_pages)
    k = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[k:k + n]
        k += n
    unused = order[k:]
    q_lens = np.ones(num_seqs, np.int64) if case.query_lens is None else np.asarray(case.query_lens)
    unseen = _unseen_rows(case, table, lens, q_lens)
    kc, vc = (_poison(_poison_rows(x, unseen, case), unused) for x in (kc, vc))
    sides = tuple(None if x is None else _poison(_poison_rows(x, unseen, case), unused)
                  for x in sides)
    query = (rng.standard_normal((int(q_lens.sum()), case.num_heads, d)) * 1.3).astype(
        NP_DTYPES[case.query_dtype])
    call = dict(kwargs, query=query, block_table=table, seq_lens=lens)
    call.update(args)
    if sides[0] is not None:
        call["key_scale_cache"], call["value_scale_cache"] = sides
    if case.query_lens is not None:
        call["query_start_loc"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    if case.sinks:
        call["sinks"] = rng.standard_normal(case.num_heads).astype(np.float32)
    if case.window is not None:
        call["sliding_window"] = case.window
    if case.soft_cap is not None:
        call["logits_soft_cap"] = case.soft_cap
    if case.layout != "NHD":
        call["layout"] = case.layout
    caches = dict(kv_cache=np.stack([kc, vc], axis=1)) if case.combined else dict(
        key_cache=kc, value_cache=vc)
    if case.layers:
        stacked = ["key_scale_cache", "value_scale_cache"]
        caches = {n: _stack(a, case, rng) for n, a in caches.items()}
        for n in stacked:
            if isinstance(call.get(n), np.ndarray):
                call[n] = _stack(call[n], case, rng)
        call["layer"] = case.layer
    call.update(caches)
    ref, vmax, mass = reference_attention(**{**dict(key_cache=None, value_cache=None), **call})
    return dict(call=call, ref=ref, bound=error_bound(ref, vmax, mass, d))


def _scatter(x, case: AttentionCase, num_pages: int):
    """Slot-major rows ``[slots, H, D]`` as pages of the case's layout."""
    if case.rank == 3:
        return np.ascontiguousarray(x)
    p = x.reshape(num_pages, case.page_size, case.num_kv_heads, -1)
    return np.ascontiguousarray(p if case.layout == "NHD" else p.transpose(0, 2, 1, 3))


def _scales(case: AttentionCase, rng, kc):
    """``(key_scale, value_scale, key_scale_cache, value_scale_cache)`` of a case's FP8 write."""
    h = case.num_kv_heads
    if case.scale == "value":
        return 0.011, 0.017, None, None
    if case.scale == "tensor":
        return np.float32([0.012]), np.float32([0.019]), None, None
    if case.scale == "head":
        return ((rng.uniform(0.005, 0.03, h)).astype(np.float32),
                (rng.uniform(0.005, 0.03, h)).astype(np.float32), None, None)
    if case.scale.startswith("inline"):
        return None, None, "inline", "inline"
    shapes = reference.scale_cache_shapes(kc.shape, case.layout)
    shape = shapes["token_head" if case.scale == "token_head" else "token"]
    return None, None, np.zeros(shape, np.float32), np.zeros(shape, np.float32)


def _write(kx, vx, kc, slots, ks, vs, ksc, vsc, case):
    out = reference.write_kv(kx, vx, kc, kc.copy(), slots, ks, vs, layout=case.layout,
                             key_scale_cache=ksc, value_scale_cache=vsc,
                             cache_format=case.cache if kc.dtype == np.uint8 else None)
    return out


def _poison(array, pages):
    """NaN bytes (0xFF: NaN in e4m3, e5m2, bf16, fp16 and fp32) in the pages (or, rank 3,
    slots) no sequence names."""
    array = np.array(array, copy=True)
    array.view(np.uint8)[np.asarray(pages, np.int64)] = 0xFF
    return array


def _unseen_rows(case: AttentionCase, table, lens, q_lens) -> list:
    """``(page, offset)`` of every token in a sequence's pages that none of its query rows sees:
    past its length, before its first row's window, all of them without query rows."""
    ps = case.page_size if case.rank == 4 else 1
    rows = []
    for b, (n, q) in enumerate(zip(lens, q_lens)):
        first = int(n) - int(q)                      # the first query row's position
        low = max(0, first - case.window + 1) if case.window else 0
        for t in range(-(-int(n) // ps) * ps):
            if q == 0 or not low <= t < n:
                rows.append((int(table[b, t // ps]), t % ps))
    return rows


def _poison_rows(array, rows, case: AttentionCase):
    """NaN bytes (see :func:`_poison`) in the token rows ``rows`` of a cache or side array of
    the case's layout."""
    array = np.array(array, copy=True)
    raw = array.view(f"u{array.itemsize}")             # the same shape, every bit settable
    ones = np.iinfo(raw.dtype).max
    for page, offset in rows:
        if case.rank == 3:
            raw[page] = ones
        elif case.layout == "NHD" or array.ndim == 2:   # [P, S, ...] or per-token HND [P, S]
            raw[page, offset] = ones
        else:
            raw[page, :, offset] = ones
    return array


def _stack(array, case: AttentionCase, rng):
    """``array`` as layer ``case.layer`` of ``case.layers`` (none: out of range); the other
    layers random bytes."""
    noise = np.frombuffer(rng.bytes(case.layers * array.nbytes), np.uint8)
    stack = noise.copy().view(array.dtype).reshape((case.layers,) + array.shape)
    if case.layer < case.layers:
        stack[case.layer] = array
    return stack


def _random_case(rng) -> AttentionCase:
    """A configuration drawn from every cache format and scale kind, GQA group, head_dim, page
    size, layout and rank, 1-4 ragged lengths (0 included), query lengths 0-16, sliding
    window, soft cap, sinks, stacked caches."""
    cache = rng.choice(["e4m3", "e5m2", "nvfp4", "bfloat16", "float16"])
    scales = {"e4m3": ["value", "tensor", "head", "token", "token_head", "inline", "inline16"],
              "e5m2": ["value", "head", "token_head"], "nvfp4": ["value", "tensor"]}
    group = int(rng.choice([1, 4, 8, 16]))
    kv = int(rng.choice([1, 2]))
    ps = int(rng.choice([1, 4, 16, 64]))
    rank = 3 if ps == 1 and rng.random() < 0.5 else 4
    seqs = int(rng.integers(1, 5))
    q_lens = None
    if rng.random() < 0.4:
        q_lens = tuple(int(x) for x in rng.integers(0, 17, seqs))
    lens = tuple(int(x) for x in rng.integers(0, 300, seqs))
    if q_lens is not None:
        lens = tuple(max(n, q) for n, q in zip(lens, q_lens))
    return AttentionCase(
        cache=str(cache), scale=str(rng.choice(scales.get(cache, ["value"]))),
        query_dtype="float16" if cache == "float16" else "bfloat16",
        layout=str(rng.choice(["NHD", "HND"])), rank=rank, combined=bool(rng.random() < 0.2),
        layers=0 if cache == "nvfp4" or rng.random() < 0.7 else 3, layer=1,
        num_heads=group * kv, num_kv_heads=kv,
        head_dim=int(rng.choice([64, 80, 96, 128, 256])), page_size=ps, seq_lens=lens,
        query_lens=q_lens, window=int(rng.integers(1, 64)) if rng.random() < 0.3 else None,
        soft_cap=30.0 if rng.random() < 0.3 else None, sinks=bool(rng.random() < 0.3),
        seed=int(rng.integers(1 << 30)))


# The GPU suite runs them all (torch and JAX), the CPU every one through JAX's jnp path and a
# few through the interpreter (whose programs take milliseconds each).
RANDOM_CASES = [_random_case(np.random.default_rng(seed)) for seed in range(40)]


def _random_mxfp8_case(seed) -> AttentionCase:
    """A random configuration read from an mxfp8 cache (head_dim a multiple of 32; every third
    with an fp16 query)."""
    case = _random_case(np.random.default_rng(1000 + seed))
    return replace(case, cache="mxfp8", scale="value",
                   query_dtype="float16" if seed % 3 == 0 else "bfloat16",
                   head_dim=case.head_dim if case.head_dim % 32 == 0 else 96)


RANDOM_CASES += [_random_mxfp8_case(seed) for seed in range(12)]


NOTHING_TO_READ = ("no_sequences", "no_query_tokens", "no_pages")


def nothing_to_read(kind: str) -> dict:
    """The call of an engine's step that reads no token (:data:`NOTHING_TO_READ`): a batch of
    no sequences; one sequence with no query token (``query_start_loc``); or two empty
    sequences, a block table of no columns and sinks. Its output is all zeros ([0, 8, 32] for
    the first two, [2, 8, 32] for the third); every cache byte is NaN, so a read shows."""
    seqs, tokens, width, length = {"no_sequences": (0, 0, 2, 0), "no_query_tokens": (1, 0, 2, 5),
                                   "no_pages": (2, 2, 0, 0)}[kind]
    rng = np.random.default_rng(0)
    cache = np.full((4, 8, 2, 32), 0xFF, np.uint8).view(FP8_DTYPES["e4m3"])
    call = dict(query=rng.standard_normal((tokens, 8, 32)).astype(ml_dtypes.bfloat16),
                key_cache=cache, value_cache=cache.copy(),
                block_table=np.zeros((seqs, width), np.int32),
                seq_lens=np.full(seqs, length, np.int32), key_scale=1.0, value_scale=1.0)
    if kind == "no_query_tokens":
        call["query_start_loc"] = np.zeros(seqs + 1, np.int32)
    if kind == "no_pages":
        call["sinks"] = np.ones(8, np.float32)
    return call
