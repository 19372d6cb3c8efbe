"""Paged decode attention (``python -m bench --only attention``): fp8kv's kernel on every cache
format against the bytes it reads, the dequantize route (``dequantize_pages`` + attention over the
compact bf16 pages), and in JAX fp8kv under ``jax.jit`` against JAX's Pallas GPU
``paged_attention`` on the same cache. Llama-3-8B decode: 32 query heads, 8 kv heads, head_dim
128, page 16, bf16 queries, sequences of one length; bytes = the K and V pages read (and their
scales).
"""
from __future__ import annotations

import collections
import math
import time

import torch

import fp8kv_torch

from .common import Config, Timer, free_memory
from .jax_profile import traced_phases
from .results import Table

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
GPU_SHAPES = ((1, 8192), (8, 4096), (32, 4096), (64, 2048), (64, 8192), (256, 1024))
CPU_SHAPES = ((2, 16),)
FORMATS = ("e4m3", "bf16", "e4m3 token-head", "nvfp4", "mxfp8", "e5m2")


def shapes(cfg: Config, cuda: bool) -> tuple:
    return GPU_SHAPES if cuda and cfg.copy_bytes >= (1 << 30) and cfg.rep_ms >= 100 else (
        GPU_SHAPES[1::2] if cuda else CPU_SHAPES)


