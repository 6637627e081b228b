"""Two GPUs: qwen3_kernels.tp_all_reduce(_add_rms_norm), our one-shot all-reduce over peer memory
(LLM(tp_all_reduce="custom")), against the fp32 reference of all_reduce + fused_add_rms_norm; both
ranks bit-identical; many calls in a row and from a CUDA graph replayed with changing inputs (the
device-side call count and the two buffer halves).
A peer that never arrives: the call waits until the abort word is set, then returns. Skips
without 2 GPUs:
    pytest -q -s tests/test_custom_allreduce_cuda.py
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qwen3_kernels
from qwen3_kernels import reference as ref
from tests.test_tp import free_port

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and qwen3_kernels.has_cuda_kernels()),
    reason="needs 2 CUDA GPUs and the built extension",
)
WORLD = 2
ROWS = (1, 3, 64, 257)
HIDDENS = (1024, 4096, 5120)
DTYPES = (torch.bfloat16, torch.float16)
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}
EPS = 1e-6


def _inputs(seed, t, h, dtype, world=WORLD):
    """Every rank's partial sum [world, t, h], the residual [t, h] and weight [h], the same on every
    rank (CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(world, t, h, generator=g).to(dtype)
    residual = (2 * torch.randn(t, h, generator=g)).to(dtype)
    weight = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    return parts.cuda(), residual.cuda(), weight.cuda()


def _same_on_all_ranks(t: torch.Tensor, what: str):
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    for r, g in enumerate(got):
        assert torch.equal(g.view(torch.int16), got[0].view(torch.int16)), f"{what}: rank {r} differs from rank 0"


def _check(what, x, res, parts, residual, weight, norm):
    if norm:
        want_x, want_res = ref.tp_all_reduce_add_rms_norm(parts, residual, weight, EPS)
        # the sum and the residual add round exactly as the reference: bit-equal
        torch.testing.assert_close(res, want_res, atol=0, rtol=0, msg=lambda m: f"{what} residual: {m}")
        torch.testing.assert_close(x, want_x, **TOL[x.dtype], msg=lambda m: f"{what} x: {m}")
    else:
        torch.testing.assert_close(x, ref.tp_all_reduce(parts), atol=0, rtol=0, msg=lambda m: f"{what}: {m}")


def _abort_unblocks_a_waiting_call(car, bufs):
    import threading
    import time

    x = torch.ones(2, 4096, dtype=torch.bfloat16, device="cuda")
    res = torch.zeros_like(x)
    w = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # capture launches nothing: no peer needed
        with torch.cuda.graph(g, stream=stream):
            qwen3_kernels.tp_all_reduce_add_rms_norm(x, res, w, EPS, *bufs)
            qwen3_kernels.tp_all_reduce(x, *bufs)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    timer = threading.Timer(1.0, car.abort)
    start = time.monotonic()
    timer.start()
    qwen3_kernels.tp_all_reduce(x, *bufs)  # eager: waits for rank 1's packets
    g.replay()
    torch.cuda.synchronize()
    waited = time.monotonic() - start
    timer.join()
    assert 0.9 <= waited < 20, f"the aborted all-reduce returned after {waited:.1f} s"
    start = time.monotonic()
    for _ in range(3):  # the word stays set: later calls do not wait
        qwen3_kernels.tp_all_reduce(x, *bufs)
        g.replay()
    torch.cuda.synchronize()
    assert time.monotonic() - start < 1.0
    torch.ones(1, device="cuda").sum().item()  # the context is healthy (a trap would poison it)


def _join(rank, world, port):
    """This worker's GPU and process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))


def _worker(rank, world, port):
    _join(rank, world, port)
    from qwen3_model.distributed import _CustomAllReduce

    car = _CustomAllReduce(max(ROWS), max(HIDDENS), torch.bfloat16, torch.device("cuda", rank))
    bufs = (car.buf, car.peer_ptrs, car.counters, car.abort_flag, rank)
    try:
        # 1. every shape and dtype, fused and plain, one call at a time
        seed = 0
        for dtype in DTYPES:
            for h in HIDDENS:
                for t in ROWS:
                    for norm in (True, False):
                        seed += 1
                        parts, residual, weight = _inputs(seed, t, h, dtype)
                        x, res = parts[rank].clone(), residual.clone()
                        if norm:
                            qwen3_kernels.tp_all_reduce_add_rms_norm(x, res, weight, EPS, *bufs)
                        else:
                            qwen3_kernels.tp_all_reduce(x, *bufs)
                        what = f"{dtype} T={t} H={h} norm={norm}"
                        _check(what, x, res, parts, residual, weight, norm)
                        _same_on_all_ranks(x, what)
                        _same_on_all_ranks(res, what)

        # 2. many calls in a row without a host sync, sizes changing (the halves alternate)
        calls = []
        for i in range(200):
            t, h = ROWS[i % len(ROWS)], HIDDENS[i % 2]
            parts, residual, weight = _inputs(1000 + i, t, h, torch.bfloat16)
            x, res = parts[rank].clone(), residual.clone()
            norm = i % 3 != 0
            if norm:
                qwen3_kernels.tp_all_reduce_add_rms_norm(x, res, weight, EPS, *bufs)
            else:
                qwen3_kernels.tp_all_reduce(x, *bufs)
            calls.append((i, x, res, parts, residual, weight, norm))
        torch.cuda.synchronize()
        for i, x, res, parts, residual, weight, norm in calls:
            _check(f"in a row, call {i}", x, res, parts, residual, weight, norm)

        # 3. a CUDA graph of dependent calls (a decode step in miniature), replayed many times with
        # new inputs: the epoch comes from the device, not from the captured arguments
        t, h = 2, 4096
        sx = torch.zeros(t, h, dtype=torch.bfloat16, device="cuda")
        sres = torch.zeros_like(sx)
        sw = torch.ones(h, dtype=torch.bfloat16, device="cuda")
        s2 = torch.zeros_like(sx)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                qwen3_kernels.tp_all_reduce_add_rms_norm(sx, sres, sw, EPS, *bufs)
                s2.copy_(sx)
                qwen3_kernels.tp_all_reduce(s2, *bufs)
                qwen3_kernels.tp_all_reduce_add_rms_norm(s2, sres, sw, EPS, *bufs)
        torch.cuda.current_stream().wait_stream(stream)
        for rep in range(300):
            parts, residual, weight = _inputs(5000 + rep, t, h, torch.bfloat16)
            sx.copy_(parts[rank])
            sres.copy_(residual)
            sw.copy_(weight)
            g.replay()
            if rep % 10 == 0 or rep > 290:
                # the same three steps from the reference
                x1, r1 = ref.tp_all_reduce_add_rms_norm(parts, residual, weight, EPS)
                torch.cuda.synchronize()
                # the plain all-reduce sums x1 over the ranks (every rank holds x1): x2; the last
                # call sums x2 over the ranks again into the residual
                x2 = ref.tp_all_reduce(torch.stack([x1] * WORLD))
                want_x, want_r = ref.tp_all_reduce_add_rms_norm(torch.stack([x2] * WORLD), r1, weight, EPS)
                # after the first norm x1 differs from the kernel's by rounding: compare with tolerance
                torch.testing.assert_close(s2, want_x, atol=6e-2, rtol=3e-2,
                                           msg=lambda m: f"graph replay {rep}: {m}")
                torch.testing.assert_close(sres, want_r, atol=6e-2, rtol=3e-2,
                                           msg=lambda m: f"graph replay {rep} residual: {m}")
                _same_on_all_ranks(s2, f"graph replay {rep}")
                _same_on_all_ranks(sres, f"graph replay {rep} residual")
        torch.cuda.synchronize()
        del g

        # 4. 0 rows: nothing launched, nothing advanced; then a normal call still agrees
        empty = torch.empty(0, 1024, dtype=torch.bfloat16, device="cuda")
        qwen3_kernels.tp_all_reduce(empty, *bufs)
        parts, residual, weight = _inputs(9, 3, 1024, torch.bfloat16)
        x = parts[rank].clone()
        qwen3_kernels.tp_all_reduce(x, *bufs)
        _check("after an empty call", x, None, parts, None, None, False)

        # 5. too many rows for the buffer: a clear error before any launch (every rank alike)
        big = torch.zeros(max(ROWS) + 1, max(HIDDENS), dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="needs a receive buffer of"):
            qwen3_kernels.tp_all_reduce(big, *bufs)
        torch.cuda.synchronize()
        dist.barrier()

        # 6. a peer that never comes (last: the ranks' call counts part here). Rank 1 stays out;
        # rank 0's calls, eager and from a graph, wait until its abort word is set from another
        # thread, then return (no trap: the context stays usable), and so do later calls at once.
        if rank == 0:
            _abort_unblocks_a_waiting_call(car, bufs)
        dist.barrier()
    finally:
        del car, bufs
        torch.cuda.synchronize()
        dist.destroy_process_group()


def test_custom_allreduce_two_gpus():
    mp.spawn(_worker, args=(WORLD, free_port()), nprocs=WORLD, join=True)


# ---- tp_gemv_push: the projection's GEMV sends its row, the all-reduce runs pushed ------------

PUSH_SHAPES = ((4096, 2048), (4096, 6144), (1024, 3072), (12288, 4096))  # (H = N, K); 12288: 4 rows a warp


def _push_worker(rank, world, port):
    _join(rank, world, port)
    from qwen3_model.distributed import _CustomAllReduce

    car = _CustomAllReduce(4, max(h for h, _ in PUSH_SHAPES), torch.bfloat16,
                           torch.device("cuda", rank))
    bufs = (car.buf, car.peer_ptrs, car.counters, car.abort_flag, rank)
    push_bufs = (car.buf, car.peer_ptrs, car.counters, rank)

    def operands(seed, h, k, dtype):
        # every rank's x [1, K] and weight [H, K] (this rank's shard), residual and norm weight
        g = torch.Generator().manual_seed(seed)
        xs = torch.randn(world, 1, k, generator=g).to(dtype)
        ws = (torch.randn(world, h, k, generator=g) * k**-0.5).to(dtype)
        residual = (2 * torch.randn(1, h, generator=g)).to(dtype)
        nw = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
        return xs[rank].cuda(), ws[rank].cuda(), residual.cuda(), nw.cuda()

    try:
        # 1. pushed == plain, bit for bit: the GEMV's out, the sum, the residual, the norm; calls
        # alternating pushed / plain without a host sync (the count and the halves advance alike)
        seed, results = 0, []
        for dtype in DTYPES:
            for h, k in PUSH_SHAPES:
                for norm in (True, False):
                    seed += 1
                    x, w, residual, nw = operands(seed, h, k, dtype)
                    out = torch.full((1, h), float("nan"), dtype=dtype, device="cuda")
                    qwen3_kernels.tp_gemv_push(x, w, *push_bufs, out=out)
                    plain = qwen3_kernels.linear(x, w)  # the same GEMV, no push
                    pushed_out = out.clone()
                    res = residual.clone()
                    if norm:
                        qwen3_kernels.tp_all_reduce_add_rms_norm(out, res, nw, EPS, *bufs, pushed=True)
                    else:
                        qwen3_kernels.tp_all_reduce(out, *bufs, pushed=True)
                    want = plain.clone()
                    res2 = residual.clone()
                    if norm:
                        qwen3_kernels.tp_all_reduce_add_rms_norm(want, res2, nw, EPS, *bufs)
                    else:
                        qwen3_kernels.tp_all_reduce(want, *bufs)
                    results.append((f"{dtype} H={h} K={k} norm={norm}",
                                    pushed_out, plain, out, want, res, res2))
        torch.cuda.synchronize()
        for what, pushed_out, plain, out, want, res, res2 in results:
            assert torch.equal(pushed_out.view(torch.int16), plain.view(torch.int16)), f"{what}: GEMV out"
            assert torch.equal(out.view(torch.int16), want.view(torch.int16)), f"{what}: x"
            assert torch.equal(res.view(torch.int16), res2.view(torch.int16)), f"{what}: residual"
            _same_on_all_ranks(out, what)

        # 2. a CUDA graph: push, pushed all-reduce + norm, then a plain GEMV and all-reduce + norm,
        # replayed with new inputs against the same ops run eagerly without the push
        h, k = 4096, 2048
        sx = torch.zeros(1, k, dtype=torch.bfloat16, device="cuda")
        sw = torch.zeros(h, k, dtype=torch.bfloat16, device="cuda")
        sres = torch.zeros(1, h, dtype=torch.bfloat16, device="cuda")
        snw = torch.ones(h, dtype=torch.bfloat16, device="cuda")
        sout = torch.zeros(1, h, dtype=torch.bfloat16, device="cuda")
        sw2 = torch.zeros(h, h, dtype=torch.bfloat16, device="cuda")
        sout2 = torch.zeros(1, h, dtype=torch.bfloat16, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                qwen3_kernels.tp_gemv_push(sx, sw, *push_bufs, out=sout)
                qwen3_kernels.tp_all_reduce_add_rms_norm(sout, sres, snw, EPS, *bufs, pushed=True)
                qwen3_kernels.linear(sout, sw2, out=sout2)
                qwen3_kernels.tp_all_reduce_add_rms_norm(sout2, sres, snw, EPS, *bufs)
        torch.cuda.current_stream().wait_stream(stream)
        for rep in range(100):
            x, w, residual, nw = operands(7000 + rep, h, k, torch.bfloat16)
            w2 = operands(9000 + rep, h, h, torch.bfloat16)[1]
            sx.copy_(x); sw.copy_(w); sres.copy_(residual); snw.copy_(nw); sw2.copy_(w2)
            g.replay()
            if rep % 10 == 0 or rep > 95:
                y = qwen3_kernels.linear(x, w)
                r = residual.clone()
                qwen3_kernels.tp_all_reduce_add_rms_norm(y, r, nw, EPS, *bufs)
                y2 = qwen3_kernels.linear(y, w2)
                qwen3_kernels.tp_all_reduce_add_rms_norm(y2, r, nw, EPS, *bufs)
                torch.cuda.synchronize()
                assert torch.equal(sout2.view(torch.int16), y2.view(torch.int16)), f"graph replay {rep}"
                assert torch.equal(sres.view(torch.int16), r.view(torch.int16)), f"graph replay {rep} residual"
                _same_on_all_ranks(sout2, f"graph replay {rep}")
        torch.cuda.synchronize()
        del g

        # 3. bad input: clear errors before any launch, on every rank alike
        x, w, _, _ = operands(1, 4096, 2048, torch.bfloat16)
        with pytest.raises(ValueError, match="one token"):
            qwen3_kernels.tp_gemv_push(torch.cat([x, x]), w, *push_bufs)
        with pytest.raises(ValueError, match="pushed=True needs the one row"):
            qwen3_kernels.tp_all_reduce(torch.zeros(2, 4096, dtype=torch.bfloat16, device="cuda"),
                                        *bufs, pushed=True)
        with pytest.raises(ValueError, match="inner dims"):
            qwen3_kernels.tp_gemv_push(x, w[:, :1024].contiguous(), *push_bufs)

        # 4. the engine's pairing (_CustomAllReduce): a pushed row must be the next all-reduce.
        # Last: a refused pairing leaves the pushed packets in the buffers.
        y = car.push_linear(x, w)
        with pytest.raises(RuntimeError, match="never all-reduced"):
            car.push_linear(x, w)
        with pytest.raises(RuntimeError, match="must be the very next all-reduce"):
            car(torch.zeros_like(y))
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        del car, bufs, push_bufs
        torch.cuda.synchronize()
        dist.destroy_process_group()


def test_gemv_push_two_gpus():
    mp.spawn(_push_worker, args=(WORLD, free_port()), nprocs=WORLD, join=True)
