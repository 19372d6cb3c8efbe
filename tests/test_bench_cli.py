"""``python -m bench`` as a user meets it: ``--help`` without importing torch, JAX, Triton or NumPy; a progress
line per table and a total; a non-zero exit status when a table fails, with the summary still
written; CSVs of a CPU run marked as not performance; no CSV for a table without rows, and the
summary saying why."""
from __future__ import annotations

import csv
import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.tables import ENTRIES, KINDS, only_names, select

ROOT = Path(__file__).resolve().parents[1]
CPU_LABEL = "CPU interpreter - not performance"


def _python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_help_imports_neither_torch_nor_jax():
    got = _python("""
        import json, runpy, sys
        sys.argv = ["python -m bench", "--help"]
        try:
            runpy.run_module("bench", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            status = e.code
        heavy = [m for m in ("torch", "jax", "triton", "matplotlib", "numpy") if m in sys.modules]
        print("RESULT " + json.dumps([status, heavy]))
    """, timeout=60)
    assert got.returncode == 0, got.stderr
    assert "usage: python -m bench" in got.stdout
    assert "--only names: write" in " ".join(got.stdout.split())
    status, heavy = json.loads(got.stdout.split("RESULT ")[1])
    assert status == 0
    # What makes --help fast is importing nothing heavy; its time is not asserted (a loaded
    # host would make that flaky).
    assert heavy == []      # no torch, jax, triton, matplotlib or numpy for --help


def test_unknown_only_name_is_a_usage_error():
    got = _python("""
        import sys
        from bench.__main__ import main
        main(["--only", "write,nope"])
    """, timeout=60)
    assert got.returncode == 2
    assert "--only: unknown table(s) ['nope']" in got.stderr
    assert "torch" not in got.stderr


def test_registry_entries():
    """Every entry names a known kind; --only names and the default selection are as documented."""
    names = [e.name for e in ENTRIES]
    assert len(set(names)) == len(names)
    assert all(e.kind in KINDS and ":" in e.build for e in ENTRIES)
    assert all(e.needs for e in ENTRIES if e.kind == "jax-rows")
    assert list(only_names()) == ["write", "variants", "small", "rope", "nvfp4", "dequant",
                                  "dynamic", "attention", "attention_ragged", "eager",
                                  "sweep", "attention_sweep", "accuracy", "jax", "jax_layers"]
    assert [e.name for e in select({"write"}, cuda=False)] == ["write", "variants"]
    assert [e.name for e in select({"dequant"}, cuda=False)] == ["dequant", "jax dequant rows"]
    assert not {"sweep", "attention sweep"} & {e.name for e in select(None, cuda=False)}
    assert [e.name for e in select({"sweep"}, cuda=True)] == ["sweep", "attention sweep"]
    assert [e.name for e in select(None, cuda=True)] == names
    # JAX entries after every torch one (importing jax_triton changes the environment).
    kinds = [e.kind.startswith("jax") for e in ENTRIES]
    assert kinds == sorted(kinds)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_registry_builders_exist(entry):
    pytest.importorskip("torch")   # the builders' modules measure torch beside JAX
    module, function = entry.build.split(":")
    assert callable(getattr(importlib.import_module(f"bench.{module}"), function))


def _needs_bench_run():
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")


FAILING_RUN = """
    import runpy, sys
    import bench.write_torch as w
    from bench.results import Table

    def boom(device, cfg, timer, copy_gbps):
        raise RuntimeError("boom: the write table broke")

    def tiny(device, cfg, timer, copy_gbps):
        t = Table("write_variants", "Variants", "A stand-in table.", plot="bars")
        t.add("case a", 1, "fp8kv", "eager", 2.0, 1000)
        return t

    w.table_write, w.table_variants = boom, tiny
    sys.argv = ["python -m bench", "--only", "write", "--out", sys.argv[1]]
    runpy.run_module("bench", run_name="__main__", alter_sys=True)
"""


