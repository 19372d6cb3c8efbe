"""Where small writes spend their time: the launch floor, a plain copy, and the host's share."""
from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch
import triton
import triton.language as tl


from fp8kv_torch import _launch

from .common import Config, Timer
from .results import Table
from .write_torch import build_write_case


@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst = src, converted to dst's element type by truncation / zero extension of the bits."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n)
    tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty, bitcast=False), mask=offs < n)


def table_traffic_floors(device, cfg: Config, timer: Timer) -> Table:
    """What this GPU gives a plain Triton copy with each kernel's read/write mix.

    write_kv reads 2 bytes (bf16) and writes 1 per element; dequantize_pages reads 1 and writes 2.
    A copy with the same mix, contiguous and without any arithmetic, bounds what either can reach.
    """
    table = Table("traffic_floors", "Plain copies with the kernels' read/write mix",
                  "Triton copy kernels, contiguous, 4096 elements per program, graph timing. "
                  "`narrowing`: int16 -> int8 (write_kv's 2:1 mix, its 65,536-token volume); "
                  "`widening`: uint8 -> int16 (dequantize_pages' 1:2 mix, its 16x512 volume).",
                  plot="bars")
    for label, n, src_dtype, dst_dtype in (
            ("narrowing copy 2 B -> 1 B", 65536 * 1024 * 2, torch.int16, torch.int8),
            ("widening copy 1 B -> 2 B", 16 * 512 * 16 * 1024 * 2, torch.uint8, torch.int16)):
        src = torch.randint(0, 100, (n,), device=device).to(src_dtype)
        dst = torch.empty(n, dtype=dst_dtype, device=device)
        grid = (triton.cdiv(n, 4096),)
        us = timer.time("graph", [lambda: _copy_kernel[grid](src, dst, n, BLOCK=4096)])
        table.add(label, n, "triton", "graph", us, n * (src.element_size() + dst.element_size()))
        src = dst = None  # free the buffers (the timed lambda holds the names)
    return table


def table_latency_floor(device, cfg: Config, timer: Timer, tokens: int = 16) -> Table:
    """Graph-replay time per call of an empty kernel, of a copy of the same K/V bytes, and of
    fp8kv's write; then the host time per eager call split into its parts (plus a profile)."""
    table = Table("latency", f"Latency floor at {tokens} tokens",
                  "graph: per call in a CUDA graph of 10 calls. `empty`: an empty Triton kernel; "
                  "`copy`: one Triton kernel copying the same K and V bytes (2048 elements per "
                  "program); host rows: wall time per eager call on the host (200 calls).",
                  plot="bars")
    case = build_write_case(device, cfg, tokens)
    key, value, slots = case.sets[0]
    src = torch.cat([key.reshape(-1), value.reshape(-1)]).view(torch.int16)
    dst = torch.empty_like(src)
    n = src.numel()
    table.add("empty kernel", tokens, "triton", "graph",
              timer.time("graph", [lambda: _empty_kernel[(1,)](src)]), 0)
    table.add("copy K+V (bf16 -> bf16)", tokens, "triton", "graph",
              timer.time("graph", [lambda: _copy_kernel[(triton.cdiv(n, 2048),)](src, dst, n,
                                                                                  BLOCK=2048)]),
              case.nbytes)
    write = case.fp8kv_calls()[0]
    table.add("fp8kv write_kv", tokens, "fp8kv", "graph", timer.time("graph", [write]), case.nbytes)

    # Host side: the public call (cached launch), the launch alone, and the uncached path.
    calls = {
        "host: fp8kv_torch.write_kv": write,
        "host: uncached (validate + plan + kernel[grid])": lambda: _launch.call("write_kv", 
            key, value, case.key_cache, case.value_cache, slots, case.key_scale, case.value_scale,
            "NHD", None, exact=False),
        "host: Triton kernel[grid] of an empty kernel": lambda: _empty_kernel[(1,)](src),
    }
    for label, fn in calls.items():
        table.add(label, tokens, "host", "eager-wall", _host_us(fn), 0)
    _print_profile(write)
    return table


def _host_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _print_profile(fn, calls: int = 2000) -> None:
    """Print where the host time of ``calls`` eager calls goes (top functions by own time)."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(14)
    print(f"host profile of {calls} eager fp8kv_torch.write_kv calls:\n{out.getvalue()}")



