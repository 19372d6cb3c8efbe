"""What a run writes: one CSV (and one PNG, unless ``--no-plots``) per table with rows, and
``summary.md``, rewritten as each table is done."""
from __future__ import annotations

import traceback
from pathlib import Path

from .results import Table, markdown, write_csv


class Report:
    """Writes each table's CSV and PNG as soon as it is done, and re-writes ``summary.md``.

    A table without rows gets no CSV and no PNG; its section in the summary says why (its
    notes). ``failures`` lists what failed (a table that raised, or a part of one): any makes the
    run's exit status non-zero.
    """

    def __init__(self, out: Path, header: str, copy_gbps: float, label: str = "",
                 bandwidth: bool = True, plots: bool = True):
        self.out, self.header, self.copy_gbps, self.label = out, header, copy_gbps, label
        self.bandwidth = bandwidth   # GB/s mean something here (a GPU run): columns and panels
        self.plots = plots           # a PNG per table (--no-plots: CSV and summary.md only)
        self.tables: dict[str, Table] = {}
        self.sections: dict[str, str] = {}    # markdown of what is not a Table, by key
        self.order: list[str] = []
        self.notes: list[str] = []    # failures and skipped tables
        self.failures: list[str] = []

    def emit(self, table: Table) -> None:
        """Write (or re-write) ``table``; a timing table gets the run's label in its titles."""
        table.label = self.label
        self.tables[table.key] = table
        if table.key not in self.order:
            self.order.append(table.key)
        for suffix in (".csv", ".png"):   # a re-emitted table may have had rows before: no
            (self.out / f"{table.key}{suffix}").unlink(missing_ok=True)   # stale files
        if table.rows:
            write_csv(table, self.copy_gbps, self.out / f"{table.key}.csv")
            if self.plots:
                from .plot import plot_table   # matplotlib: only where plots are made
                plot_table(table, self.copy_gbps, self.out / f"{table.key}.png", self.bandwidth)
        self._write_summary()

    def fail(self, what: str) -> None:
        """Record the exception being handled; the other tables still run."""
        traceback.print_exc()
        last = traceback.format_exc().strip().splitlines()[-1]
        self.failures.append(f"{what}: {last}")
        self.add_note(f"{what} FAILED: {last}")

    def fail_part(self, what: str, table: Table) -> None:
        """``table`` was made, but parts of it failed (:meth:`bench.results.Table.fail`)."""
        self.failures.append(f"{what}: " + "; ".join(table.failures))
        self.add_note(f"{what} FAILED in part (see its notes): " + "; ".join(table.failures))

    def add_note(self, text: str) -> None:
        self.notes.append(text)
        self._write_summary()

    def section(self, key: str, text: str) -> None:
        """Add a ready-made markdown section (the accuracy table)."""
        self.sections[key] = text
        if key not in self.order:
            self.order.append(key)
        self._write_summary()

    @property
    def files(self) -> list[str]:
        """The keys of the tables that have a CSV (and a PNG)."""
        return [k for k in self.order if k in self.tables and self.tables[k].rows]

    def markdown(self) -> str:
        parts = [self.header]
        parts += [markdown(self.tables[k], self.copy_gbps, f"{k}.png" if self.plots else None,
                           self.bandwidth) if k in self.tables
                  else self.sections[k] for k in self.order]
        parts += [f"- {n}" for n in self.notes]
        return "\n".join(parts) + "\n"

    def _write_summary(self) -> None:
        (self.out / "summary.md").write_text(self.markdown())
