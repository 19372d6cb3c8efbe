"""Tensor parallelism over kv heads with torch ranks (examples/tensor_parallel_torch.py)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from examples import tensor_parallel_torch as tp  # noqa: E402


def test_two_cpu_ranks_gloo_match_single_device():
    """Two gloo ranks on the CPU (kernels under the interpreter): gathered == single device."""
    assert tp.spawn(2, "gloo", port=29531)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (NCCL ranks)")
def test_two_gpu_ranks_nccl_match_single_device():
    assert tp.spawn(2, "nccl", port=29532)
