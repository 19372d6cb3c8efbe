"""Benchmarks of fp8kv against the code it replaces: ``python -m bench [--out DIR] [--only ...] [--quick]``.

One process measures the device's copy bandwidth, then every table (torch write, write variants,
page dequantization, a tuning sweep, and the JAX frontend last), and writes one CSV and one PNG per
table plus ``summary.md``. Without CUDA it runs tiny sizes through Triton's CPU interpreter, which
shows the harness works but says nothing about speed.
"""
