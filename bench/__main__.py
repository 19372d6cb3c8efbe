"""``python -m bench [--out DIR] [--only NAMES] [--quick] [--no-plots]``: every table of
``bench.tables``.

Prints one line per entry of ``bench.tables`` (``[3/12] dequant ... 41 s: dequant``, the tables it
made), then where the files are and the total time; writes one CSV and one PNG per table (no PNG
with ``--no-plots``) and ``summary.md`` to ``--out``. The exit status is 1 when any table (or a
part of one) failed: the summary still lists what ran, and what failed, and why.

Without a CUDA GPU only a short harness check runs, through Triton's CPU interpreter: its numbers
are not performance, and every title, the summary and every CSV row (column ``label``) say so.

torch, Triton and JAX are imported when the run starts, not at import: ``--help`` needs none of
them.
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
import importlib  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

from .tables import ENTRIES, only_names, select  # noqa: E402

CPU_LABEL = "CPU interpreter - not performance"
CPU_BANNER = ("No CUDA GPU found: only a short harness check runs, through Triton's CPU "
              "interpreter; its numbers are not performance.")
JAX_CPU_NOTE = ("Without a GPU fp8kv_jax runs its jnp path (no Triton): these rows only check the "
                "harness.")


def _parse(argv, entries=ENTRIES):
    names = only_names(entries)
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark fp8kv against the PyTorch/XLA code it replaces; write one CSV and "
                    "one PNG per table and summary.md to --out. Exit status 1 if any table "
                    "failed.",
        epilog="--only names: " + "; ".join(f"{n} ({a})" if a else n for n, a in names.items())
               + ". Without a CUDA GPU only a short harness check runs through Triton's CPU "
               "interpreter: its numbers are not performance.")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                   help="output directory (default: bench/out/)")
    p.add_argument("--only", default=None,
                   help=f"comma-separated subset of {','.join(names)} (default: all; the sweep "
                        "only on a GPU)")
    p.add_argument("--quick", action="store_true",
                   help="every table, with fewer sizes and shorter timings (a GPU smoke run of "
                        "about a minute); no effect without a GPU")
    p.add_argument("--no-plots", dest="plots", action="store_false",
                   help="CSV files and summary.md only, no PNG (the layout of the runs kept in "
                        "bench/results/)")
    args = p.parse_args(argv)
    if args.only is not None:
        args.only = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = args.only - set(names)
        if unknown:
            p.error(f"--only: unknown table(s) {sorted(unknown)}; choose from {','.join(names)}")
    return args


def _header(device: str, versions: str, copy_gbps: float, cuda: bool, cfg, date: str) -> str:
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
             "back-to-back loop as on a GPU); the times below (and the GB/s in the CSV files) "
             "only show that the harness works and say nothing about fp8kv's speed or how it "
             "compares, so the tables and plots show times only. Every "
             f"CSV row says so in its `label` column (\"{CPU_LABEL}\").")
    title = "## Benchmarks" if cuda else f"## Benchmarks ({CPU_LABEL})"
    return "\n".join([
        title, "", f"{device}; {versions}; run on {date} (UTC).", "",
        f"Copy bandwidth (bytes read + written, {copy_how}): **{copy_gbps:.0f} GB/s**; "
        "\"% of copy\" is relative to it.", "",
        "Time: median per call in microseconds. GB/s: the minimal bytes of one call (each input "
        "read once, each output written once) / time. " + modes, ""])


def warm_up_gpu(device, seconds: float = 1.0) -> None:
    """Keep the GPU busy for a moment so that the first table does not run at idle clocks."""
    import torch
    x = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            x.add_(1)
        torch.cuda.synchronize()
    del x


def _builder(entry):
    module, function = entry.build.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


class _Run:
    """What the builders are called with, and JAX, loaded once for every JAX entry."""

    def __init__(self, device, cfg, timer, copy_gbps: float, cuda: bool, out: Path,
                 plots: bool = True):
        self.device, self.cfg, self.timer = device, cfg, timer
        self.copy_gbps, self.cuda, self.out, self.plots = copy_gbps, cuda, out, plots
        self._jax = None   # (jax, fp8kv_jax) or the reason they cannot be used

    def jax(self):
        """``((jax, fp8kv_jax), None)``, or ``(None, reason)`` where JAX cannot be used."""
        if self._jax is None:
            from .jax_tables import load_jax
            loaded, reason = load_jax(self.cuda)
            self._jax = loaded if loaded is not None else reason
        return (self._jax, None) if isinstance(self._jax, tuple) else (None, self._jax)


def _run_entry(entry, run: _Run, report) -> str:
    """Run one entry; returns what its progress line says: the tables it made (their files'
    names), or why it made none. Raises what its builder raises."""
    from .results import Table

    build = _builder(entry)
    if entry.kind == "section":
        report.section(entry.name, build(run.out, run.plots))
        return entry.name
    if entry.kind == "torch":
        made = build(run.device, run.cfg, run.timer, run.copy_gbps)
    else:
        loaded, reason = run.jax()
        if loaded is None:
            return reason
        jax, fp8kv_jax = loaded
        if entry.kind == "jax-rows":
            table = report.tables.get(entry.needs)
            if table is None:
                return f"skipped: no {entry.needs} table in this run"
            build(jax, fp8kv_jax, run.cfg, table)
            report.emit(table)
            return f"rows added to {table.key}"
        else:
            made = build(jax, fp8kv_jax, run.cfg, run.copy_gbps, run.cuda)
    said = []
    for table in [made] if isinstance(made, Table) else made:
        if entry.kind == "jax" and not run.cuda and table.rows:
            table.note(JAX_CPU_NOTE)
        report.emit(table)
        if table.failures:
            report.fail_part(f"{entry.name}: table {table.key}", table)
            said.append(f"{table.key} FAILED in part")
        elif not table.rows:
            said.append(f"{table.key} has no rows (" + "; ".join(table.notes) + ")")
        else:
            said.append(table.key)
    return ", ".join(said)


def run_entries(entries, run: _Run, report) -> None:
    """One line per entry: ``[i/N] name ...`` when it starts, completed with its time and the
    tables it made (or why it made none) when it ends. A failing entry is reported (traceback,
    a FAILED line and a summary note) and the run goes on."""
    from .common import free_memory

    jax_reason_noted = False
    for i, entry in enumerate(entries, 1):
        tag = f"[{i}/{len(entries)}] {entry.name} ..."
        print(tag, end="", flush=True)
        start = time.perf_counter()
        try:
            said = _run_entry(entry, run, report)
        except Exception:
            print(flush=True)   # the traceback goes on lines of its own, then the line again
            report.fail(entry.name)
            said = "FAILED"
            print(tag, end="")
        seconds = time.perf_counter() - start
        if said.startswith("skipped") and entry.kind.startswith("jax") and not jax_reason_noted:
            jax_reason_noted = True
            report.add_note(f"JAX tables {said}")
        print(f" {seconds:.0f} s" + (f": {said}" if said else ""), flush=True)
        free_memory()


def _files_line(out: Path, report, plots: bool) -> str:
    """Where the run's files are, and which."""
    tables = len(report.files)
    kinds = "a CSV and a PNG" if plots else "a CSV"
    extra = ""
    if "accuracy" in report.sections:
        extra = ", accuracy.csv" + (" + accuracy.png" if plots else "")
    return f"wrote {out}/: summary.md, {kinds} per table with rows ({tables}){extra}"


