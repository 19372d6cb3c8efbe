"""Where a synced jitted call's time goes: ``jax.profiler`` traces of calls, split into phases.

Each call is ``block_until_ready(step(state))`` inside a ``jax.profiler.TraceAnnotation``; the
trace (``*.trace.json.gz``, host and GPU events on one clock) gives per call:

* ``dispatch``: the call starts -> its first kernel starts on the GPU (JAX's Python and C++
  dispatch, XLA's thunks, the launch and its latency);
* ``device``: first kernel start -> last kernel end;
* ``return``: last kernel end -> ``block_until_ready`` returns (how soon the host learns);
* ``call``: the whole call;
* ``kernels``: the kernels' own durations added up (``device`` less the gaps between them).

Medians over the calls. Tracing slows host work (each traced function records itself), so the
phases are read side by side, provider against provider, not as absolute costs.
"""
from __future__ import annotations

import glob
import gzip
import json
import statistics
import tempfile

from .common import Config
from .jax_tables import FLOOR_TRITON, floor_steps, write_steps
from .results import Table, tokens_case
from .write_torch import HEAD_DIM, HEADS, PAGE_SIZE

PHASES = ("dispatch", "device", "return", "call")
MEASURES = (*PHASES, "kernels")   # what traced_phases gives per provider
GiB = 1 << 30


def trace_events(jax, steps: dict, calls: int) -> list:
    """The ``jax.profiler`` trace events of ``calls`` synced calls of each step (``steps``: name
    -> [jitted step, its carried state]), each call annotated ``fp8kv-bench:<name>:<i>``."""
    for entry in steps.values():
        for _ in range(3):
            entry[1] = jax.block_until_ready(entry[0](entry[1]))
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir)
        try:
            for name, entry in steps.items():
                for i in range(calls):
                    with jax.profiler.TraceAnnotation(f"fp8kv-bench:{name}:{i}"):
                        entry[1] = jax.block_until_ready(entry[0](entry[1]))
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(f"{log_dir}/plugins/profile/*/*.trace.json.gz")
        with gzip.open(path) as f:
            return json.load(f)["traceEvents"]


def traced_phases(jax, steps: dict, calls: int) -> dict:
    """``jax.profiler`` trace of ``calls`` synced calls of each step; provider -> phase (and
    ``kernels``) -> median us."""
    return _phases(trace_events(jax, steps, calls), list(steps))


def _phases(events: list, names: list) -> dict:
    """Per provider and phase, the median over its annotated calls (us)."""
    devices = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and e["args"]["name"].startswith("/device:")}
    spans = [e for e in events if e.get("ph") == "X"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["pid"] in devices)
    result = {}
    for name in names:
        phases = {p: [] for p in MEASURES}
        for call in (e for e in spans if e["name"].startswith(f"fp8kv-bench:{name}:")):
            start, end = call["ts"], call["ts"] + call["dur"]
            inside = [k for k in kernels if start <= k[0] and k[1] <= end]
            if not inside:
                continue
            first, last = inside[0][0], max(k[1] for k in inside)
            busy = sum(k[1] - k[0] for k in inside)
            for phase, us in zip(MEASURES, (first - start, last - first, end - last, end - start,
                                            busy)):
                phases[phase].append(us)
        if phases["call"]:
            result[name] = {p: statistics.median(v) for p, v in phases.items()}
    return result


def table_jax_call_phases(jax, fp8kv_jax, cfg: Config, copy_gbps: float, cuda: bool) -> Table:
    """Phases of synced jitted calls: fp8kv's write and XLA's scatter at 1 token and at the
    largest token count, and XLA elementwise calls of about the large write's device time."""
    import jax.numpy as jnp

    big = max(cfg.jax_call_tokens)
    table = Table(
        "jax_call_phases", "Where a synced jitted call's time goes (JAX, jax.profiler)",
        f"jax {jax.__version__}. {cfg.jax_calls} traced calls each (`block_until_ready` after "
        "every call), medians. `dispatch`: the call starts -> its first kernel starts on the GPU; "
        "`device`: kernels running; `return`: the last kernel ends -> the call returns; `call`: "
        f"the whole call. Writes as in `write_jax_calls`, caches of 1 GiB each at {big:,} "
        f"tokens. `xla x*2+1`: a jitted, donated elementwise call on {big * HEADS * HEAD_DIM:,} "
        "bf16 (about the large write's device time); `+ empty jax-triton`: the same jit with an "
        "empty jax-triton kernel beside it (one custom call, as fp8kv's). Tracing slows the host "
        "side: compare rows, not absolute numbers.", plot="time")
    if not cuda:
        table.note("skipped: the phases need a GPU's kernel events")
        return table
    pages = max(GiB // (PAGE_SIZE * HEADS * HEAD_DIM), big // PAGE_SIZE + 1)
    steps = {}
    for tokens in (1, big):
        made, _ = write_steps(jax, fp8kv_jax, table, tokens_case(tokens), tokens, tokens, pages)
        steps.update({f"{provider}, {case}": step for (case, _, provider), step in made.items()})
        del made
    floors, note = floor_steps(jax, cuda)
    if note:
        table.note(note)
    elementwise = jax.jit(lambda x: x * 2 + 1, donate_argnums=(0,))
    steps["xla x*2+1"] = [elementwise, jnp.zeros(big * HEADS * HEAD_DIM, jnp.bfloat16)]
    if FLOOR_TRITON in floors:
        empty = floors[FLOOR_TRITON][0]
        both = jax.jit(lambda xs: (xs[0] * 2 + 1, empty(xs[1])), donate_argnums=(0,))
        steps["xla x*2+1 + empty jax-triton"] = [
            both, (jnp.zeros(big * HEADS * HEAD_DIM, jnp.bfloat16), jnp.zeros(16, jnp.float32))]
    for name, phases in traced_phases(jax, steps, cfg.jax_calls).items():
        for phase in PHASES:
            table.add(name, 0, phase, "traced", phases[phase], 0)
    return table
