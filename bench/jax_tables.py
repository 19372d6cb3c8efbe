"""JAX tables: ``fp8kv_jax.write_kv`` against a jitted XLA scatter, and dequantize rows.

Tables: ``write_jax`` (per jitted call and inside a jitted ``fori_loop``), ``write_jax_calls``
(eager jitted calls, synced and pipelined, beside two floors: XLA's cheapest call and an empty
jax-triton kernel), ``write_jax_cache_<tokens>`` (the same calls with caches of growing size) and
``dequant_jax_calls`` (eager jitted dequantize against an XLA gather); the ``dequant`` table gets
fp8kv-jax rows. The eager-call tables time every provider (and size) of a table's row in the same
rounds. ``bench.jax_profile`` splits synced calls into phases.

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


def write_bytes(tokens: int) -> int:
    """A write's minimal traffic: K and V read (bf16), written (fp8), slots read."""
    return tokens * HEADS * HEAD_DIM * (2 * 2 + 2) + tokens * 4


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
        nbytes = write_bytes(tokens)

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
                table.fail(f"{provider} at {tokens} tokens: {type(e).__name__}: {e}")
        if len(written) == 2 and not all(_bytes_equal(jax, a, b) for a, b in zip(*written)):
            mismatched.append(tokens)
        del written
        if cuda:
            table.add_roofline(name, tokens, nbytes, copy_gbps)
    if mismatched:
        table.note(f"fp8kv-jax and xla-scatter wrote DIFFERENT cache bytes at {mismatched} tokens")
    return table


def add_dequant_rows(jax, fp8kv_jax, cfg: Config, table: Table) -> None:
    """Add ``fp8kv-jax`` rows (jitted call, and per call inside a fori_loop) to the dequant table,
    and a note that says what they are."""
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
            table.fail(f"fp8kv-jax dequantize at {name}: {type(e).__name__}: {e}")
    table.note("fp8kv-jax rows: `call` = wall time of one `jax.jit` call to `block_until_ready`; "
               f"`loop` = a jitted fori_loop of {cfg.jax_loop} calls / {cfg.jax_loop}.")


# ---------------------------------------------------------------------------------------------
# Eager-call tables: one jitted call at a time, as a serving loop makes them.

def _interleaved_us(jax, steps: dict, cfg: Config, synced: bool) -> dict:
    """Wall time per call of each provider's ``state = step(state)``, measured in alternation.

    ``steps``: provider -> ``[step, state]`` (the state is updated in place: the jitted functions
    donate it). ``cfg.eager_warmup`` untimed calls each, then ``cfg.eager_reps`` rounds, each
    timing ``cfg.eager_calls`` calls of every provider in turn (the order reversed every other
    round); per provider the median round divided by its calls. A host whose load changes
    between rounds then moves every provider alike: timed one after the other, two providers'
    numbers differed by up to 30 us from that alone (``bench/NOTES.md``, "Modes"). ``synced``:
    ``block_until_ready`` after every call (dispatch and device time add up); otherwise
    back-to-back calls and one ``block_until_ready`` at the end (dispatch of the next call
    overlaps this one's device work).
    """
    for entry in steps.values():
        for _ in range(cfg.eager_warmup):
            entry[1] = jax.block_until_ready(entry[0](entry[1]))
    samples = {name: [] for name in steps}
    order = list(steps)
    for round_ in range(cfg.eager_reps):
        for name in order if round_ % 2 == 0 else order[::-1]:
            step, state = steps[name]
            start = time.perf_counter()
            if synced:
                for _ in range(cfg.eager_calls):
                    state = jax.block_until_ready(step(state))
            else:
                for _ in range(cfg.eager_calls):
                    state = step(state)
                state = jax.block_until_ready(state)
            samples[name].append((time.perf_counter() - start) / cfg.eager_calls)
            steps[name][1] = state
    return {name: statistics.median(t) * 1e6 for name, t in samples.items()}


CALL_MODES = (("synced", True), ("pipelined", False))


def _calls_description(cfg: Config) -> str:
    return (f"Per call: {cfg.eager_warmup} warm-up calls, then {cfg.eager_reps} rounds, each "
            f"timing {cfg.eager_calls} calls of every provider in turn; the median round. "
            "`synced`: `block_until_ready` after every call; `pipelined`: back-to-back calls, "
            "one `block_until_ready` at the end. ")


