"""``python -m bench [--out DIR] [--only NAMES] [--quick]``.

``--only`` names (comma-separated): ``write`` (the torch write table and the variants table),
``variants`` (the variants table alone), ``dequant`` (with fp8kv-jax rows when JAX is usable),
``dynamic`` (dynamic-scale placements), ``eager`` (eager-call tables, torch), ``sweep`` (tuning;
default on a GPU only), ``accuracy``
(attention error per scale scheme, NumPy), ``jax`` (the JAX tables).

Without a CUDA GPU only a short harness check runs, through Triton's CPU interpreter: its numbers
are not performance, and every title says so.
"""
from __future__ import annotations

import os

# JAX reads this at its import only; set it before anything can import jax (torch would otherwise
# find 75 % of the GPU already taken by JAX).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The accuracy table's NumPy matmuls are small: one BLAS thread is as fast, and several threads
# spin against each other (4x slower on a busy 2-core machine). Read when numpy loads its BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import traceback  # noqa: E402
from unittest import mock  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from . import (accuracy, dequant, dynamic, eager, jax_layers, jax_profile,  # noqa: E402
               jax_tables, small_writes, sweep, write_torch)
from .common import Timer, copy_bandwidth, free_memory, make_config  # noqa: E402
from .plot import plot_table  # noqa: E402
from .results import Table, markdown, write_csv  # noqa: E402

TABLES = ("write", "variants", "small", "dequant", "dynamic", "eager", "sweep", "accuracy", "jax",
          "jax_layers")
CPU_LABEL = "CPU interpreter - not performance"
CPU_BANNER = ("No CUDA GPU found: only a short harness check runs, through Triton's CPU "
              "interpreter; its numbers are not performance.")


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark fp8kv against the PyTorch/XLA code it replaces; write one CSV and "
                    "one PNG per table and summary.md to --out.",
        epilog="--only names: write (the torch write table and the variants table), variants "
               "(the variants table alone), dequant (with fp8kv-jax rows when JAX is usable), "
               "eager (eager-call tables of fp8kv_torch against single-launch Triton anchors and "
               "an empty kernel), dynamic (dynamic-scale placements side by side), sweep "
               "(tuning; default on a GPU only), accuracy (attention "
               "error of an FP8 cache per scale scheme; NumPy, real data, not timing), jax (the "
               "JAX tables: write, eager calls, cache sizes, dequantize). Without a CUDA GPU "
               "only a short harness check runs through Triton's CPU interpreter: its numbers "
               "are not performance.")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                   help="output directory (default: bench/out/)")
    p.add_argument("--only", default=None,
                   help=f"comma-separated subset of {','.join(TABLES)} (default: all; the sweep "
                        "only on a GPU)")
    p.add_argument("--quick", action="store_true",
                   help="every table, with fewer sizes and shorter timings (a GPU smoke run of "
                        "about a minute); no effect without a GPU")
    args = p.parse_args(argv)
    if args.only is None:
        args.only = set(TABLES) if torch.cuda.is_available() else set(TABLES) - {"sweep"}
    else:
        args.only = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = args.only - set(TABLES)
        if unknown:
            p.error(f"--only: unknown table(s) {sorted(unknown)}; choose from {','.join(TABLES)}")
    return args


class Report:
    """Writes each table's CSV and PNG as soon as it is done, and re-writes ``summary.md``."""

    def __init__(self, out: Path, header: str, copy_gbps: float, label: str = ""):
        self.out, self.header, self.copy_gbps, self.label = out, header, copy_gbps, label
        self.tables: dict[str, Table] = {}
        self.sections: dict[str, str] = {}    # markdown of what is not a Table, by key
        self.order: list[str] = []
        self.notes: list[str] = []    # failures and skipped tables

    def emit(self, table: Table) -> None:
        """Write (or re-write) ``table``; a timing table gets the run's label in its titles."""
        table.label = self.label
        self.tables[table.key] = table
        if table.key not in self.order:
            self.order.append(table.key)
        write_csv(table, self.copy_gbps, self.out / f"{table.key}.csv")
        plot_table(table, self.copy_gbps, self.out / f"{table.key}.png")
        self._write_summary()

    def fail(self, what: str) -> None:
        """Record the exception being handled; the other tables still run."""
        traceback.print_exc()
        self.add_note(f"{what} FAILED: {traceback.format_exc().strip().splitlines()[-1]}")

    def add_note(self, text: str) -> None:
        self.notes.append(text)
        self._write_summary()

    def section(self, key: str, text: str) -> None:
        """Add a ready-made markdown section (the accuracy table)."""
        self.sections[key] = text
        if key not in self.order:
            self.order.append(key)
        self._write_summary()

    def markdown(self) -> str:
        parts = [self.header]
        parts += [markdown(self.tables[k], self.copy_gbps, f"{k}.png") if k in self.tables
                  else self.sections[k] for k in self.order]
        parts += [f"- {n}" for n in self.notes]
        return "\n".join(parts) + "\n"

    def _write_summary(self) -> None:
        (self.out / "summary.md").write_text(self.markdown())


