"""The ready-launch cache of fp8kv_torch: a new signature is always validated and planned afresh.

Every call is counted at the core's validation (each op's ``check`` in the op table, which the
launcher calls); the cache may skip it only for a repeat of a signature that passed.
The bytes written through cached launches are checked against the reference.
"""
from __future__ import annotations

import dataclasses
import functools

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch")

from tests.helpers import bits, torch
from fp8kv import reference as ref
from fp8kv.optable import OPS
from fp8kv_torch import (_fast, _launch, dequantize_pages, dequantize_pages_combined, write_kv,
                         write_kv_combined)


@pytest.fixture
def validations(monkeypatch):
    """Count the launcher's validations; start from an empty cache. The fast path is on for these
    tests whatever FP8KV_FAST says: they test it (the suite also runs with it off)."""
    monkeypatch.setattr(_fast, "ENABLED", True)
    counts = {"write": 0, "dequantize": 0}

    def counting(name, check):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return check(*args, **kwargs)
        return wrapper

    for name, op in OPS.items():
        if op.family in ("write_kv", "dequantize_pages"):
            monkeypatch.setitem(OPS, name, dataclasses.replace(
                op, check=counting(op.family.split("_")[0], op.check)))
    _launch.clear_launch_caches()
    yield counts
    _launch.clear_launch_caches()


def _write_inputs(device, tokens=3, heads=2, head_dim=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, heads, head_dim, generator=g).to(dtype).to(device)
    v = torch.randn(tokens, heads, head_dim, generator=g).to(dtype).to(device)
    caches = [torch.zeros(4, 4, heads, head_dim, dtype=torch.uint8, device=device) for _ in range(2)]
    slots = torch.arange(tokens, dtype=torch.int64, device=device) * 3
    return k, v, *caches, slots


def _expected_write(k, v, kc, vc, slots, ks, vs):
    def host(t):
        if t is None or isinstance(t, float):
            return t
        return t.float().cpu().numpy().astype(ml_dtypes.bfloat16 if t.dtype == torch.bfloat16
                                              else np.float32)

    want = ref.write_kv(host(k), host(v), kc.cpu().numpy(), vc.cpu().numpy(), slots.cpu().numpy(),
                        host(ks), host(vs))
    return [np.asarray(w).view(np.uint8) for w in want]


def test_repeat_is_cached_and_new_signatures_revalidate(device, validations):
    k, v, kc, vc, slots = _write_inputs(device)
    scale = torch.tensor(0.5, device=device)
    write_kv(k, v, kc, vc, slots, scale, scale)
    write_kv(k, v, kc, vc, slots, scale, scale)
    assert validations["write"] == 1
    variants = {
        "tokens": lambda: _write_inputs(device, tokens=5),
        "dtype": lambda: _write_inputs(device, dtype=torch.float16),
        "heads": lambda: _write_inputs(device, heads=1),
    }
    for name, make in variants.items():
        before = validations["write"]
        write_kv(*make(), scale, scale)
        assert validations["write"] == before + 1, name
    before = validations["write"]
    wide = torch.zeros(3, 2, 32, dtype=torch.bfloat16, device=device)
    write_kv(wide[:, :, :16], v, kc, vc, slots, scale, scale)            # strides
    write_kv(k, v, kc, vc, slots.to(torch.int32), scale, scale)          # slot dtype
    write_kv(k, v, kc, vc, slots, 0.5, 0.5)                              # host scale
    write_kv(k, v, kc, vc, slots, 0.25, 0.5)                             # its value
    write_kv(k, v, kc, vc, slots, torch.full((2,), 0.5, device=device), scale)  # per head
    write_kv(k, v, kc, vc, slots, None, None)                            # no scale
    write_kv(k, v, kc.transpose(1, 2), vc.transpose(1, 2), slots, scale, scale, layout="HND")
    flat = torch.zeros(3 * 2 * 16 + 1, dtype=torch.bfloat16, device=device)
    write_kv(flat[1:].view(3, 2, 16), v, kc, vc, slots, scale, scale)    # alignment
    th = [torch.zeros(4, 4, 2, device=device) for _ in range(2)]
    write_kv(k, v, kc, vc, slots, key_scale_cache=th[0], value_scale_cache=th[1])  # dynamic
    write_kv(k, v, kc, vc, slots, key_scale_cache=th[0][..., 0], value_scale_cache=th[1][..., 0])
    write_kv(k, v, kc, vc, slots, key_scale_cache=th[0], value_scale_cache=th[1],
             scale_rounding="pow2")                                       # its rounding
    assert validations["write"] == before + 11