def _add_call_rows(jax, table: Table, steps: dict, nbytes: int, cfg: Config) -> None:
    """Time ``steps`` (``(case, size, provider)`` -> ``[step, state]``) in both call modes, in
    alternation, and add their rows."""
    for mode, synced in CALL_MODES:
        try:
            for (case, size, provider), us in _interleaved_us(jax, steps, cfg, synced).items():
                table.add(case, size, provider, mode, us, 0 if provider in FLOORS else nbytes)
        except Exception as e:  # report and go on: the other cases still count
            cases = sorted({str(case) for case, _, _ in steps})
            table.fail(f"{mode} calls at {', '.join(cases)}: {type(e).__name__}: {e}")


FLOOR_XLA, FLOOR_TRITON = "floor: xla x+1", "floor: empty jax-triton"
FLOORS = (FLOOR_XLA, FLOOR_TRITON)   # rows without bytes


@triton.jit
def _empty_kernel(x_ptr, out_ptr):
    pass


def floor_steps(jax, cuda: bool) -> tuple[dict, str | None]:
    """The floors of a jitted call, as ``steps`` for :func:`_interleaved_us`: XLA's own
    ``x + 1`` on 16 floats and an empty jax-triton kernel (a custom call, as fp8kv's), each
    updating a donated 16-float buffer. Returns them and a note (why one is missing, or None)."""
    import jax.numpy as jnp

    steps = {FLOOR_XLA: [jax.jit(lambda x: x + 1, donate_argnums=(0,)),
                         jnp.zeros(16, jnp.float32)]}
    if not cuda:
        return steps, "The empty jax-triton kernel floor needs a GPU."
    try:
        from fp8kv_jax._triton import jax_triton

        def empty(x):
            return jax_triton().triton_call(
                x, kernel=_empty_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                grid=(1,), input_output_aliases={0: 0})

        steps[FLOOR_TRITON] = [jax.jit(empty, donate_argnums=(0,)), jnp.zeros(16, jnp.float32)]
    except Exception as e:
        return steps, f"No empty jax-triton kernel floor: {type(e).__name__}: {e}"
    return steps, None


def write_steps(jax, fp8kv_jax, table: Table, case: str, size: int, tokens: int,
                 num_pages: int) -> tuple[dict, bool | None]:
    """Both writers (jitted, caches donated) ready to time: ``(case, size, provider)`` ->
    ``[step, caches]``; and whether they wrote the same bytes at the slots (None when one of
    them failed)."""
    import jax.numpy as jnp

    rk, rv, rs = jax.random.split(jax.random.key(tokens), 3)
    key = jax.random.normal(rk, (tokens, HEADS, HEAD_DIM), jnp.bfloat16)
    value = jax.random.normal(rv, (tokens, HEADS, HEAD_DIM), jnp.bfloat16)
    slots = jax.random.permutation(rs, num_pages * PAGE_SIZE)[:tokens].astype(jnp.int32)
    scale = jnp.asarray(SCALE, jnp.float32)
    shape = (num_pages, PAGE_SIZE, HEADS, HEAD_DIM)
    written, steps = [], {}
    for provider, write in (("fp8kv-jax", fp8kv_jax.write_kv), ("xla-scatter", xla_write)):
        try:
            call = jax.jit(write, donate_argnums=(2, 3))
            caches = (jnp.zeros(shape, jnp.float8_e4m3fn), jnp.zeros(shape, jnp.float8_e4m3fn))
            caches = jax.block_until_ready(tuple(call(key, value, *caches, slots, scale, scale)))
            # Only the written rows are kept for the comparison: the caches may be GiBs.
            written.append([jax.lax.bitcast_convert_type(c.reshape(-1, HEADS, HEAD_DIM)[slots],
                                                         jnp.uint8) for c in caches])
            steps[case, size, provider] = [
                lambda c, call=call: tuple(call(key, value, *c, slots, scale, scale)), caches]
        except Exception as e:  # report and go on: the other provider and sizes still count
            table.fail(f"{provider} at {case}: {type(e).__name__}: {e}")
    if len(written) != 2:
        return steps, None
    return steps, all(bool((a == b).all()) for a, b in zip(*written))


