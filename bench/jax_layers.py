"""JAX tables of a model's decode step: many layers per jitted step (``--only jax_layers``).

An engine writes every layer's cache in one jitted step, from per-layer arrays (donated) or from a
stacked ``[L, ...]`` array carried through ``lax.scan``. Tables (every provider of a row timed in
the same rounds, ``bench.jax_tables._interleaved_us``):

* ``jax_layers_<tokens>``: a step of L per-layer writes, L = 1 ... 16: fp8kv through XLA's own
  Triton call, fp8kv through jax-triton (``FP8KV_JAX_XLA_TRITON=0``) and XLA's ``.at[].set``
  scatter; ``jax_layers_marginal``: each one's cost per extra layer (least-squares slope over L),
  with the issue's goals checked in its notes;
* ``jax_layers_stacked``: L stacked layers written under ``lax.scan`` (traced layer) and in a
  Python loop (int layers) inside one jit, beside the per-layer step of the same L and tokens and
  XLA's scatter in the same scan / loop;
* ``jax_layers_dequant``: ``dequantize_pages`` of a prefill's pages from each of L stacked layers
  under ``lax.scan``, per-layer caches, and XLA's gather in the same scan;
* ``jax_layers_profile``: ``jax.profiler`` traces of the per-layer step at 1 token: per step the
  wall time, the GPU's kernel time and the gaps between its kernels, and the host events per call
  (XLA's thunks and custom calls, by name).

Every step is compiled ahead (``jit(...).lower(...).compile()``) under the path it names, caches
donated; the compiled HLO says which custom call each fp8kv step holds (noted).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import statistics
from unittest import mock

import numpy as np

from .common import MiB, Config
from .dequant import dequant_bytes
from .jax_profile import trace_events
from .jax_tables import _interleaved_us, write_bytes, xla_write
from .results import Table, tokens_case
from .write_torch import HEAD_DIM, HEADS, PAGE_SIZE, SCALE

ENV = "FP8KV_JAX_XLA_TRITON"
XLA_CALL, JAX_TRITON, XLA = "fp8kv-jax (xla triton call)", "fp8kv-jax (jax-triton)", "xla-scatter"
MODES = (("synced", True), ("pipelined", False))


@dataclasses.dataclass(frozen=True)
class Sizes:
    tokens: tuple
    layers: tuple
    stacked_layers: int
    stacked_tokens: tuple
    cache_bytes: int            # per layer and side
    dequant_shape: tuple        # (batch, pages per sequence) of the prefill
    profile_layers: tuple
    profile_calls: int


def sizes(cfg: Config, cuda: bool) -> Sizes:
    if not cuda:   # a harness check through the jnp path
        return Sizes((1, 16), (1, 2), 2, (1,), MiB // 4, (1, 4), (), 0)
    if cfg.eager_reps < 5:   # --quick
        return Sizes((1, 256, 16384), (1, 4, 8), 8, (1, 256), 32 * MiB, (2, 64), (1, 8), 10)
    return Sizes((1, 16, 256, 16384), (1, 2, 4, 8, 16), 8, (1, 256, 16384), 128 * MiB,
                 (4, 256), (1, 2, 4, 8, 16), 30)


@contextlib.contextmanager
def _path(xla: bool | None):
    """FP8KV_JAX_XLA_TRITON for the compiles inside (None: as the environment says)."""
    if xla is None:
        yield
        return
    with mock.patch.dict(os.environ, {ENV: "1" if xla else "0"}):
        yield


def _compiled(jax, fn, state, xla):
    """``fn(*inputs, caches) -> caches`` compiled ahead under the path ``xla`` for ``state =
    (inputs, caches)``, the caches donated (the inputs are shared between providers):
    ``(step, hlo)`` with ``step(state) -> state``."""
    with _path(xla):
        jitted = jax.jit(lambda inputs, caches: fn(*inputs, caches), donate_argnums=(1,))
        compiled = jitted.lower(*state).compile()
    return (lambda s: (s[0], compiled(*s))), compiled.as_text()


def _custom_calls(hlo: str) -> str:
    """Which fp8kv custom call a compiled step holds."""
    if "__gpu$xla.gpu.triton" in hlo:
        return "xla triton call"
    if "triton_kernel_call" in hlo:
        return "jax-triton"
    return "no custom call (jnp path)"


def _cache_copies(hlo: str, shape) -> int:
    """HLO ``copy`` instructions that make an fp8 or byte array of a cache's ``shape``."""
    dims = ",".join(map(str, shape))
    return len(re.findall(rf"=\s*(?:f8e4m3fn|u8)\[{dims}\]\S*\s+copy(?:-start)?\(", hlo))


