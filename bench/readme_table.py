"""``python -m bench.readme_table [DIR]``: the README's performance table, from a GPU run's CSV
files (default: the committed run, ``bench/results/gpu/``).

Each row of :data:`ROWS` is one call of fp8kv and, where the run has it, what it is compared with
in the same run; a row whose table or case the run lacks is left out (a run of some tables only
gives a shorter table). ``tests/test_readme.py`` checks that the README carries exactly this
output, so the README's numbers are those of the committed run.
"""
from __future__ import annotations

import argparse
import csv
import re
from dataclasses import dataclass
from pathlib import Path

from .results import _num

GPU_RUN = Path(__file__).resolve().parent / "results" / "gpu"


@dataclass(frozen=True)
class Spec:
    what: str                # the row's first column: the call
    table: str               # the CSV's key
    case: str
    provider: str            # fp8kv's provider and mode in that table
    mode: str
    against: str = ""        # the provider compared with, in the same table, and how it is named
    against_mode: str = ""
    against_name: str = ""


UNFUSED = "unfused torch (divide, clamp, cast, `index_put`), CUDA graph"
ROWS = (
    Spec("`write_kv`, 65,536 tokens, CUDA graph", "write", "65,536 tokens", "fp8kv", "graph",
         "torch-unfused", "graph", UNFUSED),
    Spec("`dequantize_pages`, 16 x 512 pages -> bf16, CUDA graph", "dequant", "16x512", "fp8kv",
         "graph", "torch-gather", "eager", "torch gather + cast (eager)"),
    Spec("`rope_write_kv`, 65,536 tokens, bf16 Q, CUDA graph", "rope", "65,536 tokens",
         "fused, bf16 Q", "graph", "unfused: RoPE + write_kv", "graph",
         "Triton RoPE, then `write_kv`"),
    Spec("`write_kv` nvfp4, 65,536 tokens, CUDA graph", "nvfp4", "write 65,536 tokens", "fp8kv",
         "graph", "e4m3 (static scale)", "graph", "the same write into an e4m3 cache"),
    *(Spec(f"`paged_attention` e4m3, {what}, CUDA graph", "attention", case, "e4m3", "graph",
           "bf16", "graph", "the same kernel over a bf16 cache")
      for what, case in (("1 x 8,192 tokens", "1x8192"), ("8 x 4,096", "8x4096"),
                         ("64 x 2,048", "64x2048"), ("64 x 8,192", "64x8192"))),
    Spec("`paged_attention` e4m3, 64 x 2,048, 4 query tokens each, CUDA graph", "attention",
         "64x2048", "e4m3 q4", "graph", "e4m3", "graph", "1 query token each"),
    Spec("`paged_attention` e4m3, 64 x 2,048, CUDA graph", "attention", "64x2048", "e4m3",
         "graph", "dequantize route", "graph", "`dequantize_pages` to bf16, then attention"),
    Spec("`paged_attention` e4m3 per-token-head scales, 64 x 8,192, CUDA graph", "attention",
         "64x8192", "e4m3 token-head", "graph", "bf16", "graph", "a bf16 cache"),
    Spec("`paged_attention` nvfp4, 64 x 8,192, CUDA graph", "attention", "64x8192", "nvfp4",
         "graph", "bf16", "graph", "a bf16 cache"),
    Spec("`fp8kv_jax.paged_attention` e4m3, 64 x 8,192, jitted, kernel time", "attention_jax",
         "64x8192", "fp8kv-jax e4m3", "device", "pallas e4m3", "device",
         "JAX Pallas GPU `paged_attention`, same FP8 cache"),
)


def _rows(run: Path, table: str) -> dict:
    path = run / f"{table}.csv"
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        return {(r["case"], r["provider"], r["mode"]): r for r in csv.DictReader(f)}


def _time(row) -> str:
    return f"{_num(float(row['time_us']))} us"


def header(run: Path) -> tuple[str, str]:
    """``(what the run ran on, its date)`` from the run's summary.md."""
    text = (run / "summary.md").read_text()
    found = re.search(r"^(.+); run on (\d{4}-\d\d-\d\d) \(UTC\)\.$", text, re.M)
    if found is None:
        raise ValueError(f"{run / 'summary.md'}: no line '<device>; <versions>; run on <date> "
                         "(UTC).'")
    copy = re.search(r"\*\*(\d+) GB/s\*\*", text)
    return f"{found.group(1)}; copy bandwidth {copy.group(1)} GB/s", found.group(2)


def table(run: Path = GPU_RUN) -> str:
    """The README's table (markdown) for the run in ``run``."""
    machine, date = header(run)
    lines = [f"Measured on {date} with `python -m bench` ({machine}). 8 kv heads x 128, page 16, "
             "bf16 K/V, e4m3 cache with one device scale unless the row says otherwise. Medians; "
             "\"% of copy\": the call's minimal bytes per second against a device-to-device copy "
             "timed in the same run; the last two columns: what the row is compared with, "
             "measured in the same run.", "",
             "| call | fp8kv | % of copy | compared with | its time |",
             "| --- | ---: | ---: | --- | ---: |"]
    for spec in ROWS:
        rows = _rows(run, spec.table)
        ours = rows.get((spec.case, spec.provider, spec.mode))
        if ours is None:
            continue
        pct = float(ours["pct_of_copy"])
        other = rows.get((spec.case, spec.against, spec.against_mode)) if spec.against else None
        lines.append(f"| {spec.what} | **{_time(ours)}** | "
                     + (f"{_num(pct)} %" if int(ours["bytes"]) and pct >= 1 else "")
                     + f" | {spec.against_name if other else ''} | "
                     + (_time(other) if other else "") + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.readme_table",
                                description="Print the README's performance table from a GPU "
                                            "run's CSV files.")
    p.add_argument("run", nargs="?", type=Path, default=GPU_RUN,
                   help="the run's folder (default: bench/results/gpu/)")
    print(table(p.parse_args(argv).run), end="")


if __name__ == "__main__":
    main()