def test_cached_launch_writes_the_tensors_of_each_call(device, validations):
    scale = torch.tensor(0.75, device=device)
    for seed in range(3):   # new inputs and new caches of one signature: one validation
        k, v, kc, vc, slots = _write_inputs(device, seed=seed)
        kc.fill_(0xAA)
        write_kv(k, v, kc, vc, slots, scale, scale)
        want = _expected_write(k, v, torch.full_like(kc, 0xAA), torch.zeros_like(vc), slots,
                               scale, scale)
        np.testing.assert_array_equal(bits(kc), want[0])
        np.testing.assert_array_equal(bits(vc), want[1])
    assert validations["write"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in the GPU suite)")
def test_another_device_revalidates(validations):
    for device in ("cuda", "cpu", "cuda"):
        write_kv(*_write_inputs(device), 0.5, 0.5)
    assert validations["write"] == 2


def test_a_bad_call_fails_the_same_on_every_call(device, validations):
    k, v, kc, vc, slots = _write_inputs(device)
    write_kv(k, v, kc, vc, slots)                                       # a good call, cached
    messages = set()
    for _ in range(100):
        with pytest.raises(ValueError) as e:
            write_kv(k, v, kc, vc, slots[:2])
        messages.add(str(e.value))
    assert messages == {"slots: expected shape [3] (one per token), got [2]"}
    for _ in range(3):
        with pytest.raises(TypeError, match=r"slots: expected dtype int32 or int64, got int16"):
            write_kv(k, v, kc, vc, slots.to(torch.int16))
        with pytest.raises(TypeError, match=r"slots: expected a torch.Tensor, got list"):
            write_kv(k, v, kc, vc, [0, 3, 6])


@pytest.mark.parametrize("allocating", [True, False], ids=["allocating", "out"])
def test_dequantize_cache(device, validations, allocating):
    cache = torch.randint(0, 0x7F, (6, 4, 2, 16), dtype=torch.uint8, device=device)
    table = torch.tensor([[5, -1], [0, 2]], dtype=torch.int32, device=device)
    want = ref.dequantize_pages(cache.cpu().numpy(), cache.cpu().numpy(), table.cpu().numpy(), 0.5,
                                0.5, dtype="float32")
    outs = None if allocating else tuple(torch.empty_like(torch.from_numpy(w)).to(device) for w in want)
    for _ in range(3):
        got = dequantize_pages(cache, cache, table, 0.5, 0.5, dtype=torch.float32,
                               out=None if outs is None else list(outs))
        assert type(got) is tuple
        for g, w in zip(got, want):
            np.testing.assert_array_equal(bits(g), np.asarray(w).view(bits(g).dtype))
        assert allocating or all(g is o for g, o in zip(got, outs))
    assert validations["dequantize"] == 1
    dequantize_pages(cache, cache, table[:1], 0.5, 0.5, dtype=torch.float32)        # shape
    dequantize_pages(cache, cache, table, 0.5, 0.5, dtype=torch.bfloat16)           # dtype
    dequantize_pages(cache, cache, table, 0.5, 0.5, dtype=torch.float32, null_page=0)  # option
    kv = torch.stack([cache, cache], 1)
    dequantize_pages_combined(kv, table, 0.5, 0.5, dtype=torch.float32)            # combined
    assert validations["dequantize"] == 5
    for _ in range(3):
        with pytest.raises(ValueError, match=r"block_table: expected rank 2"):
            dequantize_pages(cache, cache, table[0], 0.5, 0.5, dtype=torch.float32)


def test_torch_guards_pass_their_self_test():
    """The repeat check of fp8kv_torch._fast runs on the torch versions CI and the GPU suite use
    (its self-test passes): were torch to change the private guards, this fails, and calls keep
    working through the metadata key, only slower."""
    assert _fast._tensor_guard() is not None


