"""Result tables: rows, derived bandwidth, CSV and markdown output."""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Row:
    case: str
    size: int              # x value of line plots (tokens or table entries); unused by bar plots
    provider: str
    mode: str              # timing mode (see bench.common.Timer), "-" for the roofline
    time_us: float
    nbytes: int            # minimal traffic of one call

    @property
    def gbps(self) -> float:
        return self.nbytes / self.time_us / 1e3 if self.time_us > 0 else 0.0


@dataclass
class Table:
    """One benchmark table: one CSV, one PNG and one markdown section.

    ``plot`` is ``"lines"`` (time and GB/s against ``size``), ``"bars"`` (GB/s per case) or
    ``"time"`` (time per call per case; rows of provider ``floor`` drawn as lines);
    ``sort`` lists rows fastest first (the sweep). ``notes`` collect skips and failures;
    ``failures`` the part of a table that failed while the rest still ran (the run then fails).
    ``label`` (e.g. "CPU interpreter - not performance") is appended to the title everywhere and
    is the ``label`` column of every CSV row.
    """

    key: str
    title: str
    description: str
    xlabel: str = ""
    plot: str = "lines"
    sort: bool = False
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    label: str = ""

    @property
    def full_title(self) -> str:
        return f"{self.title} ({self.label})" if self.label else self.title

    def add(self, case, size, provider, mode, time_us, nbytes) -> Row:
        row = Row(case, int(size), provider, mode, float(time_us), int(nbytes))
        self.rows.append(row)
        return row

    def add_roofline(self, case, size, nbytes, copy_gbps: float) -> None:
        """The time the copy bandwidth allows for ``nbytes``."""
        self.add(case, size, "roofline", "-", nbytes / copy_gbps / 1e3, nbytes)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def fail(self, text: str) -> None:
        """A part of the table failed (the other rows still count): noted, and the run fails."""
        self.note(f"FAILED: {text}")
        self.failures.append(text)

    def ordered(self) -> list[Row]:
        return sorted(self.rows, key=lambda r: r.time_us) if self.sort else list(self.rows)


def tokens_case(tokens: int) -> str:
    return f"{tokens:,} token" + ("" if tokens == 1 else "s")


def _num(x: float) -> str:
    """Numbers for people: 3 significant digits, no exponent above 0.001."""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 0.001:
        return f"{x:.3g}" if x < 1 else f"{x:.2f}"
    return f"{x:.2e}"


CSV_COLUMNS = ("case", "size", "provider", "mode", "time_us", "bytes", "gbps", "pct_of_copy",
               "label")


def write_csv(table: Table, copy_gbps: float, path: Path) -> None:
    """The table's rows; ``label`` is the run's mark on every row (empty on a GPU run; "CPU
    interpreter - not performance" without one). A table without rows has no CSV."""
    if not table.rows:
        raise ValueError(f"table {table.key}: no rows, so no CSV (notes: {table.notes})")
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in table.ordered():
            w.writerow([r.case, r.size, r.provider, r.mode, f"{r.time_us:.6g}", r.nbytes,
                        f"{r.gbps:.6g}", f"{100 * r.gbps / copy_gbps:.6g}", table.label])


def markdown(table: Table, copy_gbps: float, image: str | None = None,
             bandwidth: bool = True) -> str:
    """The table's section of ``summary.md``: title, what it measures, the numbers, notes, the
    plot. ``bandwidth``: GB/s and % of copy columns (a GPU run; on the CPU they mean nothing).

    A table without rows says why there is no CSV and no plot (its notes)."""
    lines = [f"### {table.full_title}", "", table.description, ""]
    if not table.rows:
        reason = "; ".join(n.rstrip(".") for n in table.notes) or "nothing ran"
        return "\n".join(lines + [f"No rows, so no CSV and no plot: {reason}.", ""])
    if bandwidth:
        lines += ["| case | provider | mode | time (us) | GB/s | % of copy |",
                  "| --- | --- | --- | ---: | ---: | ---: |"]
        lines += [f"| {r.case} | {r.provider} | {r.mode} | {_num(r.time_us)} | "
                  + (f"{_num(r.gbps)} | {_num(100 * r.gbps / copy_gbps)} |" if r.nbytes
                     else "- | - |")
                  for r in table.ordered()]
    else:
        lines += ["| case | provider | mode | time (us) |", "| --- | --- | --- | ---: |"]
        lines += [f"| {r.case} | {r.provider} | {r.mode} | {_num(r.time_us)} |"
                  for r in table.ordered()]
    lines.append("")
    lines += [f"- {n}" for n in table.notes]
    if table.notes:
        lines.append("")
    if image:
        lines += [f"![{table.full_title}]({image})", ""]
    return "\n".join(lines)