def make_cache(batch: int, context: int, fmt: str, device, seed: int = 0):
    """``(call kwargs, bytes read)``: pages in random order, every sequence ``context`` long."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = batch * context // PAGE
    table = torch.randperm(pages, device=device, generator=g).view(batch, -1).to(torch.int32)
    kw = dict(block_table=table, seq_lens=torch.full((batch,), context, dtype=torch.int32,
                                                     device=device),
              query=torch.randn(batch, HEADS, HEAD_DIM, device=device, generator=g).to(
                  torch.bfloat16))
    shape = (pages, PAGE, KV_HEADS, HEAD_DIM)
    if fmt == "bf16":
        k = torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16)
        kw.update(key_cache=k, value_cache=torch.randn_like(k))
        return kw, 2 * k.numel() * 2
    if fmt == "nvfp4":
        codes = shape[:-1] + (HEAD_DIM // 2,)
        blocks = shape[:-1] + (HEAD_DIM // 16,)
        kw.update(key_cache=torch.randint(0, 256, codes, dtype=torch.uint8, device=device,
                                          generator=g),
                  value_cache=torch.randint(0, 256, codes, dtype=torch.uint8, device=device,
                                            generator=g),
                  key_scale_cache=torch.randint(0x30, 0x40, blocks, dtype=torch.uint8,
                                                device=device, generator=g),
                  value_scale_cache=torch.randint(0x30, 0x40, blocks, dtype=torch.uint8,
                                                  device=device, generator=g),
                  key_scale=0.01, value_scale=0.01, cache_format="nvfp4")
        return kw, 2 * (math.prod(codes) + math.prod(blocks))
    fp8 = torch.float8_e5m2 if fmt == "e5m2" else torch.float8_e4m3fn
    k = (torch.randn(shape, device=device, generator=g) * 8).to(fp8)
    kw.update(key_cache=k, value_cache=(torch.randn(shape, device=device, generator=g)
                                        * 8).to(fp8))
    if fmt == "mxfp8":   # E8M0 block scales 2**-9 .. 2**-1, one per 32 elements
        blocks = shape[:-1] + (HEAD_DIM // 32,)
        kw.update(key_scale_cache=torch.randint(118, 127, blocks, dtype=torch.uint8,
                                                device=device, generator=g),
                  value_scale_cache=torch.randint(118, 127, blocks, dtype=torch.uint8,
                                                  device=device, generator=g),
                  cache_format="mxfp8")
        return kw, 2 * (k.numel() + math.prod(blocks))
    if fmt == "e4m3 token-head":
        s = torch.rand(shape[:-1], device=device, generator=g) * 0.01 + 0.001
        kw.update(key_scale_cache=s, value_scale_cache=s.clone())
        return kw, 2 * (k.numel() + 4 * s.numel())
    kw.update(key_scale=0.02, value_scale=0.03)
    return kw, 2 * k.numel()


def attend(kw: dict, out):
    kw = dict(kw)
    return fp8kv_torch.paged_attention(kw.pop("query"), kw.pop("key_cache"),
                                       kw.pop("value_cache"), kw.pop("block_table"),
                                       kw.pop("seq_lens"), out=out, **kw)


def table_attention(device, cfg: Config, timer: Timer, copy_gbps: float) -> Table:
    mode = "graph" if timer.cuda else "eager"
    table = Table("attention", "Paged decode attention",
                  f"{HEADS} query heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, page {PAGE}, "
                  "bf16 query, one query token per sequence (`e4m3 q4`: 4, causal), batch x "
                  "context; provider = the cache's format; bytes = K + V pages read (with their "
                  "scales); `dequantize route` = "
                  "dequantize_pages of the context to bf16 + fp8kv attention over it. Time: "
                  + ("one CUDA-graph replay." if timer.cuda else "eager calls on the CPU."),
                  plot="bars")
    for batch, context in shapes(cfg, timer.cuda):
        size = f"{batch}x{context}"
        for fmt in FORMATS if timer.cuda else FORMATS[::3]:   # the CPU: a harness check
            kw, nbytes = make_cache(batch, context, fmt, device)
            out = torch.empty_like(kw["query"])
            timer.settle()
            us = timer.time(mode, [lambda: attend(kw, out)])
            table.add(size, batch * context, fmt, mode, us, nbytes)
            if fmt == "e4m3":
                table.add_roofline(size, batch * context, nbytes, copy_gbps)
                route = _dequantize_route(kw, device)
                timer.settle()
                us = timer.time(mode, [route])
                table.add(size, batch * context, "dequantize route", mode, us, nbytes)
                if (batch, context) in ((64, 2048), CPU_SHAPES[-1]):
                    q4 = _four_queries(kw)
                    out4 = torch.empty_like(q4["query"])
                    timer.settle()
                    us = timer.time(mode, [lambda: attend(q4, out4)])
                    table.add(size, batch * context, "e4m3 q4", mode, us, nbytes)
            del kw, out
            free_memory()
    if timer.cuda:
        table.note(f"% of copy bandwidth: bytes / time / {copy_gbps:.0f} GB/s.")
    return table


RAGGED_SHAPE = (64, 8192)   # sequences, each one's table in tokens
RAGGED_LENGTHS = {
    "uniform": lambda rng, batch, capacity: [capacity] * batch,
    "one long": lambda rng, batch, capacity: [capacity] + [min(512, capacity)] * (batch - 1),
    "random": lambda rng, batch, capacity: rng.integers(1, capacity + 1, batch).tolist()}


def table_attention_ragged(device, cfg: Config, timer: Timer, copy_gbps: float) -> Table:
    """Ragged batches: the same caches and tables, ``seq_lens`` changed on the device; both
    schedules forced (the shares balanced over ``seq_lens``, and every sequence split alike).
    Bytes: the pages the lengths name."""
    import numpy as np

    from fp8kv import attention
    from .sweep import planned_with

    mode = "graph" if timer.cuda else "eager"
    batch, capacity = RAGGED_SHAPE if timer.cuda else CPU_SHAPES[0]
    table = Table("attention_ragged", "Paged decode attention, ragged batches",
                  f"{batch} sequences, block tables of {capacity} tokens each, lengths: all "
                  f"{capacity} (uniform), one {capacity} among {min(512, capacity)}s (one long), "
                  f"drawn from 1..{capacity} (random, seed 0); the Llama decode shape of the "
                  "attention table; provider = format and schedule: `balanced` = the shares "
                  "balanced over seq_lens (`balance_seqs` raised to the batch), `uniform split` = "
                  "every sequence split alike (the CUDA default); bytes = the pages the lengths name. Time: "
                  + ("one CUDA-graph replay." if timer.cuda else "eager calls on the CPU."),
                  plot="bars")
    backend = attention.CUDA if timer.cuda else attention.INTERPRET
    for fmt in ("e4m3", "nvfp4") if timer.cuda else ("e4m3",):   # the CPU: a harness check
        kw, nbytes = make_cache(batch, capacity, fmt, device)
        per_token = nbytes / (batch * capacity)
        out = torch.empty_like(kw["query"])
        for name, lengths in RAGGED_LENGTHS.items():
            lens = [int(n) for n in lengths(np.random.default_rng(0), batch, capacity)]
            kw["seq_lens"] = torch.tensor(lens, dtype=torch.int32, device=device)
            for provider, entries in ((f"{fmt} balanced", {"balance_seqs": batch}),
                                      (f"{fmt} uniform split", {"balance_seqs": 0})):
                with planned_with(attention.ATTENTION_SIZES, backend, **entries):
                    timer.settle()
                    us = timer.time(mode, [lambda: attend(kw, out)])
                table.add(name, sum(lens), provider, mode, us, round(per_token * sum(lens)))
            if fmt == "e4m3":
                table.add_roofline(name, sum(lens), round(per_token * sum(lens)), copy_gbps)
        del kw, out
        free_memory()
    if timer.cuda:
        table.note(f"% of copy bandwidth: bytes / time / {copy_gbps:.0f} GB/s.")
    return table


def _dequantize_route(kw: dict, device):
    """dequantize_pages of every sequence's pages to bf16, then attention over them."""
    batch, pages = kw["block_table"].shape
    k_out = torch.empty(batch * pages, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                        device=device)
    v_out = torch.empty_like(k_out)
    new_table = torch.empty(batch, pages, dtype=torch.int32, device=device)
    out = torch.empty_like(kw["query"])

    def route():
        fp8kv_torch.dequantize_pages(kw["key_cache"], kw["value_cache"], kw["block_table"],
                                     kw["key_scale"], kw["value_scale"],
                                     out=(k_out, v_out, new_table))
        fp8kv_torch.paged_attention(kw["query"], k_out, v_out, new_table, kw["seq_lens"],
                                    out=out)
    return route


