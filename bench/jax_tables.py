"""JAX tables: ``fp8kv_jax.write_kv`` against a jitted XLA scatter, and dequantize rows.

They run after every torch table: importing jax_triton 0.3.1 sets ``TRITON_CACHE_DIR`` to "", which
breaks later torch-side Triton launches in the same process ; the variable is restored
around the import and around the whole JAX phase anyway.
"""
from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from unittest import mock

import triton

from .common import Config
from .dequant import dequant_bytes
from .results import Table, tokens_case
from .write_torch import HEAD_DIM, HEADS, PAGE_SIZE, SCALE


def load_jax(cuda: bool):
    """Import jax and fp8kv_jax for this run.

    Returns
    -------
    (jax, fp8kv_jax) or None, and the reason they cannot be used (None when they can).
    """
    # JAX would otherwise take 75 % of the GPU's memory at start; read at jax's import only.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    with mock.patch.dict(os.environ):
        try:
            import jax
            # Import jax_triton here, inside patch.dict, so that no later lazy import of it (by
            # fp8kv_jax) clears the variable again.
            with contextlib.suppress(Exception):
                import jax_triton  # noqa: F401
            import fp8kv_jax
        except Exception as e:  # a missing or broken install is a skip, not a failure of the run
            return None, f"skipped: cannot import jax / fp8kv_jax ({type(e).__name__}: {e})"
    if not hasattr(fp8kv_jax, "write_kv"):
        return None, "skipped: fp8kv_jax has no write_kv (the JAX frontend is not there yet)"
    platform = jax.devices()[0].platform
    if cuda and platform != "gpu":
        return None, f"skipped: JAX has no GPU (its default device is {platform})"
    return (jax, fp8kv_jax), None


def xla_write(key, value, key_cache, value_cache, slots, key_scale, value_scale):
    """The XLA baseline: quantize with jnp (upcast, divide, clip, cast), then ``.at[].set``."""
    import jax.numpy as jnp

    page_size = key_cache.shape[1]
    page, offset = slots // page_size, slots % page_size

    def quantize(x, scale):
        # Clip first: jnp's cast gives NaN above 464 (docs/SPEC.md).
        return jnp.clip(x.astype(jnp.float32) / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)

    return (key_cache.at[page, offset].set(quantize(key, key_scale)),
            value_cache.at[page, offset].set(quantize(value, value_scale)))


def _write_loop(write, n, key, value, key_cache, value_cache, slots, key_scale, value_scale):
    """``n`` writes in one ``lax.fori_loop`` with the caches as the carry."""
    from jax import lax

    def body(_, caches):
        # Tie the loop-invariant inputs to the carry: XLA could otherwise hoist the baseline's
        # quantization out of the loop and time a bare scatter.
        caches, k, v, s, ks, vs = lax.optimization_barrier(
            (caches, key, value, slots, key_scale, value_scale))
        return tuple(write(k, v, *caches, s, ks, vs))

    return lax.fori_loop(0, n, body, (key_cache, value_cache))


def _dequant_loop(dequant, n, key_cache, value_cache, table, key_scale, value_scale, outs):
    """``n`` dequantizations in one ``lax.fori_loop`` with the outputs as the carry."""
    from jax import lax

    def body(_, outs):
        # As in _write_loop: without the carry in the barrier the body is loop-invariant.
        _, kc, vc, t, ks, vs = lax.optimization_barrier(
            (outs, key_cache, value_cache, table, key_scale, value_scale))
        return tuple(dequant(kc, vc, t, ks, vs))

    return lax.fori_loop(0, n, body, tuple(outs))


def _median_us(jax, step, state, calls: int, warmup: int = 2):
    """Median wall time of ``state = step(state)`` up to ``block_until_ready``, and the last state.

    The state is fed back because the jitted functions donate it (the caches).
    """
    for _ in range(warmup):
        state = jax.block_until_ready(step(state))
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        state = jax.block_until_ready(step(state))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6, state


def _pipelined_us(jax, step, state, calls: int):
    """Wall time per call of ``calls`` back-to-back ``state = step(state)``, blocking once.

    A serving loop does not wait for each cache write: dispatch of the next call overlaps the
    GPU work of this one, so the cost per call is the larger of the two, not their sum.
    """
    state = jax.block_until_ready(step(state))
    start = time.perf_counter()
    for _ in range(calls):
        state = step(state)
    state = jax.block_until_ready(state)
    return (time.perf_counter() - start) / calls * 1e6, state


def _bytes_equal(jax, a, b) -> bool:
    u8 = jax.numpy.uint8
    return bool((jax.lax.bitcast_convert_type(a, u8) == jax.lax.bitcast_convert_type(b, u8)).all())


