"""``python -m bench.profile_attention BATCH CONTEXT [FORMAT] [--calls N] [KEY=VALUE ...]``: one
attention table shape (``bench.attention``'s caches) called ``N`` times, for a profiler such as
``ncu`` or ``nsys`` to watch; ``KEY=VALUE`` overrides the CUDA row of ``ATTENTION_SIZES`` (ints
and booleans), as the sweep does. bench/NOTES.md has the commands used."""
from __future__ import annotations

import argparse
import ast

import torch

from fp8kv import attention

from .attention import FORMATS, attend, make_cache
from .sweep import planned_with


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile_attention")
    p.add_argument("batch", type=int)
    p.add_argument("context", type=int)
    p.add_argument("format", nargs="?", default="e4m3", choices=FORMATS)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("sizes", nargs="*", metavar="KEY=VALUE")
    a = p.parse_intermixed_args(argv)   # KEY=VALUE after --calls too
    entries = {}
    for item in a.sizes:
        key, _, value = item.partition("=")
        if key not in attention.ATTENTION_SIZES[attention.CUDA]:
            p.error(f"{key}: not an ATTENTION_SIZES entry")
        entries[key] = ast.literal_eval(value)
    kw, _ = make_cache(a.batch, a.context, a.format, "cuda")
    out = torch.empty_like(kw["query"])
    with planned_with(attention.ATTENTION_SIZES, attention.CUDA, **entries):
        for _ in range(a.calls):
            attend(kw, out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