def main(argv=None) -> int:
    """Run the benchmark; returns the exit status (1 when anything failed)."""
    args = _parse(argv)
    started = time.perf_counter()

    import torch
    import triton

    from .common import Timer, copy_bandwidth, make_config
    from .report import Report

    cuda = torch.cuda.is_available()
    if not cuda:  # say so before anything runs
        print(CPU_BANNER, flush=True)
    entries = select(args.only, cuda)
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
    versions = (f"torch {torch.__version__}, triton {triton.__version__}, Python "
                f"{platform.python_version()}")
    date = time.strftime("%Y-%m-%d", time.gmtime())
    report = Report(args.out, _header(name, versions, copy_gbps, cuda, cfg, date), copy_gbps,
                    label="" if cuda else CPU_LABEL, bandwidth=cuda, plots=args.plots)
    run = _Run(device, cfg, timer, copy_gbps, cuda, args.out, args.plots)
    # JAX, imported by the first JAX entry, may change the environment (jax_triton 0.3.1 clears
    # TRITON_CACHE_DIR): it is restored when the run ends. Donation is a no-op on some backends
    # (the CPU); that is not news in a benchmark log.
    with mock.patch.dict(os.environ), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        run_entries(entries, run, report)

    print(_files_line(args.out, report, args.plots))
    total = time.perf_counter() - started
    status = 1 if report.failures else 0
    print(f"total {total:.0f} s, {len(entries)} entries: "
          + (f"{len(report.failures)} FAILED ({'; '.join(report.failures)})" if status
             else "none failed"), flush=True)
    if not cuda:
        print(CPU_BANNER)
    return status


if __name__ == "__main__":
    sys.exit(main())
