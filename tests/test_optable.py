"""The op table (:mod:`fp8kv.optable`) is what the public functions, the torch ops, the operand
maps and the JAX sharding say: each op declared once, and held to it here.

Each public function of both frontends takes exactly its op's arguments, in the table's order,
and its docstring documents each of them and nothing else. Every operand map names the op's own
arguments and writes in place exactly those the table says it updates. An op shaped like the
paged attention that comes next (read-only caches, a new output, query heads split with the kv
heads) derives its torch schema, launch order and sharding from a table entry alone.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Optional

import pytest

from fp8kv.arrays import ArrayInfo
from fp8kv.optable import DIMS, FOLLOWS, JAX, OPS, SHAPES, TORCH, Arg, Op, Role, combined

FRONTENDS = {TORCH: "fp8kv_torch", JAX: "fp8kv_jax"}
CASES = [(frontend, op) for frontend in FRONTENDS for op in OPS]


def _frontend(frontend: str):
    return pytest.importorskip(FRONTENDS[frontend])


def _documented(fn, frontend) -> tuple[set, set]:
    """``(names the docstring's Parameters list, names it documents through "Other parameters
    are those of :func:`f`")``."""
    doc = inspect.getdoc(fn)
    own, section = set(), None
    for line, underline in zip(doc.splitlines(), doc.splitlines()[1:] + [""]):
        if underline.startswith("---") and line.strip():
            section = line.strip()
            continue
        entry = re.fullmatch(r"(\w+(?:, \w+)*)(?: : .*)?", line)
        if section == "Parameters" and entry:
            own.update(entry.group(1).split(", "))
    inherited = set()
    for other in re.findall(r"Other parameters(?:\s+and\s+the\s+result)?\s+are\s+those\s+of\s+"
                            r":func:`(\w+)`", doc):
        inherited |= set.union(*_documented(getattr(_frontend(frontend), other), frontend))
    return own, inherited


@pytest.mark.parametrize("frontend, op", CASES, ids=[f"{f}-{o}" for f, o in CASES])
def test_each_public_function_takes_and_documents_the_tables_arguments(frontend, op):
    fn = getattr(_frontend(frontend), op)
    names = [a.name for a in OPS[op].public(frontend)]
    assert list(inspect.signature(fn).parameters) == names
    own, inherited = _documented(fn, frontend)
    assert own <= set(names), own - set(names)      # nothing the function does not take
    assert set(names) <= own | inherited, set(names) - own - inherited


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_the_table_has_every_public_function(frontend):
    module = _frontend(frontend)
    functions = [n for n in module.__all__ if inspect.isfunction(getattr(module, n))]
    assert sorted(functions) == sorted(OPS)


@pytest.mark.parametrize("op", OPS)
def test_every_array_has_the_roles_of_its_dimensions(op):
    """Each array's dimensions have roles JAX's partitioning rule knows; each op may split its
    caches over kv heads (a partitioning rule: tests/test_sharded_jit.py runs them)."""
    entry = OPS[op]
    for a in entry.args:
        if a.array and not a.parts:
            assert a.dims in SHAPES or set(a.dims.split()) <= set(DIMS), (a.name, a.dims)
        if a.role is Role.OUTPUT and not a.parts:
            assert a.name in entry.returns, a.name
    assert "h" in entry.splits and set(entry.splits) <= set(DIMS)
    assert set(entry.reads) <= {a.name for a in entry.args}
    assert all(a.combined == "" for a in entry.args) == op.endswith("_combined")


# ---------------------------------------------------------------------------------------------
# The operand maps name the table's arguments.

def _infos(op: str, variant: str) -> dict:
    """One validated-call's worth of arguments of ``op`` (ArrayInfo for arrays)."""
    def array(shape, dtype="bfloat16"):
        return ArrayInfo.contiguous(shape, dtype, "cuda:0")

    nvfp4, stacked = variant == "nvfp4", variant.startswith("layer")
    mxfp8 = variant == "mxfp8"   # head_dim 32: one block
    dim = 20 if variant == "inline" else 8 if nvfp4 else 32 if mxfp8 else 16
    hd = 32 if mxfp8 else 16
    page = ((3,) if stacked else ()) + (4, 4, 2)
    caches = ({"kv_cache": array(page[:-2] + (2,) + page[-2:] + (dim,), "uint8")}
              if op.endswith("_combined")
              else dict.fromkeys(("key_cache", "value_cache"), array(page + (dim,), "uint8")))
    named = {**caches, "key": array((3, 2, hd)), "value": array((3, 2, hd)),
             "slots": array((3,), "int32"), "query": array((3, 4, hd)),
             "positions": array((3,), "int32"), "cos_sin_cache": array((8, 16), "float32"),
             "block_table": array((2, 2), "int32"), "key_scale": 1.0, "value_scale": 0.5,
             "layout": "NHD", "fp8_format": None, "scale_rounding": "exact", "dtype": "bfloat16",
             "null_page": None, "head_dim": None, "rope_style": "neox", "rotary_dim": None,
             "seq_lens": array((2,), "int32"), "query_start_loc": array((3,), "int32"),
             **dict.fromkeys(("softmax_scale", "sliding_window", "logits_soft_cap", "sinks",
                              "max_query_len")),
             **dict.fromkeys(("query_scale", "query_out", "key_out", "key_scale_cache",
                              "value_scale_cache", "cache_format", "out_scale", "layer"))}
    if variant == "device":
        named.update(key_scale=array((2,), "float32"), value_scale=array((1,), "float32"))
    elif variant == "side":   # per token-head for K, per token for V
        named.update(key_scale_cache=array(page, "float32"),
                     value_scale_cache=array(page[:-1], "float32"), key_scale=None,
                     value_scale=None)
    elif nvfp4:               # one e4m3 block scale per 16 elements
        named.update(key_scale_cache=array(page + (1,), "uint8"),
                     value_scale_cache=array(page + (1,), "uint8"), cache_format="nvfp4")
    elif mxfp8:               # one E8M0 block scale per 32 elements, no static scales
        named.update(key_scale_cache=array(page + (1,), "uint8"),
                     value_scale_cache=array(page + (1,), "uint8"), cache_format="mxfp8",
                     key_scale=None, value_scale=None)
    elif variant == "inline":
        named.update(key_scale_cache="inline", value_scale_cache="inline", key_scale=None,
                     value_scale=None, head_dim=16)
    elif variant == "given":
        named.update(query_out=array((3, 4, 16), "uint8"), key_out=array((3, 2, 16)),
                     query_scale=array((1,), "float32"))
    if stacked:
        named["layer"] = array((), "int32") if variant == "layer-device" else 1
    return named


def _variants(op: str):
    family = OPS[op].family
    extra = {"write_kv": ["nvfp4", "mxfp8", "layer-host", "layer-device"],
             "dequantize_pages": ["nvfp4", "mxfp8", "layer-host", "layer-device"],
             "rope_write_kv": ["given"],
             "paged_attention": ["nvfp4", "mxfp8", "layer-host", "layer-device"]}[family]
    return ["host", "device", "side", "inline"] + extra


@pytest.mark.parametrize("op, variant", [(op, v) for op in OPS for v in _variants(op)],
                         ids=[f"{op}-{v}" for op in OPS for v in _variants(op)])
def test_the_operand_maps_name_the_tables_arguments(op, variant):
    """Every kernel array takes an argument (or output) of its op; those written in place are
    the arguments the table says the op updates (given as arrays) and outputs given to it; new
    outputs are the ones the op makes; a pointer never read takes an array every call has."""
    entry = OPS[op]
    named = _infos(op, variant)
    if entry.family == "paged_attention" and variant == "nvfp4":
        named["layer"] = None
    args = entry.check(**{a.name: named[a.name] for a in entry.public(TORCH)
                          if a.name in named and (a.array or a.validated)})
    operands = entry.operands(args)
    names = {a.name for a in entry.args} | set(entry.workspace)
    for o in operands.params:
        assert o.source is None or o.source in names, (o.param, o.source)
    updated = {a.name for a in entry.args if a.updated and isinstance(named.get(a.name),
                                                                       ArrayInfo)}
    given = {a.name for a in entry.args if a.role is Role.OUTPUT and isinstance(
        named.get(a.name), ArrayInfo)}
    for o in operands.inputs:
        if not o.used and o.source is not None:
            assert o.source in entry.required(TORCH) or o.source in given, o
    assert set(operands.updated) == updated | given
    assert set(operands.new_outputs) <= set(entry.made(args)) | set(entry.workspace)


# ---------------------------------------------------------------------------------------------
# The next op fits with one entry.

def _paged_attention() -> Op:
    """The table entry of ``paged_attention`` as docs/ADDING_AN_OP.md describes it (no kernel
    behind it here: its hooks are never called)."""
    def array(name, doc, dims, **kw):
        return Arg(name, Role.INPUT, doc, dims=dims, **kw)

    def option(name, schema):
        return Arg(name, Role.OPTION, name, schema=schema)

    write = OPS["write_kv"]
    caches = [dataclasses.replace(write.arg(n), updated=False)
              for n in ("key_cache", "value_cache")]
    sides = [dataclasses.replace(write.arg(n), updated=False)
             for n in ("key_scale_cache", "value_scale_cache")]
    args = (array("query", "queries", "t H d"), *caches,
            array("block_table", "pages", "b q"), array("seq_lens", "lengths", "b"),
            write.arg("key_scale"), write.arg("value_scale"),
            array("query_start_loc", "starts", "B", optional=True),
            option("softmax_scale", Optional[float]), option("sliding_window", Optional[int]),
            option("logits_soft_cap", Optional[float]),
            array("sinks", "per head", "H", optional=True), *sides,
            write.arg("cache_format"), write.arg("layout"), option("head_dim", Optional[int]),
            write.arg("layer"),
            Arg("out", Role.OUTPUT, "attention output", optional=True, made=True, dims="t H d"))
    return Op("paged_attention", args, check=None, bounds=None, made=None, empty=None,
              operands=None, plan=None, returns=("out",), splits=("h",), reads=("block_table",))


def test_an_op_with_read_only_caches_and_a_new_output_fits_in_one_entry():
    _ops = pytest.importorskip("fp8kv_torch._ops")
    from fp8kv_torch import _launch

    op = _paged_attention()
    for entry in (op, combined(op)):
        schema = _ops.Schema(entry)
        assert schema.mutated == ("out",)   # the caches and scale caches are only read
        params = [str(p) for p in schema.signature.parameters.values()]
        assert "softmax_scale: Optional[float]" in params and "out: torch.Tensor" in params
        assert "key_scale_value: Optional[float]" in params
        assert _launch._order(entry)[-1] == "out" and _launch._made(entry) == ("out",)
    assert [a.name for a in combined(op).args][1] == "kv_cache"
    assert op.required(JAX) == ("query", "key_cache", "value_cache", "block_table", "seq_lens")
    assert "query_start_loc" in op.optional(JAX) and "out" in op.optional(TORCH)


def test_its_query_and_output_split_with_the_kv_heads(monkeypatch):
    """JAX's rule shards a query-heads dimension (``H``) over the kv heads' mesh axes, and tells
    Shardy so (a compound factor: the kv head, then the query head within it)."""
    jax = pytest.importorskip("jax")
    import numpy as np
    from jax.sharding import Mesh

    from fp8kv.dequantize import check_dequantize
    from fp8kv_jax import _shard

    assert FOLLOWS == {"H": "h"}
    op = _paged_attention()
    monkeypatch.setitem(OPS, op.name, op)
    cache = ArrayInfo.contiguous((4, 4, 2, 16), "uint8", "jax")
    args = check_dequantize(cache, cache, ArrayInfo.contiguous((2, 2), "int32", "jax"),
                            dtype="bfloat16", layout="NHD", fp8_format=None, null_page=None)
    names = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "sinks")
    call = _shard.Call(op.name, "jnp", args, names, (), ("out",), (), 4)
    assert _shard.roles(call, "out", 3) == ("t", "H", "d")
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    assert tuple(_shard._sharding(call, mesh, "sinks", 1, {"h": "x"}).spec) == ("x",)
    shapes = [type("T", (), {"shape": s}) for s in ((5, 8, 16), (4, 4, 2, 16), (4, 4, 2, 16),
                                                    (2, 2), (2,), (8,))]
    text, kwargs = _shard._rule(call, mesh, shapes, [type("T", (), {"shape": (5, 8, 16)})])
    assert text.startswith("t (h H) d, p s h c, p s h c, b q, b, (h H) -> t (h H) d")
    assert kwargs["H"] == 4 and "h" not in kwargs["need_replication_factors"]


