"""Run configuration, timers and the copy-bandwidth measurement shared by every table."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

MiB = 1 << 20
GiB = 1 << 30

# Each timed sequence of calls cycles through enough input sets to touch this many bytes: a few
# times the H200's 50 MB L2, so that mid sizes (1k-16k tokens) are not timed out of the cache.
# Small sizes still fit in L2, which is their real situation (a decode step's few new tokens).
ROTATE_BYTES = 256 * MiB


@dataclass(frozen=True)
class Config:
    """Sizes and repetition counts of one run (GPU, GPU ``--quick`` or CPU)."""

    write_tokens: tuple[int, ...]
    variant_tokens: int
    jax_tokens: tuple[int, ...]
    dequant_shapes: tuple[tuple[int, int, str], ...]   # (batch, pages_per_seq, case name)
    sweep_write_tokens: tuple[int, ...]
    sweep_dequant: tuple[int, int, str]
    min_cache_bytes: int        # K + V cache at least this big, so small writes scatter over HBM
    dequant_cache_pages: int
    copy_bytes: int
    warmup_ms: int = 25
    rep_ms: int = 100
    sweep_warmup_ms: int = 10
    sweep_rep_ms: int = 50
    graph_calls: int = 10       # calls captured per CUDA graph: amortizes the replay launch
    settle_ms: int = 1000       # idle GPU time before each row of the attention table
    wall_calls: int = 200
    cpu_calls: int = 3
    jax_calls: int = 50
    jax_loop: int = 64          # writes per jitted fori_loop
    max_sets: int = 10          # input sets to rotate through (1 on the CPU: nothing to flush there)
    # Eager-call tables (bench.eager, and the call tables of bench.jax_tables).
    eager_cache_pages: int = 4096           # pages of 16 x 8 heads x 128 per K or V cache
    eager_dequant_shapes: tuple[tuple[int, int], ...] = ((1, 4), (1, 64), (1, 256), (4, 256))
    eager_write_tokens: tuple[int, ...] = (1, 32)
    eager_warmup: int = 20      # untimed calls before the timed ones
    eager_calls: int = 300      # back-to-back calls per timed repetition
    eager_reps: int = 5         # repetitions; the median is reported
    jax_call_tokens: tuple[int, ...] = (1, 256, 16384, 65536)
    # Dynamic-scale placements (bench.dynamic).
    dynamic_tokens: int = 65536
    dynamic_head_dims: tuple[int, ...] = (128, 256)
    dynamic_dequant: tuple[int, int] = (16, 512)
    dynamic_graph_tokens: tuple[int, ...] = (1, 16, 256)
    jax_cache_tokens: tuple[int, ...] = (256, 65536)
    jax_cache_bytes: tuple[int, ...] = (4 * MiB, 256 * MiB, GiB, 8 * GiB)  # K and V each
    jax_dequant_shapes: tuple[tuple[int, int], ...] = ((1, 64), (16, 512))


def make_config(cuda: bool, quick: bool) -> Config:
    """The sizes of the README tables on a GPU, a smoke test with ``quick``, tiny ones on the CPU.

    ``quick`` keeps every table but with fewer sizes and shorter timings (about a minute on a
    GPU); the CPU configuration is a harness check through Triton's interpreter, not a benchmark.
    """
    if not cuda:
        return Config(write_tokens=(1, 16, 64), variant_tokens=16, jax_tokens=(1, 16),
                      dequant_shapes=((2, 4, "2x4"),), sweep_write_tokens=(16,),
                      sweep_dequant=(2, 4, "2x4"), min_cache_bytes=MiB, dequant_cache_pages=64,
                      copy_bytes=64 * MiB, jax_calls=3, jax_loop=4, max_sets=1,
                      eager_cache_pages=32, eager_dequant_shapes=((1, 4), (2, 8)),
                      eager_warmup=1, eager_calls=2, eager_reps=1, jax_call_tokens=(1, 16),
                      jax_cache_tokens=(16,), jax_cache_bytes=(MiB, 4 * MiB),
                      jax_dequant_shapes=((1, 4), (2, 8)), dynamic_tokens=16,
                      dynamic_head_dims=(128,), dynamic_dequant=(1, 2), dynamic_graph_tokens=())
    if quick:
        return Config(write_tokens=(1, 256, 16384), variant_tokens=16384, jax_tokens=(1, 4096),
                      dequant_shapes=((4, 256, "4x256"), (64, 32, "64x32 decode mix")),
                      sweep_write_tokens=(16384, 16), sweep_dequant=(4, 256, "4x256"),
                      min_cache_bytes=64 * MiB, dequant_cache_pages=4096, copy_bytes=GiB,
                      warmup_ms=5, rep_ms=20, sweep_warmup_ms=5, sweep_rep_ms=10, wall_calls=50,
                      jax_calls=10, jax_loop=16, eager_warmup=5, eager_calls=100, eager_reps=3,
                      jax_call_tokens=(1, 256, 16384), jax_cache_tokens=(256,),
                      jax_cache_bytes=(4 * MiB, 256 * MiB), jax_dequant_shapes=((1, 64), (4, 256)),
                      dynamic_tokens=16384, dynamic_dequant=(4, 256))
    return Config(write_tokens=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536), variant_tokens=65536,
                  jax_tokens=(1, 16, 256, 4096, 65536),
                  dequant_shapes=((16, 512, "16x512"), (4, 256, "4x256"),
                                  (64, 32, "64x32 decode mix")),
                  sweep_write_tokens=(65536, 256, 16), sweep_dequant=(16, 512, "16x512"),
                  min_cache_bytes=64 * MiB, dequant_cache_pages=16384, copy_bytes=GiB)


def num_sets(cfg: Config, set_bytes: int) -> int:
    """How many input sets a timed sequence rotates through (see ``ROTATE_BYTES``)."""
    return max(1, min(cfg.max_sets, math.ceil(ROTATE_BYTES / max(set_bytes, 1))))


def free_memory() -> None:
    """Hand cached blocks back between tables, so one table's buffers never crowd the next."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class Timer:
    """Median time of one call in microseconds, measured in one of several modes.

    Modes (GPU):

    * ``graph``: ``cfg.graph_calls`` calls, cycling through the input sets, captured in one CUDA
      graph; replays timed with ``triton.testing.do_bench`` (median) and divided by the calls.
    * ``eager``: ``do_bench`` of one plain call. do_bench flushes the L2 before every call, and
      while the GPU runs that flush the host has already queued the call, so this is device time
      of a cold-cache call, without the host's launch cost.
    * ``eager-wall``: host clock around ``cfg.wall_calls`` back-to-back calls and a synchronize:
      what a Python serving loop pays per call, launch and validation cost included.

    On the CPU there is one mode, ``eager``: ``time.perf_counter`` median over ``cfg.cpu_calls``.
    """

    def __init__(self, cfg: Config, cuda: bool):
        self.cfg = cfg
        self.cuda = cuda

    @property
    def modes(self) -> tuple[str, ...]:
        return ("graph", "eager", "eager-wall") if self.cuda else ("eager",)

    def settle(self) -> None:
        """Leave the GPU idle for ``cfg.settle_ms`` (nothing on the CPU): a row timed right
        after a power-hungry one (the dequantize route's bf16 pages, a bf16 cache at full
        bandwidth) would otherwise run at the clock the power cap left (bench/NOTES.md)."""
        if self.cuda:
            torch.cuda.synchronize()
            time.sleep(self.cfg.settle_ms / 1000)

    def time(self, mode: str, fns, sweep: bool = False) -> float:
        """Time ``fns`` (zero-argument callables, one per input set) in ``mode``.

        ``sweep`` uses the shorter warm-up and repetition times of the tuning sweep.
        """
        fns = list(fns)
        if not self.cuda:
            return self._cpu_us(fns)
        warmup, rep = ((self.cfg.sweep_warmup_ms, self.cfg.sweep_rep_ms) if sweep
                       else (self.cfg.warmup_ms, self.cfg.rep_ms))
        if mode == "graph":
            return self._graph_us(fns, warmup, rep)
        if mode == "eager":
            return _do_bench_us(fns[0], warmup, rep)
        if mode == "eager-wall":
            return self._wall_us(fns)
        raise ValueError(f"unknown mode {mode!r}")

    def _graph_us(self, fns, warmup: int, rep: int) -> float:
        calls = [fns[i % len(fns)] for i in range(self.cfg.graph_calls)]
        # Warm up on a side stream (PyTorch's recipe): Triton compiles and loads every
        # specialization and the allocator fills its pools, none of which may happen in capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for fn in calls:
                    fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        torch.cuda.synchronize()
        try:
            return _do_bench_us(graph.replay, warmup, rep) / len(calls)
        finally:
            graph.reset()

    def _wall_us(self, fns) -> float:
        n = self.cfg.wall_calls
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for i in range(n):
                fns[i % len(fns)]()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) / n)
        return statistics.median(samples) * 1e6

    def _cpu_us(self, fns) -> float:
        fns[0]()  # first call builds the interpreter twins
        samples = []
        for i in range(self.cfg.cpu_calls):
            start = time.perf_counter()
            fns[i % len(fns)]()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6