def test_failing_table_fails_the_run(tmp_path):
    """`python -m bench` exits 1 when a table raises; the other tables run and the summary lists
    both (a subprocess: the real exit path, `sys.exit(main())`)."""
    _needs_bench_run()
    got = subprocess.run([sys.executable, "-c", textwrap.dedent(FAILING_RUN), str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert got.returncode == 1, got.stdout + got.stderr
    out = got.stdout
    progress = [line for line in out.splitlines() if line.startswith("[")]
    # The failing entry's line is cut by its traceback (on stderr) and said again with FAILED.
    assert progress[0] == "[1/2] write ...", progress
    assert re.fullmatch(r"\[1/2\] write \.\.\. \d+ s: FAILED", progress[1]), progress
    assert re.fullmatch(r"\[2/2\] variants \.\.\. \d+ s: write_variants", progress[2]), progress
    assert len(progress) == 3, progress
    assert "total " in out and "1 FAILED (write: RuntimeError: boom: the write table broke)" in out
    assert "RuntimeError: boom" in got.stderr   # the traceback
    summary = (tmp_path / "summary.md").read_text()
    assert "- write FAILED: RuntimeError: boom: the write table broke" in summary
    assert "### Variants" in summary
    rows = list(csv.DictReader(open(tmp_path / "write_variants.csv")))
    assert [r["case"] for r in rows] == ["case a"]
    cuda = "No CUDA GPU found" not in out
    assert rows[0]["label"] == ("" if cuda else CPU_LABEL)
    assert not (tmp_path / "write.csv").exists()


def test_progress_lines_and_total(tmp_path, monkeypatch, capsys):
    """In process: `main()` returns 0 when every table ran; a progress line per entry; a table
    without rows gets no CSV and no plot, and the summary says why; a partly failed table fails
    the run."""
    _needs_bench_run()
    import bench.__main__ as cli
    from bench.results import Table
    from bench.tables import Entry

    def rows(device, cfg, timer, copy_gbps):
        t = Table("t_rows", "With rows", "Two rows.")
        t.add("1 token", 1, "fp8kv", "eager", 3.0, 100)
        t.add("2 tokens", 2, "fp8kv", "eager", 4.0, 200)
        return t

    def empty(device, cfg, timer, copy_gbps):
        t = Table("t_empty", "Without rows", "Nothing to time here.")
        t.note("skipped: needs a GPU")
        yield t

    def partly(device, cfg, timer, copy_gbps):
        t = Table("t_partly", "Partly failed", "One size failed.")
        t.add("1 token", 1, "fp8kv", "eager", 3.0, 100)
        t.fail("16 tokens: ValueError: no")
        return t

    import bench.write_torch as w
    monkeypatch.setattr(w, "rows", rows, raising=False)
    monkeypatch.setattr(w, "empty", empty, raising=False)
    monkeypatch.setattr(w, "partly", partly, raising=False)
    two = (Entry("rows", "write_torch:rows", "torch"), Entry("empty", "write_torch:empty", "torch"))
    monkeypatch.setattr(cli, "select", lambda only, cuda: list(two))
    assert cli.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\[1/2\] rows \.\.\. \d+ s: t_rows$", out, re.M), out
    assert re.search(r"^\[2/2\] empty \.\.\. \d+ s: t_empty has no rows \(skipped: needs a "
                     r"GPU\)$", out, re.M), out
    assert "none failed" in out
    assert (tmp_path / "t_rows.csv").exists() and (tmp_path / "t_rows.png").exists()
    assert not (tmp_path / "t_empty.csv").exists() and not (tmp_path / "t_empty.png").exists()
    summary = (tmp_path / "summary.md").read_text()
    assert "No rows, so no CSV and no plot: skipped: needs a GPU." in summary

    monkeypatch.setattr(cli, "select",
                        lambda only, cuda: [Entry("partly", "write_torch:partly", "torch")])
    assert cli.main(["--out", str(tmp_path / "partly")]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^\[1/1\] partly \.\.\. \d+ s: t_partly FAILED in part$", out, re.M), out
    summary = (tmp_path / "partly" / "summary.md").read_text()
    assert "FAILED in part" in summary and "16 tokens: ValueError: no" in summary
