"""The online engine's counters and latency histograms, and their Prometheus text (served at
``GET /metrics``; no client library: the text format is a few lines)."""

from __future__ import annotations

import bisect
from collections import Counter

# seconds; the upper bounds of the buckets (Prometheus ``le``), +Inf implied
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.observe_many(value, 1)

    def observe_many(self, value: float, n: int) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, c in zip(self.bounds, self.counts):
            total += c
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum}")
        out.append(f"{name}_count {self.count}")
        return out


class EngineMetrics:
    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)  # arrival -> first token handed to the caller
        self.itl = Histogram(ITL_BUCKETS)  # between tokens handed out (a k-token delta: k gaps)

    def render(self, stats: dict) -> str:
        """Prometheus text exposition (version 0.0.4) of these and of ``AsyncLLM.stats()``."""
        lines = []

        def metric(name, kind, help_, values):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(values)

        for key, help_ in (("running", "Requests running (holding KV blocks)."),
                           ("waiting", "Requests waiting to be admitted.")):
            metric(f"qwen3_requests_{key}", "gauge", help_, [f"qwen3_requests_{key} {stats[key]}"])
        metric("qwen3_kv_blocks_used", "gauge", "KV cache blocks held by unfinished requests.",
               [f"qwen3_kv_blocks_used {stats['kv_blocks_used']}"])
        metric("qwen3_kv_blocks_total", "gauge", "KV cache blocks in the pool.",
               [f"qwen3_kv_blocks_total {stats['kv_blocks_total']}"])
        metric("qwen3_prompt_tokens_total", "counter", "Prompt tokens of the requests admitted.",
               [f"qwen3_prompt_tokens_total {self.prompt_tokens}"])
        metric("qwen3_generation_tokens_total", "counter", "Tokens generated.",
               [f"qwen3_generation_tokens_total {self.generation_tokens}"])
        metric("qwen3_requests_finished_total", "counter", "Requests finished, by reason.",
               [f'qwen3_requests_finished_total{{finish_reason="{r}"}} {self.finished[r]}'
                for r in FINISH_REASONS])
        metric("qwen3_time_to_first_token_seconds", "histogram",
               "From a request's arrival to its first token.",
               self.ttft.lines("qwen3_time_to_first_token_seconds"))
        metric("qwen3_inter_token_latency_seconds", "histogram", "Between a request's tokens.",
               self.itl.lines("qwen3_inter_token_latency_seconds"))
        return "\n".join(lines) + "\n"
