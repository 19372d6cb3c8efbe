"""Sharded caches under plain ``jax.jit`` (docs/SPEC.md section 15): the partitioning rule.

Each scenario runs in a fresh process with 4 forced host devices (XLA:CPU): caches placed with a
``NamedSharding``, one jitted call with the caches donated; the results keep the caches'
sharding, equal a one-device run byte for byte, and the compiled HLO gathers nothing (no
``all-gather`` at all: the small inputs are replicated here). Shardings the rule cannot split
raise, naming ``jax.shard_map``. The 2-GPU variant runs the same scenarios where 2 GPUs are seen.
Every op of the op table (:mod:`fp8kv.optable`) has a scenario with caches sharded over kv heads,
and every one of its calls reaches its partitioning rule.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

REPO = Path(__file__).resolve().parents[1]

# name: (function, cache layout, mesh axes, how the cache is sharded (one entry per cache dim),
# stacked, dynamic scales, error expected or None). A rope call also returns its rotated key.
SCENARIOS = {
    "write-NHD-heads": ("write", "NHD", ("x",), (None, None, "x", None), False, None, None),
    # Outside jax.jit: concrete sharded arrays go through the same rule.
    "eager-write-NHD-heads": ("write", "NHD", ("x",), (None, None, "x", None), False, None,
                              None),
    "write-HND-heads-per-head-scale": ("write", "HND", ("x",), (None, "x", None, None), False,
                                       None, None),
    "write-3D-heads": ("write", "3D", ("x",), (None, "x", None), False, None, None),
    "write-NHD-pages-and-heads": ("write", "NHD", ("p", "h"), ("p", None, "h", None), False,
                                  None, None),
    "write-3D-slots": ("write", "3D", ("x",), ("x", None, None), False, None, None),
    "write-combined-heads": ("write", "combined", ("x",), (None, None, None, "x", None), False,
                             None, None),
    "write-stacked-layers-and-heads": ("write", "NHD", ("l", "h"), ("l", None, None, "h", None),
                                       True, None, None),
    "write-stacked-pages": ("write", "HND", ("x",), (None, "x", None, None, None), True, None,
                            None),
    "write-dynamic-token-head-heads": ("write", "NHD", ("x",), (None, None, "x", None), False,
                                       "token_head", None),
    "write-dynamic-token-pages": ("write", "NHD", ("x",), ("x", None, None, None), False,
                                  "token", None),
    "dequantize-NHD-heads": ("dequantize", "NHD", ("x",), (None, None, "x", None), False, None,
                             None),
    "dequantize-stacked-heads": ("dequantize", "HND", ("x",), (None, None, "x", None, None),
                                 True, None, None),
    "dequantize-combined-heads": ("dequantize", "combined", ("x",),
                                  (None, None, None, "x", None), False, None, None),
    "rope-NHD-heads": ("rope", "NHD", ("x",), (None, None, "x", None), False, None, None),
    "rope-combined-heads": ("rope", "combined", ("x",), (None, None, None, "x", None), False, None,
                            None),
    "rope-HND-pages-and-heads": ("rope", "HND", ("p", "h"), ("p", "h", None, None), False, None,
                                 None),
    "rope-3D-slots": ("rope", "3D", ("x",), ("x", None, None), False, None, None),
    "rope-dynamic-token-head-heads": ("rope", "NHD", ("x",), (None, None, "x", None), False,
                                      "token_head", None),
    "attention-NHD-heads": ("attention", "NHD", ("x",), (None, None, "x", None), False, None,
                            None),
    "attention-combined-heads": ("attention", "combined", ("x",), (None, None, None, "x", None),
                                 False, None, None),
    "attention-dynamic-token-head-HND-heads": ("attention", "HND", ("x",),
                                               (None, "x", None, None), False, "token_head",
                                               None),
    "error-attention-pages": ("attention", "NHD", ("x",), ("x", None, None, None), False, None,
                              "sharded over its pages dimension"),
    "error-write-head-dim": ("write", "NHD", ("x",), (None, None, None, "x"), False, None,
                             "sharded over its head_dim dimension"),
    "error-write-page-size": ("write", "NHD", ("x",), (None, "x", None, None), False, None,
                              "sharded over its page_size dimension"),
    "error-dynamic-token-heads": ("write", "NHD", ("x",), (None, None, "x", None), False,
                                  "token", "per-token dynamic scales need every kv head"),
    "error-dequantize-pages": ("dequantize", "NHD", ("x",), ("x", None, None, None), False, None,
                               "sharded over its pages dimension"),
    "error-rope-page-size": ("rope", "HND", ("x",), (None, None, "x", None), False, None,
                             "sharded over its page_size dimension"),
    "error-rope-dynamic-token-heads": ("rope", "NHD", ("x",), (None, None, "x", None), False,
                                       "token", "per-token dynamic scales need every kv head"),
    "error-dequantize-layers": ("dequantize", "NHD", ("x",), ("x", None, None, None, None), True,
                                None, "sharded over its layer dimension"),
}

LAYERS, PAGES, PAGE, HEADS, DIM, TOKENS, POSITIONS = 4, 8, 4, 4, 16, 6, 10
CACHES = ("key_cache", "value_cache", "kv_cache")
FUNCTIONS = {"write": "write_kv", "dequantize": "dequantize_pages", "rope": "rope_write_kv",
             "attention": "paged_attention"}


def op_of(name: str) -> str:
    """The op (its name in the op table) that scenario ``name`` calls."""
    function, layout, *_ = SCENARIOS[name]
    return FUNCTIONS[function] + ("_combined" if layout == "combined" else "")


def _inputs(name: str):
    """NumPy arguments of a scenario's call (and the cache's name)."""
    from tests.cases import random_values

    op, layout, _, _, stacked, dynamic, _ = SCENARIOS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    shape = {"NHD": (PAGES, PAGE, HEADS, DIM), "HND": (PAGES, HEADS, PAGE, DIM),
             "3D": (PAGES * PAGE, HEADS, DIM), "combined": (PAGES, 2, PAGE, HEADS, DIM)}[layout]
    shape = ((LAYERS,) if stacked else ()) + shape
    # (attention reads the codes as values: no NaN codes there)
    caches = [rng.integers(0, 0x70 if op == "attention" else 256, shape, dtype=np.uint8)
              for _ in range(2)]
    args = ({"kv_cache": caches[0]} if layout == "combined"
            else {"key_cache": caches[0], "value_cache": caches[1]})
    if op in ("write", "rope"):
        num_slots = PAGES * PAGE
        slots = rng.permutation(num_slots)[:TOKENS].astype(np.int32)
        slots[1] = -1
        slots[2] = num_slots + 3   # out of range everywhere
        args.update(key=random_values(rng, (TOKENS, HEADS, DIM), "bfloat16"),
                    value=random_values(rng, (TOKENS, HEADS, DIM), "bfloat16"), slots=slots)
    if op == "rope":   # 2 query heads per kv head; one position past the cos/sin cache
        positions = rng.integers(0, POSITIONS, TOKENS).astype(np.int32)
        positions[3] = POSITIONS
        args.update(query=random_values(rng, (TOKENS, 2 * HEADS, DIM), "bfloat16"),
                    positions=positions,
                    cos_sin_cache=rng.uniform(-1, 1, (POSITIONS, DIM)).astype(np.float32))
    elif op == "dequantize":
        args["block_table"] = np.array([[0, 7, -1], [3, 9, 5]], np.int32)
    elif op == "attention":   # decode: one token per sequence, 2 query heads per kv head
        args.update(block_table=np.array([[0, 7, 1], [3, 6, 5]], np.int32),
                    seq_lens=np.array([6, 3 * PAGE], np.int32),
                    query=random_values(rng, (2, 2 * HEADS, DIM), "bfloat16"))
    if dynamic:
        sshape = {"token_head": shape[:-1], "token": shape[:-2] if layout == "NHD" else None}
        args.update(key_scale_cache=rng.standard_normal(sshape[dynamic]).astype(np.float32),
                    value_scale_cache=rng.standard_normal(sshape[dynamic]).astype(np.float32))
    else:
        args.update(key_scale=(rng.random(HEADS) + 0.5).astype(np.float32), value_scale=0.75)
    return args


def _call(name: str, arrays: dict):
    import fp8kv_jax

    op, layout, *_ = SCENARIOS[name]
    stacked = SCENARIOS[name][4]
    kw = dict(layout="HND" if layout == "HND" else "NHD")
    kw["cache_format" if op == "attention" else "fp8_format"] = "e4m3"
    if stacked:
        kw["layer"] = 2 if op == "write" else arrays.pop("layer")
    if op == "rope":
        kw["return_key"] = True
    out = getattr(fp8kv_jax, op_of(name))(**arrays, **kw)
    return out if isinstance(out, tuple) else (out,)


def scenario(name: str, count: int = 4) -> str:
    """Run one scenario in this process on its first ``count`` (4 or 2) devices; returns "OK"
    or raises."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.cases import as_uint

    op, layout, axes, cache_spec, stacked, dynamic, error = SCENARIOS[name]
    devices = np.array(jax.devices()[:count])
    mesh = Mesh(devices.reshape((2, count // 2) if len(axes) == 2 else (count,)), axes)
    args = _inputs(name)
    if stacked and op == "dequantize":
        args["layer"] = np.array(1, np.int32)   # a traced layer (a replicated array)
    sharded = {}
    for n, a in args.items():
        if not isinstance(a, np.ndarray):
            continue
        # A cache, and its side scale arrays (the cache's spec without the trailing dimensions
        # they lack); everything else replicated.
        spec = P(*cache_spec[:a.ndim]) if n in CACHES or n.endswith("_scale_cache") else P()
        sharded[n] = jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
    whole = {n: jax.device_put(jnp.asarray(a), jax.devices()[0]) if isinstance(a, np.ndarray)
             else a for n, a in args.items()}
    scalars = {n: a for n, a in args.items() if not isinstance(a, np.ndarray)}
    step = jax.jit(lambda arrays: _call(name, {**arrays, **scalars}), donate_argnums=(0,))
    if error:
        try:
            step.lower(sharded).compile()
        except Exception as e:   # noqa: BLE001 -- the message is what is checked
            message = str(e)
            assert error in message and "shard_map" in message, message
            return "OK"
        raise AssertionError(f"{name}: no error")
    if name.startswith("eager-"):
        got = _call(name, {**sharded, **scalars})
    else:
        hlo = step.lower(sharded).compile().as_text()
        gathers = [line.strip() for line in hlo.splitlines() if "all-gather" in line]
        assert not gathers, gathers[:3]
        got = step(sharded)   # donated
    want = _call(name, dict(whole))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(as_uint(np.asarray(g)), as_uint(np.asarray(w)))
        if op != "dequantize":
            assert len(g.sharding.device_set) == count, g.sharding
    return "OK"


def _run(names, count: int, **env) -> str:
    code = textwrap.dedent(f"""
        from tests.test_sharded_jit import scenario
        for name in {list(names)!r}:
            print(name, scenario(name, {count}))
        """)
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p),
                                   **env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.jnp   # XLA:CPU devices: the jnp path (in its own process: out of conftest's guard)
def test_sharded_calls_on_four_cpu_devices():
    out = _run(SCENARIOS, 4, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    assert out.split() == [w for n in SCENARIOS for w in (n, "OK")], out


def _gpus() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs JAX on 2 NVIDIA GPUs")
def test_sharded_calls_on_two_gpus():
    """The same scenarios on 2 GPUs: each GPU launches the kernels on its shards."""
    out = _run(SCENARIOS, 2)
    assert out.split() == [w for n in SCENARIOS for w in (n, "OK")], out


def _heads_scenario(op: str) -> str | None:
    """The scenario that calls ``op`` on caches sharded over kv heads, if any."""
    return next((n for n in SCENARIOS if op_of(n) == op and n.endswith("-heads")
                 and SCENARIOS[n][6] is None), None)


def test_every_op_has_a_scenario_sharded_over_kv_heads():
    """An op of the table without one fails here: each such scenario checks, on 4 devices, that
    the op's rule gathers no cache and gives the bytes of one device."""
    from fp8kv.optable import OPS

    assert [op for op in OPS if _heads_scenario(op) is None] == []


@pytest.mark.jnp
@pytest.mark.parametrize("op", ["write_kv", "write_kv_combined", "dequantize_pages",
                                "dequantize_pages_combined", "rope_write_kv",
                                "rope_write_kv_combined", "paged_attention",
                                "paged_attention_combined"])
def test_every_call_reaches_its_partitioning_rule(op):
    """Traced (as under ``jax.jit``), a call is one ``custom_partitioning`` call of its own op:
    one that skipped ``fp8kv_jax._shard.run`` (as ``rope_write_kv`` once did) would leave XLA
    nothing but gathering sharded caches."""
    import jax.numpy as jnp

    from fp8kv.optable import OPS

    assert op in OPS
    name = _heads_scenario(op)
    args = _inputs(name)
    arrays = {n: jnp.asarray(a) for n, a in args.items() if isinstance(a, np.ndarray)}
    scalars = {n: a for n, a in args.items() if not isinstance(a, np.ndarray)}
    jaxpr = jax.make_jaxpr(lambda arrays: _call(name, {**arrays, **scalars}))(arrays)
    rules = [e.params["static_args"][0].op for e in jaxpr.jaxpr.eqns
             if e.primitive.name == "custom_partitioning"]
    assert rules == [op]
