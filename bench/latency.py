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
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


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
    src = torch.cat([key.reshape(-1), value.reshape(-1)])
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
        "host: uncached (validate + plan + kernel[grid])": lambda: _launch.write_kv(
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