def test_a_repeated_signature_is_served_by_the_last_call_check(device, validations):
    k, v, kc, vc, slots = _write_inputs(device)
    scale = torch.tensor(0.5, device=device)
    for _ in range(2):
        write_kv(k, v, kc, vc, slots, scale, scale)
    assert "write_kv" in _launch._LAST       # the second call of a signature makes it
    _launch._READY.clear()                # no key lookup can serve the next calls
    for seed in range(2):                 # new tensors of the same signature
        k, v, kc, vc, slots = _write_inputs(device, seed=seed)
        write_kv(k, v, kc, vc, slots, scale, scale)
        want = _expected_write(k, v, torch.zeros_like(kc), torch.zeros_like(vc), slots, scale, scale)
        np.testing.assert_array_equal(bits(kc), want[0])
    write_kv(k, v, kc, vc, slots, 0.5, scale)   # a host scale where a tensor was: validated
    assert validations["write"] == 2


def _write_call(device, seed, form):
    """One write of a signature named by ``form`` on fresh tensors (``seed``) into poisoned
    caches; returns every tensor it writes."""
    k, v, kc, vc, slots = _write_inputs(device, seed=seed)
    kc.fill_(0x11)
    vc.fill_(0x22)
    s, t = (torch.tensor(x + seed, device=device) for x in (0.5, 0.25))
    if form == "combined":
        kv = torch.stack([kc, vc], dim=1)
        write_kv_combined(k, v, kv, slots, s, t)
        return [kv]
    if form == "dynamic":
        sc = [torch.full((4, 4, 2), -1.0, device=device) for _ in range(2)]
        write_kv(k, v, kc, vc, slots, key_scale_cache=sc[0], value_scale_cache=sc[1])
        return [kc, vc, *sc]
    write_kv(k, v, kc, vc, slots, *{"shared": (s, s), "distinct": (s, t), "host": (0.5, 0.25),
                                    "none": (None, None)}[form])
    return [kc, vc]