def _four_queries(kw: dict) -> dict:
    """The same cache with 4 query tokens per sequence (speculative decoding)."""
    batch = kw["block_table"].shape[0]
    q = kw["query"].repeat_interleave(4, dim=0)
    starts = torch.arange(0, 4 * batch + 1, 4, dtype=torch.int32, device=q.device)
    return dict(kw, query=q, query_start_loc=starts, max_query_len=4)


# ---------------------------------------------------------------------------------------------
# JAX: fp8kv_jax under jax.jit, and JAX's Pallas GPU paged_attention on the same FP8 cache.

def table_attention_jax(jax, fp8kv_jax, cfg: Config, copy_gbps: float, cuda: bool) -> Table:
    import jax.numpy as jnp

    table = Table("attention_jax", "Paged decode attention in JAX",
                  "As the attention table, e4m3 pages (bf16 for the Pallas bf16 rows): fp8kv_jax "
                  "under jax.jit and JAX's Pallas GPU paged_attention "
                  "(jax.experimental.pallas.ops.gpu, its own [kv_heads, pages, page, head_dim] "
                  "layout and fp32 scale pages). `device` (GPU): the kernels' time of a synced "
                  f"jitted call; `jit loop` (CPU): a jitted fori_loop of {cfg.jax_loop} "
                  "dependent calls (each call's output the next one's query), time per call.",
                  plot="bars")
    n = cfg.jax_loop
    compile_s = collections.defaultdict(list)
    for batch, context in (GPU_SHAPES[1], GPU_SHAPES[3], GPU_SHAPES[4]) if cuda else CPU_SHAPES:
        size = f"{batch}x{context}"
        kw, nbytes = make_cache(batch, context, "e4m3", torch.device("cuda" if cuda else "cpu"))
        arrays = {k: _to_jax(jnp, v) for k, v in kw.items()}
        del kw
        free_memory()

        def ours(q, a, scales=(arrays["key_scale"], arrays["value_scale"])):
            return fp8kv_jax.paged_attention(q, a["key_cache"], a["value_cache"],
                                             a["block_table"], a["seq_lens"], *scales)
        # Each step is (q, its arrays) -> output: the caches are arguments of the jitted call
        # (captured, they would be compiled in as constants); host floats stay host floats.
        paged = {k: arrays[k] for k in ("key_cache", "value_cache", "block_table", "seq_lens")}
        steps = {"fp8kv-jax e4m3": (ours, paged, nbytes)}
        if cuda:
            scale_bytes = 2 * batch * context * KV_HEADS * 4
            for fmt in ("e4m3", "bf16"):
                pallas = _pallas(jax, jnp, arrays, fmt)
                if pallas is None:
                    table.note("Pallas GPU paged_attention is not importable here: no rows.")
                    break
                steps[f"pallas {fmt}"] = (*pallas, 2 * nbytes if fmt == "bf16"
                                          else nbytes + scale_bytes)
        if not cuda:   # no kernel events on the CPU: a jitted loop's time per call
            for name, (step, step_arrays, step_bytes) in steps.items():
                table.add(size, batch * context, name, "jit loop",
                          _loop_us(jax, step, arrays["query"], step_arrays, n), step_bytes)
        else:   # the kernels' own time, as torch's CUDA-graph replay measures it
            compiled = {}
            for name, (step, step_arrays, _) in steps.items():
                start = time.perf_counter()
                call = jax.jit(step).lower(arrays["query"], step_arrays).compile()
                compile_s[name].append(time.perf_counter() - start)
                compiled[name] = [lambda q, call=call, a=step_arrays: call(q, a), arrays["query"]]
            for name, phases in traced_phases(jax, compiled, cfg.jax_calls).items():
                for mode in ("device", "kernels"):
                    table.add(size, batch * context, name, mode, phases[mode], steps[name][2])
            del compiled
        del arrays, steps
    table.note("Pallas e4m3 bytes include its fp32 scale pages (4 bytes per token and head, "
               "K and V). `device`: first kernel start -> last kernel end of a synced call "
               "(jax.profiler trace, median), comparable to torch's graph replay; `kernels`: "
               "the same calls' kernel durations added up (`device` less the gaps between "
               "a call's kernels, which the host's launches may leave).")
    if compile_s:
        table.note("Compile time of one jitted call (s, per shape): " + "; ".join(
            f"{name} " + " / ".join(f"{x:.1f}" for x in xs) for name, xs in compile_s.items()))
    return table


