"""Every op of one frontend called once, for tests/test_triton_interpret.py, which runs this in a
fresh interpreter with and without ``TRITON_INTERPRET=1`` (the variable counts when Triton is
imported, so only a new process can set it).

``python -m tests.interpret_calls FRONTEND DEVICE [--as-gpu]`` prints one line per call,
``RESULT {"call": ..., "raised": message or null, "digest": ..., "untouched": ...}``: the
SHA-256 of every array the call wrote or returned, and whether the caches still hold their
poison (0x11 bytes) after a call that raised. ``FRONTEND`` is ``torch`` or ``jax``; ``DEVICE``
``cpu`` or ``gpu``. ``--as-gpu`` sends CPU arrays down the GPU path (the compiled kernels) by
replacing the frontend's device check, so that a machine without a GPU reaches the call sites of
compiled launches.
"""
from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

T, HQ, H, D, P, S, L = 3, 4, 2, 32, 4, 4, 2   # tokens, query heads, kv heads, head_dim, pages..
POISON = 0x11


def _arrays(rng) -> dict:
    """NumPy arrays of every call, with poisoned caches."""
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    angles = np.arange(8)[:, None] * 10000.0 ** (-np.arange(0, D, 2) / D)
    return dict(
        key=x, value=-x, query=rng.standard_normal((T, HQ, D)).astype(np.float32),
        cache=np.full((P, S, H, D), POISON, np.uint8),
        kv=np.full((P, 2, S, H, D), POISON, np.uint8),
        stack=np.full((L, P, S, H, D), POISON, np.uint8),
        codes=np.full((P, S, H, D // 2), POISON, np.uint8),
        blocks=np.full((P, S, H, D // 16), POISON, np.uint8),
        slots=np.array([0, 5, 9], np.int32), positions=np.array([1, 2, 7], np.int32),
        table=np.array([[1, 2]], np.int32),
        cos_sin=np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32))


def calls(f, a: dict):
    """``(name, call, caches)`` for every op: ``call()`` returns what to digest; ``caches`` are
    the arrays that must keep their poison when the call raises. ``a``: the frontend's arrays
    (fresh copies per call)."""
    fp8 = dict(fp8_format="e4m3")
    nvfp4 = dict(cache_format="nvfp4")
    return [
        ("write_kv", lambda c: f.write_kv(a["key"], a["value"], c[0], c[1], a["slots"], 0.5, 0.5,
                                          **fp8), ("cache", "cache")),
        ("write_kv_combined", lambda c: f.write_kv_combined(a["key"], a["value"], c[0],
                                                            a["slots"], 0.5, 0.5, **fp8),
         ("kv",)),
        ("write_kv stacked", lambda c: f.write_kv(a["key"], a["value"], c[0], c[1], a["slots"],
                                                  0.5, 0.5, layer=1, **fp8), ("stack", "stack")),
        ("write_kv nvfp4", lambda c: f.write_kv(
            a["key"], a["value"], c[0], c[1], a["slots"], 0.25, 4.0, key_scale_cache=c[2],
            value_scale_cache=c[3], **nvfp4), ("codes", "codes", "blocks", "blocks")),
        ("dequantize_pages", lambda c: f.dequantize_pages(c[0], c[1], a["table"], 0.5, 0.5,
                                                          **fp8), ("cache", "cache")),
        ("dequantize_pages_combined", lambda c: f.dequantize_pages_combined(
            c[0], a["table"], 0.5, 0.5, **fp8), ("kv",)),
        ("dequantize_pages stacked", lambda c: f.dequantize_pages(
            c[0], c[1], a["table"], 0.5, 0.5, layer=1, **fp8), ("stack", "stack")),
        ("dequantize_pages nvfp4", lambda c: f.dequantize_pages(
            c[0], c[1], a["table"], 0.25, 4.0, key_scale_cache=c[2], value_scale_cache=c[3],
            **nvfp4),
         ("codes", "codes", "blocks", "blocks")),
        ("rope_write_kv", lambda c: f.rope_write_kv(
            a["query"], a["key"], a["value"], c[0], c[1], a["slots"], a["positions"],
            a["cos_sin"], 0.5, 0.5, **fp8), ("cache", "cache")),
        ("rope_write_kv_combined", lambda c: f.rope_write_kv_combined(
            a["query"], a["key"], a["value"], c[0], a["slots"], a["positions"], a["cos_sin"],
            0.5, 0.5, **fp8), ("kv",)),
    ]


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for x in arrays:
        if x is not None:
            h.update(np.ascontiguousarray(x).view(np.uint8).tobytes())
    return h.hexdigest()


def _torch(device: str, as_gpu: bool):
    import torch

    import fp8kv_torch
    from fp8kv.plan import CUDA
    from fp8kv_torch import _launch

    if as_gpu:
        _launch._backend = lambda t, name: CUDA
    dev = "cuda" if device == "gpu" else "cpu"

    def convert(x):
        t = torch.from_numpy(x.copy()).to(dev)
        return t.to(torch.bfloat16) if x.dtype == np.float32 and x.ndim == 3 else t

    def host(t):
        t = t.detach().cpu()
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else
                t.view(torch.uint8) if t.element_size() == 1 else t).numpy()

    return fp8kv_torch, convert, host, True


def _jax(device: str, as_gpu: bool):
    import jax
    import jax.numpy as jnp

    import fp8kv_jax

    if as_gpu:
        fp8kv_jax._args.use_triton = lambda arrays: True
    dev = jax.devices("gpu" if device == "gpu" else "cpu")[0]

    def convert(x):
        y = jnp.asarray(x, jnp.bfloat16) if x.dtype == np.float32 and x.ndim == 3 else x
        return jax.device_put(y, dev)

    def host(x):
        x = np.asarray(x)
        return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint8) if (
            x.dtype.itemsize == 1) else x

    return fp8kv_jax, convert, host, False


def main(argv) -> None:
    frontend, device, as_gpu = argv[0], argv[1], "--as-gpu" in argv[2:]
    f, convert, host, in_place = (_torch if frontend == "torch" else _jax)(device, as_gpu)
    base = _arrays(np.random.default_rng(0))
    for name, call, cache_names in calls(f, {k: convert(v) for k, v in base.items()}):
        caches = [convert(base[n]) for n in cache_names]
        try:
            out = call(caches)
            raised = None
        except Exception as e:   # noqa: BLE001 -- what was raised is the result
            out, raised = None, f"{type(e).__name__}: {e}"
        outs = out if isinstance(out, (tuple, list)) else [out]
        written = (caches if in_place else []) + [o for o in outs if o is not None]
        print("RESULT " + json.dumps({
            "call": name, "raised": raised,
            "digest": None if raised else _digest(host(x) for x in written),
            "untouched": all((host(c) == POISON).all() for c in caches)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