def _dequantize_call(device, seed, form):
    """One dequantize of a signature named by ``form`` on fresh tensors; returns its outputs."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randint(0, 0x7F, (6, 4, 2, 16), dtype=torch.uint8, generator=g).to(device)
    table = torch.randint(-1, 6, (2, 3), dtype=torch.int32, generator=g).to(device)
    s = torch.tensor(0.5 + seed, device=device)
    if form == "combined":
        return dequantize_pages_combined(torch.stack([cache, cache.flip(0)], 1), table, s, s,
                                         dtype=torch.float32)
    outs = None
    if form == "out":
        outs = (torch.full((6, 4, 2, 16), -1.0, device=device),
                torch.full((6, 4, 2, 16), -2.0, device=device),
                torch.full((2, 3), -3, dtype=torch.int32, device=device))
    return dequantize_pages(cache, cache.flip(0), table, s, None, dtype=torch.float32, out=outs)


@pytest.mark.parametrize("op, form", [
    ("write", "shared"), ("write", "distinct"), ("write", "host"), ("write", "none"),
    ("write", "dynamic"), ("write", "combined"),
    ("dequantize", "allocating"), ("dequantize", "out"), ("dequantize", "combined")])
def test_the_last_call_launches_each_calls_own_tensors(device, validations, op, form):
    """A LastCall hands each call's pointers to the kernel arguments they belong to (a shared
    scale, a placeholder pointer for no scale, one combined cache read as K and V, new outputs):
    the bytes equal those of a validated launch of the same inputs."""
    call = functools.partial(_write_call if op == "write" else _dequantize_call, device, form=form)
    want = {}
    for seed in (1, 2):
        _launch.clear_launch_caches()
        want[seed] = [bits(t) for t in call(seed=seed) if t is not None]
    _launch.clear_launch_caches()
    call(seed=0)
    call(seed=0)
    name = {"write": "write_kv", "dequantize": "dequantize_pages"}[op]
    assert (f"{name}_combined" if form == "combined" else name) in _launch._LAST
    _launch._READY.clear()          # only the LastCall can serve without validating
    before = validations[op]
    for seed in (1, 2):
        got = [bits(t) for t in call(seed=seed) if t is not None]
        for g, w in zip(got, want[seed], strict=True):
            np.testing.assert_array_equal(g, w)
    assert validations[op] == before


@pytest.mark.parametrize("batch, pages_per_seq", [(2, 3), (1, 1)], ids=["2x3", "1x1"])
def test_allocating_calls_return_new_tensors_of_their_own(device, validations, batch,
                                                          pages_per_seq):
    """Every allocating call -- validated, served by its key, served by the LastCall -- returns
    new contiguous outputs laid out as ``torch.empty`` lays them out, none sharing memory with
    another output of the call or of an earlier call still alive. (A 1 x 1 table is a shape whose
    template-made tensor would get other strides: there ``torch.empty`` makes it.)"""
    cache = torch.randint(0, 0x7F, (6, 4, 2, 16), dtype=torch.uint8, device=device)
    table = torch.randint(-1, 6, (batch, pages_per_seq), dtype=torch.int32, device=device)
    want = [bits(t) for t in dequantize_pages(cache, cache.flip(0), table, 0.5, 0.25,
                                              dtype=torch.bfloat16)]
    _launch.clear_launch_caches()
    before, kept = validations["dequantize"], []
    for i in range(4):   # validated; by the key (which makes the LastCall); the LastCall twice
        outs = dequantize_pages(cache, cache.flip(0), table, 0.5, 0.25, dtype=torch.bfloat16)
        assert ("dequantize_pages" in _launch._LAST) == (i >= 1)
        for got, w, like in zip(outs, want, ((batch * pages_per_seq, 4, 2, 16),) * 2 + (
                (batch, pages_per_seq),), strict=True):
            plain = torch.empty(like, dtype=got.dtype, device=device)
            assert (got.shape, got.stride(), got.device) == (plain.shape, plain.stride(),
                                                             plain.device)
            np.testing.assert_array_equal(bits(got), w)
        kept += outs
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in kept)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert validations["dequantize"] == before + 1


def test_template_outputs_are_laid_out_as_torch_empty(device):
    """``_empty_maker`` uses a template only where its tensor has torch.empty's layout: for
    empty and all-ones shapes (other strides from a template) it makes them with torch.empty."""
    for shape, dtype in (((6, 4, 2, 16), torch.bfloat16), ((5, 2, 4, 2, 128), torch.float16),
                         ((2, 3), torch.int32), ((1, 1), torch.int32), ((0, 4, 2, 16), torch.bfloat16),
                         ((1, 1, 1, 1), torch.float32)):
        made = _launch._empty_maker(shape, dtype, torch.device(device))()
        plain = torch.empty(shape, dtype=dtype, device=device)
        assert _launch._layout_of(made) == _launch._layout_of(plain), shape


def test_a_shared_scale_then_two_scales(device, validations):
    """A LastCall made with one scale tensor for K and V does not serve two tensors (nor the
    reverse): the second scale would be read from the first one's pointer."""
    for first, then in (("shared", "distinct"), ("distinct", "shared")):
        _launch.clear_launch_caches()
        want = [bits(t) for t in _write_call(device, 1, then)]
        _launch.clear_launch_caches()
        for _ in range(2):
            _write_call(device, 0, first)
        assert "write_kv" in _launch._LAST
        got = [bits(t) for t in _write_call(device, 1, then)]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


def test_alternating_signatures_make_no_last_call(device, validations):
    a, b = _write_inputs(device), _write_inputs(device, tokens=5)
    for _ in range(3):
        write_kv(*a)
        write_kv(*b)
    assert "write_kv" not in _launch._LAST and validations["write"] == 2


def test_the_launcher_check_knows_triton_3_6():
    """The launcher source that fp8kv_torch._fast calls past is Triton 3.6's; on another Triton the
    launch goes through the launcher object (Triton's own runner makes that call)."""
    triton = pytest.importorskip("triton")
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the pinned launcher source is Triton 3.6's, this is {triton.__version__}")
    from triton.backends.nvidia.driver import CudaLauncher
    assert _fast._launcher_matches(CudaLauncher)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in the GPU suite)")
def test_gpu_direct_launches_and_launch_hooks(monkeypatch, validations):
    """Ready launches call Triton's launcher directly on the Triton of the GPU suite (its C
    function on Triton 3.6), and a registered launch hook (a profiler) still sees every launch."""
    import triton
    from triton import knobs
    assert _fast._runner_matches(triton.compiler.CompiledKernel)
    found, c_launch = [], _fast._c_launch

    def recording(run):
        found.append(c_launch(run))
        return found[-1]

    monkeypatch.setattr(_fast, "_c_launch", recording)
    args = _write_inputs("cuda")
    for _ in range(3):
        write_kv(*args)
    assert len(found) == 1 and (found[0] is not None) == triton.__version__.startswith("3.6.")
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        write_kv(*args)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert seen == ["_write_kv_kernel"]