def _header(device: str, copy_gbps: float, cuda: bool, cfg) -> str:
    copy_how = (f"device-to-device torch copy of {cfg.copy_bytes >> 20} MiB, do_bench median"
                if cuda else f"CPU torch copy of {cfg.copy_bytes >> 20} MiB, perf_counter median")
    n = cfg.graph_calls
    modes = (f"`graph`: {n} calls per CUDA graph (inputs rotated over several sets so mid sizes "
             f"do not run from L2), replays timed by `triton.testing.do_bench` (median) / {n}; "
             "`eager`: do_bench of one call (L2 flushed before each call; the host launch cost "
             "hides behind the flush, so this is device time); `eager-wall`: host clock over "
             f"{cfg.wall_calls} back-to-back calls + synchronize (launch and Python overhead "
             "included; the eager-call tables use their own counts, given with each); `synced` / "
             "`pipelined` (JAX): `block_until_ready` after every jitted call / once after "
             "back-to-back calls; `roofline`: bytes / copy bandwidth. Method: bench/NOTES.md."
             if cuda else
             "**No CUDA GPU: this is a harness check, not a benchmark.** Tiny sizes run through "
             "Triton's CPU interpreter (`eager` = perf_counter median, `eager-wall` = the same "
             "back-to-back loop as on a GPU); the times, GB/s and % of copy below only show that "
             "the harness works and say nothing about fp8kv's speed or how it compares.")
    title = "## Benchmarks" if cuda else f"## Benchmarks ({CPU_LABEL})"
    return "\n".join([
        title, "",
        f"{device}; torch {torch.__version__}, triton {triton.__version__}, Python "
        f"{platform.python_version()}.", "",
        f"Copy bandwidth (bytes read + written, {copy_how}): **{copy_gbps:.0f} GB/s**; "
        "\"% of copy\" is relative to it.", "",
        "Time: median per call in microseconds. GB/s: the minimal bytes of one call (each input "
        "read once, each output written once) / time. " + modes, ""])


def warm_up_gpu(device, seconds: float = 1.0) -> None:
    """Keep the GPU busy for a moment so that the first table does not run at idle clocks."""
    import time
    x = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            x.add_(1)
        torch.cuda.synchronize()
    del x


def main(argv=None) -> None:
    args = _parse(argv)
    cuda = torch.cuda.is_available()
    if not cuda:  # say so before anything runs
        print(CPU_BANNER, flush=True)
    cfg = make_config(cuda, args.quick)
    device = torch.device("cuda" if cuda else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    timer = Timer(cfg, cuda)
    name = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or 'unknown'})"
    if cuda:
        warm_up_gpu(device)
    copy_gbps = copy_bandwidth(timer, device)
    print(f"{name}: copy bandwidth {copy_gbps:.0f} GB/s (bytes read + written)", flush=True)
    report = Report(args.out, _header(name, copy_gbps, cuda, cfg), copy_gbps,
                    label="" if cuda else CPU_LABEL)

    # "write" is both write tables; "variants" alone is the second one. Each step gives a list of
    # tables; a step that fails is reported and the run goes on.
    def one(build):
        return lambda: [build(device, cfg, timer, copy_gbps)]

    steps = [({"write"}, "table table_write", one(write_torch.table_write)),
             ({"write", "variants"}, "table table_variants", one(write_torch.table_variants)),
             ({"small"}, "table write_small", one(small_writes.table_write_small)),
             ({"dequant"}, "table table_dequant", one(dequant.table_dequant)),
             ({"dynamic"}, "table table_dynamic", one(dynamic.table_dynamic)),
             ({"eager"}, "eager tables", lambda: eager.eager_tables(device, cfg, cuda)),
             ({"sweep"}, "sweep", lambda: sweep.sweep_tables(device, cfg, timer))]
    for keys, label, build in steps:
        if keys & args.only:
            try:
                for table in build():
                    report.emit(table)
            except Exception:
                report.fail(label)
            free_memory()
    if "accuracy" in args.only:
        _accuracy(args.out, report)
    # JAX last: see bench.jax_tables for why.
    if args.only & {"jax", "jax_layers"} or "dequant" in report.tables:
        _jax_phase(args, cfg, copy_gbps, cuda, report)

    text = report.markdown()
    print("\n" + text)
    print(f"wrote {args.out}/: summary.md and {len(report.order)} tables (CSV + PNG)")
    if not cuda:
        print(CPU_BANNER)