def _to_jax(jnp, v):
    """A torch tensor as a JAX array of the same bytes (host floats as they are)."""
    if not isinstance(v, torch.Tensor):
        return v
    if v.dtype == torch.float8_e4m3fn:
        return jnp.asarray(v.view(torch.uint8).cpu().numpy()).view(jnp.float8_e4m3fn)
    if v.dtype == torch.bfloat16:
        return jnp.asarray(v.view(torch.int16).cpu().numpy()).view(jnp.bfloat16)
    return jnp.asarray(v.cpu().numpy())


def _loop_us(jax, step, q, arrays, n: int) -> float:
    import statistics

    loop = jax.jit(lambda q, a: jax.lax.fori_loop(0, n, lambda i, x: step(x, a), q))
    jax.block_until_ready(loop(q, arrays))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(loop(q, arrays))
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def _pallas(jax, jnp, arrays: dict, fmt: str):
    """``(step, its arrays)``: Pallas GPU paged_attention over the same pages in its layout, or
    None (not importable)."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as pallas_ops
    except ImportError:
        return None
    k, v = arrays["key_cache"], arrays["value_cache"]
    if fmt == "bf16":   # the values of the FP8 cache, as bf16 pages
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    k = jnp.transpose(k, (2, 0, 1, 3))        # [kv_heads, pages, page, head_dim]
    v = jnp.transpose(v, (2, 0, 1, 3))
    pages = dict(k=k, v=v, table=arrays["block_table"], lens=arrays["seq_lens"], scales={})
    if fmt == "e4m3":
        ones = jnp.ones(k.shape[:-1], jnp.float32)
        pages["scales"] = dict(k_scales_pages=ones * arrays["key_scale"],
                               v_scales_pages=ones * arrays["value_scale"])

    def step(q, p):
        return pallas_ops.paged_attention(q, p["k"], p["v"], p["table"], p["lens"],
                                          **p["scales"]).astype(q.dtype)
    return step, pages
