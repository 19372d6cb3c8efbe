"""``python -m bench [--out DIR] [--only write,variants,dequant,sweep,jax] [--quick]``.

``--only`` names: ``write`` (the torch write table and the variants table), ``variants`` (the
variants table alone), ``dequant`` (with fp8kv-jax rows when JAX is usable), ``sweep`` (tuning;
default on a GPU only), ``jax`` (the JAX write table).
"""
from __future__ import annotations

import os

# JAX reads this at its import only; set it before anything can import jax (torch would otherwise
# find 75 % of the GPU already taken by JAX).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import platform  # noqa: E402
import traceback  # noqa: E402
from unittest import mock  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from . import dequant, jax_tables, sweep, write_torch  # noqa: E402
from .common import Timer, copy_bandwidth, free_memory, make_config  # noqa: E402
from .plot import plot_table  # noqa: E402
from .results import Table, markdown, write_csv  # noqa: E402

TABLES = ("write", "variants", "dequant", "sweep", "jax")


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark fp8kv against the PyTorch/XLA code it replaces; write one CSV and "
                    "one PNG per table and summary.md to --out.",
        epilog="--only names: write (the torch write table and the variants table), variants "
               "(the variants table alone), dequant (with fp8kv-jax rows when JAX is usable), "
               "sweep (tuning; default on a GPU only), jax (the JAX write table).")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                   help="output directory (default: bench/out/)")
    p.add_argument("--only", default=None,
                   help=f"comma-separated subset of {','.join(TABLES)} (default: all; the sweep "
                        "only on a GPU)")
    p.add_argument("--quick", action="store_true", help="small GPU sizes and short timings")
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

    def __init__(self, out: Path, header: str, copy_gbps: float):
        self.out, self.header, self.copy_gbps = out, header, copy_gbps
        self.tables: dict[str, Table] = {}
        self.notes: list[str] = []    # failures and skipped tables

    def emit(self, table: Table) -> None:
        self.tables[table.key] = table
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

    def markdown(self) -> str:
        parts = [self.header]
        parts += [markdown(t, self.copy_gbps, f"{t.key}.png") for t in self.tables.values()]
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
             "included); `roofline`: bytes / copy bandwidth."
             if cuda else
             "CPU mode: tiny sizes through Triton's interpreter, `eager` = perf_counter median; "
             "the numbers only show that the harness works.")
    return "\n".join([
        "## Benchmarks", "",
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
    report = Report(args.out, _header(name, copy_gbps, cuda, cfg), copy_gbps)

    # "write" is both write tables; "variants" alone is the second one.
    steps = [({"write"}, write_torch.table_write),
             ({"write", "variants"}, write_torch.table_variants),
             ({"dequant"}, dequant.table_dequant)]
    for keys, build in steps:
        if keys & args.only:
            try:
                report.emit(build(device, cfg, timer, copy_gbps))
            except Exception:
                report.fail(f"table {build.__name__}")
            free_memory()
    if "sweep" in args.only:
        try:
            for table in sweep.sweep_tables(device, cfg, timer):
                report.emit(table)
        except Exception:
            report.fail("sweep")
        free_memory()
    # JAX last: see bench.jax_tables for why.
    if "jax" in args.only or "dequant" in report.tables:
        _jax_phase(args, cfg, copy_gbps, cuda, report)

    text = report.markdown()
    print("\n" + text)
    print(f"wrote {args.out}/: summary.md and {len(report.tables)} tables (CSV + PNG)")


def _jax_phase(args, cfg, copy_gbps, cuda, report: Report) -> None:
    with mock.patch.dict(os.environ), warnings.catch_warnings():
        # Donation is a no-op on some backends (the CPU); that is not news in a benchmark log.
        warnings.filterwarnings("ignore", message=".*donated buffers.*")
        loaded, reason = jax_tables.load_jax(cuda)
        if loaded is None:
            print(f"JAX: {reason}", flush=True)
            if "jax" in args.only:
                report.add_note(f"JAX write table {reason}")
            if "dequant" in report.tables:
                report.tables["dequant"].note(f"fp8kv-jax rows {reason}")
                report.emit(report.tables["dequant"])
            return
        jax, fp8kv_jax = loaded
        if "jax" in args.only:
            try:
                report.emit(jax_tables.table_write_jax(jax, fp8kv_jax, cfg, copy_gbps, cuda))
            except Exception:
                report.fail("JAX write table")
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
