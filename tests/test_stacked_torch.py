"""Stacked caches in torch (``layer=``, docs/SPEC.md section 14): every stacked case against the
reference (Triton's interpreter on CPU tensors; compiled kernels on CUDA), a layer tensor under
CUDA-graph replay and ``torch.compile``, the custom ops' schemas, torch/JAX parity and bad layers.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

import fp8kv_torch  # noqa: E402
from fp8kv import reference  # noqa: E402
from tests.cases import as_uint  # noqa: E402
from tests.helpers import bits, requires_cuda, to_torch, torch  # noqa: E402
from tests.stacked_cases import (LAYERS, STACKED_CASES, StackedCase,  # noqa: E402
                                 dequant_inputs_stacked, expected_dequant, expected_write,
                                 layer_id, write_inputs_stacked)


def torch_layer(layer, device):
    value, where = layer
    return torch.tensor(value, dtype=torch.int32, device=device) if where == "array" else value


def tensors(args: dict, device) -> dict:
    return {n: to_torch(a, device) if isinstance(a, np.ndarray) else a for n, a in args.items()}


def run_write(case: StackedCase, args: dict, layer, device) -> dict:
    """fp8kv_torch's stacked write; the stacked tensors afterwards, by name."""
    t = tensors(args, device)
    fn = fp8kv_torch.write_kv_combined if case.combined else fp8kv_torch.write_kv
    fn(**t, layer=layer)
    return {n: v for n, v in t.items() if isinstance(v, torch.Tensor) and n.endswith("cache")}


def run_dequant(case: StackedCase, args: dict, layer, device):
    fn = fp8kv_torch.dequantize_pages_combined if case.combined else fp8kv_torch.dequantize_pages
    return fn(**tensors(args, device), layer=layer)


# Dynamic cases are slow under the interpreter: two layers each (a device one in range, a host
# one out of range); static cases take all four.
CASE_LAYERS = [pytest.param(case, layer, id=f"{case.id}-{layer_id(layer)}")
               for case in STACKED_CASES
               for layer in (LAYERS if case.scales == "static" else LAYERS[1:3])]


@pytest.mark.parametrize("case, layer", CASE_LAYERS)
def test_stacked_write(case, layer, device):
    args = write_inputs_stacked(case)
    expected = expected_write(case, args, layer[0])
    got = run_write(case, args, torch_layer(layer, device), device)
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert tuple(got[name].shape) == want.shape
        np.testing.assert_array_equal(bits(got[name]), as_uint(want), err_msg=name)


@pytest.mark.parametrize("case, layer", CASE_LAYERS)
def test_stacked_dequantize(case, layer, device):
    args = dequant_inputs_stacked(case)
    expected = expected_dequant(case, args, layer[0])
    got = run_dequant(case, args, torch_layer(layer, device), device)
    for g, want in zip(got, expected, strict=True):
        assert tuple(g.shape) == want.shape
        np.testing.assert_array_equal(bits(g), as_uint(want))


CASE = STACKED_CASES[2]   # NHD, combined, static scales


def test_torch_and_jax_write_the_same_stacked_bytes(device):
    """The same stacked write through both frontends (on a GPU machine: compiled Triton from
    torch; JAX's default backend, jax-triton or XLA's Triton call on the GPU)."""
    jax = pytest.importorskip("jax")
    import fp8kv_jax

    for case in (CASE, STACKED_CASES[5]):   # combined / separate dynamic
        args = write_inputs_stacked(case, seed=4)
        got = run_write(case, args, 1, device)
        fn = fp8kv_jax.write_kv_combined if case.combined else fp8kv_jax.write_kv
        out = fn(**{n: jax.numpy.asarray(a) if isinstance(a, np.ndarray) else a
                    for n, a in args.items()}, layer=jax.numpy.int32(1))
        out = out if isinstance(out, tuple) else (out,)
        for name, x in zip(got, out, strict=True):
            np.testing.assert_array_equal(bits(got[name]), as_uint(np.asarray(x)), err_msg=name)


