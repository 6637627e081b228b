"""Shared GPU timing for every benchmark: CUDA events around graph replays, rotated inputs.

Why graphs: a small kernel timed launch by launch reads ~20 us whatever it does (launch + sync
overhead). Capturing N calls into one graph and timing replays between two events measures the
kernels. Why rotation: an input that fits in the 60 MB L2 measures the cache, not HBM; callers
pass one closure per input set, the sets together larger than L2 unless the real use is cached.
"""

from __future__ import annotations

import statistics

import torch

from record import H200_BF16_TFLOPS, H200_COPY_TBS, H200_READ_TBS  # noqa: F401 (one place)

L2_BYTES = 60 * 1024 * 1024


def sets_for(bytes_per_set: int, min_total: int = 4 * L2_BYTES, max_sets: int = 32) -> int:
    """How many input sets to rotate so that together they exceed the L2 several times."""
    return max(1, min(max_sets, -(-min_total // max(1, bytes_per_set))))


def time_gpu(fns, reps: int = 30, graph: bool = True, calls_per_replay: int | None = None) -> float:
    """Median seconds of one call; fns is a list of closures (one per rotated input set).

    With graph=True the calls are captured once into a CUDA graph (repeated to fill at least
    ``calls_per_replay`` calls) and replays are timed; falls back to eager launches if capture
    fails.
    """
    if callable(fns):
        fns = [fns]
    n_rep_sets = 1
    if calls_per_replay is not None:
        n_rep_sets = max(1, -(-calls_per_replay // len(fns)))
    seq = list(fns) * n_rep_sets

    for f in fns:  # warm-up: compilation, autotuning, allocator
        f()
    torch.cuda.synchronize()

    run = None
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for f in fns:
                    f()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for f in seq:
                    f()
            run = g.replay
        except Exception:  # noqa: BLE001 - some baselines cannot be captured; time them eagerly
            torch.cuda.synchronize()
            run = None
    if run is None:
        def run():
            for f in seq:
                f()

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(seq))
    return statistics.median(times)


def tbs(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e12


def tflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12


def rematch(paths: dict, best: dict, rounds: int = 3, **time_kw) -> dict:
    """Times every named path again ``rounds`` times, alternating, and keeps each one's best.

    The GPU runs a few % slower late in a long run (on an H200 the first path timed read up to 4%
    faster than the same kernel timed later), which favours whatever a benchmark times
    first, usually ours. Alternating gives every path the same share of early and late.
    paths: name -> closures, as time_gpu takes them; best: name -> seconds from the first timing
    (names missing from it start empty), lowered in place and returned. time_kw goes to time_gpu.
    """
    for _ in range(rounds):
        for name, fns in paths.items():
            t = time_gpu(fns, **time_kw)
            best[name] = min(best.get(name, t), t)
    return best
