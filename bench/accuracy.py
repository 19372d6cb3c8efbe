"""Attention accuracy of an FP8 (or NVFP4) KV cache under each scale scheme (NumPy, CPU, a few
seconds).

``python -m bench.accuracy [--out DIR]`` or ``bench.accuracy.run(out_dir)``: writes
``accuracy.csv`` and ``accuracy.png`` to the directory and returns the rows.

What is measured: decode-style attention (``NUM_QUERIES`` queries, ``Q_HEADS`` query heads over
``KV_HEADS`` kv heads, ``HEAD_DIM``, no mask) over a context of bf16 K/V. The golden output is
fp32 attention over those bf16 K/V; the measured one is the same fp32 attention over K/V that were
written into a paged FP8 cache and read back as bf16 through :func:`fp8kv.reference.write_kv` and
:func:`fp8kv.reference.dequantize_pages`, so the numbers are those of the project's exact bytes.

Scale schemes (K and V each get their own):

* ``tensor-unit``: a static scale of 1.0 (no calibration);
* ``tensor``: one static scale, amax of the whole context / fmax (calibrated on the very data
  written: the best case for a static scale);
* ``head``: one static scale per kv head, amax over the context;
* ``token`` / ``token-head``: dynamic scales computed at write time, stored in a side cache.

The static calibrated scales are computed with :func:`fp8kv.reference.dynamic_scales` over the
whole tensor (or head) as one group, so every scheme follows the same rule (fp32 division, the
1e-6 floor, and ``pow2``: rounded up to a power of two).

The ``reader`` column says how the cache is read: ``dequantize`` (the reference's
``dequantize_pages`` to bf16, then the fp32 attention above) or ``paged_attention`` (fp8kv's fused
reader, ``fp8kv_torch.paged_attention`` over the same cache, compiled: on a machine with a CUDA
GPU only (the interpreter would take minutes), for the scale schemes of :data:`FUSED_SCHEMES`).
The fused rows add the reader's own rounding (fp16 probabilities, bf16 output) to the cache's.

NVFP4 (``nvfp4`` rows, docs/SPEC.md section 13): E2M1 codes with an e4m3 scale per 16 elements
computed at write time; its scheme is the global scale: ``tensor-unit`` (1.0), ``tensor`` (amax
of the whole context / (6 x 448), the calibration FlashInfer's tests use) or ``head`` (the same
per kv head). Its block scales cost 1 byte per 16 elements (``scale_bytes_per_token``), and its
codes half the bytes of FP8's.

MXFP8 (``mxfp8`` rows, docs/SPEC.md section 13a): e4m3 codes with an e8m0 (power-of-two) scale
per 32 elements computed at write time, its only scheme (``block``); 1 byte per 32 elements.

K/V: Gaussian with per-channel and per-token magnitude spread ("plain"), and the same with
outlier channels ("outliers"): in each kv head, 4 key channels 20-100x larger and 1 value
channel 20x larger, as seen in real models' keys. Queries are Gaussian, scaled so that the logits
have a standard deviation of ``LOGIT_STD`` in both kinds.
"""
from __future__ import annotations

import argparse
import csv
import pathlib
import time

import numpy as np

from fp8kv import reference as ref
from fp8kv.formats import FORMATS

CONTEXTS = (128, 8192)
Q_HEADS, KV_HEADS, HEAD_DIM, NUM_QUERIES, PAGE_SIZE = 8, 2, 128, 16, 16
LOGIT_STD = 3.0
FORMAT_NAMES = ("e4m3", "e5m2", "mxfp8", "nvfp4")
KV_KINDS = ("plain", "outliers")
# (scheme, rounding) in plot order
SCHEMES = (("tensor-unit", "-"), ("tensor", "exact"), ("tensor", "pow2"), ("head", "exact"),
           ("head", "pow2"), ("token", "exact"), ("token", "pow2"), ("token-head", "exact"),
           ("token-head", "pow2"))
