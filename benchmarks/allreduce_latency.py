"""NCCL all-reduce time between this machine's GPUs at tensor-parallel decode sizes, one process a
GPU, and whether the GPUs reach each other directly (peer access). Tensor-parallel decode of
Qwen3-8B does 2 all-reduces per layer (o_proj, down) = 72 a step plus the LM head's gather, each of
[batch, 4096] bf16: at batch 1 their latency, not the weights, decides the TP speed-up.

    python benchmarks/allreduce_latency.py            # all visible GPUs
    NCCL_DEBUG=INFO python benchmarks/allreduce_latency.py 2>&1 | grep -E " via |us/all-reduce"

Times: 72 all-reduces captured in one CUDA graph (as the engine's decode graphs hold them),
replays timed between CUDA events; eager: the same 72 launched one by one. Implementations:
NCCL (dist.all_reduce, the NCCL environment as it is), the engine's opt-in one-shot all-reduce
over torch's symmetric memory (QWEN3_TP_ALLREDUCE=symm_mem: peer loads, multicast off), and ours
(QWEN3_TP_ALLREDUCE=custom: qwen3_kernels.tp_all_reduce, peer stores with inline flags), alone
and fused with the residual add + RMSNorm (tp_all_reduce_add_rms_norm, what the model runs after
every row-parallel layer; compare with NCCL + fused_add_rms_norm), each launch variant
(QWEN3_CAR_VARIANT), each checked for the right sum first.
"""

from __future__ import annotations

import ctypes
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


def _time_one(all_reduce, rows: int) -> tuple[float, float]:
    """(graph, eager) microseconds per all-reduce of [rows, HIDDEN] bf16 with ``all_reduce``."""
    x = torch.zeros(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        all_reduce(x)
    torch.cuda.synchronize()

    def eager():
        for _ in range(CALLS):
            all_reduce(x)

    eager()
    torch.cuda.synchronize()
    dist.barrier()
    t_eager = _time(eager, reps=5)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            all_reduce(x)
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    t_graph = _time(g.replay)
    del g
    return t_graph, t_eager


def _check(all_reduce, rank: int, world: int) -> None:
    x = torch.full((3, HIDDEN), float(rank + 1), device="cuda", dtype=torch.bfloat16)
    all_reduce(x)
    want = world * (world + 1) / 2
    if not bool((x == want).all()):
        raise RuntimeError(f"wrong sum: {x.float().unique().tolist()} instead of {want}")


def _push_pairs(car, lib) -> dict:
    """A row-parallel projection at one token and the all-reduce + norm after it, as a TP-2
    Qwen3-8B decode step runs them: o_proj (K 2048) and down_proj (K 6144) alternating, 72 pairs,
    each with its own weight (2.4 GB: streamed from HBM, as in a step). The GEMV (linear) then
    the all-reduce, against the GEMV that sends its row itself (tp_gemv_push) and the pushed
    all-reduce. Both with the GEMV's pdl_early launch (the TP graphs' choice). Graph replays, us
    per pair; the two paths' outputs checked equal first."""
    import qwen3_kernels

    ks = [2048 if i % 2 == 0 else 6144 for i in range(CALLS)]
    ws = [torch.randn(HIDDEN, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for k in ks]
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in set(ks)}
    norm_w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ys = [torch.empty(1, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in ks]

    def pairs(push: bool):
        for i, k in enumerate(ks):
            y = car.push_linear(xs[k], ws[i]) if push else qwen3_kernels.linear(xs[k], ws[i], out=ys[i])
            car.add_rms_norm(y, res, norm_w, 1e-6)
        return y

    before = lib.qwen3_gemv_set_variant(2)  # pdl_early
    try:
        got = {}
        for push in (False, True):
            res.zero_()
            got[push] = pairs(push).clone()
        if not torch.equal(got[False], got[True]):
            raise RuntimeError("the pushed pairs differ from the plain ones")
        times = {}
        for name, push in (("GEMV + all-reduce + norm", False), ("pushed GEMV + all-reduce + norm", True)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                pairs(push)
            g.replay()
            torch.cuda.synchronize()
            dist.barrier()
            times[name] = {1: (_time(g.replay), float("nan"))}
            del g
        return times
    finally:
        lib.qwen3_gemv_set_variant(before)


def _worker(rank: int, world: int, port: int, queue) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    out = {"nccl": {}, "one-shot (symm_mem)": {}}
    nccl = dist.all_reduce
    _check(nccl, rank, world)
    for rows in ROWS:
        out["nccl"][rows] = _time_one(nccl, rows)
    # the engine's opt-in path (QWEN3_TP_ALLREDUCE=symm_mem, qwen3_model/distributed.py)
    try:
        from qwen3_model.distributed import _OneShotAllReduce

        one = _OneShotAllReduce(max(ROWS) * HIDDEN, torch.bfloat16, torch.device("cuda", rank))
        _check(one, rank, world)
        for rows in ROWS:
            out["one-shot (symm_mem)"][rows] = _time_one(one, rows)
        del one
    except Exception as e:  # noqa: BLE001 - reported; the NCCL figures stand on their own
        out["one-shot (symm_mem)"] = f"{type(e).__name__}: {e}"
    # ours (QWEN3_TP_ALLREDUCE=custom), per launch variant; and the fused norm beside NCCL + norm
    try:
        import qwen3_kernels
        from qwen3_kernels.ops import extension_cdll
        from qwen3_model.distributed import _CustomAllReduce

        car = _CustomAllReduce(max(ROWS), HIDDEN, torch.bfloat16, torch.device("cuda", rank))
        lib = extension_cdll()
        lib.qwen3_car_variant_name.restype = ctypes.c_char_p
        w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
        res = {rows: torch.zeros(rows, HIDDEN, device="cuda", dtype=torch.bfloat16) for rows in ROWS}

        def fused(x):
            return car.add_rms_norm(x, res[x.shape[0]], w, 1e-6)

        def nccl_then_norm(x):
            dist.all_reduce(x)
            return qwen3_kernels.fused_add_rms_norm(x, res[x.shape[0]], w, 1e-6)

        out["nccl + fused_add_rms_norm"] = {rows: _time_one(nccl_then_norm, rows) for rows in ROWS}
        for v in range(lib.qwen3_car_num_variants()):
            lib.qwen3_car_set_variant(v)
            name = lib.qwen3_car_variant_name(v).decode()
            _check(car, rank, world)
            out[f"custom ({name})"] = {rows: _time_one(car, rows) for rows in ROWS}
            out[f"custom + add_rms_norm ({name})"] = {rows: _time_one(fused, rows) for rows in ROWS}
        lib.qwen3_car_set_variant(0)
        out.update(_push_pairs(car, lib))
        del car
    except Exception as e:  # noqa: BLE001 - reported, as the one-shot's
        out["custom"] = f"{type(e).__name__}: {e}"
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
    for name, table in res.items():
        print(f"\n{name}: all-reduce of [rows, {HIDDEN}] bf16 over {world} GPUs "
              f"({CALLS} a step, as Qwen3-8B decode):")
        if isinstance(table, str):
            print(f"  failed: {table}")
            continue
        print("| rows | graph us/all-reduce | eager us/all-reduce | 72 a step (graph) |")
        print("|---|---|---|---|")
        for rows, (g, e) in table.items():
            print(f"| {rows} | {g:.1f} | {e:.1f} | {g * CALLS / 1e3:.2f} ms |")


if __name__ == "__main__":
    main()
