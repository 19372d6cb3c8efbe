"""``fp8kv_jax.paged_attention`` (docs/SPEC.md section 16): the jnp path and the GPU launch code
(through the interpreter stand-ins of tests/jax_glue.py) against the fp64 reference within the
bound; under ``jax.jit`` with traced lengths and a traced layer (``lax.scan``); caches sharded
over kv heads on host devices; on the GPU, torch's bytes and no copy of a cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fp8kv_jax  # noqa: E402
from tests import jax_glue  # noqa: E402
from tests.attention_cases import (NOTHING_TO_READ, RANDOM_CASES, AttentionCase,  # noqa: E402
                                   build, gpu_infos, nothing_to_read)
from tests.helpers import jnp_where_jax_runs_on_the_cpu  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
JNP = jnp_where_jax_runs_on_the_cpu()


def on_jnp(test):
    """Marked jnp where JAX's default device is the CPU (tests/conftest.py)."""
    for mark in JNP:
        test = mark(test)
    return test

CASES = [
    AttentionCase(),
    AttentionCase(cache="e5m2", scale="tensor", seq_lens=(9, 0, 17), num_heads=4,
                  num_kv_heads=4, head_dim=32, page_size=4),
    AttentionCase(cache="bfloat16", seq_lens=(20, 33), num_heads=4, head_dim=32),
    AttentionCase(cache="float16", query_dtype="float16", seq_lens=(3,), num_heads=4,
                  num_kv_heads=1, head_dim=32, page_size=1, rank=3),
    AttentionCase(scale="head", layout="HND", seq_lens=(18, 40), head_dim=32, page_size=8),
    AttentionCase(scale="token_head", seq_lens=(25, 2), head_dim=32, page_size=8),
    AttentionCase(scale="token", seq_lens=(25,), head_dim=32, page_size=8, num_heads=4),
    AttentionCase(scale="inline", seq_lens=(12, 30), head_dim=32, page_size=8),
    AttentionCase(cache="nvfp4", seq_lens=(21, 40), head_dim=32, page_size=8),
    AttentionCase(combined=True, seq_lens=(21, 9), head_dim=32, page_size=8),
    AttentionCase(layers=3, layer=1, seq_lens=(21, 9), head_dim=32, page_size=8),
    AttentionCase(query_lens=(3, 1), seq_lens=(30, 7), head_dim=32, page_size=4, window=6,
                  num_heads=4, num_kv_heads=1),
    AttentionCase(soft_cap=4.0, sinks=True, seq_lens=(30, 0), head_dim=32, page_size=4),
    AttentionCase(head_dim=80, seq_lens=(30,), page_size=16, num_heads=2, num_kv_heads=2),
    AttentionCase(cache="mxfp8", seq_lens=(21, 9), head_dim=64, page_size=8, layout="HND"),
]
# What the launch code must get right: scales on the device, a split call (merge kernel),
# nvfp4's block scales, a combined cache, a host layer made a device scalar.
GPU_PATH_CASES = [CASES[0], CASES[5], CASES[8], CASES[9], CASES[10]]
GPU_PATH_CASES += [CASES[-1]]   # mxfp8's block scales and fp32 operands


def attend(call: dict, fn=None, **kw):
    call = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in call.items()}
    if "kv_cache" in call:
        return fp8kv_jax.paged_attention_combined(call.pop("query"), call.pop("kv_cache"),
                                                  call.pop("block_table"), call.pop("seq_lens"),
                                                  **call, **kw)
    return fp8kv_jax.paged_attention(call.pop("query"), call.pop("key_cache"),
                                     call.pop("value_cache"), call.pop("block_table"),
                                     call.pop("seq_lens"), **call, **kw)


def within_bound(out, c):
    got = np.asarray(out.astype(jnp.float32))
    err = np.abs(got - c["ref"])
    bad = np.argwhere(~(err <= c["bound"]))
    assert not bad.size, (f"{len(bad)} elements outside the bound, first {tuple(bad[0])}: "
                          f"{got[tuple(bad[0])]} vs {c['ref'][tuple(bad[0])]}")


@on_jnp
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_the_reference_within_the_bound(case):
    c = build(case)
    within_bound(attend(c["call"]), c)


