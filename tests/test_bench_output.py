"""What ``python -m bench`` shows and keeps: one line per entry and where the files are (no rows
or summary echoed); titles, cases and plots that say what this machine measured (on the CPU no
GPU mode, no bandwidth panel); ``--no-plots``, the layout of the runs in ``bench/results/``; and
those runs themselves (one GPU run, one CPU harness run, 1 MB at most together)."""
from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from bench.results import CSV_COLUMNS, Table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CPU_LABEL = "CPU interpreter - not performance"


def _table(plot: str, nbytes: int) -> Table:
    t = Table("t", "A table", "Rows.", xlabel="tokens", plot=plot)
    for size in (1, 16):
        t.add(f"{size} tokens", size, "fp8kv", "eager", 3.0 * size, nbytes * size)
    t.add("1 tokens", 1, "floor", "eager", 1.0, 0)
    return t


def _labels(fig) -> list[str]:
    return [text for ax in fig.axes for text in
            [ax.get_title(), ax.get_ylabel()] + [line.get_label() for line in ax.get_lines()]]


@pytest.mark.parametrize("plot", ["lines", "bars", "time"])
def test_plots_show_bandwidth_only_where_it_means_something(plot):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from bench.plot import figure

    gpu = figure(_table(plot, 1000), 4000.0, bandwidth=True)
    cpu = figure(_table(plot, 1000), 8.0, bandwidth=False)
    no_bytes = figure(_table(plot, 0), 4000.0, bandwidth=True)
    try:
        for fig in (cpu, no_bytes):   # time only: no GB/s axis, no copy line
            assert not any("GB/s" in label for label in _labels(fig)), _labels(fig)
            assert [ax.get_ylabel() for ax in fig.axes] == ["time per call (us)"]
        gpu_labels = _labels(gpu)
        if plot == "time":
            assert not any("GB/s" in label for label in gpu_labels)
        else:
            assert "GB/s (minimal bytes)" in gpu_labels
            assert any(label.startswith("copy bandwidth (4000 GB/s)") for label in gpu_labels)
    finally:
        plt.close("all")


class _CpuTimer:
    """The CPU run's timer without the timing (the builders' own calls still run)."""

    cuda = False
    modes = ("eager",)

    def __init__(self, cfg):
        self.cfg = cfg

    def time(self, mode, fns, sweep=False):
        return 1.0


@pytest.mark.parametrize("name", ["write", "variants", "small", "rope", "nvfp4", "dequant",
                                  "dynamic"])
def test_cpu_tables_name_no_gpu_mode(name):
    """A CPU run's tables (title, description, cases, modes, providers) never say graph or
    replay: their calls are eager."""
    torch = pytest.importorskip("torch")
    from bench.__main__ import _builder
    from bench.common import make_config
    from bench.tables import ENTRIES

    entry = next(e for e in ENTRIES if e.name == name)
    cfg = make_config(False, False)
    made = _builder(entry)(torch.device("cpu"), cfg, _CpuTimer(cfg), 8.0)
    for table in [made] if isinstance(made, Table) else made:
        assert table.rows, table.key
        text = " ".join([table.title, table.description]
                        + [f"{r.case} {r.mode} {r.provider}" for r in table.rows])
        assert not re.search(r"graph|replay", text, re.I), (table.key, text)


def test_traced_phases_split_a_call_into_its_span_and_its_kernels():
    """A traced call of two kernels with a gap between them: ``device`` spans both, ``kernels``
    adds up their durations; the host's own spans and other calls' kernels count for neither."""
    pytest.importorskip("torch")   # the bench's modules import it (the jax leg has none)
    from bench.jax_profile import _phases

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    spans = [("fp8kv-bench:ours:0", 1, 0.0, 100.0), ("thunk", 1, 5.0, 3.0),
             ("attention", 2, 20.0, 28.0), ("merge", 2, 52.0, 2.0), ("later", 2, 120.0, 9.0)]
    events = meta + [{"ph": "X", "name": n, "pid": p, "ts": ts, "dur": dur}
                     for n, p, ts, dur in spans]
    phases = _phases(events, ["ours"])["ours"]
    assert phases == {"dispatch": 20.0, "device": 34.0, "return": 46.0, "call": 100.0,
                      "kernels": 30.0}