def table_write_jax(jax, fp8kv_jax, cfg: Config, copy_gbps: float, cuda: bool) -> Table:
    """Table 3: fp8kv_jax.write_kv vs an XLA scatter, per jitted call and inside a jitted loop."""
    import jax.numpy as jnp

    table = Table(
        "write_jax", "Write K/V into the FP8 paged cache (JAX)",
        f"jax {jax.__version__}. {HEADS} kv heads x {HEAD_DIM} dims, page {PAGE_SIZE}, "
        "bf16 -> e4m3, device scale, int32 "
        "random slots, caches donated. `fp8kv-jax`: `jax.jit(fp8kv_jax.write_kv)`. `xla-scatter`: "
        "jitted `x.astype(f32) / s`, clip, cast, `cache.at[page, off].set(q)`. Modes: `call` = "
        "wall time of one jitted call to `block_until_ready` (dispatch included); "
        "`call-pipelined` = back-to-back calls, one `block_until_ready` at the end (dispatch "
        "overlaps the previous call's GPU work, as in a serving loop); `loop` = one "
        f"jitted `lax.fori_loop` of {cfg.jax_loop} writes, divided by {cfg.jax_loop}.",
        xlabel="tokens written per call")
    row = HEADS * HEAD_DIM
    mismatched = []
    for tokens in cfg.jax_tokens:
        name = tokens_case(tokens)
        num_pages = max(triton.cdiv(tokens, PAGE_SIZE) + 16,
                        triton.cdiv(cfg.min_cache_bytes, 2 * PAGE_SIZE * row))
        rk, rv, rs = jax.random.split(jax.random.key(tokens), 3)
        key = jax.random.normal(rk, (tokens, HEADS, HEAD_DIM), jnp.bfloat16)
        value = jax.random.normal(rv, (tokens, HEADS, HEAD_DIM), jnp.bfloat16)
        slots = jax.random.permutation(rs, num_pages * PAGE_SIZE)[:tokens].astype(jnp.int32)
        scale = jnp.asarray(SCALE, jnp.float32)
        nbytes = tokens * row * (2 * 2 + 2) + tokens * 4

        def fresh_caches():
            shape = (num_pages, PAGE_SIZE, HEADS, HEAD_DIM)
            return jnp.zeros(shape, jnp.float8_e4m3fn), jnp.zeros(shape, jnp.float8_e4m3fn)

        written = []
        for provider, write in (("fp8kv-jax", fp8kv_jax.write_kv), ("xla-scatter", xla_write)):
            try:
                call = jax.jit(write, donate_argnums=(2, 3))
                loop = jax.jit(functools.partial(_write_loop, write, cfg.jax_loop),
                               donate_argnums=(2, 3))
                written.append(jax.block_until_ready(
                    tuple(call(key, value, *fresh_caches(), slots, scale, scale))))
                us, caches = _median_us(
                    jax, lambda c: tuple(call(key, value, *c, slots, scale, scale)),
                    fresh_caches(), cfg.jax_calls)
                table.add(name, tokens, provider, "call", us, nbytes)
                us, caches = _pipelined_us(
                    jax, lambda c: tuple(call(key, value, *c, slots, scale, scale)), caches,
                    cfg.jax_calls)
                table.add(name, tokens, provider, "call-pipelined", us, nbytes)
                us, caches = _median_us(
                    jax, lambda c: loop(key, value, *c, slots, scale, scale), caches,
                    max(3, cfg.jax_calls // 5))
                table.add(name, tokens, provider, "loop", us / cfg.jax_loop, nbytes)
                del caches
            except Exception as e:  # report and go on: the other provider and sizes still count
                table.note(f"{provider} at {tokens} tokens failed: {type(e).__name__}: {e}")
        if len(written) == 2 and not all(_bytes_equal(jax, a, b) for a, b in zip(*written)):
            mismatched.append(tokens)
        del written
        if cuda:
            table.add_roofline(name, tokens, nbytes, copy_gbps)
    if mismatched:
        table.note(f"fp8kv-jax and xla-scatter wrote DIFFERENT cache bytes at {mismatched} tokens")
    return table


def add_dequant_rows(jax, fp8kv_jax, cfg: Config, table: Table) -> None:
    """Add ``fp8kv-jax`` rows (jitted call, and per call inside a fori_loop) to the dequant table."""
    import jax.numpy as jnp

    shape = (cfg.dequant_cache_pages, PAGE_SIZE, HEADS, HEAD_DIM)
    rk, rv, rt = jax.random.split(jax.random.key(1), 3)
    key_cache = jax.random.normal(rk, shape, jnp.bfloat16).astype(jnp.float8_e4m3fn)
    value_cache = jax.random.normal(rv, shape, jnp.bfloat16).astype(jnp.float8_e4m3fn)
    key_scale = jnp.asarray(SCALE, jnp.float32)
    value_scale = jnp.asarray(2 * SCALE, jnp.float32)
    call = jax.jit(fp8kv_jax.dequantize_pages)
    loop = jax.jit(functools.partial(_dequant_loop, fp8kv_jax.dequantize_pages, cfg.jax_loop),
                   donate_argnums=(5,))
    for batch, pages_per_seq, name in cfg.dequant_shapes:
        entries = batch * pages_per_seq
        block_table = (jax.random.permutation(rt, shape[0])[:entries].astype(jnp.int32)
                       .reshape(batch, pages_per_seq))
        nbytes = dequant_bytes(entries)
        args = (key_cache, value_cache, block_table, key_scale, value_scale)
        try:
            us, outs = _median_us(jax, lambda _: tuple(call(*args)), None, cfg.jax_calls)
            table.add(name, entries, "fp8kv-jax", "call", us, nbytes)
            us, outs = _median_us(jax, lambda o: loop(*args, o), outs, max(3, cfg.jax_calls // 5))
            table.add(name, entries, "fp8kv-jax", "loop", us / cfg.jax_loop, nbytes)
            del outs
        except Exception as e:
            table.note(f"fp8kv-jax dequantize at {name} failed: {type(e).__name__}: {e}")