@on_jnp
@pytest.mark.parametrize("case", RANDOM_CASES, ids=lambda c: c.id)
def test_random_configurations(case):
    """The random configurations (tests/attention_cases.py) on JAX's default device: the jnp
    path on the CPU, the kernels through jax-triton on a GPU."""
    c = build(case)
    within_bound(attend(c["call"]), c)


@pytest.mark.parametrize("case", GPU_PATH_CASES, ids=lambda c: c.id)
def test_gpu_launch_code_through_the_interpreter(case, monkeypatch):
    jax_glue.use_interpreted_gpu_path(monkeypatch)
    c = build(case)
    within_bound(attend(c["call"]), c)


@pytest.mark.parametrize("path", [pytest.param("default_device", marks=JNP),
                                  "gpu_launch_code"])
@pytest.mark.parametrize("kind", NOTHING_TO_READ)
def test_a_call_that_reads_no_token_gives_zeros(kind, path, monkeypatch):
    """As torch's test of the same name: zeros of the output's shape, the caches unread (the
    default device: the jnp path on the CPU, the kernels on a GPU)."""
    if path == "gpu_launch_code":
        jax_glue.use_interpreted_gpu_path(monkeypatch)
    call = nothing_to_read(kind)
    out = attend(call)
    assert out.shape == call["query"].shape and out.dtype == jnp.bfloat16
    assert not np.asarray(out != 0).any()


def test_gpu_path_never_hands_attention_to_xla_triton_call(monkeypatch):
    """Even where XLA's Triton call is forced on, attention runs through jax-triton (the
    bytes and the speed of torch's kernels: bench/NOTES.md)."""
    import fp8kv_jax._xla_triton

    jax_glue.use_interpreted_gpu_path(monkeypatch)
    monkeypatch.setenv("FP8KV_JAX_XLA_TRITON", "1")

    def refuse(*args, **kwargs):
        raise AssertionError("attention reached XLA's Triton call")
    monkeypatch.setattr(fp8kv_jax._xla_triton, "launch", refuse)
    c = build(CASES[0])
    within_bound(attend(c["call"]), c)


@on_jnp
def test_under_jit_lengths_and_tables_are_traced():
    c = build(AttentionCase(seq_lens=(40, 7), head_dim=32, page_size=8))
    call = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in c["call"].items()}
    step = jax.jit(lambda q, k, v, t, n: fp8kv_jax.paged_attention(
        q, k, v, t, n, key_scale=call["key_scale"], value_scale=call["value_scale"]))
    within_bound(step(call["query"], call["key_cache"], call["value_cache"],
                      call["block_table"], call["seq_lens"]), c)
    # The same compiled step with other lengths (the same pages hold their first tokens).
    from fp8kv.attention import error_bound, paged_attention as reference

    shorter = np.array([3, 1], np.int32)
    ref, vmax, mass = reference(**{**c["call"], "seq_lens": shorter})
    out = step(call["query"], call["key_cache"], call["value_cache"], call["block_table"],
               jnp.asarray(shorter))
    within_bound(out, dict(ref=ref, bound=error_bound(ref, vmax, mass, 32)))


@on_jnp
def test_a_traced_layer_under_lax_scan():
    """One compiled step serves every layer of a stack (the layer is a scan index)."""
    layers = 3
    built = [build(AttentionCase(layers=layers, layer=i, seq_lens=(21, 9), head_dim=32,
                                 page_size=8, seed=5)) for i in range(layers)]
    # Same seed: the same stack bytes, layer i holding case i's caches.
    stack = {n: np.stack([b["call"][n][i] for i, b in enumerate(built)])
             for n in ("key_cache", "value_cache")}
    base = built[0]["call"]

    def body(carry, layer):
        out = fp8kv_jax.paged_attention(base["query"], carry[0], carry[1], base["block_table"],
                                        base["seq_lens"], base["key_scale"],
                                        base["value_scale"], layer=layer)
        return carry, out

    _, outs = jax.jit(lambda k, v: jax.lax.scan(body, (k, v), jnp.arange(layers)))(
        jnp.asarray(stack["key_cache"]), jnp.asarray(stack["value_cache"]))
    for i, b in enumerate(built):
        within_bound(outs[i], b)