def test_opcheck_stacked_write_and_dequantize(device):
    args = tensors(write_inputs_stacked(StackedCase("NHD", False, "static")), device)
    kc, vc = args["key_cache"].view(torch.uint8), args["value_cache"].view(torch.uint8)
    for layer, layer_tensor in ((1, None), (None, torch.tensor(2, device=device))):
        torch.library.opcheck(torch.ops.fp8kv.write_kv.default,
                              (args["key"], args["value"], kc, vc, args["slots"],
                               args["key_scale"], None, None, 0.5, "NHD", "e4m3", None, None,
                               False, False, "exact", None, layer, layer_tensor),
                              test_utils=("test_schema", "test_faketensor"))
    table = torch.tensor([[1, -1], [4, 0]], dtype=torch.int32, device=device)
    outs = (torch.empty(4, 4, 3, 80, dtype=torch.bfloat16, device=device),
            torch.empty(4, 4, 3, 80, dtype=torch.bfloat16, device=device),
            torch.empty(2, 2, dtype=torch.int32, device=device))
    torch.library.opcheck(torch.ops.fp8kv.dequantize_pages.default,
                          (kc, vc, table, None, None, 0.5, None, "NHD", "e4m3", None, *outs,
                           None, None, False, False, None, None, None, None, None,
                           torch.tensor(0, device=device)),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_loop_over_stacked_layers(device):
    """A compiled step writes every layer of stacked caches (a Python loop of int layers) and
    reads one back through a layer tensor."""
    case = StackedCase("HND", False, "static", layers=3)
    args = write_inputs_stacked(case, seed=2)
    t = tensors(args, device)
    backend = "inductor" if device == "cuda" else "aot_eager"  # inductor on CPU needs a C++ build

    @torch.compile(fullgraph=True, backend=backend)
    def step(key, value, kc, vc, slots, key_scale, table, layer):
        for i in range(case.layers):
            fp8kv_torch.write_kv(key * (i + 1), value, kc, vc, slots, key_scale, 0.37,
                                 layout="HND", layer=i)
        return fp8kv_torch.dequantize_pages(kc, vc, table, key_scale, 0.37, layout="HND",
                                            layer=layer)

    table = torch.tensor([[0, 3], [2, -1]], dtype=torch.int32, device=device)
    pages = step(t["key"], t["value"], t["key_cache"], t["value_cache"], t["slots"],
                 t["key_scale"], table, torch.tensor(1, device=device))
    k, v = args["key_cache"], args["value_cache"]
    for i in range(case.layers):
        k, v = reference.write_kv((args["key"].astype(np.float32) * (i + 1)).astype(
            args["key"].dtype), args["value"], k, v, args["slots"], args["key_scale"], 0.37,
            layout="HND", layer=i)
    np.testing.assert_array_equal(bits(t["key_cache"]), as_uint(k))
    np.testing.assert_array_equal(bits(t["value_cache"]), as_uint(v))
    want = reference.dequantize_pages(k, v, table.cpu().numpy(), args["key_scale"], 0.37,
                                      layout="HND", layer=1)
    for g, w in zip(pages, want, strict=True):
        np.testing.assert_array_equal(bits(g), as_uint(w))


@requires_cuda
def test_cuda_graph_replays_a_layer_tensor():
    """One captured write and dequantize serve every layer: the layer tensor is read at replay."""
    case = StackedCase("NHD", False, "dynamic", layers=4)
    args = write_inputs_stacked(case, seed=5)
    t = tensors(args, "cuda")
    layer = torch.tensor(0, dtype=torch.int64, device="cuda")
    table = torch.tensor([[0, 1, 4]], dtype=torch.int32, device="cuda")
    pages = [torch.empty(3, 4, 3, 80, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    outs = (*pages, torch.empty(1, 3, dtype=torch.int32, device="cuda"))

    def step():
        fp8kv_torch.write_kv(**t, layer=layer)
        fp8kv_torch.dequantize_pages(t["key_cache"], t["value_cache"], table, layer=layer,
                                     key_scale_cache=t["key_scale_cache"],
                                     value_scale_cache=t["value_scale_cache"], out=outs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()   # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    state = {n: a for n, a in expected_write(case, args, 0).items()}   # after the warm-up
    for value in (2, 3, 7, 1):
        layer.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        state = expected_write(case, {**args, **state}, value)
        for name, want in state.items():
            np.testing.assert_array_equal(bits(t[name]), as_uint(want), err_msg=f"{name} {value}")
        pages = reference.dequantize_pages(state["key_cache"], state["value_cache"],
                                           table.cpu().numpy(), layer=value,
                                           key_scale_cache=state["key_scale_cache"],
                                           value_scale_cache=state["value_scale_cache"])
        np.testing.assert_array_equal(bits(outs[0]), as_uint(pages[0]))


def _bad(device, **kw):
    args = tensors(write_inputs_stacked(StackedCase("NHD", False, "static")), device)
    args.update(kw)
    return lambda: fp8kv_torch.write_kv(**args)


BAD_LAYERS = {   # name: (layer, error, match); "past" is out of range without a check
    "bool": (True, TypeError, r"layer: expected None, an int or an int32 array of shape \[\], "
                              r"got bool"),
    "float": (1.0, TypeError, "layer: expected None, an int .* got float"),
    "float-tensor": ("float32", TypeError, "layer: expected dtype int32 or int64, got float32"),
    "int16-tensor": ("int16", TypeError, "layer: expected dtype int32 or int64, got int16"),
    "shape-1": ("vector", ValueError, r"layer: expected an int or an array of shape \[\], got "
                                      r"shape \[1\]"),
    "past": (3, None, None),
    "past-check-bounds": ("check", ValueError, r"layer: expected 0 <= layer < 3 "
                                               r"\(num_layers\), got 3"),
}


@pytest.mark.parametrize("name", BAD_LAYERS)
def test_bad_layer_raises(name, device):
    layer, error, match = BAD_LAYERS[name]
    if layer == "float32" or layer == "int16":
        layer = torch.tensor(1, dtype=getattr(torch, layer), device=device)
    elif layer == "vector":
        layer = torch.ones(1, dtype=torch.int32, device=device)
    kw = dict(layer=layer)
    if layer == "check":
        kw = dict(layer=torch.tensor(3, device=device), check_bounds=True)
    call = _bad(device, **kw)
    if error is None:
        call()   # out of range, no check: nothing written, no error
        return
    with pytest.raises(error, match=match):
        call()


@requires_cuda
def test_layer_tensor_on_another_device_raises():
    with pytest.raises(ValueError, match="layer: expected device cuda:0 .* got cpu"):
        _bad("cuda", layer=torch.tensor(1))()
