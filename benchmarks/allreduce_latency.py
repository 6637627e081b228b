"""NCCL all-reduce time between this machine's GPUs at tensor-parallel decode sizes, one process a
GPU, and whether the GPUs reach each other directly (peer access). Tensor-parallel decode of
Qwen3-8B does 2 all-reduces per layer (o_proj, down) = 72 a step plus the LM head's gather, each of
[batch, 4096] bf16: at batch 1 their latency, not the weights, decides the TP speed-up.

    python benchmarks/allreduce_latency.py            # all visible GPUs
    NCCL_DEBUG=INFO python benchmarks/allreduce_latency.py 2>&1 | grep -E " via |us/all-reduce"

Times: 72 all-reduces captured in one CUDA graph (as the engine's decode graphs hold them),
replays timed between CUDA events; eager: the same 72 launched one by one. The NCCL environment is
used as it is (nothing here turns an NCCL feature on).
"""

from __future__ import annotations

import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS = (1, 8, 64, 256)
HIDDEN = 4096
CALLS = 72


def _time(fn, reps=20) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, queue) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    out = {}
    for rows in ROWS:
        x = torch.zeros(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()

        def eager():
            for _ in range(CALLS):
                dist.all_reduce(x)

        eager()
        torch.cuda.synchronize()
        dist.barrier()
        t_eager = _time(eager, reps=5)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(CALLS):
                dist.all_reduce(x)
        g.replay()
        torch.cuda.synchronize()
        dist.barrier()
        out[rows] = (_time(g.replay), t_eager)
        del g
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    world = torch.cuda.device_count()
    if world < 2:
        print(f"needs 2 GPUs, torch sees {world}")
        return
    peers = [(i, j, torch.cuda.can_device_access_peer(i, j))
             for i in range(world) for j in range(world) if i != j]
    print("peer access: " + ", ".join(f"{i}->{j} {'yes' if ok else 'NO'}" for i, j, ok in peers))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    res = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    print(f"all-reduce of [rows, {HIDDEN}] bf16 over {world} GPUs ({CALLS} a step, as Qwen3-8B decode):")
    print("| rows | graph us/all-reduce | eager us/all-reduce | 72 a step (graph) |")
    print("|---|---|---|---|")
    for rows, (g, e) in res.items():
        print(f"| {rows} | {g:.1f} | {e:.1f} | {g * CALLS / 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