# fp32 side-cache bytes per token, for K (the same again for V)
SCALE_BYTES = {"token": 4, "token-head": 4 * KV_HEADS}
# NVFP4: the global scale is the scheme; e4m3 block scales come with every scheme.
NVFP4_SCHEMES = (("tensor-unit", "-"), ("tensor", "exact"), ("head", "exact"))
# MXFP8: its e8m0 block scales are its only scheme.
MXFP8_SCHEMES = (("block", "-"),)
MXFP8_BLOCK_BYTES = KV_HEADS * HEAD_DIM // 32
NVFP4_BLOCK_BYTES = KV_HEADS * HEAD_DIM // 16
# The schemes read again by the fused reader, per format: a static scale and (FP8) the
# recommended dynamic per-token-head scales.
FUSED_SCHEMES = {"e4m3": (("tensor", "exact"), ("token-head", "exact")),
                 "e5m2": (("tensor", "exact"),), "mxfp8": (("block", "-"),),
                 "nvfp4": (("tensor", "exact"),)}
COLUMNS = ("context", "kv", "fmt", "scheme", "rounding", "reader", "attn_rel_l2", "attn_max_abs",
           "k_rel_l2", "v_rel_l2", "scale_bytes_per_token")


def make_inputs(context: int, kind: str, seed: int = 0):
    """bf16 queries ``[NUM_QUERIES, Q_HEADS, D]`` and keys/values ``[context, KV_HEADS, D]``."""
    rng = np.random.default_rng([seed, context, KV_KINDS.index(kind)])
    bf16 = ref.np_dtype("bfloat16")

    def kv():
        x = rng.standard_normal((context, KV_HEADS, HEAD_DIM))
        x *= np.exp(0.5 * rng.standard_normal((1, KV_HEADS, HEAD_DIM)))   # channel spread
        x *= np.exp(0.3 * rng.standard_normal((context, 1, 1)))           # token spread
        return x

    k, v = kv(), kv()
    if kind == "outliers":
        for h in range(KV_HEADS):
            ch = rng.choice(HEAD_DIM, size=5, replace=False)
            k[:, h, ch[:4]] *= rng.uniform(20, 100, size=4)
            v[:, h, ch[4]] *= 20
    q = rng.standard_normal((NUM_QUERIES, Q_HEADS, HEAD_DIM))
    # Scale the queries so that the logits q.k / sqrt(d) have std LOGIT_STD in both kinds: the
    # kinds then differ in how K/V are distributed, not in how peaked the softmax is.
    group = Q_HEADS // KV_HEADS
    logits = np.stack([q[:, h] @ k[:, h // group].T for h in range(Q_HEADS)]) / np.sqrt(HEAD_DIM)
    q *= LOGIT_STD / logits.std()
    return q.astype(bf16), k.astype(bf16), v.astype(bf16)


def attention(q, k, v) -> np.ndarray:
    """fp32 softmax(q k^T / sqrt(d)) v per query head (grouped-query: kv head = head // group)."""
    # [H, T, D] contiguous fp32 copies (bf16 -> fp32 is exact)
    q, k, v = (np.ascontiguousarray(a.astype(np.float32).transpose(1, 0, 2)) for a in (q, k, v))
    group = Q_HEADS // KV_HEADS
    out = np.empty((NUM_QUERIES, Q_HEADS, HEAD_DIM), np.float32)
    for h in range(Q_HEADS):
        kh, vh = k[h // group], v[h // group]
        logits = q[h] @ kh.T / np.float32(np.sqrt(HEAD_DIM))
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        out[:, h] = (p / p.sum(axis=-1, keepdims=True)) @ vh
    return out


def static_scale(x, fmt: str, scheme: str, rounding: str):
    """None (unit), a float (whole tensor) or ``[H]`` (per head), by the dynamic rule applied to
    the whole tensor / each head as one group."""
    if scheme == "tensor-unit":
        return None
    if scheme == "tensor":
        return float(ref.dynamic_scales(x.reshape(1, 1, -1), fmt, "token", rounding)[0])
    per_head = np.ascontiguousarray(x.transpose(1, 0, 2)).reshape(KV_HEADS, 1, -1)
    return ref.dynamic_scales(per_head, fmt, "token", rounding)


def nvfp4_global_scale(x, scheme: str):
    """The global scale of an nvfp4 side: None (unit), amax / (6 * 448) of the whole tensor, or
    ``[H]`` per kv head (fp32 division)."""
    if scheme == "tensor-unit":
        return None
    a = np.abs(x.astype(np.float32))
    amax = a.max() if scheme == "tensor" else a.max(axis=(0, 2))
    return (np.asarray(amax, np.float32) / np.float32(6 * 448)).astype(np.float32)


def write_nvfp4(k, v, scheme: str):
    """``(key_cache, value_cache, read)``: K/V written into an nvfp4 paged cache, and the read
    arguments (scales, block scales, format) of both readers."""
    context = k.shape[0]
    pages = -(-context // PAGE_SIZE)
    shape = (pages, PAGE_SIZE, KV_HEADS)
    cache = np.zeros(shape + (HEAD_DIM // 2,), np.uint8)
    blocks = np.zeros(shape + (HEAD_DIM // 16,), np.uint8)
    g_k, g_v = nvfp4_global_scale(k, scheme), nvfp4_global_scale(v, scheme)
    kc, vc, kb, vb = ref.write_kv(k, v, cache, cache, np.arange(context), g_k, g_v,
                                  key_scale_cache=blocks, value_scale_cache=blocks,
                                  cache_format="nvfp4")
    return kc, vc, dict(key_scale=g_k, value_scale=g_v, key_scale_cache=kb,
                        value_scale_cache=vb, cache_format="nvfp4")


def write(k, v, fmt: str, scheme: str, rounding: str):
    """``(key_cache, value_cache, read)``: K/V written into a paged cache under the scheme, and
    the read arguments of both readers."""
    if fmt == "nvfp4":
        return write_nvfp4(k, v, scheme)
    context = k.shape[0]
    pages = -(-context // PAGE_SIZE)
    if fmt == "mxfp8":
        shape = (pages, PAGE_SIZE, KV_HEADS)
        cache = np.zeros(shape + (HEAD_DIM,), np.uint8)
        blocks = np.zeros(shape + (HEAD_DIM // 32,), np.uint8)
        kc, vc, kb, vb = ref.write_kv(k, v, cache, cache, np.arange(context),
                                      key_scale_cache=blocks, value_scale_cache=blocks,
                                      cache_format="mxfp8")
        return kc, vc, dict(key_scale_cache=kb, value_scale_cache=vb, cache_format="mxfp8")
    cache = np.zeros((pages, PAGE_SIZE, KV_HEADS, HEAD_DIM), ref.np_dtype(FORMATS[fmt].dtype))
    slots = np.arange(context)
    if scheme in ("token", "token-head"):
        shape = (pages, PAGE_SIZE) + ((KV_HEADS,) if scheme == "token-head" else ())
        side = np.zeros(shape, np.float32)
        kc, vc, ks, vs = ref.write_kv(k, v, cache, cache, slots, key_scale_cache=side,
                                      value_scale_cache=side, scale_rounding=rounding)
        return kc, vc, dict(key_scale_cache=ks, value_scale_cache=vs)
    k_s, v_s = static_scale(k, fmt, scheme, rounding), static_scale(v, fmt, scheme, rounding)
    kc, vc = ref.write_kv(k, v, cache, cache, slots, k_s, v_s)
    return kc, vc, dict(key_scale=k_s, value_scale=v_s)


def dequantize(kc, vc, read: dict, context: int):
    """The cache read back as bf16 ``[T, H, D]`` (the reference's ``dequantize_pages``)."""
    table = np.arange(kc.shape[0], dtype=np.int32)[None]
    kp, vp, _ = ref.dequantize_pages(kc, vc, table, **read)
    flat = (kc.shape[0] * PAGE_SIZE, KV_HEADS, HEAD_DIM)
    return kp.reshape(flat)[:context], vp.reshape(flat)[:context]


def fused_reader():
    """``fp8kv_torch.paged_attention`` as ``read(q, kc, vc, read, context) -> [N, Hq, D]`` fp32
    (one sequence per query, all over the same pages), or None without torch and a CUDA GPU."""
    try:
        import torch

        import fp8kv_torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    device = "cuda"

    def tensor(a):
        if isinstance(a, np.ndarray):
            if a.dtype.itemsize == 1 and a.dtype != np.uint8:   # FP8 codes: by their bytes
                return torch.from_numpy(a.view(np.uint8)).to(device).view(
                    getattr(torch, a.dtype.name))
            if a.dtype == ref.np_dtype("bfloat16"):
                return torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16)
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)
        return a

    def read(q, kc, vc, args: dict, context: int):
        pages = kc.shape[0]
        table = torch.arange(pages, dtype=torch.int32, device=device).repeat(len(q), 1)
        lens = torch.full((len(q),), context, dtype=torch.int32, device=device)
        out = fp8kv_torch.paged_attention(tensor(q), tensor(kc), tensor(vc), table, lens,
                                          **{k: tensor(a) for k, a in args.items()})
        return out.float().cpu().numpy()
    return read


def _rel_l2(got, want) -> float:
    got, want = (a.astype(np.float32).astype(np.float64) for a in (got, want))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def measure(fused: bool = True) -> list[dict]:
    """Every row; ``fused``: also the fused reader's rows, where torch is installed."""
    reader = fused_reader() if fused else None
    rows = []
    for context in CONTEXTS:
        for kind in KV_KINDS:
            q, k, v = make_inputs(context, kind)
            golden = attention(q, k, v)
            for fmt in FORMAT_NAMES:
                for scheme, rounding in {"nvfp4": NVFP4_SCHEMES,
                                         "mxfp8": MXFP8_SCHEMES}.get(fmt, SCHEMES):
                    kc, vc, read = write(k, v, fmt, scheme,
                                         "exact" if rounding == "-" else rounding)
                    kd, vd = dequantize(kc, vc, read, context)
                    outs = [("dequantize", attention(q, kd, vd))]
                    if reader is not None and (scheme, rounding) in FUSED_SCHEMES.get(fmt, ()):
                        outs.append(("paged_attention", reader(q, kc, vc, read, context)))
                    for name, out in outs:
                        err = np.abs(out.astype(np.float64) - golden)
                        rows.append(dict(
                            context=context, kv=kind, fmt=fmt, scheme=scheme, rounding=rounding,
                            reader=name, attn_rel_l2=_rel_l2(out, golden),
                            attn_max_abs=(float(err.max()) if np.isfinite(err).all()
                                          else float("inf")),
                            k_rel_l2=_rel_l2(kd, k), v_rel_l2=_rel_l2(vd, v),
                            scale_bytes_per_token={
                                "nvfp4": NVFP4_BLOCK_BYTES, "mxfp8": MXFP8_BLOCK_BYTES}.get(
                                    fmt, SCALE_BYTES.get(scheme, 0))))
    return rows


def write_csv(rows, path: pathlib.Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: f"{r[c]:.6g}" if isinstance(r[c], float) else r[c] for c in COLUMNS})


def scheme_label(row) -> str:
    label = row["scheme"] if row["rounding"] == "-" else f"{row['scheme']} ({row['rounding']})"
    return label + (", paged_attention" if row["reader"] == "paged_attention" else "")


def plot(rows, path: pathlib.Path) -> None:
    """Grouped bars on a log scale: one group per (context, K/V kind, format), one bar per scheme;
    relative L2 error on top, max abs error below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["context"], r["kv"], r["fmt"]) for r in rows))
    labels = list(dict.fromkeys(scheme_label(r) for r in rows))
    value = {(r["context"], r["kv"], r["fmt"], scheme_label(r)): r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(15, 9), sharex=True)
    width = 0.85 / len(labels)
    colors = plt.get_cmap("tab10").colors
    for ax, metric, title in ((axes[0], "attn_rel_l2", "attention output: relative L2 error"),
                              (axes[1], "attn_max_abs", "attention output: max abs error")):
        for i, label in enumerate(labels):
            xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(groups))]
            # NaN (no bar) where a format has no such scheme (nvfp4: no token scales)
            ys = [value[g + (label,)][metric] if g + (label,) in value else float("nan")
                  for g in groups]
            ax.bar(xs, ys, width, label=label, color=colors[i % len(colors)],
                   hatch="//" if "pow2" in label else None, edgecolor="white", linewidth=0.3)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[1].set_xticks(range(len(groups)), [f"ctx {c}\n{kind}\n{fmt}" for c, kind, fmt in groups],
                       fontsize=8)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"FP8 / NVFP4 KV cache vs bf16 K/V: decode attention, {Q_HEADS} query heads / "
                 f"{KV_HEADS} kv heads, head_dim {HEAD_DIM}, {NUM_QUERIES} queries")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(rows) -> str:
    """The results as a markdown table (one line per row)."""
    lines = ["| context | K/V | format | scale (reader) | attn rel L2 | attn max abs | K rel L2 | "
             "V rel L2 |",
             "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['context']} | {r['kv']} | {r['fmt']} | {scheme_label(r)} | "
              f"{r['attn_rel_l2']:.2e} | {r['attn_max_abs']:.2e} | {r['k_rel_l2']:.2e} | "
              f"{r['v_rel_l2']:.2e} |" for r in rows]
    return "\n".join(lines)


def run(out_dir: pathlib.Path, plots: bool = True) -> list[dict]:
    """Measure every configuration; write ``accuracy.csv`` (and, with ``plots``,
    ``accuracy.png``) into ``out_dir``."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = measure()
    write_csv(rows, out_dir / "accuracy.csv")
    if plots:
        plot(rows, out_dir / "accuracy.png")
    return rows


def section(out_dir: pathlib.Path, plots: bool = True) -> str:
    """:func:`run`, and the results as a section of ``summary.md`` (what ``python -m bench``
    shows)."""
    rows = run(out_dir, plots)
    image = ["![Attention accuracy of an FP8 KV cache per scale scheme](accuracy.png)", ""]
    return "\n".join([
        "### Attention accuracy of an FP8 KV cache per scale scheme (NumPy: real data, not a "
        "timing)", "",
        "Computed with NumPy through fp8kv's reference write and dequantize (the exact bytes of "
        "the kernels); real results on any machine, not a timing. Decode attention "
        f"({NUM_QUERIES} queries, {Q_HEADS} query heads over {KV_HEADS} kv heads, head_dim "
        f"{HEAD_DIM}) over bf16 K/V against the same attention over K/V written to an FP8 cache "
        "and read back as bf16; `plain` and `outliers` K/V (see bench/accuracy.py); rows marked "
        "`paged_attention`: read by fp8kv's fused reader instead (CUDA GPU only). Errors are "
        "relative L2 and max abs of the attention output, and relative L2 of K and V.", "",
        markdown(rows), ""] + (image if plots else []))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.accuracy",
                                description="FP8 KV-cache attention accuracy per scale scheme.")
    p.add_argument("--out", type=pathlib.Path,
                   default=pathlib.Path(__file__).resolve().parent / "out",
                   help="output directory (default: bench/out/)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    rows = run(args.out)
    print(markdown(rows))
    print(f"\nwrote {args.out / 'accuracy.csv'} and {args.out / 'accuracy.png'} "
          f"in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