def _stand_in_run(monkeypatch, capsys, tmp_path, *args):
    """``bench.__main__.main`` over two stand-in entries (a table and a section)."""
    pytest.importorskip("torch")
    import bench.__main__ as cli
    import bench.write_torch as w
    from bench.tables import Entry

    def rows(device, cfg, timer, copy_gbps):
        return _table("lines", 1000)

    def section(out, plots):
        (out / "s.csv").write_text("x\n")
        return "### A section\n" + ("\n![A section](s.png)\n" if plots else "")

    monkeypatch.setattr(w, "rows", rows, raising=False)
    monkeypatch.setattr(w, "section", section, raising=False)
    entries = [Entry("rows", "write_torch:rows", "torch"),
               Entry("accuracy", "write_torch:section", "section")]
    monkeypatch.setattr(cli, "select", lambda only, cuda: entries)
    status = cli.main(["--out", str(tmp_path), *args])
    return status, capsys.readouterr().out.splitlines()


def test_output_is_one_line_per_entry_and_where_the_files_are(monkeypatch, capsys, tmp_path):
    torch = pytest.importorskip("torch")

    status, lines = _stand_in_run(monkeypatch, capsys, tmp_path)
    assert status == 0
    cpu = not torch.cuda.is_available()
    banner = ["No CUDA GPU found: only a short harness check runs, through Triton's CPU "
              "interpreter; its numbers are not performance."] if cpu else []
    assert lines[:len(banner)] == banner and lines[len(lines) - len(banner):] == banner
    body = lines[len(banner):len(lines) - len(banner)]
    assert re.fullmatch(r".+: copy bandwidth \d+ GB/s \(bytes read \+ written\)", body[0]), body
    assert re.fullmatch(r"\[1/2\] rows \.\.\. \d+ s: t", body[1]), body
    assert re.fullmatch(r"\[2/2\] accuracy \.\.\. \d+ s: accuracy", body[2]), body
    assert body[3] == (f"wrote {tmp_path}/: summary.md, a CSV and a PNG per table with rows (1), "
                       "accuracy.csv + accuracy.png")
    assert re.fullmatch(r"total \d+ s, 2 entries: none failed", body[4]) and len(body) == 5, body
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv", "summary.md", "t.csv", "t.png"]
    summary = (tmp_path / "summary.md").read_text()
    assert "![A table" in summary and "![A section](s.png)" in summary
    assert re.search(r"; run on \d{4}-\d\d-\d\d \(UTC\)\.$", summary, re.M)
    if cpu:   # times only: GB/s mean nothing through the interpreter
        assert "| case | provider | mode | time (us) |\n" in summary and "GB/s |" not in summary


def test_no_plots_writes_csv_and_summary_only(monkeypatch, capsys, tmp_path):
    status, lines = _stand_in_run(monkeypatch, capsys, tmp_path, "--no-plots")
    assert status == 0
    assert f"wrote {tmp_path}/: summary.md, a CSV per table with rows (1), accuracy.csv" in lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv", "summary.md", "t.csv"]
    assert "![" not in (tmp_path / "summary.md").read_text()


def _runs() -> dict:
    return {p.name: p for p in sorted(RESULTS.iterdir())}


def test_results_hold_one_gpu_run_and_one_cpu_run_in_one_megabyte():
    assert sorted(_runs()) == ["cpu", "gpu"]
    files = [f for f in RESULTS.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 1 << 20
    assert all(f.parent.parent == RESULTS for f in files), files   # no folders inside a run


@pytest.mark.parametrize("run", ["gpu", "cpu"])
def test_each_run_has_the_no_plots_layout(run):
    """What ``python -m bench --out bench/results/RUN --no-plots`` writes: summary.md and one CSV
    per table; the CSV rows carry the run's label (the CPU run's says it is not performance)."""
    folder = RESULTS / run
    summary = (folder / "summary.md").read_text()
    assert "![" not in summary
    assert re.search(r"^.+; run on \d{4}-\d\d-\d\d \(UTC\)\.$", summary, re.M)
    assert summary.startswith("## Benchmarks" + ("" if run == "gpu" else f" ({CPU_LABEL})"))
    tables = sorted(folder.glob("*.csv"))
    assert tables and {f.name for f in folder.iterdir()} == {"summary.md"} | {
        f.name for f in tables}
    for f in tables:
        with open(f, newline="") as handle:
            reader = csv.reader(handle)
            header = next(reader)
            if f.name == "accuracy.csv":   # not a timing table: its own columns
                continue
            assert tuple(header) == CSV_COLUMNS, f
            labels = {row[-1] for row in reader}
        assert labels == {"" if run == "gpu" else CPU_LABEL}, (f, labels)