def table_write_jax_calls(jax, fp8kv_jax, cfg: Config, copy_gbps: float, cuda: bool) -> Table:
    """Eager jitted write calls, synced and pipelined, at 1 ... 65,536 tokens."""
    pages = cfg.eager_cache_pages
    table = Table(
        "write_jax_calls", "Eager calls: write K/V from jax.jit (JAX)",
        f"jax {jax.__version__}. `fp8kv-jax`: `jax.jit(fp8kv_jax.write_kv, donate_argnums=(2, 3))`;"
        " `xla-scatter`: the same jit of `x.astype(f32) / s`, clip, cast, "
        f"`cache.at[page, off].set(q)`. Caches {pages} pages x {PAGE_SIZE} x {HEADS} heads x "
        f"{HEAD_DIM} e4m3 each, bf16 K/V, int32 random distinct slots, device scale. "
        f"Floors, timed in every row's rounds: `{FLOOR_XLA}` (a jitted, donated `x + 1` on 16 "
        f"floats: XLA's own cheapest call) and `{FLOOR_TRITON}` (the same through an empty "
        "jax-triton kernel: a custom call, as fp8kv's). "
        + _calls_description(cfg) + "Bytes: K and V read, fp8 written, slots read.",
        xlabel="tokens written per call")
    floors, floor_note = floor_steps(jax, cuda)
    if floor_note:
        table.note(floor_note)
    mismatched = []
    for tokens in cfg.jax_call_tokens:
        if tokens > pages * PAGE_SIZE:
            table.note(f"{tokens} tokens skipped: more than the cache's {pages * PAGE_SIZE} slots")
            continue
        case = tokens_case(tokens)
        steps, same = write_steps(jax, fp8kv_jax, table, case, tokens, tokens, pages)
        # The floors in every row, timed in the same rounds: the row's own reference.
        steps.update({(case, tokens, floor): step for floor, step in floors.items()})
        _add_call_rows(jax, table, steps, write_bytes(tokens), cfg)
        del steps
        if cuda:
            table.add_roofline(case, tokens, write_bytes(tokens), copy_gbps)
        if same is False:
            mismatched.append(tokens)
    if mismatched:
        table.note(f"fp8kv-jax and xla-scatter wrote DIFFERENT bytes at {mismatched} tokens")
    else:
        table.note("fp8kv-jax and xla-scatter wrote identical bytes wherever both ran.")
    return table


def _available_bytes(jax, cuda: bool) -> int | None:
    """Device memory a new buffer can still get (None when unknown)."""
    try:
        if cuda:
            import torch
            free = torch.cuda.mem_get_info()[0]
            stats = jax.devices()[0].memory_stats() or {}
            in_use = stats.get("bytes_in_use", 0)
            # JAX's pool keeps freed blocks: they count as free for JAX but not for the driver.
            free += max(0, stats.get("pool_bytes", in_use) - in_use)
            if "bytes_limit" in stats:
                free = min(free, stats["bytes_limit"] - in_use)
            return int(free)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except Exception:
        return None


