"""Benchmarks of fp8kv against the code it replaces: ``python -m bench [--out DIR] [--only ...] [--quick]``.

One process measures the device's copy bandwidth, then every table (torch write, write variants,
page dequantization, eager calls against single-launch Triton anchors and an empty kernel, a
tuning sweep, attention accuracy per scale scheme, and the JAX tables last; the list is
``bench/tables.py``), and writes one CSV and one PNG per table plus ``summary.md``; its exit status
is 1 if any table failed. Without a CUDA GPU it says so first and runs only a short harness check
through Triton's CPU interpreter: those numbers are not performance, and every title and CSV row
says so. Method: ``bench/NOTES.md``.
"""