# ---------------------------------------------------------------------------------------------
# Caches sharded over kv heads on 4 host devices: each device its heads, no cache gathered.

def sharded_scenario() -> str:
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    results = []
    for case in (AttentionCase(num_heads=8, num_kv_heads=4, seq_lens=(21, 9), head_dim=32,
                               page_size=8, scale="head", sinks=True),
                 AttentionCase(num_heads=8, num_kv_heads=4, seq_lens=(21, 9), head_dim=32,
                               page_size=8, scale="token_head", combined=True)):
        c = build(case)
        call = c["call"]
        cache_name = "kv_cache" if case.combined else "key_cache"
        specs = {"key_cache": P(None, None, "x", None), "value_cache": P(None, None, "x", None),
                 "kv_cache": P(None, None, None, "x", None), "key_scale": P("x"),
                 "value_scale": P("x"), "key_scale_cache": P(None, None, "x"),
                 "value_scale_cache": P(None, None, "x"), "query": P(None, "x", None),
                 "sinks": P("x")}
        arrays = {n: jax.device_put(jnp.asarray(a), NamedSharding(mesh, specs.get(n, P())))
                  for n, a in call.items() if isinstance(a, np.ndarray)}
        hosts = {n: a for n, a in call.items() if not isinstance(a, np.ndarray)}
        step = jax.jit(lambda arrays: attend({**arrays, **hosts}))
        hlo = step.lower(arrays).compile().as_text()
        cache_shape = ",".join(map(str, call[cache_name].shape))
        gathers = [ln for ln in hlo.splitlines() if "all-gather" in ln and cache_shape in ln]
        assert not gathers, gathers[:2]
        got = step(arrays)
        assert len(got.sharding.device_set) == 4
        one = attend({n: jax.device_put(jnp.asarray(a), jax.devices()[0])
                      if isinstance(a, np.ndarray) else a for n, a in call.items()})
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                      np.asarray(one).view(np.uint16))
        within_bound(got, c)
        results.append("OK")
    return " ".join(results)


@pytest.mark.jnp   # XLA:CPU devices: the jnp path (in its own process)
def test_sharded_over_kv_heads_on_four_cpu_devices():
    code = "from tests.test_attention_jax import sharded_scenario; print(sharded_scenario())"
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p),
                                   XLA_FLAGS="--xla_force_host_platform_device_count=4",
                                   JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["OK", "OK"], proc.stdout


# ---------------------------------------------------------------------------------------------
# The GPU: torch's bytes, and the caches read where they are.

def _gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs JAX on an NVIDIA GPU (runs in the GPU suite)")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gpu_gives_torch_bytes(case):
    torch = pytest.importorskip("torch")
    from tests.helpers import to_torch
    from tests.test_attention import attend as torch_attend

    c = build(case)
    got = np.asarray(attend(c["call"]))
    want = torch_attend({k: to_torch(v, "cuda") if isinstance(v, np.ndarray) else v
                         for k, v in c["call"].items()})
    np.testing.assert_array_equal(got.view(np.uint16),
                                  want.view(torch.int16).cpu().numpy().view(np.uint16))
    within_bound(jnp.asarray(got), c)