def _do_bench_us(fn, warmup: int, rep: int) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def copy_bandwidth(timer: Timer, device: torch.device) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.

    The ceiling every other number is compared to: a ``torch`` copy of ``cfg.copy_bytes``
    random bytes, timed like the ``eager`` mode (do_bench median on a GPU).
    """
    n = timer.cfg.copy_bytes
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = timer.time("eager", [lambda: dst.copy_(src)])
    src = dst = None  # free the buffers (the timed lambda holds the names)
    free_memory()
    return 2 * n / us / 1e3


def back_to_back_us(fns, cfg: Config, cuda: bool) -> float:
    """Wall time per call of back-to-back eager calls, as an engine's Python loop makes them.

    ``cfg.eager_warmup`` untimed calls, then ``cfg.eager_reps`` repetitions of
    ``cfg.eager_calls`` calls (cycling through ``fns``) with one ``torch.cuda.synchronize()`` at
    the end of each; the median repetition's time divided by its calls, in microseconds. The host
    queues calls while the GPU runs earlier ones, so this is the larger of the host's cost per
    call and the device's, whichever binds. On the CPU nothing is asynchronous: it is the
    interpreter's time, not a performance number.
    """
    fns = list(fns)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(cfg.eager_warmup):
        fns[i % len(fns)]()
    sync()
    samples = []
    for _ in range(cfg.eager_reps):
        start = time.perf_counter()
        for i in range(cfg.eager_calls):
            fns[i % len(fns)]()
        sync()
        samples.append((time.perf_counter() - start) / cfg.eager_calls)
    return statistics.median(samples) * 1e6