def _providers(cuda: bool):
    """(name, FP8KV_JAX_XLA_TRITON) of the fp8kv providers."""
    if not cuda:
        return [("fp8kv-jax (jnp)", None)]
    return [(XLA_CALL, True), (JAX_TRITON, False)]


def _inputs(jax, tokens: int, layers: int, num_pages: int, seed: int = 0):
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 2 * layers + 1)
    kv = [jax.random.normal(k, (tokens, HEADS, HEAD_DIM), jnp.bfloat16) for k in keys[:-1]]
    slots = jax.random.permutation(keys[-1], num_pages * PAGE_SIZE)[:tokens].astype(jnp.int32)
    return kv, slots, jnp.asarray(SCALE, jnp.float32)


def _per_layer(write, layers: int):
    """A step writing ``layers`` per-layer caches, each from its own K/V (as from each layer's
    projection): ``step(kv, slots, scale, caches) -> caches``."""
    def step(kv, slots, scale, caches):
        out = []
        for i in range(layers):
            out += list(write(kv[2 * i], kv[2 * i + 1], caches[2 * i], caches[2 * i + 1], slots,
                              scale, scale))
        return tuple(out)
    return step


def _caches(jax, shape, count: int):
    import jax.numpy as jnp

    return tuple(jnp.zeros(shape, jnp.float8_e4m3fn) for _ in range(count))


def _time(jax, steps: dict, cfg: Config, calls: int, table: Table, row_bytes: dict) -> None:
    """Time ``steps`` ((case, size, provider) -> [step, state]) in both modes, in the same
    rounds, and add their rows (``row_bytes``: (case, size) -> minimal bytes of a step)."""
    timing = dataclasses.replace(cfg, eager_calls=calls)
    for mode, synced in MODES:
        try:
            for (case, size, provider), us in _interleaved_us(jax, steps, timing, synced).items():
                table.add(case, size, provider, mode, us, row_bytes[case, size])
        except Exception as e:   # report and go on: the other rows still count
            table.note(f"{mode} steps of {sorted({c for c, _, _ in steps})} failed: "
                       f"{type(e).__name__}: {e}")


