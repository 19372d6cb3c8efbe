"""The benchmark's tables, in the order ``python -m bench`` runs them: one :class:`Entry` each.

This module imports nothing heavy (``python -m bench --help`` reads it without torch or JAX): an
entry names its builder as ``"module:function"`` inside the ``bench`` package, imported only when
the entry runs. Adding a table is one line in :data:`ENTRIES`; the builder is called according
to its ``kind``:

* ``"torch"``: ``build(device, cfg, timer, copy_gbps)``
* ``"jax"``: ``build(jax, fp8kv_jax, cfg, copy_gbps, cuda)``; runs after every torch table, with
  JAX imported once for all of them (``bench.jax_tables.load_jax``); skipped, with the reason,
  where JAX cannot be used
* ``"jax-rows"``: ``build(jax, fp8kv_jax, cfg, table)`` adds rows to the table ``needs`` names,
  made earlier in the same run
* ``"section"``: ``build(out_dir)`` returns a ready markdown section (not a timing table)

A ``"torch"`` or ``"jax"`` builder returns a :class:`bench.results.Table`, or an iterable of them
(a generator may yield each as soon as it is done).
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("torch", "jax", "jax-rows", "section")


@dataclass(frozen=True)
class Entry:
    name: str             # the progress line's name
    build: str            # "module:function" in the bench package
    kind: str             # see KINDS
    only: tuple = ()      # the --only names that select it, the one it is listed under first
                          # (default: its name)
    gpu_default: bool = False   # without --only, run on a GPU only
    needs: str = ""       # "jax-rows": the key of the table it adds rows to
    about: str = ""       # what --help says of its --only name

    @property
    def selectors(self) -> tuple:
        return self.only or (self.name,)


ENTRIES = (
    Entry("write", "write_torch:table_write", "torch",
          about="the torch write table and the variants table"),
    Entry("variants", "write_torch:table_variants", "torch", only=("variants", "write"),
          about="the variants table alone"),
    Entry("small", "small_writes:table_write_small", "torch",
          about="small writes (1-256 tokens) under CUDA-graph replay against one-program-per-"
                "token writers, with small-batch plan variants"),
    Entry("rope", "rope:table_rope", "torch",
          about="fused RoPE + FP8 write (rope_write_kv) against an in-place Triton RoPE then "
                "write_kv, Llama-3-8B shapes, 1-65,536 tokens"),
    Entry("nvfp4", "nvfp4:table_nvfp4", "torch",
          about="NVFP4 caches: the write at 1-65,536 tokens and dequantize to bf16 / an FP8 "
                "workspace"),
    Entry("dequant", "dequant:table_dequant", "torch",
          about="page dequantization, with fp8kv-jax rows when JAX is usable"),
    Entry("dynamic", "dynamic:table_dynamic", "torch", about="dynamic-scale placements"),
    Entry("attention", "attention:table_attention", "torch",
          about="paged decode attention over every cache format, the dequantize route, and in "
                "JAX against Pallas's GPU paged_attention"),
    Entry("attention ragged", "attention:table_attention_ragged", "torch",
          only=("attention_ragged", "attention"),
          about="paged attention over ragged batches: shares balanced over seq_lens against "
                "every sequence split alike"),
    Entry("eager", "eager:eager_tables", "torch",
          about="eager calls of fp8kv_torch against single-launch Triton anchors and an empty "
                "kernel"),
    Entry("sweep", "sweep:sweep_tables", "torch", gpu_default=True,
          about="tuning; by default on a GPU only"),
    Entry("attention sweep", "sweep:attention_sweep_tables", "torch", gpu_default=True,
          only=("attention_sweep", "sweep"),
          about="paged attention's size-table candidates (CUDA only)"),
    Entry("accuracy", "accuracy:section", "section",
          about="attention error of an FP8 cache per scale scheme; NumPy, not a timing"),
    Entry("jax write", "jax_tables:table_write_jax", "jax", only=("jax",),
          about="the JAX tables: write, eager calls, cache sizes, dequantize, call phases"),
    Entry("jax write calls", "jax_tables:table_write_jax_calls", "jax", only=("jax",)),
    Entry("jax cache sizes", "jax_tables:tables_write_jax_cache", "jax", only=("jax",)),
    Entry("jax dequant calls", "jax_tables:table_dequant_jax_calls", "jax", only=("jax",)),
    Entry("jax call phases", "jax_profile:table_jax_call_phases", "jax", only=("jax",)),
    Entry("jax layers", "jax_layers:tables_per_layer", "jax", only=("jax_layers",),
          about="many layers per jitted step: per-layer caches, stacked caches under lax.scan "
                "and a Python loop, a stacked prefill dequantize, against XLA's scatter / "
                "gather; a profile of the per-call cost"),
    Entry("jax layers stacked", "jax_layers:table_stacked", "jax", only=("jax_layers",)),
    Entry("jax layers dequant", "jax_layers:table_dequant", "jax", only=("jax_layers",)),
    Entry("jax layers profile", "jax_layers:table_profile", "jax", only=("jax_layers",)),
    Entry("jax attention", "attention:table_attention_jax", "jax", only=("attention",)),
    Entry("jax dequant rows", "jax_tables:add_dequant_rows", "jax-rows", only=("dequant",),
          needs="dequant"),
)


def only_names(entries=ENTRIES) -> dict:
    """Each ``--only`` name -> what it selects (from the first entry that says)."""
    names: dict = {}
    for entry in entries:
        for name in entry.selectors:
            if entry.about and name == entry.selectors[0]:
                names.setdefault(name, entry.about)
            names.setdefault(name, "")
    return names


def select(only: set | None, cuda: bool, entries=ENTRIES) -> list:
    """The entries a run makes: those an ``--only`` name selects, or (``only`` None) all but the
    GPU-only ones on a machine without a GPU."""
    if only is None:
        return [e for e in entries if cuda or not e.gpu_default]
    return [e for e in entries if set(e.selectors) & only]
