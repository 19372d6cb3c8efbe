"""One PNG per table (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from .results import Table, _num  # noqa: E402


def _series(table: Table) -> dict[str, list]:
    """Rows grouped by provider and mode, in first-seen order: one line or bar colour each."""
    series: dict[str, list] = {}
    for r in table.rows:
        label = r.provider if r.mode == "-" else f"{r.provider} ({r.mode})"
        series.setdefault(label, []).append(r)
    return series


def _copy_line(ax, copy_gbps: float) -> None:
    ax.axhline(copy_gbps, color="gray", linestyle="--", linewidth=1,
               label=f"copy bandwidth ({copy_gbps:.0f} GB/s)")


def plot_table(table: Table, copy_gbps: float, path: Path, bandwidth: bool = True) -> None:
    """Save ``table``'s :func:`figure` as a PNG (nothing for a table without rows)."""
    if not table.rows:
        return
    fig = figure(table, copy_gbps, bandwidth)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(table: Table, copy_gbps: float, bandwidth: bool = True):
    """``table`` as a figure: time and GB/s against size (lines), GB/s per case (bars), or time
    per call per case (time).

    ``bandwidth``: whether GB/s mean anything in this run (a GPU's; on the CPU they are the
    interpreter's and next to nothing). Without it, or where no row moves bytes, the figure
    shows time only: no bandwidth panel, no copy-bandwidth line."""
    series = _series(table)
    bandwidth = bandwidth and any(r.nbytes for r in table.rows)
    if table.plot == "lines":
        fig, axes = plt.subplots(1, 2 if bandwidth else 1, figsize=(13 if bandwidth else 7, 5),
                                 squeeze=False)
        ax_t, ax_b = axes[0][0], axes[0][1] if bandwidth else None
        for label, rows in series.items():
            rows = sorted(rows, key=lambda r: r.size)
            style = dict(linestyle=":", color="black") if rows[0].provider == "roofline" else {}
            xs = [r.size for r in rows]
            ax_t.plot(xs, [r.time_us for r in rows], marker="o", label=label, **style)
            if ax_b is not None and rows[0].nbytes:   # a floor moves no bytes: time only
                ax_b.plot(xs, [r.gbps for r in rows], marker="o", label=label, **style)
        ax_t.set(xscale="log", yscale="log", xlabel=table.xlabel, ylabel="time per call (us)",
                 title="latency")
        ax_t.grid(True, which="both", alpha=0.3)
        ax_t.legend(fontsize=8)
        if ax_b is not None:
            ax_b.set(xscale="log", xlabel=table.xlabel, ylabel="GB/s (minimal bytes)",
                     title="bandwidth")
            _copy_line(ax_b, copy_gbps)
            ax_b.grid(True, which="both", alpha=0.3)
            ax_b.legend(fontsize=8)
    elif table.plot == "time" or not bandwidth:
        fig, ax_b = _time_bars(table)
    else:
        cases = list(dict.fromkeys(r.case for r in table.ordered()))
        fig, ax_b = plt.subplots(figsize=(max(8, 0.35 * len(cases) * len(series) + 3), 5.5))
        width = 0.8 / len(series)
        for i, (label, rows) in enumerate(series.items()):
            by_case = {r.case: r.gbps for r in rows}
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(cases))]
            values = [by_case.get(c, 0.0) for c in cases]
            bars = ax_b.bar(xs, values, width, label=label)
            ax_b.bar_label(bars, [f"{100 * v / copy_gbps:.0f}%" if v else "" for v in values],
                          fontsize=7)
        ax_b.set_xticks(range(len(cases)), cases, rotation=30, ha="right", fontsize=8)
        ax_b.set(ylabel="GB/s (minimal bytes)")
        _copy_line(ax_b, copy_gbps)
        ax_b.grid(True, axis="y", alpha=0.3)
        ax_b.legend(fontsize=8)
    fig.suptitle(table.full_title)
    fig.tight_layout()
    return fig


def _time_bars(table: Table):
    """Time per call, one group of bars per case and one bar per provider (and mode); rows of the
    provider ``floor`` are horizontal dashed lines across the plot instead of bars."""
    floors = [r for r in table.rows if r.provider == "floor"]
    rows = [r for r in table.rows if r.provider != "floor"]
    series: dict[str, list] = {}
    for r in rows:
        series.setdefault(f"{r.provider} ({r.mode})", []).append(r)
    cases = list(dict.fromkeys(r.case for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.4 * len(cases) * max(len(series), 1) + 3), 5.5))
    width = 0.8 / max(len(series), 1)
    for i, (label, group) in enumerate(series.items()):
        by_case = {r.case: r.time_us for r in group}
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(cases))]
        values = [by_case.get(c, 0.0) for c in cases]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, [_num(v) if v else "" for v in values], fontsize=7)
    for r in floors:
        ax.axhline(r.time_us, color="black", linestyle="--", linewidth=1,
                   label=f"floor: {r.case} ({r.time_us:.3g} us)")
    ax.set_xticks(range(len(cases)), cases, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="time per call (us)", yscale="log")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return fig, ax
