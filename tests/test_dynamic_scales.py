"""Dynamic per-token and per-token-head scales: every path against fp8kv.reference, byte for byte.

Side scale arrays (per token-head and per token) in every layout, inline scales (+4 and +16),
e4m3/e5m2, exact/pow2 rounding, padding slots, poisoned data and scale caches, special groups
(all zero, NaN, inf, subnormal), dequantization reading the scales back, torch vs JAX parity, the
JAX GPU launch glue in the interpreter, and the custom op (argument errors:
tests/bad_inputs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.cases import as_uint, random_values  # noqa: E402
from tests.helpers import bits, requires_cuda, to_torch  # noqa: E402
from fp8kv import reference as ref  # noqa: E402
import fp8kv_torch  # noqa: E402
from fp8kv_torch import _launch  # noqa: E402


@dataclass(frozen=True)
class DynCase:
    tokens: int = 5
    heads: int = 3
    head_dim: int = 80
    page_size: int = 16
    layout: str = "NHD"        # "NHD" | "HND" | "3D"
    fmt: str = "e4m3"
    rounding: str = "exact"
    granularity: str = "tokenhead"   # "tokenhead" | "token" | "inline4" | "inline16"
    dtype: str = "bfloat16"

    @property
    def id(self):
        page = "" if self.layout == "3D" else f"-P{self.page_size}"
        return (f"T{self.tokens}-H{self.heads}-D{self.head_dim}{page}-{self.layout}-{self.fmt}-"
                f"{self.rounding}-{self.granularity}-{self.dtype}")

    @property
    def api_layout(self):
        return "NHD" if self.layout == "3D" else self.layout

    @property
    def pad(self):
        return {"inline4": 4, "inline16": 16}.get(self.granularity, 0)

    @property
    def pages(self):
        return -(-self.tokens // (1 if self.layout == "3D" else self.page_size)) + 2

    @property
    def cache_shape(self):
        w = self.head_dim + self.pad
        if self.layout == "3D":
            return (self.pages, self.heads, w)
        if self.layout == "NHD":
            return (self.pages, self.page_size, self.heads, w)
        return (self.pages, self.heads, self.page_size, w)


CASES = [
    DynCase(),
    DynCase(layout="HND", fmt="e5m2", rounding="pow2"),
    DynCase(layout="3D", granularity="token", head_dim=40),
    DynCase(heads=1, head_dim=72, page_size=1, granularity="token", rounding="pow2"),
    DynCase(heads=8, head_dim=96, page_size=32, layout="HND", granularity="token", fmt="e5m2"),
    DynCase(heads=3, head_dim=192, page_size=16, granularity="inline4", dtype="float16"),
    DynCase(heads=1, head_dim=256, page_size=16, layout="HND", granularity="inline16",
            rounding="pow2", dtype="float32"),
    DynCase(heads=3, head_dim=40, layout="3D", granularity="inline16", fmt="e5m2"),
    DynCase(heads=8, head_dim=80, page_size=1, layout="HND", granularity="tokenhead",
            rounding="pow2", dtype="float16"),
    DynCase(tokens=3, heads=3, head_dim=256, page_size=32, granularity="inline4", fmt="e5m2",
            rounding="pow2"),
]

SPECIAL_GROUPS = {
    "zero": lambda shape: np.zeros(shape, np.float32),
    "nan": lambda shape: np.full(shape, np.nan, np.float32),
    "inf": lambda shape: np.where(np.arange(shape[-1]) % 5 == 0, -np.inf, 1.5).astype(np.float32)
    * np.ones(shape, np.float32),
    "subnormal": lambda shape: np.full(shape, -3e-39, np.float32),
    "mixed_nan": lambda shape: np.where(np.arange(shape[-1]) % 3 == 0, np.nan, 7.0).astype(
        np.float32) * np.ones(shape, np.float32),
}


def inputs(case: DynCase, seed=0, special=None):
    rng = np.random.default_rng(seed)
    shape = (case.tokens, case.heads, case.head_dim)
    k, v = (random_values(rng, shape, case.dtype) for _ in range(2))
    if special is not None:   # token 0, head 0 (and all of token 1) take the special values
        for x in (k, v):
            x[0, 0] = SPECIAL_GROUPS[special]((case.head_dim,)).astype(x.dtype)
            if case.tokens > 1:
                x[1] = SPECIAL_GROUPS[special]((case.heads, case.head_dim)).astype(x.dtype)
    num_slots = case.pages * (1 if case.layout == "3D" else case.page_size)
    slots = rng.permutation(num_slots)[: case.tokens].astype(np.int64)
    if case.tokens > 2:
        slots[2] = -1                            # padding
    if case.tokens > 3:
        slots[3] = num_slots + 3                 # out of range
    caches = [rng.integers(0, 256, size=case.cache_shape, dtype=np.uint8) for _ in range(2)]
    if case.pad:   # poison scales in the normal fp32 range (XLA:CPU flushes subnormal scales)
        for c in caches:
            c[..., case.head_dim:case.head_dim + 4] = np.frombuffer(
                (rng.random(case.cache_shape[:-1]) * 3 + 0.25).astype("<f4").tobytes(),
                np.uint8).reshape(case.cache_shape[:-1] + (4,))
        scs = ["inline", "inline"]
    else:
        gran = "token_head" if case.granularity == "tokenhead" else "token"
        sshape = ref.scale_cache_shapes(case.cache_shape, case.api_layout)[gran]
        scs = [(rng.random(sshape) * 3 + 0.25).astype(np.float32) for _ in range(2)]
    return dict(key=k, value=v, key_cache=caches[0], value_cache=caches[1], slots=slots,
                key_scale_cache=scs[0], value_scale_cache=scs[1])


def ref_write(case, x):
    return ref.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"], x["slots"],
                        layout=case.api_layout, fp8_format=case.fmt,
                        key_scale_cache=x["key_scale_cache"],
                        value_scale_cache=x["value_scale_cache"], scale_rounding=case.rounding)


def _t(a, device):
    return a if isinstance(a, str) else to_torch(a, device)


def torch_write(case, x, device, exact=None):
    t = {k: _t(v, device) for k, v in x.items()}
    if exact is None:
        fp8kv_torch.write_kv(**t, layout=case.api_layout, fp8_format=case.fmt,
                             scale_rounding=case.rounding)
    else:
        _launch.call("write_kv", t["key"], t["value"], t["key_cache"], t["value_cache"], t["slots"], None,
                         None, case.api_layout, case.fmt, exact=exact,
                         key_scale_cache=t["key_scale_cache"],
                         value_scale_cache=t["value_scale_cache"], scale_rounding=case.rounding)
    out = [bits(t["key_cache"]), bits(t["value_cache"])]
    if not case.pad:
        out += [bits(t["key_scale_cache"]), bits(t["value_scale_cache"])]
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_write_matches_reference(case, device):
    x = inputs(case)
    want = ref_write(case, x)
    got = torch_write(case, x, device)
    assert len(got) == len(want)
    for g, w in zip(got, want):   # whole arrays: untouched poison bytes compared too
        np.testing.assert_array_equal(g, as_uint(w))


@pytest.mark.parametrize("special", list(SPECIAL_GROUPS))
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=lambda c: c.id)
def test_special_groups(case, special, device):
    x = inputs(case, special=special)
    for g, w in zip(torch_write(case, x, device), ref_write(case, x)):
        np.testing.assert_array_equal(g, as_uint(w))


def test_reference_special_scales():
    """The rules themselves: all-zero -> the floor, NaN ignored, inf -> inf, pow2 exact."""
    x = np.zeros((1, 4, 8), np.float32)
    x[0, 1] = np.nan
    x[0, 2, 0] = -np.inf
    x[0, 3] = 448.0 * 3
    s = ref.dynamic_scales(x, "e4m3", "token_head", "pow2")
    floor_pow2 = np.float32(2.0 ** -19)
    assert s.tolist() == [[floor_pow2, floor_pow2, np.inf, 4.0]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_dequantize_reads_the_scales(case, device):
    x = inputs(case)
    written = ref_write(case, x)
    kc, vc = written[0], written[1]
    ksc, vsc = ((x["key_scale_cache"], x["value_scale_cache"]) if case.pad
                else (written[2], written[3]))
    table = np.array([[1, -1, 0], [case.pages - 1, case.pages + 4, 1]], np.int32)
    head_dim = case.head_dim if case.pad else None
    want = ref.dequantize_pages(kc, vc, table, layout=case.api_layout, fp8_format=case.fmt,
                                key_scale_cache=ksc, value_scale_cache=vsc, head_dim=head_dim,
                                dtype="float32")
    got = fp8kv_torch.dequantize_pages(
        _t(kc, device), _t(vc, device), _t(table, device), layout=case.api_layout,
        fp8_format=case.fmt, key_scale_cache=_t(ksc, device), value_scale_cache=_t(vsc, device),
        head_dim=head_dim, dtype=torch.float32)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), as_uint(w))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_combined_caches_with_views_of_a_combined_scale_buffer(layout, device):
    rng = np.random.default_rng(5)
    tokens, h, d, pages, ps = 6, 3, 72, 3, 4
    shape = (pages, 2, ps, h, d) if layout == "NHD" else (pages, 2, h, ps, d)
    kv = rng.integers(0, 256, size=shape, dtype=np.uint8)
    sc = (rng.random((pages, 2, ps, h) if layout == "NHD" else (pages, 2, h, ps)) + 1).astype(
        np.float32)
    key, value = (random_values(rng, (tokens, h, d), "bfloat16") for _ in range(2))
    slots = rng.permutation(pages * ps)[:tokens]
    slots[1] = -1
    t_kv, t_sc = to_torch(kv, device), to_torch(sc, device)
    fp8kv_torch.write_kv_combined(to_torch(key, device), to_torch(value, device), t_kv,
                                  to_torch(slots, device), layout=layout,
                                  key_scale_cache=t_sc[:, 0], value_scale_cache=t_sc[:, 1],
                                  scale_rounding="pow2")
    wk, wv, wks, wvs = ref.write_kv(key, value, kv[:, 0], kv[:, 1], slots, layout=layout,
                                    key_scale_cache=sc[:, 0], value_scale_cache=sc[:, 1],
                                    scale_rounding="pow2")
    got_kv, got_sc = bits(t_kv), bits(t_sc)
    np.testing.assert_array_equal(got_kv[:, 0], wk)
    np.testing.assert_array_equal(got_kv[:, 1], wv)
    np.testing.assert_array_equal(got_sc[:, 0], as_uint(wks))
    np.testing.assert_array_equal(got_sc[:, 1], as_uint(wvs))
    table = torch.tensor([[2, 0, -1]], dtype=torch.int32, device=device)
    pages_out, _ = fp8kv_torch.dequantize_pages_combined(
        t_kv, table, layout=layout, key_scale_cache=t_sc[:, 0], value_scale_cache=t_sc[:, 1])
    rk, rv, _ = ref.dequantize_pages(kv[:, 0] * 0 + got_kv[:, 0], got_kv[:, 1],
                                     table.cpu().numpy(), layout=layout,
                                     key_scale_cache=wks, value_scale_cache=wvs)
    np.testing.assert_array_equal(bits(pages_out[:, 0]), as_uint(rk))
    np.testing.assert_array_equal(bits(pages_out[:, 1]), as_uint(rv))


def test_mixed_static_key_dynamic_value(device):
    case = DynCase(granularity="token")
    x = inputs(case)
    x["key_scale_cache"] = None
    want = ref.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"], x["slots"], 0.5,
                        layout="NHD", value_scale_cache=x["value_scale_cache"])
    t = {k: _t(v, device) for k, v in x.items()}
    fp8kv_torch.write_kv(**t, key_scale=0.5)
    np.testing.assert_array_equal(bits(t["key_cache"]), as_uint(want[0]))
    np.testing.assert_array_equal(bits(t["value_cache"]), as_uint(want[1]))
    np.testing.assert_array_equal(bits(t["value_scale_cache"]), as_uint(want[3]))


@pytest.mark.parametrize("key_scale", ["float", "per-head"])
def test_mixed_static_key_dynamic_value_round_trip(device, key_scale):
    """A static K scale (host float, or one per head) beside a dynamic V, written and read back."""
    case = DynCase(granularity="token_head")
    x = inputs(case)
    x["key_scale_cache"] = None
    ks = 0.5 if key_scale == "float" else np.linspace(0.25, 2.0, case.heads).astype(np.float32)
    want = ref.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"], x["slots"], ks,
                        layout="NHD", value_scale_cache=x["value_scale_cache"])
    t = {k: _t(v, device) for k, v in x.items()}
    t_ks = ks if key_scale == "float" else _t(ks, device)
    fp8kv_torch.write_kv(**t, key_scale=t_ks)
    np.testing.assert_array_equal(bits(t["key_cache"]), as_uint(want[0]))
    table = np.array([[2, -1, 0]], dtype=np.int32)
    rk, rv, _ = ref.dequantize_pages(want[0], want[1], table, ks, layout="NHD",
                                     value_scale_cache=want[3])
    k, v, _ = fp8kv_torch.dequantize_pages(t["key_cache"], t["value_cache"], _t(table, device),
                                           t_ks, value_scale_cache=t["value_scale_cache"])
    np.testing.assert_array_equal(bits(k), as_uint(rk))
    np.testing.assert_array_equal(bits(v), as_uint(rv))


# ---------------------------------------------------------------------------------------------
# torch.library custom op: opcheck and torch.compile with scale caches.

def test_opcheck_write_with_scale_caches():
    from fp8kv_torch._ops import write_kv_op
    x = {k: _t(v, "cpu") for k, v in inputs(DynCase()).items()}
    args = (x["key"], x["value"], x["key_cache"], x["value_cache"], x["slots"], None, None, None,
            None, "NHD", "e4m3", x["key_scale_cache"], x["value_scale_cache"], False, False,
            "pow2", None, None, None)
    torch.library.opcheck(write_kv_op, args, test_utils=("test_schema", "test_faketensor"))


def test_opcheck_dequantize_with_scale_caches():
    from fp8kv_torch._ops import dequantize_pages_op
    cache = torch.randint(0, 256, (3, 4, 2, 20), dtype=torch.uint8)
    table = torch.tensor([[0, 2]], dtype=torch.int32)
    outs = [torch.empty(2, 4, 2, 16, dtype=torch.bfloat16) for _ in range(2)]
    args = (cache, cache, table, None, None, None, None, "NHD", None, None, outs[0], outs[1],
            torch.empty(1, 2, dtype=torch.int32), None, None, True, True, 16, None, None, None, None, None)
    torch.library.opcheck(dequantize_pages_op, args, test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph_with_scale_caches():
    case = DynCase(tokens=4, heads=2, head_dim=40, page_size=4)
    x = inputs(case)
    want = ref_write(case, x)
    t = {k: _t(v, "cpu") for k, v in x.items()}

    @torch.compile(fullgraph=True, backend="eager")
    def step(key, value, kc, vc, slots, ksc, vsc):
        fp8kv_torch.write_kv(key, value, kc, vc, slots, key_scale_cache=ksc, value_scale_cache=vsc)

    step(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slots"],
         t["key_scale_cache"], t["value_scale_cache"])
    for g, w in zip((t["key_cache"], t["value_cache"], t["key_scale_cache"],
                     t["value_scale_cache"]), want):
        np.testing.assert_array_equal(bits(g), as_uint(w))


# ---------------------------------------------------------------------------------------------
# GPU only.

@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gpu_exact_path_equals_fast_path(case):
    x = inputs(case)
    want = ref_write(case, x)
    for exact in (False, True):
        for g, w in zip(torch_write(case, x, "cuda", exact=exact), want):
            np.testing.assert_array_equal(g, as_uint(w))


@requires_cuda
@pytest.mark.parametrize("special", list(SPECIAL_GROUPS))
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_large_batch_special_groups(fmt, special):
    case = DynCase(tokens=300, heads=8, head_dim=128, page_size=16, fmt=fmt, rounding="pow2")
    x = inputs(case, special=special)
    for exact in (False, True):
        for g, w in zip(torch_write(case, x, "cuda", exact=exact), ref_write(case, x)):
            np.testing.assert_array_equal(g, as_uint(w))


@requires_cuda
@pytest.mark.parametrize("fmt,amax,granularity,rounding", [
    ("e4m3", 1.0, "tokenhead", "exact"), ("e4m3", 448.0, "tokenhead", "exact"),
    ("e4m3", 0.37, "tokenhead", "exact"), ("e4m3", 3.3e-4, "tokenhead", "exact"),
    ("e4m3", 1e-30, "tokenhead", "exact"), ("e4m3", 3.0e38, "tokenhead", "exact"),
    ("e4m3", 7.1, "token", "exact"), ("e4m3", 0.37, "tokenhead", "pow2"),
    ("e4m3", 3.0e38, "token", "pow2"), ("e5m2", 1.0, "tokenhead", "exact"),
    ("e5m2", 0.37, "tokenhead", "exact"), ("e5m2", 1.7e-4, "tokenhead", "exact"),
    ("e5m2", 2.9e37, "token", "exact"), ("e5m2", 1.7e-4, "tokenhead", "pow2")])
def test_gpu_fast_path_on_all_inputs_below_the_amax(fmt, amax, granularity, rounding):
    """The fast write (hardware conversions, NaN-dropping max.f32) gives the exact path's bytes
    for every fp32 value within 27 binades below the group's amax -- all that quantize to more
    than +-0 in either format -- plus every subnormal and zero, both signs, and NaN/inf groups.
    Each head row is [amax, 127 of those values]."""
    a = torch.tensor(amax, dtype=torch.float32)
    top = int(a.view(torch.int32))
    mags = torch.cat([torch.arange(max(top - (27 << 23), 1 << 23), top + 1),
                      torch.arange(0, 1 << 23), torch.tensor([0x7F800000, 0x7FC00000, 0x7F800001])])
    values = torch.cat([mags, mags | (1 << 31)]).to(torch.int32).view(torch.float32).cuda()
    heads, chunk = 8, 127 * 8 * 65536
    for start in range(0, values.numel(), chunk):
        part = values[start:start + chunk]
        rows = -(-part.numel() // 127)
        body = torch.cat([part, part.new_zeros(rows * 127 - part.numel())]).view(rows, 127)
        tokens = -(-rows // heads)
        x = torch.zeros(tokens * heads, 128, device="cuda")
        x[:rows, 0] = amax
        x[:rows, 1:] = body
        x = x.view(tokens, heads, 128)
        slots = torch.arange(tokens, device="cuda")
        got = []
        for exact in (False, True):
            out = [torch.empty(tokens, heads, 128, dtype=torch.uint8, device="cuda"),
                   torch.empty(tokens, heads, 128, dtype=torch.uint8, device="cuda"),
                   torch.empty((tokens, heads) if granularity == "tokenhead" else (tokens,),
                               device="cuda")]
            out.append(torch.empty_like(out[2]))
            _launch.call("write_kv", x, -x, out[0], out[1], slots, None, None, "NHD", fmt, exact=exact,
                             key_scale_cache=out[2], value_scale_cache=out[3],
                             scale_rounding=rounding)
            got.append(out)
        for fast, exact in zip(*got):
            assert torch.equal(fast, exact), f"values {start}..{start + chunk} differ"


@requires_cuda
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_gpu_fast_scale_on_every_amax(fmt):
    """The fast path's scale (``amax / fmax`` by a constant reciprocal and FMA corrections,
    codec.dynamic_scale) equals the exact path's ``div_rn`` for every finite fp32 amax and
    inf: each head row is [amax, 0, ...]."""
    heads, head_dim, chunk = 8, 16, 1 << 25
    for start in range(0, 0x7F800001, chunk):
        amax = torch.arange(start, min(start + chunk, 0x7F800001), device="cuda")
        amax = amax.to(torch.int32).view(torch.float32)
        tokens = -(-amax.numel() // heads)
        x = torch.zeros(tokens * heads, head_dim, device="cuda")
        x[:amax.numel(), 0] = amax
        x = x.view(tokens, heads, head_dim)
        slots = torch.arange(tokens, device="cuda")
        got = []
        for exact in (False, True):
            cache = torch.empty(tokens, heads, head_dim, dtype=torch.uint8, device="cuda")
            scales = torch.empty(tokens, heads, device="cuda")
            _launch.call("write_kv", x, x, cache, cache, slots, None, None, "NHD", fmt, exact=exact,
                             key_scale_cache=scales, value_scale_cache=scales)
            got.append(scales)
        assert torch.equal(got[0], got[1]), f"amax bits {start:#x}.. differ"


@requires_cuda
def test_gpu_cuda_graph_capture_with_scale_caches():
    case = DynCase(tokens=8, heads=2, head_dim=64, page_size=16)
    x = inputs(case)
    want = ref_write(case, x)
    t = {k: _t(v, "cuda") for k, v in x.items()}
    fresh = {k: v.clone() for k, v in t.items() if isinstance(v, torch.Tensor)}
    fp8kv_torch.write_kv(**t)   # warm up (compiles)
    for k, v in fresh.items():
        t[k].copy_(v)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8kv_torch.write_kv(**t)
    for k, v in fresh.items():
        t[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip((t["key_cache"], t["value_cache"], t["key_scale_cache"],
                     t["value_scale_cache"]), want):
        np.testing.assert_array_equal(bits(g), as_uint(w))


# ---------------------------------------------------------------------------------------------
# JAX: the jnp path (CPU) and the GPU launch glue (interpreter stand-in) give the same bytes.

PARITY_CASES = [CASES[i] for i in (0, 1, 2, 5, 7)]


def _jax_write(case, x):
    import fp8kv_jax
    return fp8kv_jax.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"],
                              x["slots"].astype(np.int32), layout=case.api_layout,
                              fp8_format=case.fmt, key_scale_cache=x["key_scale_cache"],
                              value_scale_cache=x["value_scale_cache"],
                              scale_rounding=case.rounding)


def _jax_dequantize(case, written, x):
    import jax.numpy as jnp
    import fp8kv_jax
    ksc, vsc = ((x["key_scale_cache"], x["value_scale_cache"]) if case.pad
                else (written[2], written[3]))
    table = np.array([[1, -1, 0]], np.int32)
    return fp8kv_jax.dequantize_pages(written[0], written[1], table, layout=case.api_layout,
                                      fp8_format=case.fmt, key_scale_cache=ksc,
                                      value_scale_cache=vsc,
                                      head_dim=case.head_dim if case.pad else None,
                                      dtype=jnp.float32), table, ksc, vsc


def _check_jax(case, x):
    want = ref_write(case, x)
    got = _jax_write(case, x)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(as_uint(np.asarray(g)), as_uint(w))
    (pages, table, ksc, vsc) = _jax_dequantize(case, [np.asarray(g) for g in got], x)
    ref_ksc = ksc if isinstance(ksc, str) else np.asarray(ksc)
    ref_vsc = vsc if isinstance(vsc, str) else np.asarray(vsc)
    want = ref.dequantize_pages(want[0], want[1], table, layout=case.api_layout,
                                fp8_format=case.fmt, key_scale_cache=ref_ksc,
                                value_scale_cache=ref_vsc,
                                head_dim=case.head_dim if case.pad else None, dtype="float32")
    for g, w in zip(pages, want):
        np.testing.assert_array_equal(as_uint(np.asarray(g)), as_uint(w))
    return got


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.id)
def test_jax_jnp_and_torch_same_bytes(case):
    jax = pytest.importorskip("jax")
    x = inputs(case)
    with jax.default_device(jax.devices("cpu")[0]):
        got = _check_jax(case, x)
    for g, t in zip(got, torch_write(case, x, "cpu")):
        np.testing.assert_array_equal(as_uint(np.asarray(g)), t)


@pytest.mark.parametrize("case", PARITY_CASES, ids=lambda c: c.id)
def test_jax_gpu_launch_in_interpreter(case, monkeypatch):
    jax = pytest.importorskip("jax")
    from tests.jax_glue import use_interpreted_gpu_path
    use_interpreted_gpu_path(monkeypatch)
    x = inputs(case)
    with jax.default_device(jax.devices("cpu")[0]):
        _check_jax(case, x)


def test_jax_donated_scale_caches_under_jit():
    jax = pytest.importorskip("jax")
    import functools

    import fp8kv_jax
    case = DynCase(tokens=4, heads=2, head_dim=40, page_size=4, granularity="token")
    x = inputs(case)
    want = ref_write(case, x)
    step = jax.jit(functools.partial(fp8kv_jax.write_kv, scale_rounding="exact"),
                   donate_argnames=("key_cache", "value_cache", "key_scale_cache",
                                    "value_scale_cache"))
    with jax.default_device(jax.devices("cpu")[0]):
        got = step(x["key"], x["value"], x["key_cache"], x["value_cache"],
                   x["slots"].astype(np.int32), key_scale_cache=x["key_scale_cache"],
                   value_scale_cache=x["value_scale_cache"])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(as_uint(np.asarray(g)), as_uint(w))