def _accuracy(out: Path, report: Report) -> None:
    """The accuracy table: NumPy on the host, the same data on any machine (not a timing)."""
    print("accuracy: attention error per scale scheme (NumPy) ...", flush=True)
    try:
        rows = accuracy.run(out)
    except Exception:
        report.fail("accuracy table")
        return
    report.section("accuracy", "\n".join([
        "### Attention accuracy of an FP8 KV cache per scale scheme (NumPy: real data, not a "
        "timing)", "",
        "Computed with NumPy through fp8kv's reference write and dequantize (the exact bytes of "
        "the kernels); real results on any machine, not a timing. Decode attention "
        f"({accuracy.NUM_QUERIES} queries, {accuracy.Q_HEADS} query heads over "
        f"{accuracy.KV_HEADS} kv heads, head_dim {accuracy.HEAD_DIM}) over bf16 K/V against the "
        "same attention over K/V written to an FP8 cache and read back as bf16; "
        "`plain` and `outliers` K/V (see bench/accuracy.py). Errors are relative L2 and max "
        "abs of the attention output, and relative L2 of K and V.", "",
        accuracy.markdown(rows), "",
        "![Attention accuracy of an FP8 KV cache per scale scheme](accuracy.png)", ""]))


def _jax_phase(args, cfg, copy_gbps, cuda, report: Report) -> None:
    with mock.patch.dict(os.environ), warnings.catch_warnings():
        # Donation is a no-op on some backends (the CPU); that is not news in a benchmark log.
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        loaded, reason = jax_tables.load_jax(cuda)
        if loaded is None:
            print(f"JAX: {reason}", flush=True)
            if args.only & {"jax", "jax_layers"}:
                report.add_note(f"JAX tables {reason}")
            if "dequant" in report.tables:
                report.tables["dequant"].note(f"fp8kv-jax rows {reason}")
                report.emit(report.tables["dequant"])
            return
        jax, fp8kv_jax = loaded
        builds = []
        if "jax" in args.only:
            builds += [jax_tables.table_write_jax, jax_tables.table_write_jax_calls,
                       jax_tables.tables_write_jax_cache, jax_tables.table_dequant_jax_calls,
                       jax_profile.table_jax_call_phases]
        if "jax_layers" in args.only:   # many layers per jitted step (bench.jax_layers)
            builds += list(jax_layers.TABLES)
        if builds:
            for build in builds:
                try:
                    made = build(jax, fp8kv_jax, cfg, copy_gbps, cuda)
                    for table in ([made] if isinstance(made, Table) else made):
                        if not cuda:
                            table.note("Without a GPU fp8kv_jax runs its jnp path (no Triton): "
                                       "these rows only check the harness.")
                        report.emit(table)
                except Exception:
                    report.fail(f"JAX table {build.__name__}")
        if "dequant" in report.tables:
            table = report.tables["dequant"]
            try:
                jax_tables.add_dequant_rows(jax, fp8kv_jax, cfg, table)
                table.note("fp8kv-jax rows: `call` = wall time of one `jax.jit` call to "
                           f"`block_until_ready`; `loop` = a jitted fori_loop of {cfg.jax_loop} "
                           f"calls / {cfg.jax_loop}.")
            except Exception:
                report.fail("JAX dequantize rows")
            report.emit(table)


if __name__ == "__main__":
    main()