def test_the_table_is_every_op_module_entry_and_kernels_resolve_by_name():
    """OPS collects the OP of each module of fp8kv (and its combined form); a plan's kernel name
    is found in whichever module of fp8kv.ops defines it, an unknown one is an AttributeError."""
    import importlib
    import pkgutil

    import fp8kv
    from fp8kv import ops

    declared = {m.name: importlib.import_module(f"fp8kv.{m.name}").__dict__.get("OP")
                for m in pkgutil.iter_modules(fp8kv.__path__) if not m.ispkg}
    declared = {module: op.name for module, op in declared.items() if isinstance(op, Op)}
    assert declared == {"write": "write_kv", "dequantize": "dequantize_pages",
                        "rope_write": "rope_write_kv", "attention": "paged_attention"}
    assert set(OPS) == {n for name in declared.values() for n in (name, f"{name}_combined")}
    for name in ("_write_kv_kernel", "_write_nvfp4_kernel", "_dequantize_pages_kernel",
                 "_dequantize_nvfp4_kernel", "_rope_write_kv_kernel", "_paged_attention_kernel",
                 "_attention_merge_kernel"):
        assert getattr(ops, name).fn.__name__ == name
    with pytest.raises(AttributeError, match="_no_such_kernel"):
        ops._no_such_kernel
