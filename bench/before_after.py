"""Before / after: the large calls of one source tree against another's, in one run.

    python bench/before_after.py --old DIR [--rounds 3] [--out DIR] [--cases writes|attention]

``DIR`` is another checkout of fp8kv (e.g. ``git worktree add DIR <commit>``). Each round runs
this file with ``--measure`` in a fresh process, once with ``DIR`` first on ``PYTHONPATH`` and once
with this checkout, alternating which goes first, so that both trees see the same GPU state. A
measurement uses only the public torch API (``fp8kv_torch``), so it runs unchanged on either
tree: CUDA-graph replays (10 calls per graph, over several input sets so that nothing runs from
L2) timed by ``triton.testing.do_bench`` (median) of

* ``write 65,536``: ``write_kv`` of 65,536 tokens, 8 kv heads x 128, bf16 -> e4m3, device scale;
* ``dequantize 16x512``: ``dequantize_pages`` of 16 x 512 pages of 16 slots to bf16 (``out=``);
* ``dynamic write 65,536``: ``write_kv`` with per-token-head scales in side arrays;
* ``write N``: small writes of 1, 64 and 256 tokens (the graph-replay sizes of a decode step);
* ``rope 65,536 bf16`` / ``rope 65,536 fp8 query``: ``rope_write_kv`` of 65,536 tokens, 32 query
  heads, the query out in bf16 / as e4m3 codes (``query_scale``);
* ``nvfp4 write 65,536`` / ``nvfp4 dequantize 16x512``: an NVFP4 cache written, read to bf16;

or, with ``--cases attention``, ``paged_attention`` on the attention table's Llama-3-8B decode
shapes (32 query heads, 8 kv heads x 128, page 16, pages in random order): e4m3 caches with
static scales at every batch x context, per-token-head scales, NVFP4 and bf16 at some.

Prints one line per case (median over rounds of each tree and new / old) and writes
``before_after.csv`` and ``before_after.md`` (``before_after_attention.*``) to ``--out``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HEADS, HEAD_DIM, PAGE_SIZE = 8, 128, 16
CALLS_PER_GRAPH = 10


def _graph_us(fns) -> float:
    import torch
    import triton

    for fn in fns:   # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    calls = [fns[i % len(fns)] for i in range(CALLS_PER_GRAPH)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300,
                                   return_mode="median") * 1e3 / len(calls)


ATTENTION_CASES = (("e4m3", 1, 8192), ("e4m3", 8, 4096), ("e4m3", 32, 4096), ("e4m3", 64, 2048),
                   ("e4m3", 256, 1024), ("e4m3 token-head", 8, 4096),
                   ("e4m3 token-head", 256, 1024), ("nvfp4", 64, 2048), ("bf16", 8, 4096),
                   ("bf16", 64, 2048))


def measure_attention() -> dict:
    """``{case: microseconds per call}`` of ``paged_attention`` for the fp8kv on ``sys.path``,
    on the attention table's caches (``bench.attention.make_cache``: public API only; this
    checkout's bench is found after the other tree's packages)."""
    import torch

    sys.path.append(str(Path(__file__).resolve().parent.parent))
    from bench.attention import attend, make_cache

    out = {}
    for fmt, batch, context in ATTENTION_CASES:
        kw, _ = make_cache(batch, context, fmt, "cuda")
        dst = torch.empty_like(kw["query"])
        out[f"attention {fmt} {batch}x{context}"] = _graph_us([lambda: attend(kw, dst)])
        del kw, dst
    return out


def measure() -> dict:
    """``{case: microseconds per call}`` for the fp8kv on ``sys.path``."""
    import torch

    import fp8kv_torch

    torch.manual_seed(0)
    dev = "cuda"
    out = {}
    tokens, sets = 65536, 3
    slots_total = 3 * tokens
    num_pages = slots_total // PAGE_SIZE
    kc = torch.zeros(num_pages, PAGE_SIZE, HEADS, HEAD_DIM, dtype=torch.float8_e4m3fn, device=dev)
    vc = torch.zeros_like(kc)
    scale = torch.tensor(0.37, device=dev)
    inputs = [(torch.randn(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev),
               torch.randn(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev),
               torch.randperm(slots_total, device=dev)[:tokens]) for _ in range(sets)]
    out["write 65,536"] = _graph_us([
        lambda k=k, v=v, s=s: fp8kv_torch.write_kv(k, v, kc, vc, s, scale, scale)
        for k, v, s in inputs])
    ksc, vsc = (torch.zeros(num_pages, PAGE_SIZE, HEADS, device=dev) for _ in range(2))
    out["dynamic write 65,536"] = _graph_us([
        lambda k=k, v=v, s=s: fp8kv_torch.write_kv(k, v, kc, vc, s, key_scale_cache=ksc,
                                                   value_scale_cache=vsc)
        for k, v, s in inputs])
    del inputs
    tables = [torch.randint(0, num_pages, (16, 512), dtype=torch.int32, device=dev)
              for _ in range(sets)]
    pages = (16 * 512, PAGE_SIZE, HEADS, HEAD_DIM)
    outs = (torch.empty(pages, dtype=torch.bfloat16, device=dev),
            torch.empty(pages, dtype=torch.bfloat16, device=dev),
            torch.empty(16, 512, dtype=torch.int32, device=dev))
    out["dequantize 16x512"] = _graph_us([
        lambda t=t: fp8kv_torch.dequantize_pages(kc, vc, t, scale, scale, out=outs)
        for t in tables])
    del outs
    for n in (1, 64, 256):
        small = [(torch.randn(n, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev),
                  torch.randperm(slots_total, device=dev)[:n]) for _ in range(sets)]
        out[f"write {n}"] = _graph_us([
            lambda k=k, s=s: fp8kv_torch.write_kv(k, k, kc, vc, s, scale, scale)
            for k, s in small])
    out.update(_rope(dev, kc, vc, scale, slots_total, tokens, sets))
    out.update(_nvfp4(dev, num_pages, slots_total, tokens, sets))
    return out


def _rope(dev, kc, vc, scale, slots_total: int, tokens: int, sets: int) -> dict:
    import torch

    import fp8kv_torch

    q_heads = 32
    cos_sin = torch.randn(8192, HEAD_DIM, device=dev)
    inputs = [(torch.randn(tokens, q_heads, HEAD_DIM, dtype=torch.bfloat16, device=dev),
               torch.randn(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev),
               torch.randperm(slots_total, device=dev)[:tokens],
               torch.randint(0, 8192, (tokens,), device=dev)) for _ in range(sets)]
    out = {}
    for name, q_scale in (("rope 65,536 bf16", None), ("rope 65,536 fp8 query", scale)):
        out[name] = _graph_us([
            lambda q=q, k=k, s=s, p=p: fp8kv_torch.rope_write_kv(
                q, k, k, kc, vc, s, p, cos_sin, scale, scale, query_scale=q_scale)
            for q, k, s, p in inputs])
    return out


def _nvfp4(dev, num_pages: int, slots_total: int, tokens: int, sets: int) -> dict:
    import torch

    import fp8kv_torch

    codes = torch.zeros(num_pages, PAGE_SIZE, HEADS, HEAD_DIM // 2, dtype=torch.uint8,
                        device=dev)
    blocks = torch.zeros(num_pages, PAGE_SIZE, HEADS, HEAD_DIM // 16, dtype=torch.uint8,
                         device=dev)
    kc, vc, kb, vb = codes, codes.clone(), blocks, blocks.clone()
    inputs = [(torch.randn(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev),
               torch.randperm(slots_total, device=dev)[:tokens]) for _ in range(sets)]
    out = {"nvfp4 write 65,536": _graph_us([
        lambda k=k, s=s: fp8kv_torch.write_kv(k, k, kc, vc, s, 0.5, 0.5, key_scale_cache=kb,
                                              value_scale_cache=vb, cache_format="nvfp4")
        for k, s in inputs])}
    tables = [torch.randint(0, num_pages, (16, 512), dtype=torch.int32, device=dev)
              for _ in range(sets)]
    pages = (16 * 512, PAGE_SIZE, HEADS, HEAD_DIM)
    outs = (torch.empty(pages, dtype=torch.bfloat16, device=dev),
            torch.empty(pages, dtype=torch.bfloat16, device=dev),
            torch.empty(16, 512, dtype=torch.int32, device=dev))
    out["nvfp4 dequantize 16x512"] = _graph_us([
        lambda t=t: fp8kv_torch.dequantize_pages(kc, vc, t, 0.5, 0.5, out=outs,
                                                 key_scale_cache=kb, value_scale_cache=vb,
                                                 cache_format="nvfp4")
        for t in tables])
    return out


def _run(tree: Path, cases: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    done = subprocess.run([sys.executable, __file__, "--measure", cases], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, help="the other checkout (the 'before')")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    p.add_argument("--cases", choices=("writes", "attention"), default="writes")
    p.add_argument("--measure", choices=("writes", "attention"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure() if args.measure == "writes" else measure_attention()))
        return
    if args.old is None:
        p.error("--old: expected the checkout to compare with")
    new = Path(__file__).resolve().parent.parent
    runs = {"old": [], "new": []}
    for r in range(args.rounds):
        for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
            runs[which].append(_run(args.old if which == "old" else new, args.cases))
            print(f"round {r + 1} {which}: {runs[which][-1]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in runs["new"][0]:
        old = statistics.median(m[case] for m in runs["old"])
        now = statistics.median(m[case] for m in runs["new"])
        rows.append((case, old, now, now / old))
    stem = "before_after" if args.cases == "writes" else "before_after_attention"
    with open(args.out / f"{stem}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["case", "old_us", "new_us", "new_over_old", "rounds"])
        w.writerows([(c, f"{o:.2f}", f"{n:.2f}", f"{q:.4f}", args.rounds) for c, o, n, q in rows])
    lines = [f"Before / after ({args.rounds} alternating rounds, medians, CUDA-graph replay)", "",
             "| case | old (us) | new (us) | new / old |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {c} | {o:.1f} | {n:.1f} | {q:.3f} |" for c, o, n, q in rows]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