# Llama-3-8B decode layers (32 / 8 heads, head_dim 128): tens of thousands of output elements,
# where a compile that rounds any step differently from torch's shows (small cases may not).
SCALE_CASES = [
    AttentionCase(num_heads=32, num_kv_heads=8, head_dim=128, seq_lens=(1000,) * 16),
    AttentionCase(num_heads=32, num_kv_heads=8, head_dim=128, seq_lens=(4000, 3333)),   # split
    AttentionCase(cache="nvfp4", scale="token_head", num_heads=32, num_kv_heads=8,
                  head_dim=128, seq_lens=(1000,) * 8),
    AttentionCase(scale="token_head", num_heads=32, num_kv_heads=8, head_dim=128,
                  seq_lens=(777,) * 12),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs JAX on an NVIDIA GPU (runs in the GPU suite)")
@pytest.mark.parametrize("case", SCALE_CASES, ids=lambda c: c.id)
def test_gpu_gives_torch_bytes_at_decode_scale(case):
    test_gpu_gives_torch_bytes(case)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs JAX on an NVIDIA GPU (runs in the GPU suite)")
def test_gpu_under_jit_the_caches_are_not_copied():
    c = build(AttentionCase(seq_lens=(40, 7), head_dim=64, page_size=16))
    call = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in c["call"].items()}
    step = jax.jit(lambda arrays: attend({**arrays, "key_scale": call["key_scale"],
                                          "value_scale": call["value_scale"]}))
    arrays = {k: v for k, v in call.items() if isinstance(v, jax.Array)}
    hlo = step.lower(arrays).compile().as_text()
    shape = ",".join(map(str, call["key_cache"].shape))
    copies = [ln for ln in hlo.splitlines() if "copy" in ln.split("=")[-1][:40] and shape in ln]
    assert not copies, copies[:2]
    within_bound(step(arrays), c)


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(query=c["query"][:, :3]), "query: expected num_heads a multiple of"),
    (lambda c: c.update(block_table=c["block_table"].astype(np.float32)),
     "block_table: expected dtype int32"),
    (lambda c: c.update(sinks=np.zeros(3, np.float32)), r"sinks: expected shape \[8\]"),
], ids=["heads", "table-dtype", "sinks-shape"])
@on_jnp
def test_bad_inputs_raise_torch_messages(change, match):
    c = build(AttentionCase(seq_lens=(20, 9), head_dim=32, page_size=8))
    call = dict(c["call"])
    change(call)
    with pytest.raises((ValueError, TypeError), match=match):
        attend(call)


BALANCED_CASE = AttentionCase(seq_lens=(700, 3, 0, 40, 1), head_dim=32, page_size=16,
                              num_heads=4, num_kv_heads=2)


@contextlib.contextmanager
def _schedule(balance_seqs: int = 64):
    """The CUDA plan's ``balance_seqs`` set (64: the balanced schedule of SPEC 16.2 forced on;
    0: every sequence split alike), every plan and jitted launch made under it forgotten
    afterwards."""
    from fp8kv.attention import ATTENTION_SIZES, plan_attention
    from fp8kv.plan import CUDA
    from fp8kv_jax import _triton

    saved = ATTENTION_SIZES[CUDA]["balance_seqs"]
    ATTENTION_SIZES[CUDA]["balance_seqs"] = balance_seqs
    plan_attention.cache_clear()
    _triton._paged_attention.clear_cache()
    try:
        yield
    finally:
        ATTENTION_SIZES[CUDA]["balance_seqs"] = saved
        plan_attention.cache_clear()
        _triton._paged_attention.clear_cache()


@pytest.mark.parametrize("cache", ["e4m3", "nvfp4"])
@pytest.mark.parametrize("balance_seqs", [64, 0], ids=["balanced", "split-alike"])
def test_split_shares_through_the_gpu_launch_code(balance_seqs, cache, monkeypatch):
    """Both schedules of a split call through JAX's GPU launch code: balanced, the rows of one
    share that the attention grid writes stay through the merge (its output aliased to the
    grid's) and the split rows are merged; split alike, the merge finds every row's partials
    by the row's index (no index workspace)."""
    from fp8kv.attention import check_attention, plan_attention
    from fp8kv.plan import CUDA

    jax_glue.use_interpreted_gpu_path(monkeypatch)
    c = build(dataclasses.replace(BALANCED_CASE, cache=cache))
    with _schedule(balance_seqs):
        plan = plan_attention(check_attention(**gpu_infos(c["call"])), CUDA)
        assert plan.merge is not None and plan.balanced == (balance_seqs > 0)
        within_bound(attend(c["call"]), c)


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs JAX on an NVIDIA GPU (runs in the GPU suite)")
def test_gpu_balanced_shares_give_torch_bytes():
    from fp8kv_torch import _attention
    with _schedule():
        _attention.clear()
        try:
            test_gpu_gives_torch_bytes(dataclasses.replace(
                BALANCED_CASE, seq_lens=(6000, 3, 0, 400, 1, 2000), head_dim=128, num_heads=32,
                num_kv_heads=8))
        finally:
            _attention.clear()
