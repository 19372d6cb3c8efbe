"""fp8kv_torch and fp8kv_jax give the same bytes, share caches through DLPack, and coexist.

On a CPU-only machine the parity cases compare torch's Triton-interpreter kernels with JAX's jnp
path; where torch and JAX both have an NVIDIA GPU, compiled Triton launched by torch with the same
kernels launched by jax-triton. Tests marked ``gpu`` need that GPU and are skipped, with that
reason, elsewhere.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # both optional frameworks are needed here
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fp8kv_jax  # noqa: E402
import fp8kv_torch  # noqa: E402
from tests.cases import (DEQUANT_CASES, WRITE_CASES, WriteCase, as_uint,  # noqa: E402
                         dequant_inputs, write_inputs)
from fp8kv import reference  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ON_GPU = torch.cuda.is_available() and jax.default_backend() == "gpu"
NOT_GPU_REASON = (f"needs torch and JAX on an NVIDIA GPU (torch.cuda.is_available()="
                  f"{torch.cuda.is_available()}, JAX backend {jax.default_backend()})")
TORCH_DEVICE = "cuda" if ON_GPU else "cpu"
JAX_DEVICE = jax.devices("gpu" if ON_GPU else "cpu")[0]

# The CPU variant always runs; the CUDA one where both frameworks have the GPU.
PLATFORMS = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not ON_GPU, reason=NOT_GPU_REASON)])]


def jax_device(platform: str):
    return jax.devices("gpu" if platform == "cuda" else "cpu")[0]


def to_torch(a, device: str = TORCH_DEVICE):
    """A NumPy array as a new torch-allocated tensor (bf16 / fp8 through their bits)."""
    if not isinstance(a, np.ndarray):
        return a
    name = a.dtype.name
    if name == "bfloat16":
        t = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    elif name.startswith("float8"):
        t = torch.from_numpy(a.view(np.uint8)).view(getattr(torch, name))
    else:
        t = torch.from_numpy(a)
    # A copy: torch writes in place, and its allocator aligns (XLA:CPU copies unaligned DLPack).
    return t.to(device, copy=True)


def to_jax(inputs: dict, device=JAX_DEVICE) -> dict:
    return {k: jax.device_put(jnp.asarray(v), device) if isinstance(v, np.ndarray) else v
            for k, v in inputs.items()}


def torch_bytes(t) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().copy()


def assert_same_bytes(t, x):
    """A torch tensor and a JAX array: same shape, dtype and bytes (NaN payloads included)."""
    x = np.asarray(x)
    assert (tuple(t.shape), str(t.dtype).removeprefix("torch.")) == (x.shape, x.dtype.name)
    np.testing.assert_array_equal(torch_bytes(t), x.view(np.uint8))


def write_kwargs(case):
    return dict(layout=case.api_layout, fp8_format=case.fp8_format)


def dequant_kwargs(case):
    return dict(layout=case.api_layout, fp8_format=case.fp8_format, null_page=case.null_page)


# ---------------------------------------------------------------------------------------------
# Every shared case through both frontends.

@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_write_kv_parity(case):
    inputs = write_inputs(case)
    t = {k: to_torch(v) for k, v in inputs.items()}
    fp8kv_torch.write_kv(**t, **write_kwargs(case))
    with jax.default_device(JAX_DEVICE), jax.enable_x64(case.slots == "int64"):
        out = fp8kv_jax.write_kv(**to_jax(inputs), **write_kwargs(case))
    assert_same_bytes(t["key_cache"], out[0])
    assert_same_bytes(t["value_cache"], out[1])


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_write_kv_combined_parity(case):
    inputs = write_inputs(case)
    inputs["kv_cache"] = np.stack([inputs.pop("key_cache"), inputs.pop("value_cache")], axis=1)
    t = {k: to_torch(v) for k, v in inputs.items()}
    fp8kv_torch.write_kv_combined(**t, **write_kwargs(case))
    with jax.default_device(JAX_DEVICE), jax.enable_x64(case.slots == "int64"):
        out = fp8kv_jax.write_kv_combined(**to_jax(inputs), **write_kwargs(case))
    assert_same_bytes(t["kv_cache"], out)


@pytest.mark.parametrize("case", DEQUANT_CASES, ids=lambda c: c.id)
def test_dequantize_pages_parity(case):
    inputs = dequant_inputs(case)
    expected = fp8kv_torch.dequantize_pages(**{k: to_torch(v) for k, v in inputs.items()},
                                            dtype=getattr(torch, case.out), **dequant_kwargs(case))
    with jax.default_device(JAX_DEVICE):
        got = fp8kv_jax.dequantize_pages(**to_jax(inputs), dtype=getattr(jnp, case.out),
                                         **dequant_kwargs(case))
    assert len(got) == len(expected) == 3
    for t, x in zip(expected, got):
        assert_same_bytes(t, x)


@pytest.mark.parametrize("case", DEQUANT_CASES, ids=lambda c: c.id)
def test_dequantize_pages_combined_parity(case):
    inputs = dequant_inputs(case)
    inputs["kv_cache"] = np.stack([inputs.pop("key_cache"), inputs.pop("value_cache")], axis=1)
    expected = fp8kv_torch.dequantize_pages_combined(
        **{k: to_torch(v) for k, v in inputs.items()}, dtype=getattr(torch, case.out),
        **dequant_kwargs(case))
    with jax.default_device(JAX_DEVICE):
        got = fp8kv_jax.dequantize_pages_combined(**to_jax(inputs), dtype=getattr(jnp, case.out),
                                                  **dequant_kwargs(case))
    assert len(got) == len(expected) == 2
    for t, x in zip(expected, got):
        assert_same_bytes(t, x)


# ---------------------------------------------------------------------------------------------
# DLPack: zero-copy handoff both ways, and a cache shared across donated writes.

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "uint8"])
def test_dlpack_torch_to_jax_is_zero_copy(platform, dtype):
    t = (torch.arange(4096, device=platform) % 256).to(torch.uint8).view(getattr(torch, dtype))
    x = jax.dlpack.from_dlpack(t)
    assert x.devices() == {jax_device(platform)}
    assert x.dtype == jnp.dtype(dtype) and x.shape == tuple(t.shape)
    assert x.unsafe_buffer_pointer() == t.data_ptr()
    assert_same_bytes(t, x)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "uint8"])
def test_dlpack_jax_to_torch_is_zero_copy(platform, dtype):
    codes = jax.device_put((jnp.arange(4096) % 256).astype(jnp.uint8), jax_device(platform))
    x = jax.lax.bitcast_convert_type(codes, jnp.dtype(dtype))
    t = torch.from_dlpack(x)
    assert t.device.type == platform and t.dtype == getattr(torch, dtype)
    assert t.data_ptr() == x.unsafe_buffer_pointer()
    assert_same_bytes(t, x)


CACHES = ("key_cache", "value_cache")
NAMES = ("key", "value", "slots", "key_scale", "value_scale")
EXTERNAL_REFERENCE = "Donation requested for buffer with external reference"


def _shared_cache_problem(device):
    """Two write steps on one cache: (jitted write donating the caches, [(args, expected)] per
    step: the JAX arguments besides the caches, and the reference's caches after the step),
    the caches before the first step (NumPy)."""
    case = WriteCase(tokens=9, heads=2, head_dim=64, page_size=16, slots="int32")
    first, second = write_inputs(case, seed=0), write_inputs(case, seed=1)
    expected_first = reference.write_kv(**first)
    expected_second = reference.write_kv(**{**second, "key_cache": expected_first[0],
                                            "value_cache": expected_first[1]})
    steps = [([to_jax(inputs, device)[n] for n in NAMES], expected)
             for inputs, expected in ((first, expected_first), (second, expected_second))]
    step = jax.jit(fp8kv_jax.write_kv, donate_argnums=(2, 3))
    return step, steps, [first[n] for n in CACHES]


def _donated_write(step, args, caches):
    return jax.block_until_ready(step(*args[:2], *caches, *args[2:]))


def _assert_caches(got, expected):
    """JAX arrays (or torch tensors) hold the reference's bytes."""
    assert len(got) == len(expected) == 2
    for g, want in zip(got, expected):
        data = torch_bytes(g) if isinstance(g, torch.Tensor) else as_uint(np.asarray(g))
        np.testing.assert_array_equal(data.reshape(-1).view(np.uint8),
                                      as_uint(want).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dlpack_torch_owned_cache_under_a_donated_write(platform):
    """A torch-owned cache imported with ``jax.dlpack.from_dlpack`` (zero-copy) and donated to a
    jitted ``write_kv``: on an NVIDIA GPU written in place, torch sees the new bytes; on the CPU
    XLA copies instead, torch keeps its old bytes (README, "Sharing one cache between torch and
    JAX")."""
    device = jax_device(platform)
    with jax.default_device(device):
        step, steps, old = _shared_cache_problem(device)
        (args, expected), _ = steps
        views = [to_torch(c, platform) for c in old]
        caches = [jax.dlpack.from_dlpack(t) for t in views]
        assert [c.unsafe_buffer_pointer() for c in caches] == [t.data_ptr() for t in views]
        out = _donated_write(step, args, caches)
    _assert_caches(out, expected)   # JAX's own result is right either way
    assert not np.array_equal(as_uint(expected[0]), as_uint(old[0]))   # the step changes bytes
    in_place = [o.unsafe_buffer_pointer() == t.data_ptr() for o, t in zip(out, views)]
    if platform == "cuda":
        assert in_place == [True, True]
        _assert_caches(views, expected)
    else:
        assert in_place == [False, False]
        _assert_caches(views, old)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dlpack_jax_cache_with_a_live_torch_view_under_a_donated_write(platform):
    """Donating a JAX-owned cache while torch holds a DLPack view of it: XLA refuses on an NVIDIA
    GPU ("Donation requested for buffer with external reference") and writes nothing; on the CPU
    it copies, and the torch view keeps the old bytes."""
    device = jax_device(platform)
    with jax.default_device(device):
        step, steps, old = _shared_cache_problem(device)
        (args, expected), _ = steps
        caches = [jax.device_put(jnp.asarray(c), device) for c in old]
        views = [torch.from_dlpack(c) for c in caches]
        assert [t.data_ptr() for t in views] == [c.unsafe_buffer_pointer() for c in caches]
        if platform == "cuda":
            # jaxlib raises XLA's INVALID_ARGUMENT status as a ValueError (0.11) or as
            # JaxRuntimeError (other releases): either, with XLA's reason.
            with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match=EXTERNAL_REFERENCE):
                _donated_write(step, args, caches)
        else:
            out = _donated_write(step, args, caches)
            _assert_caches(out, expected)
            assert all(o.unsafe_buffer_pointer() != t.data_ptr() for o, t in zip(out, views))
    assert not np.array_equal(as_uint(expected[0]), as_uint(old[0]))   # the step changes bytes
    _assert_caches(views, old)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dlpack_cache_shared_with_torch_across_donated_writes(platform):
    """The working pattern: JAX owns the cache; after each donated step torch reads the returned
    cache through DLPack without a copy and drops that view before the next step. Every step
    writes in place, and torch sees each step's bytes."""
    device = jax_device(platform)
    with jax.default_device(device):
        step, steps, old = _shared_cache_problem(device)
        caches = [jax.device_put(jnp.asarray(c), device) for c in old]
        pointers = [c.unsafe_buffer_pointer() for c in caches]
        for args, expected in steps:
            caches = _donated_write(step, args, caches)
            views = [torch.from_dlpack(c) for c in caches]
            seen = [t.data_ptr() for t in views]
            _assert_caches(views, expected)
            del views  # a live torch view would make XLA copy (CPU) or refuse (GPU) next step
            assert seen == pointers  # in place, and no copy for torch


# ---------------------------------------------------------------------------------------------
# Import order: jax-triton's TRITON_CACHE_DIR change must not break torch-side launches.

_ORDER_SCRIPT = """
import os, sys
os.environ["FP8KV_JAX_XLA_TRITON"] = "0"   # the jax-triton path: its import is what is tested
import numpy as np
from tests.cases import WriteCase, as_uint, write_inputs
from fp8kv import reference

PLATFORM = {platform!r}
saved = os.environ.get("TRITON_CACHE_DIR")
CASES = [WriteCase(tokens=9, heads=2, head_dim=64, page_size=16, slots="int32"),
         WriteCase(tokens=5, heads=4, head_dim=32, page_size=8, layout="HND", fmt="e5m2",
                   scale="head", slots="int32")]


def jax_write(case):
    import jax, jax.numpy as jnp, fp8kv_jax
    inputs = write_inputs(case)
    out = fp8kv_jax.write_kv(**{{k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
                                for k, v in inputs.items()}}, layout=case.layout)
    for got, want in zip(out, reference.write_kv(**inputs, layout=case.layout)):
        np.testing.assert_array_equal(as_uint(np.asarray(got)), as_uint(want))
    assert ("jax_triton" in sys.modules) == (PLATFORM == "cuda"), "not the expected JAX path"
    assert os.environ.get("TRITON_CACHE_DIR") == saved, "the JAX path changed TRITON_CACHE_DIR"


def torch_write(case):
    import torch, fp8kv_torch
    inputs = write_inputs(case)
    t = {{}}
    for k, v in inputs.items():
        if isinstance(v, np.ndarray):
            bits = v.view({{1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}}[v.itemsize])
            v = torch.from_numpy(bits.copy()).view(getattr(torch, v.dtype.name)).to(PLATFORM)
        t[k] = v
    fp8kv_torch.write_kv(**t, layout=case.layout)
    expected = reference.write_kv(**inputs, layout=case.layout)
    for name, want in zip(("key_cache", "value_cache"), expected):
        got = t[name].cpu().view(torch.uint8).numpy()
        np.testing.assert_array_equal(got, want.view(np.uint8))


for step, case in {steps}:
    step(CASES[case])
print("OK")
"""

# Each order ends with a torch launch of a kernel specialization not compiled before in that
# process, so that Triton needs its cache dir after jax-triton was imported.
ORDERS = {
    "jax-first": "[(jax_write, 0), (torch_write, 0), (torch_write, 1)]",
    "torch-first": "[(torch_write, 0), (jax_write, 0), (jax_write, 1), (torch_write, 1)]",
}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("order", ORDERS)
def test_import_order(platform, order):
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    script = _ORDER_SCRIPT.format(platform=platform, steps=ORDERS[order])
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK")
