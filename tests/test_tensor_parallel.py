"""Tensor parallelism over kv heads with torch ranks (examples/tensor_parallel_torch.py).

No fixed port: the spawned ranks meet through a file in the test's temporary directory, the
command line on a port the system reports free (torchrun ``--standalone`` likewise).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from examples import tensor_parallel_torch as tp  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "tensor_parallel_torch.py")
SAME = "2 ranks (gloo): gathered shards == single-device run"


def test_two_cpu_ranks_gloo_match_single_device(tmp_path):
    """Two gloo ranks on the CPU (kernels under the interpreter): gathered == single device."""
    assert tp.spawn(2, "gloo", init_method=(tmp_path / "rendezvous").as_uri())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (NCCL ranks)")
def test_two_gpu_ranks_nccl_match_single_device(tmp_path):
    assert tp.spawn(2, "nccl", init_method=(tmp_path / "rendezvous").as_uri())


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_command_line(launcher):
    """The example's documented command lines, with gloo ranks on the CPU."""
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", EXAMPLE, "--backend", "gloo"]
    else:
        cmd = [sys.executable, EXAMPLE, "--world", "2", "--backend", "gloo"]
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert SAME in proc.stdout
