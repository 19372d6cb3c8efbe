"""Probe: does XLA's own Triton call work for fp8kv's kernels on this GPU machine?

``python -m bench.xla_triton_probe [--dump DIR]`` prints the versions and the version check,
then for a set of calls -- writes (static, dynamic, combined, stacked with a traced layer) and
dequantizations -- runs each jitted call through XLA's Triton call (``FP8KV_JAX_XLA_TRITON=1``)
and through jax-triton (``=0``) and compares the bytes with each other and with the NumPy
reference; then compiles an 8-layer decode step both ways and says whether XLA put the kernels
into a command buffer, and how long a step takes (a quick look; the ``jax_layers`` tables are the
measurement). With ``--dump DIR`` XLA also writes its HLO and PTX there, and the probe counts in
the PTX of the XLA-compiled kernel the instructions exactness rests on (``div.rn``, ``fma.rn``,
the saturating fp8 conversion, no ``ftz``). Exit status 1 if any bytes differ or a path fails.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import statistics
import sys
import time
from unittest import mock

ENV = "FP8KV_JAX_XLA_TRITON"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.xla_triton_probe")
    parser.add_argument("--dump", default=None, help="XLA dump directory (HLO and PTX)")
    args = parser.parse_args(argv)
    if args.dump:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump}"
                                   " --xla_dump_hlo_as_text").strip()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    with mock.patch.dict(os.environ):   # jax_triton 0.3.1 clears TRITON_CACHE_DIR on import
        import jax
        import jaxlib.version
        import triton
        with contextlib.suppress(Exception):
            import jax_triton  # noqa: F401
    from fp8kv_jax import _xla_triton

    print(f"jax {jax.__version__}, jaxlib {jaxlib.version.__version__}, triton "
          f"{triton.__version__}, jax-triton "
          f"{getattr(sys.modules.get('jax_triton'), '__version__', 'not importable')}")
    print(f"devices: {jax.devices()}")
    print(f"version check: {_xla_triton.version_problem() or 'passes'}; {ENV}="
          f"{os.environ.get(ENV, '(unset)')} -> {_xla_triton.setting()}")
    if jax.default_backend() != "gpu":
        print("no GPU: nothing to probe")
        return 1
    failures = compare_paths(jax)
    step_report(jax)
    if args.dump:
        ptx_report(args.dump)
    print("PROBE " + ("FAILED: " + ", ".join(failures) if failures else "PASSED"))
    return 1 if failures else 0


@contextlib.contextmanager
def path(xla: bool):
    with mock.patch.dict(os.environ, {ENV: "1" if xla else "0"}):
        yield


def _cases(jax):
    """(name, function of NumPy inputs -> outputs, NumPy inputs, reference outputs)."""
    import numpy as np

    import fp8kv_jax
    from fp8kv import reference
    from tests.cases import DequantCase, WriteCase, dequant_inputs, write_inputs
    from tests.stacked_cases import (STACKED_CASES, dequant_inputs_stacked, expected_dequant,
                                     expected_write, write_inputs_stacked)

    def jx(inputs):
        return {k: jax.numpy.asarray(v) if isinstance(v, np.ndarray) else v
                for k, v in inputs.items()}

    cases = []
    for case in (WriteCase(tokens=257, heads=8, head_dim=128, scale="tensor", slots="int32"),
                 WriteCase(tokens=33, heads=6, head_dim=80, layout="HND", fmt="e5m2",
                           scale="float", slots="int32")):
        inputs = write_inputs(case)
        kw = dict(layout=case.api_layout, fp8_format=case.fp8_format)
        cases.append((f"write {case.id}", lambda x, kw=kw: fp8kv_jax.write_kv(**jx(x), **kw),
                      inputs, reference.write_kv(**inputs, **kw)))
    for case in (DequantCase(batch=4, pages_per_seq=16, scale="head"),
                 DequantCase(heads=6, head_dim=96, page_size=64, layout="HND", fmt="e5m2",
                             out="float16", scale="tensor")):
        inputs = dequant_inputs(case)
        kw = dict(layout=case.api_layout, fp8_format=case.fp8_format, null_page=case.null_page,
                  dtype=case.out)
        cases.append((f"dequantize {case.id}",
                      lambda x, kw=kw: fp8kv_jax.dequantize_pages(**jx(x), **kw), inputs,
                      reference.dequantize_pages(**inputs, **kw)))
    for case in (STACKED_CASES[1], STACKED_CASES[2], STACKED_CASES[7]):
        inputs = write_inputs_stacked(case)
        fn = fp8kv_jax.write_kv_combined if case.combined else fp8kv_jax.write_kv
        cases.append((f"stacked write {case.id}",
                      lambda x, fn=fn: fn(**jx(x), layer=jax.numpy.int32(1)), inputs,
                      tuple(expected_write(case, inputs, 1).values())))
        inputs = dequant_inputs_stacked(case)
        fn = fp8kv_jax.dequantize_pages_combined if case.combined else fp8kv_jax.dequantize_pages
        cases.append((f"stacked dequantize {case.id}",
                      lambda x, fn=fn: fn(**jx(x), layer=jax.numpy.int32(2)), inputs,
                      expected_dequant(case, inputs, 2)))
    return cases


def compare_paths(jax) -> list:
    import numpy as np

    from tests.cases import as_uint

    failures = []
    for name, fn, inputs, expected in _cases(jax):
        got = {}
        arrays = {k: v for k, v in inputs.items() if isinstance(v, np.ndarray)}
        static = {k: v for k, v in inputs.items() if k not in arrays}
        for label, xla in (("xla", True), ("jax-triton", False)):
            try:
                with path(xla):
                    out = jax.jit(lambda a, fn=fn: fn({**a, **static}))(arrays)
                    out = out if isinstance(out, tuple) else (out,)
                    got[label] = [as_uint(np.asarray(o)) for o in out]
            except Exception as e:   # a path that fails is a finding, not a crash
                print(f"  {name}: {label} FAILED: {type(e).__name__}: {str(e)[:300]}")
                failures.append(f"{name} ({label})")
        want = [as_uint(np.asarray(w)) for w in expected]
        for label, arrays in got.items():
            same = len(arrays) == len(want) and all(
                a.shape == w.shape and np.array_equal(a, w) for a, w in zip(arrays, want))
            print(f"  {name}: {label} {'matches' if same else 'DIFFERS FROM'} the reference")
            if not same:
                failures.append(f"{name} ({label} bytes)")
    return failures


def step_report(jax, layers: int = 8, calls: int = 200) -> None:
    """An 8-layer decode step (1 token, per-layer caches) both ways: command buffers, time."""
    from bench.jax_layers import _caches, _inputs, _per_layer
    from bench.jax_tables import xla_write
    from bench.write_torch import HEAD_DIM, HEADS, PAGE_SIZE
    import fp8kv_jax

    num_pages = 4096
    shape = (num_pages, PAGE_SIZE, HEADS, HEAD_DIM)
    kv, slots, scale = _inputs(jax, 1, layers, num_pages)
    for label, xla, write in (("fp8kv xla call", True, fp8kv_jax.write_kv),
                              ("fp8kv jax-triton", False, fp8kv_jax.write_kv),
                              ("xla scatter", None, xla_write)):
        try:
            with (path(xla) if xla is not None else contextlib.nullcontext()):
                fn = jax.jit(lambda i, c, w=write: _per_layer(w, layers)(*i, c),
                             donate_argnums=(1,))
                caches = _caches(jax, shape, 2 * layers)
                compiled = fn.lower((kv, slots, scale), caches).compile()
        except Exception as e:
            print(f"  step {label}: FAILED to compile: {type(e).__name__}: {str(e)[:300]}")
            continue
        hlo = compiled.as_text()
        buffers = re.findall(r"command_buffer[\w.]*", hlo)
        inside = _calls_in_command_buffers(hlo)
        samples = {"synced": [], "pipelined": []}
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                caches = jax.block_until_ready(compiled((kv, slots, scale), caches))
            samples["synced"].append((time.perf_counter() - start) / calls * 1e6)
            start = time.perf_counter()
            for _ in range(calls):
                caches = compiled((kv, slots, scale), caches)
            jax.block_until_ready(caches)
            samples["pipelined"].append((time.perf_counter() - start) / calls * 1e6)
        print(f"  step {label}: {len(set(buffers))} command-buffer computations, custom calls "
              f"inside them: {inside}; synced {statistics.median(samples['synced']):.1f} us, "
              f"pipelined {statistics.median(samples['pipelined']):.1f} us per 8-layer step")


def _calls_in_command_buffers(hlo: str) -> str:
    """How many custom calls sit in command-buffer computations, out of how many."""
    computation, inside, total = None, 0, 0
    for line in hlo.splitlines():
        head = re.match(r"^%?([\w.\-]+) .*\{\s*$", line)
        if head:
            computation = head.group(1)
        if "custom-call(" in line or "custom_call_target" in line:
            total += 1
            inside += bool(computation and "command_buffer" in computation)
    return f"{inside} of {total}"


def ptx_report(dump: str) -> None:
    """Instructions in the PTX XLA compiled for the fp8kv kernels."""
    for path_ in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
        text = open(path_).read()
        for kernel in ("_write_kv_kernel", "_dequantize_pages_kernel"):
            if kernel not in text:
                continue
            counts = {op: len(re.findall(re.escape(op), text))
                      for op in ("div.rn.f32", "fma.rn.f32", "mul.rn.f32", "add.rn.f32",
                                 "cvt.rn.satfinite", "ftz", "ld.global.v4", "st.global.v4")}
            print(f"  {os.path.basename(path_)}: {kernel}: {counts}")


if __name__ == "__main__":
    sys.exit(main())