def _calls(cfg: Config, tokens: int, layers: int) -> int:
    """Steps per timed round: fewer where one step is long (it dominates the host's noise)."""
    return max(min(10, cfg.eager_calls),
               min(cfg.eager_calls, cfg.eager_calls * 256 // max(tokens * layers, 256)))


def tables_per_layer(jax, fp8kv_jax, cfg: Config, copy_gbps: float, cuda: bool):
    """One table per token count (x: layers per step), then ``jax_layers_marginal``."""
    size = sizes(cfg, cuda)
    num_pages = size.cache_bytes // (PAGE_SIZE * HEADS * HEAD_DIM)
    shape = (num_pages, PAGE_SIZE, HEADS, HEAD_DIM)
    marginal = Table(
        "jax_layers_marginal", "Cost of one more layer in a jitted step (JAX, per-layer caches)",
        f"jax {jax.__version__}. Least-squares slope over L of the `jax_layers_<tokens>` tables "
        "(us per extra layer per step). Goals: at 1-256 tokens fp8kv's slope at or below XLA's "
        "scatter's, and 8 layers at 16,384 tokens in at most 0.6x XLA's time.", plot="time")
    totals = {}
    for tokens in size.tokens:
        if tokens > num_pages * PAGE_SIZE:
            continue
        table = Table(
            f"jax_layers_{tokens}", f"A jitted step writing L per-layer caches, "
            f"{tokens_case(tokens)} (JAX)",
            f"jax {jax.__version__}. One `jax.jit` step writes L per-layer K/V caches ({shape} "
            f"e4m3, {size.cache_bytes >> 20} MiB per layer and side, donated), each layer from "
            f"its own bf16 K/V ({tokens:,} x {HEADS} x {HEAD_DIM}), int32 random slots, device "
            f"scale. `{XLA_CALL}`: fp8kv_jax.write_kv as XLA's own Triton call; `{JAX_TRITON}`: "
            f"the same with {ENV}=0; `{XLA}`: jnp quantize + `.at[page, off].set`. Time per "
            "step; bytes: L writes' minimal traffic.", xlabel="layers written per step")
        steps, row_bytes, paths = {}, {}, []
        for layers in size.layers:
            kv, slots, scale = _inputs(jax, tokens, layers, num_pages, seed=tokens)
            row_bytes[tokens_case(tokens), layers] = layers * write_bytes(tokens)
            for provider, xla in _providers(cuda) + [(XLA, None)]:
                write = xla_write if provider == XLA else fp8kv_jax.write_kv
                try:
                    state = ((kv, slots, scale), _caches(jax, shape, 2 * layers))
                    step, hlo = _compiled(jax, _per_layer(write, layers), state, xla)
                    if provider != XLA and layers == size.layers[0]:
                        paths.append(f"`{provider}` holds {_custom_calls(hlo)}")
                    steps[tokens_case(tokens), layers, provider] = [step, state]
                except Exception as e:
                    table.note(f"{provider} at L={layers} failed: {type(e).__name__}: {e}")
        _time(jax, steps, cfg, _calls(cfg, tokens, max(size.layers)), table, row_bytes)
        del steps
        table.note("; ".join(paths) + ".")
        for (case, layers, provider, mode), us in _fit_rows(table):
            totals[tokens, layers, provider, mode] = us
        yield table
        for (provider, mode), slope in _slopes(table).items():
            marginal.add(tokens_case(tokens), tokens, provider, mode, slope, 0)
    _goal_notes(marginal, totals, size)
    yield marginal


def _fit_rows(table: Table):
    for r in table.rows:
        yield (r.case, r.size, r.provider, r.mode), r.time_us


def _slopes(table: Table) -> dict:
    """Least-squares us per extra layer, per (provider, mode)."""
    groups = {}
    for r in table.rows:
        groups.setdefault((r.provider, r.mode), []).append((r.size, r.time_us))
    return {key: float(np.polyfit(*zip(*points), 1)[0]) for key, points in groups.items()
            if len(points) >= 2}


def _goal_notes(marginal: Table, totals: dict, size: Sizes) -> None:
    by = {(r.case, r.provider, r.mode): r.time_us for r in marginal.rows}
    for provider, _ in _providers(True):
        for mode, _ in MODES:
            small = [t for t in size.tokens if t <= 256]
            met = [by.get((tokens_case(t), provider, mode), np.inf)
                   <= by.get((tokens_case(t), XLA, mode), -np.inf) for t in small]
            if any((tokens_case(t), provider, mode) in by for t in small):
                marginal.note(f"{provider}, {mode}: marginal per layer <= XLA's at "
                              f"{small} tokens: {met}")
            big = totals.get((16384, 8, provider, mode)), totals.get((16384, 8, XLA, mode))
            if None not in big:
                marginal.note(f"{provider}, {mode}: 8 layers at 16,384 tokens = "
                              f"{big[0] / big[1]:.2f}x XLA's (goal <= 0.6)")


# ---------------------------------------------------------------------------------------------
# Stacked caches.

def _scan_write(write, layers: int):
    def step(keys, values, slots, scale, caches):
        import jax

        def body(c, x):
            layer, k, v = x
            return tuple(write(k, v, *c, slots, scale, scale, layer=layer)), None

        return jax.lax.scan(body, caches, (jax.numpy.arange(layers), keys, values))[0]
    return step


def _loop_write(write, layers: int):
    def step(keys, values, slots, scale, caches):
        for layer in range(layers):
            caches = tuple(write(keys[layer], values[layer], *caches, slots, scale, scale,
                                 layer=layer))
        return caches
    return step


def xla_write_stacked(key, value, key_cache, value_cache, slots, key_scale, value_scale, *,
                      layer):
    """XLA's baseline on stacked caches: quantize, then ``.at[layer, page, off].set``."""
    import jax.numpy as jnp

    page_size = key_cache.shape[2]
    page, offset = slots // page_size, slots % page_size

    def quantize(x, scale):
        return jnp.clip(x.astype(jnp.float32) / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)

    return (key_cache.at[layer, page, offset].set(quantize(key, key_scale)),
            value_cache.at[layer, page, offset].set(quantize(value, value_scale)))


def table_stacked(jax, fp8kv_jax, cfg: Config, copy_gbps: float, cuda: bool) -> Table:
    size = sizes(cfg, cuda)
    layers = size.stacked_layers
    num_pages = size.cache_bytes // (PAGE_SIZE * HEADS * HEAD_DIM)
    shape = (num_pages, PAGE_SIZE, HEADS, HEAD_DIM)
    table = Table(
        "jax_layers_stacked", f"Stacked caches: {layers} layers per jitted step (JAX)",
        f"jax {jax.__version__}. {layers} layers of K/V caches {shape} e4m3 "
        f"({size.cache_bytes >> 20} MiB per layer and side) as stacked `[{layers}, ...]` arrays "
        "(donated), written by `lax.scan` over the layers (`layer=` traced) or a Python loop "
        "(`layer=` an int) in one jit, beside the per-layer step of `jax_layers_<tokens>` "
        "(separate arrays) and XLA's scatter in the same scan / loop. Time per step. Goals: "
        "stacked <= 1.1x per-layer at the same L and tokens; >= 20x faster than XLA's scatter in "
        "the same scan at 256 tokens.", plot="time")
    notes = []
    for tokens in size.stacked_tokens:
        case = tokens_case(tokens)
        kv, slots, scale = _inputs(jax, tokens, layers, num_pages, seed=7 + tokens)
        keys, values = jax.numpy.stack(kv[0::2]), jax.numpy.stack(kv[1::2])
        stacked_shape = (layers,) + shape
        steps = {}
        makers = []
        for provider, xla in _providers(cuda):
            makers += [(f"{provider} scan", xla, _scan_write(fp8kv_jax.write_kv, layers), True),
                       (f"{provider} loop", xla, _loop_write(fp8kv_jax.write_kv, layers), True),
                       (f"{provider} per-layer", xla, _per_layer(fp8kv_jax.write_kv, layers),
                        False)]
        makers += [(f"{XLA} scan", None, _scan_write(xla_write_stacked, layers), True),
                   (f"{XLA} loop", None, _loop_write(xla_write_stacked, layers), True),
                   (f"{XLA} per-layer", None, _per_layer(xla_write, layers), False)]
        for provider, xla, fn, stacked in makers:
            try:
                if stacked:
                    state = ((keys, values, slots, scale), _caches(jax, stacked_shape, 2))
                else:
                    state = ((kv, slots, scale), _caches(jax, shape, 2 * layers))
                step, hlo = _compiled(jax, fn, state, xla)
                steps[case, tokens, provider] = [step, state]
                if tokens == size.stacked_tokens[0]:
                    copies = _cache_copies(hlo, stacked_shape if stacked else shape)
                    notes.append(f"`{provider}`: {_custom_calls(hlo)}, {copies} copies of a "
                                 "cache in the HLO")
            except Exception as e:
                table.note(f"{provider} at {case} failed: {type(e).__name__}: {e}")
        _time(jax, steps, cfg, _calls(cfg, tokens, layers), table,
              {(case, tokens): layers * write_bytes(tokens)})
        del steps
    table.note("Compiled steps: " + "; ".join(notes) + ".")
    _stacked_goals(table, layers)
    return table


def _stacked_goals(table: Table, layers: int) -> None:
    by = {(r.case, r.provider, r.mode): r.time_us for r in table.rows}
    for (case, provider, mode), us in sorted(by.items()):
        for pattern in (" scan", " loop"):
            if provider.endswith(pattern) and not provider.startswith(XLA):
                base = provider[:-len(pattern)]
                per_layer = by.get((case, f"{base} per-layer", mode))
                xla = by.get((case, f"{XLA}{pattern}", mode))
                parts = []
                if per_layer:
                    parts.append(f"{us / per_layer:.2f}x per-layer (goal <= 1.1)")
                if xla:
                    parts.append(f"speed-up over XLA's{pattern} {xla / us:.2f}x (< 1: slower)")
                if parts:
                    table.note(f"{case}, {provider}, {mode}: " + ", ".join(parts))


# ---------------------------------------------------------------------------------------------
# Dequantize a prefill's pages from every layer.

def xla_dequant_stacked(key_cache, value_cache, block_table, key_scale, value_scale, *, layer):
    import jax.numpy as jnp

    flat = block_table.reshape(-1)
    return tuple((c[layer][flat].astype(jnp.float32) * s).astype(jnp.bfloat16)
                 for c, s in ((key_cache, key_scale), (value_cache, value_scale)))


def _scan_dequant(fn, layers: int):
    """Every layer's pages of stacked caches: ``step(caches, table, scale) -> pages``."""
    def step(caches, table, scale):
        import jax

        def body(_, layer):
            return None, tuple(fn(*caches, table, scale, scale, layer=layer)[:2])

        return jax.lax.scan(body, None, jax.numpy.arange(layers))[1]
    return step


def _per_layer_dequant(fn, layers: int):
    def step(caches, table, scale):
        return [tuple(fn(caches[2 * i], caches[2 * i + 1], table, scale, scale)[:2])
                for i in range(layers)]
    return step


def table_dequant(jax, fp8kv_jax, cfg: Config, copy_gbps: float, cuda: bool) -> Table:
    import jax.numpy as jnp

    from .jax_tables import xla_dequant

    size = sizes(cfg, cuda)
    layers = size.stacked_layers
    batch, per_seq = size.dequant_shape
    num_pages = max(size.cache_bytes // (PAGE_SIZE * HEADS * HEAD_DIM), batch * per_seq)
    shape = (num_pages, PAGE_SIZE, HEADS, HEAD_DIM)
    table = Table(
        "jax_layers_dequant", f"Dequantize a prefill's pages from {layers} layers (JAX)",
        f"jax {jax.__version__}. {batch} x {per_seq} pages (random distinct) of {layers} layers' "
        f"e4m3 caches {shape}, to bf16, in one jitted step: `lax.scan` over stacked `[{layers}, "
        "...]` caches (`layer=` traced), per-layer caches in a Python loop, and XLA's gather "
        "(`cache[layer][table]`, upcast, scale) in the same scan. Time per step; bytes: every "
        "layer's fp8 pages read and bf16 pages written.", plot="time")
    rk, rt = jax.random.split(jax.random.key(3))
    stacked = jax.random.normal(rk, (2, layers) + shape, jnp.bfloat16).astype(jnp.float8_e4m3fn)
    table_ = (jax.random.permutation(rt, num_pages)[:batch * per_seq].astype(jnp.int32)
              .reshape(batch, per_seq))
    scale = jnp.asarray(SCALE, jnp.float32)
    case = f"{layers} layers x {batch}x{per_seq} pages"
    steps, notes = {}, []
    per_layer = tuple(c for i in range(layers) for c in (stacked[0][i], stacked[1][i]))
    makers = []
    for provider, xla in _providers(cuda):
        makers += [(f"{provider} scan", xla, _scan_dequant(fp8kv_jax.dequantize_pages, layers),
                    (stacked[0], stacked[1])),
                   (f"{provider} per-layer", xla,
                    _per_layer_dequant(fp8kv_jax.dequantize_pages, layers), per_layer)]
    makers += [("xla-gather scan", None, _scan_dequant(xla_dequant_stacked, layers),
                (stacked[0], stacked[1])),
               ("xla-gather per-layer", None, _per_layer_dequant(xla_dequant, layers), per_layer)]
    for provider, xla, fn, caches in makers:
        try:
            inputs = (caches, table_, scale)
            with _path(xla):
                compiled = jax.jit(lambda s, fn=fn: fn(*s)).lower(inputs).compile()
            # The state carries the last pages, so that a synced step waits for them.
            steps[case, layers, provider] = [
                lambda s, compiled=compiled: (s[0], compiled(s[0])), (inputs, None)]
            notes.append(f"`{provider}`: {_custom_calls(compiled.as_text())}")
        except Exception as e:
            table.note(f"{provider} failed: {type(e).__name__}: {e}")
    _time(jax, steps, cfg, _calls(cfg, batch * per_seq * PAGE_SIZE, layers), table,
          {(case, layers): layers * dequant_bytes(batch * per_seq)})
    table.note("Compiled steps: " + "; ".join(notes) + ".")
    by = {(r.provider, r.mode): r.time_us for r in table.rows}
    for provider, _ in _providers(cuda):
        for mode, _ in MODES:
            ours, xla = by.get((f"{provider} scan", mode)), by.get(("xla-gather scan", mode))
            if ours and xla:
                table.note(f"{provider} scan, {mode}: speed-up over XLA's gather in the same scan "
                           f"{xla / ours:.2f}x (< 1: slower)")
    return table


# ---------------------------------------------------------------------------------------------
# Where a step's time goes: jax.profiler.

HOST_MARKS = ("thunk", "triton", "custom", "command", "memcpy", "execute")




def step_profile(events: list, name: str) -> dict:
    """Medians over the annotated steps of ``name``: wall, kernel time (union of kernel
    intervals), gaps between kernels, kernel count, and host events by name (per step: count,
    total us) whose names look like XLA's thunks or custom calls."""
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and e["args"]["name"].startswith("/device:")}
    spans = [e for e in events if e.get("ph") == "X"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["pid"] in devices)
    host = [e for e in spans if e["pid"] not in devices
            and any(m in e["name"].lower() for m in HOST_MARKS)]
    per = {"wall": [], "kernel": [], "gaps": [], "kernels": []}
    host_by_name: dict = {}
    steps = [e for e in spans if e["name"].startswith(f"fp8kv-bench:{name}:")]
    for call in steps:
        start, end = call["ts"], call["ts"] + call["dur"]
        inside = [k for k in kernels if start <= k[0] and k[1] <= end]
        busy, last = 0.0, None
        for a, b in inside:
            if last is None or a >= last:
                busy += b - a
                last = b
            elif b > last:
                busy += b - last
                last = b
        per["wall"].append(end - start)
        per["kernel"].append(busy)
        per["gaps"].append((max(b for _, b in inside) - inside[0][0] - busy) if inside else 0.0)
        per["kernels"].append(len(inside))
        for e in host:
            if start <= e["ts"] and e["ts"] + e["dur"] <= end:
                count, total = host_by_name.get(e["name"], (0, 0.0))
                host_by_name[e["name"]] = (count + 1, total + e["dur"])
    n = max(len(steps), 1)
    result = {k: statistics.median(v) if v else 0.0 for k, v in per.items()}
    result["host"] = {k: (c / n, t / n) for k, (c, t) in host_by_name.items()}
    return result


def table_profile(jax, fp8kv_jax, cfg: Config, copy_gbps: float, cuda: bool) -> Table:
    size = sizes(cfg, cuda)
    table = Table(
        "jax_layers_profile", "Where a step of L per-layer writes spends its time (JAX, "
        "jax.profiler, 1 token)",
        f"jax {jax.__version__}. The `jax_layers_1` steps under `jax.profiler` "
        f"({size.profile_calls} synced steps each, medians). Rows per provider and L: `wall` "
        "(the step), `kernel` (GPU busy), `gaps` (GPU idle between the step's first and last "
        "kernel), `kernels` (count, not us), and per host event name that looks like an XLA "
        "thunk or custom call: `host: <name>` (us per step; the count per step in the notes). "
        "Tracing slows host work: compare rows, not absolute numbers.", plot="time")
    if not cuda or not size.profile_layers:
        table.note("skipped: needs a GPU's kernel events")
        return table
    num_pages = size.cache_bytes // (PAGE_SIZE * HEADS * HEAD_DIM)
    shape = (num_pages, PAGE_SIZE, HEADS, HEAD_DIM)
    counts = []
    for layers in size.profile_layers:
        kv, slots, scale = _inputs(jax, 1, layers, num_pages, seed=11)
        steps = {}
        for provider, xla in _providers(cuda) + [(XLA, None)]:
            write = xla_write if provider == XLA else fp8kv_jax.write_kv
            try:
                state = ((kv, slots, scale), _caches(jax, shape, 2 * layers))
                step, _ = _compiled(jax, _per_layer(write, layers), state, xla)
                steps[f"{provider} L={layers}"] = [step, state]
            except Exception as e:
                table.note(f"{provider} at L={layers} failed: {type(e).__name__}: {e}")
        try:
            events = trace_events(jax, steps, size.profile_calls)
        except Exception as e:
            table.note(f"trace at L={layers} failed: {type(e).__name__}: {e}")
            continue
        for name in steps:
            provider = name.rsplit(" L=", 1)[0]
            prof = step_profile(events, name)
            case = f"{layers} layers"
            for metric in ("wall", "kernel", "gaps", "kernels"):
                table.add(case, layers, provider, metric, prof[metric], 0)
            for host_name, (count, total) in sorted(prof["host"].items(),
                                                    key=lambda kv: -kv[1][1])[:6]:
                table.add(case, layers, provider, f"host: {host_name}", total, 0)
                counts.append(f"{provider} L={layers} `{host_name}` x{count:.1f}/step")
        del steps
    if counts:
        table.note("Host events per step: " + "; ".join(counts) + ".")
    return table


TABLES = (tables_per_layer, table_stacked, table_dequant, table_profile)

