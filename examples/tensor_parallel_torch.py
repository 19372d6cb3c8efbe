"""Tensor-parallel FP8 KV cache with fp8kv_torch: every rank owns ``num_kv_heads / world`` heads.

Each rank quantizes and writes its head shard of K/V into its shard of every page, then
dequantizes its pages for a prefill; gathered over the ranks, the caches and pages equal a
single-device run on the full heads, byte for byte (the kernels treat heads independently).

    torchrun --nproc-per-node 2 examples/tensor_parallel_torch.py          # NCCL, one GPU a rank
    python examples/tensor_parallel_torch.py --world 2 --backend gloo      # CPU ranks (interpreter)
"""
from __future__ import annotations

import argparse
import os
import socket

# NVLink multicast (NVLS) stays off: on shared hosts it can take the GPUs out of service.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import fp8kv_torch  # noqa: E402

TOKENS, HEADS, HEAD_DIM, PAGES, PAGE_SIZE = 40, 8, 64, 8, 16


def full_problem(device):
    """The whole (unsharded) problem, identical on every rank (seeded)."""
    g = torch.Generator().manual_seed(0)
    key = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    value = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    slots = torch.randperm(PAGES * PAGE_SIZE, generator=g)[:TOKENS]
    key_scale = torch.rand(HEADS, generator=g) * 0.02 + 0.005     # per-head scales
    table = torch.tensor([[3, 1, -1], [0, 5, 7]], dtype=torch.int32)
    return [t.to(device) for t in (key, value, slots, key_scale, table)]


def step(key, value, slots, key_scale, table, device):
    """One write + one dequantize on (a shard of) the heads; returns caches and pages as bytes."""
    shape = (PAGES, PAGE_SIZE, key.shape[1], HEAD_DIM)
    k_cache = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
    v_cache = torch.zeros_like(k_cache)
    fp8kv_torch.write_kv(key, value, k_cache, v_cache, slots, key_scale, 0.05)
    k_pages, v_pages, _ = fp8kv_torch.dequantize_pages(k_cache, v_cache, table, key_scale, 0.05)
    # As bytes (gloo has no fp8/int16 collectives); the last dim scales, the heads dim stays -2.
    return [t.view(torch.uint8) for t in (k_cache, v_cache, k_pages, v_pages)]


def run_rank(rank: int, world: int, backend: str, init_method: str = "env://") -> bool:
    """Run on one rank; rank 0 returns whether the gathered shards equal the full run.

    ``init_method``: how the ranks meet (``torch.distributed.init_process_group``): ``env://``
    under torchrun (``MASTER_ADDR`` / ``MASTER_PORT``), else what :func:`spawn` passes
    (``file://...`` or ``tcp://127.0.0.1:<port>``).
    """
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    key, value, slots, key_scale, table = full_problem(device)
    heads = HEADS // world
    mine = slice(rank * heads, (rank + 1) * heads)
    shards = step(key[:, mine].contiguous(), value[:, mine].contiguous(), slots,
                  key_scale[mine].contiguous(), table, device)
    gathered = []
    for shard in shards:  # gather along the heads dim (-2) of every page
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.contiguous())
        gathered.append(torch.cat(parts, dim=-2))
    ok = True
    if rank == 0:
        expected = step(key, value, slots, key_scale, table, device)
        ok = all(torch.equal(g, e) for g, e in zip(gathered, expected))
        print(f"{world} ranks ({backend}): gathered shards {'==' if ok else '!='} single-device run")
    dist.barrier()
    dist.destroy_process_group()
    return ok


def _spawned(rank, world, backend, init_method, result_queue):
    ok = run_rank(rank, world, backend, init_method)
    if rank == 0:
        result_queue.put(ok)


def free_port_init_method() -> str:
    """``tcp://127.0.0.1:<port>`` with a port the system just reported free (port 0 bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def spawn(world: int, backend: str, init_method: str | None = None) -> bool:
    """Start ``world`` ranks with torch.multiprocessing; True if rank 0 saw identical bytes.

    ``init_method``: where the ranks meet, e.g. ``file://<path of a file not yet created>``;
    default: TCP on a free local port (:func:`free_port_init_method`).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    init_method = init_method or free_port_init_method()
    mp.start_processes(_spawned, args=(world, backend, init_method, queue), nprocs=world,
                       join=True, start_method="spawn")
    return queue.get()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    args = p.parse_args()
    if "RANK" in os.environ:  # under torchrun
        ok = run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.backend)
        raise SystemExit(0 if ok else 1)
    else:
        raise SystemExit(0 if spawn(args.world, args.backend) else 1)
