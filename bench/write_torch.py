"""Write tables (torch): ``fp8kv_torch.write_kv`` against the unfused PyTorch code it replaces."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

import fp8kv_torch
from fp8kv.formats import E4M3
from fp8kv_torch import _launch

from .common import Config, Timer, free_memory, num_sets
from .results import Table, tokens_case

HEADS, HEAD_DIM, PAGE_SIZE = 8, 128, 16
Q_HEADS = 32        # query heads of the fused QKV projection the K/V-slice variant reads from
SCALE = 0.37        # dequant scale: a real, non-trivial division (1.0 would be skipped)


@dataclass
class WriteCase:
    """Inputs, caches and scales of one write size, with ready-made calls per provider.

    ``sets`` holds one ``(key, value, slots)`` per input set; timed sequences cycle through them.
    ``value_cache`` is None when ``key_cache`` is a combined ``[P, 2, ...]`` cache.
    """

    sets: list
    key_cache: torch.Tensor
    value_cache: torch.Tensor | None
    key_scale: torch.Tensor
    value_scale: torch.Tensor
    layout: str
    nbytes: int

    def fp8kv_calls(self) -> list:
        if self.value_cache is None:
            return [functools.partial(fp8kv_torch.write_kv_combined, k, v, self.key_cache, s,
                                      self.key_scale, self.value_scale, layout=self.layout)
                    for k, v, s in self.sets]
        return [functools.partial(fp8kv_torch.write_kv, k, v, self.key_cache, self.value_cache, s,
                                  self.key_scale, self.value_scale, layout=self.layout)
                for k, v, s in self.sets]

    def launch_calls(self, exact: bool) -> list:
        """Calls of the launcher with the exact (True) or hardware (False) conversions forced."""
        return [functools.partial(_launch.call, "write_kv", k, v, self.key_cache, self.value_cache, s,
                                  self.key_scale, self.value_scale, self.layout, None, exact=exact)
                for k, v, s in self.sets]

    def unfused_calls(self) -> list:
        return [functools.partial(unfused_write, k, v, self.key_cache, self.value_cache, s,
                                  self.key_scale) for k, v, s in self.sets]


def unfused_write(key, value, key_cache, value_cache, slots, scale) -> None:
    """The "before": quantize with PyTorch ops, then ``index_put`` into each NHD cache.

    One upcast, divide, clamp and cast per tensor (four kernels and three temporaries), then a
    scatter, for K and for V.
    """
    heads, head_dim = key.shape[1:]
    for x, cache in ((key, key_cache), (value, value_cache)):
        # Upcast first: bf16 / fp32-scalar-tensor would divide in bf16 (type promotion, docs/SPEC.md);
        # clamp first: torch's cast gives NaN from 480.
        q = (x.float() / scale).clamp(-E4M3.max_value, E4M3.max_value).to(torch.float8_e4m3fn)
        # Scatter through uint8 views: same bytes and the same kernel, without relying on
        # index_put's float8 support on every torch build.
        cache.view(torch.uint8).view(-1, heads, head_dim)[slots] = q.view(torch.uint8)


def _inputs(tokens, heads, head_dim, dtype, qkv, device):
    if not qkv:
        return (torch.randn(tokens, heads, head_dim, dtype=dtype, device=device),
                torch.randn(tokens, heads, head_dim, dtype=dtype, device=device))
    # K and V as strided views into one [T, (Hq + 2 Hkv) D] projection output, as models make them.
    fused = torch.randn(tokens, (Q_HEADS + 2 * heads) * head_dim, dtype=dtype, device=device)
    k0, v0 = Q_HEADS * head_dim, (Q_HEADS + heads) * head_dim
    return (fused[:, k0:v0].view(tokens, heads, head_dim),
            fused[:, v0:].view(tokens, heads, head_dim))


def build_write_case(device, cfg: Config, tokens: int, *, heads=HEADS, head_dim=HEAD_DIM,
                     page_size=PAGE_SIZE, layout="NHD", cache_dtype=torch.float8_e4m3fn,
                     dtype=torch.bfloat16, per_head=False, qkv=False, combined=False) -> WriteCase:
    """Allocate one write case.

    Parameters
    ----------
    tokens : int
        New tokens per call.
    page_size : int
        1 gives a 3-D ``[num_slots, H, D]`` cache.
    per_head : bool
        ``[H]`` scales instead of one ``[]`` device scale.
    qkv : bool
        K and V are strided slices of a fused QKV tensor.
    combined : bool
        One ``[P, 2, ...]`` cache written with ``write_kv_combined``.

    Returns
    -------
    WriteCase
        Its ``nbytes`` is the minimal traffic of one call: K and V read, fp8 K and V written, the
        slots read. The cache holds at least ``cfg.min_cache_bytes`` (K + V) so that small writes
        land on lines spread over HBM, and every input set writes a fresh random permutation of
        its slots.
    """
    row = heads * head_dim
    slot_dtype = torch.int64
    nbytes = tokens * row * (2 * dtype.itemsize + 2) + tokens * slot_dtype.itemsize
    page_bytes = page_size * row
    num_pages = max(triton.cdiv(tokens, page_size) + 16,
                    triton.cdiv(cfg.min_cache_bytes, 2 * page_bytes))
    num_slots = num_pages * page_size
    if page_size == 1:
        page_shape = (heads, head_dim)
    elif layout == "NHD":
        page_shape = (page_size, heads, head_dim)
    else:
        page_shape = (heads, page_size, head_dim)
    if combined:
        key_cache = torch.zeros(num_pages, 2, *page_shape, dtype=cache_dtype, device=device)
        value_cache = None
    else:
        key_cache = torch.zeros(num_pages, *page_shape, dtype=cache_dtype, device=device)
        value_cache = torch.zeros_like(key_cache)
    sets = [(*_inputs(tokens, heads, head_dim, dtype, qkv, device),
             torch.randperm(num_slots, dtype=slot_dtype, device=device)[:tokens])
            for _ in range(num_sets(cfg, nbytes))]
    if per_head:
        scale = SCALE * (1 + torch.arange(heads, dtype=torch.float32, device=device) / heads)
    else:
        scale = torch.tensor(SCALE, dtype=torch.float32, device=device)
    return WriteCase(sets, key_cache, value_cache, scale, scale.clone(), layout, nbytes)


def _same_bytes(case: WriteCase) -> bool:
    """Does one fp8kv call write the very bytes of the unfused baseline (fresh caches)?"""
    case.key_cache.zero_()
    case.value_cache.zero_()
    case.fp8kv_calls()[0]()
    expected = (case.key_cache.clone(), case.value_cache.clone())
    case.key_cache.zero_()
    case.value_cache.zero_()
    case.unfused_calls()[0]()
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(expected, (case.key_cache, case.value_cache)))


def table_write(device, cfg: Config, timer: Timer, copy_gbps: float) -> Table:
    """Table 1: write latency and bandwidth from 1 to 65,536 tokens, fp8kv vs unfused torch."""
    table = Table(
        "write", "Write K/V into the FP8 paged cache (torch)",
        f"{HEADS} kv heads x {HEAD_DIM} dims, page {PAGE_SIZE}, bf16 -> e4m3, one device scale "
        "tensor, random slots. `fp8kv`: `fp8kv_torch.write_kv` (one launch). `torch-unfused`: "
        "`x.float() / scale`, clamp, cast, `index_put` for K and for V. Bytes: K and V read, fp8 "
        "written, slots read.",
        xlabel="tokens written per call")
    mismatched = []
    for tokens in cfg.write_tokens:
        case = build_write_case(device, cfg, tokens)
        name = tokens_case(tokens)
        if not _same_bytes(case):
            mismatched.append(tokens)
        for provider, fns in (("fp8kv", case.fp8kv_calls()), ("torch-unfused", case.unfused_calls())):
            for mode in timer.modes:
                table.add(name, tokens, provider, mode, timer.time(mode, fns), case.nbytes)
        if timer.cuda:
            table.add_roofline(name, tokens, case.nbytes, copy_gbps)
        del case, fns
        free_memory()
    if mismatched:
        table.note(f"fp8kv and torch-unfused wrote DIFFERENT cache bytes at {mismatched} tokens")
    else:
        table.note("fp8kv and torch-unfused wrote identical cache bytes at every size.")
    return table


VARIANTS = (
    ("default: H8 D128 P16 NHD e4m3 bf16", {}),
    ("head_dim 64", dict(head_dim=64)),
    ("head_dim 256", dict(head_dim=256)),
    ("32 kv heads", dict(heads=32)),
    ("page 1 ([slots, H, D] cache)", dict(page_size=1)),
    ("page 64", dict(page_size=64)),
    ("HND layout", dict(layout="HND")),
    ("e5m2", dict(cache_dtype=torch.float8_e5m2)),
    ("fp32 input", dict(dtype=torch.float32)),
    ("per-head scales", dict(per_head=True)),
    ("K/V sliced from fused QKV", dict(qkv=True)),
    ("combined [P,2,S,H,D] cache", dict(combined=True)),
)


def table_variants(device, cfg: Config, timer: Timer, copy_gbps: float) -> Table:
    """Table 2: fp8kv's write at one large size across shapes, layouts, formats and inputs."""
    tokens = cfg.variant_tokens
    table = Table(
        "write_variants", f"Write variants at {tokens:,} tokens (fp8kv_torch)",
        "Each row changes one thing from the default (8 kv heads x 128 dims, page 16, NHD, "
        "bf16 -> e4m3, one device scale). QKV slices: K and V are strided views of a "
        f"[T, ({Q_HEADS} + 2x8) x 128] tensor; only their bytes are counted.",
        plot="bars")
    modes = [m for m in timer.modes if m != "eager-wall"]
    for name, kwargs in VARIANTS:
        case = build_write_case(device, cfg, tokens, **kwargs)
        fns = case.fp8kv_calls()
        for mode in modes:
            table.add(name, tokens, "fp8kv", mode, timer.time(mode, fns), case.nbytes)
        del case, fns
        free_memory()
    return table