def _mib(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def tables_write_jax_cache(jax, fp8kv_jax, cfg: Config, copy_gbps: float, cuda: bool):
    """Yield one table per token count: the same calls with K and V caches of growing size.

    A call whose donation does not take effect copies the whole cache, so its time grows with the
    cache; an in-place write does not.
    """
    row = HEADS * HEAD_DIM
    for tokens in cfg.jax_cache_tokens:
        table = Table(
            f"write_jax_cache_{tokens}",
            f"Eager calls: write {tokens_case(tokens)} into caches of growing size (JAX)",
            f"jax {jax.__version__}. The calls of the `write_jax_calls` table at {tokens:,} "
            "tokens, with K and V caches of each size (each); a write that copied its cache "
            "instead of updating the donated buffer would grow with the size. "
            + _calls_description(cfg),
            xlabel="K and V cache size, each (MiB)")
        mismatched, steps = [], {}
        for cache_bytes in cfg.jax_cache_bytes:
            num_pages = cache_bytes // (PAGE_SIZE * row)
            label = f"{_mib(cache_bytes)} caches"
            if tokens > num_pages * PAGE_SIZE:
                table.note(f"{label} skipped: {num_pages * PAGE_SIZE} slots, fewer than {tokens}")
                continue
            # K and V of both writers, room for a copy of both (a donation that does not
            # happen), the inputs; the smaller sizes' caches are already allocated.
            need = 6 * cache_bytes + 2 * tokens * row * 2 + 256 * (1 << 20)
            available = _available_bytes(jax, cuda)
            if available is not None and need > available:
                table.note(f"{label} skipped: needs about {need / 2**30:.1f} GiB, "
                           f"{available / 2**30:.1f} GiB free")
                continue
            made, same = write_steps(jax, fp8kv_jax, table, label, cache_bytes >> 20, tokens,
                                      num_pages)
            steps.update(made)
            if same is False:
                mismatched.append(label)
        # Every size in the same rounds: a growth with the size cannot come from the host.
        _add_call_rows(jax, table, steps, write_bytes(tokens), cfg)
        if cuda:
            for label, size in sorted({(case, size) for case, size, _ in steps}):
                table.add_roofline(label, size, write_bytes(tokens), copy_gbps)
        del steps
        if mismatched:
            table.note(f"fp8kv-jax and xla-scatter wrote DIFFERENT bytes with {mismatched}")
        else:
            table.note("fp8kv-jax and xla-scatter wrote identical bytes wherever both ran.")
        yield table


def xla_dequant(key_cache, value_cache, block_table, key_scale, value_scale):
    """The XLA baseline: gather the named pages, upcast, scale, round to bf16; plus the new
    table."""
    import jax.numpy as jnp

    flat = block_table.reshape(-1)
    key_pages, value_pages = ((c[flat].astype(jnp.float32) * s).astype(jnp.bfloat16)
                              for c, s in ((key_cache, key_scale), (value_cache, value_scale)))
    table = jnp.arange(flat.size, dtype=jnp.int32).reshape(block_table.shape)
    return key_pages, value_pages, table


def table_dequant_jax_calls(jax, fp8kv_jax, cfg: Config, copy_gbps: float, cuda: bool) -> Table:
    """Eager jitted ``dequantize_pages`` calls against a jitted XLA gather + convert."""
    import jax.numpy as jnp

    table = Table(
        "dequant_jax_calls", "Eager calls: dequantize pages from jax.jit (JAX)",
        f"jax {jax.__version__}. `fp8kv-jax`: `jax.jit(fp8kv_jax.dequantize_pages)`; "
        "`xla-gather`: the same jit of `(cache[table.reshape(-1)].astype(f32) * s)"
        ".astype(bf16)` for K and V plus the arange table. Cases are batch x pages per sequence, "
        f"random distinct pages of e4m3 caches of at least {cfg.eager_cache_pages} pages x "
        f"{PAGE_SIZE} x {HEADS} heads x {HEAD_DIM}. " + _calls_description(cfg)
        + "Bytes: fp8 pages read, bf16 pages written, table read and written.",
        plot="bars")
    mismatched = []
    for batch, pages_per_seq in cfg.jax_dequant_shapes:
        entries = batch * pages_per_seq
        name = f"{batch}x{pages_per_seq} pages"
        shape = (max(cfg.eager_cache_pages, entries), PAGE_SIZE, HEADS, HEAD_DIM)
        rk, rv, rt = jax.random.split(jax.random.key(entries), 3)
        key_cache = jax.random.normal(rk, shape, jnp.bfloat16).astype(jnp.float8_e4m3fn)
        value_cache = jax.random.normal(rv, shape, jnp.bfloat16).astype(jnp.float8_e4m3fn)
        block_table = (jax.random.permutation(rt, shape[0])[:entries].astype(jnp.int32)
                       .reshape(batch, pages_per_seq))
        args = (key_cache, value_cache, block_table, jnp.asarray(SCALE, jnp.float32),
                jnp.asarray(2 * SCALE, jnp.float32))
        nbytes = dequant_bytes(entries)
        outputs, steps = [], {}
        for provider, fn in (("fp8kv-jax", fp8kv_jax.dequantize_pages),
                             ("xla-gather", xla_dequant)):
            try:
                call = jax.jit(fn)
                outputs.append(jax.block_until_ready(tuple(call(*args))))
                steps[name, entries, provider] = [lambda _, call=call: call(*args), None]
            except Exception as e:
                table.fail(f"{provider} at {name}: {type(e).__name__}: {e}")
        _add_call_rows(jax, table, steps, nbytes, cfg)
        del steps
        if len(outputs) == 2 and not all(_bytes_equal(jax, a, b) for a, b in zip(*outputs)):
            mismatched.append(name)
        del outputs, args, key_cache, value_cache
        if cuda:
            table.add_roofline(name, entries, nbytes, copy_gbps)
    if mismatched:
        table.note(f"fp8kv-jax and xla-gather gave DIFFERENT pages for {mismatched}")
    else:
        table.note("fp8kv-jax and xla-gather gave identical pages and tables wherever both ran.")
    return table
