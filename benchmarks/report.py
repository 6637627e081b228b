"""One command from the benchmarks' JSON to what users read: RESULTS.md, the plots, README's table.

    python benchmarks/report.py                          # benchmarks/results/*.json -> all three
    python benchmarks/report.py --results-dir out/results --no-plots --no-readme

Reads every benchmarks/results/<bench>.json (record.py says what is in one) and writes
  benchmarks/RESULTS.md            current tables only, each with its command, date, GPU, commit
  benchmarks/plots/*.png           elementwise, attention_decode, attention_prefill, linear,
                                   linear_fp8, engine, serve (a plot whose JSON is absent is
                                   skipped)
  README.md                        the rows marked headline, between <!-- results:begin --> and
                                   <!-- results:end --> (left alone when the markers are absent)
The tables need nothing beyond the standard library; the plots need matplotlib
(pip install matplotlib, or pip install -e ".[plots]"), imported only when drawing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import record  # noqa: E402

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
README_HEAD = ("| what | ours | baseline in the same run | ratio | GPU | commit |",
               "|---|---|---|---|---|---|")
# the per-op benches in the order RESULTS.md shows them; others follow by name
ORDER = ["bench_elementwise", "bench_qk_norm_rope", "bench_attention_decode",
         "bench_attention_prefill", "bench_linear", "bench_linear_fp8", "bench_sample",
         "bench_engine"]
ENGINE_DEFAULTS = dict(scheduling_policy="auto", max_num_seqs=512, max_num_batched_tokens=16384,
                       max_piecewise_graph_tokens=512, overlap_steps=True, tp_all_reduce="auto",
                       tensor_parallel_size=1, enforce_eager=False, block_size=256,
                       quantization="none", kv_cache_dtype="auto", deterministic=False)

HEADER = f"""# Benchmark results

Written by `python benchmarks/report.py` from the JSON the benchmarks write
(`benchmarks/results/<bench>.json`); do not edit by hand. Each table says the command, date, GPU
and commit it comes from; older figures live in git history.

How things are measured. Kernel rows: CUDA events around CUDA-graph replays of many calls, the
median of the replays, inputs rotated through enough sets to exceed the 60 MB L2
(`benchmarks/common.py`); ours and the baseline run in the same process on the same inputs, then
again alternating, each keeping its best (`common.rematch`: a GPU runs a few % slower late in a
long run). ratio = baseline time / our time (> 1: ours is faster). Rates count the bytes that
must move (each input read once, each output written once) or the FLOPs; "of ceiling" holds them
to the H200's measured read ceiling {record.H200_READ_TBS} TB/s (read-only reduction over 2 GiB)
or cuBLAS's {record.H200_BF16_TFLOPS:.0f} TFLOP/s (bf16 8192^3), from the project's TARGETS.md.
Engine rows: output tokens / wall time of one `generate` after a warm-up, random weights at the
real shape (the speed of a trained checkpoint with ignore_eos); batch 1 reports decode tok/s
between the first and the last token.

Reproduce: `cd benchmarks && pytest -q -s bench_<op>.py` per op, `python bench_engine.py ...` for
the engine (`bash scripts/gpu_round.sh` runs them all), then `python benchmarks/report.py`.
"""


def load(results_dir: Path) -> dict[str, dict]:
    docs = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except ValueError as e:
            print(f"report: skipping {path}: {e}", file=sys.stderr)
            continue
        docs[doc.get("bench", path.stem)] = doc
    return dict(sorted(docs.items(), key=lambda kv: (
        ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER), kv[0])))


def _f(x, fmt=".2f", none="") -> str:
    return none if x is None else format(x, fmt)


def _us(x) -> str:
    return "" if x is None else (f"{x:,.0f}" if x >= 1000 else f"{x:.2f}")


def _rate(x, unit) -> str:
    if x is None:
        return ""
    return f"{x:.0f} {unit}" if unit == "TFLOP/s" else f"{x:.2f} {unit}"


def settings_label(settings: dict | None) -> str:
    """The settings that differ from the engine's defaults, or "defaults"."""
    diff = [f"{k}={v}" for k, v in (settings or {}).items() if ENGINE_DEFAULTS.get(k, v) != v]
    return ", ".join(diff) or "defaults"


def kernel_table(doc: dict) -> list[str]:
    lines = ["| op | case | ours (us) | ours | of ceiling | baseline | baseline (us) | "
             "baseline rate | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc.get("rows", []):
        unit = r.get("unit", "")
        lines.append(
            f"| {r['op']} | {r['case']} | {_us(r.get('ours_us'))} | "
            f"{_rate(r.get('ours_rate'), unit)} | {_f(r.get('of_ceiling'), '.0%')} | "
            f"{r.get('baseline') or ''} | {_us(r.get('baseline_us'))} | "
            f"{_rate(r.get('baseline_rate'), unit)} | {_f(r.get('ratio'), '.2f')}"
            f"{'x' if r.get('ratio') else ''} |")
    return lines


def linear_fp8_table(doc: dict) -> list[str]:
    """bench_linear_fp8's rows: every baseline's own column (cuBLAS bf16, torch's block-scaled
    and per-tensor FP8 GEMMs, or why one did not run), the activation quantization inside ours,
    and the GEMM alone: the op on quantized x against torch's block-scaled GEMM on the same input
    (rows from before it was measured: ours minus the quantization, marked ~); decode rows give
    cuBLAS's rate over its own bf16 bytes."""
    names = [("cublas_bf16", "cuBLAS bf16"), ("scaled_mm_blockwise", "scaled_mm blockwise"),
             ("scaled_mm_tensorwise", "scaled_mm per-tensor")]
    lines = ["| case | ours (us) | ours | of ceiling | "
             + " | ".join(f"{label} (us) | vs {label}" for _, label in names)
             + " | quantize_fp8 (us) | GEMM alone |",
             "|---" * (4 + 2 * len(names) + 2) + "|"]
    for r in doc.get("rows", []):
        unit = r.get("unit", "")
        cells = [r["case"], _us(r.get("ours_us")), _rate(r.get("ours_rate"), unit),
                 _f(r.get("of_ceiling"), ".0%")]
        for key, _ in names:
            base_us = r.get("baselines_us", {}).get(key)
            why = r.get("unavailable", {}).get(key)
            if base_us:
                extra = (f" ({r['baseline_tbs']:.2f} TB/s)"
                         if key == "cublas_bf16" and r.get("baseline_tbs") else "")
                cells += [_us(base_us) + extra, f"{base_us / r['ours_us']:.2f}x"]
            elif why:
                cells += ["unavailable", why.replace("|", "/")]
            else:
                cells += ["", ""]
        cells += [_us(r.get("quantize_us")), _gemm_alone(r, unit)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _gemm_alone(r: dict, unit: str) -> str:
    """The GEMM-alone cell of a bench_linear_fp8 row: measured on quantized x (gemm_us), with its
    ratio to torch's block-scaled GEMM, or the older estimate (gemm_est_us), or nothing."""
    if r.get("gemm_us"):
        vs = r.get("gemm_vs", {}).get("scaled_mm_blockwise")
        return (f"{_us(r['gemm_us'])} us, {_rate(r.get('gemm_rate'), unit)}"
                + (f", {vs:.2f}x scaled_mm blockwise" if vs else ""))
    if r.get("gemm_est_us"):
        return f"~{_us(r['gemm_est_us'])} us, {_rate(r.get('gemm_est_rate'), unit)}"
    return ""


def before_after_table(doc: dict) -> list[str]:
    """An A/B of two commits in one call (results/before_after.json, written by whoever ran it):
    what, the figure before and after, and after / before in speed (> 1: the new code is faster)."""
    lines = ["| what | before | after | unit | speed after / before |", "|---|---|---|---|---|"]
    for r in doc.get("rows", []):
        lines.append(f"| {r['what']} | {_us(r['before'])} | {_us(r['after'])} | {r['unit']} | "
                     f"{r['speed_ratio']:.3f} |")
    return lines


def engine_table(doc: dict) -> list[str]:
    lines = ["| workload | model | settings | output tok/s | decode tok/s | baseline | ratio | "
             "GPU | commit | SM MHz (median) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc.get("rows", []):
        base = (f"{r['baseline']} {r['baseline_tok_s']:,.0f}" if r.get("baseline_tok_s")
                else "")
        clocks = r.get("clocks") or {}
        lines.append(
            f"| {r['workload']} | {r['model']} | {settings_label(r.get('settings'))} | "
            f"{_f(r.get('output_tok_s'), ',.0f')} | {_f(r.get('decode_tok_s'), ',.1f')} | {base} | "
            f"{_f(r.get('ratio'), '.2f')}{'x' if r.get('ratio') else ''} | {r.get('gpu', '')} | "
            f"{r.get('commit', '')} | {_f(clocks.get('sm_mhz_median'), '.0f')} |")
    return lines


def is_serve(bench: str) -> bool:
    """results/serve_<tag>.json: bench_serve.py's runs, one file per model / workload."""
    return bench.startswith("serve_")


def _yes(ok) -> str:
    return "" if ok is None else ("yes" if ok else "NO")


def serve_section(doc: dict) -> list[str]:
    """One bench_serve run: its setting, a row per request rate, the two baseline comparisons."""
    lens = doc.get("workload_lens") or {}
    lines = [f"**{doc.get('model', '?')}, {doc.get('workload', '?')} workload** (prompts "
             f"{'..'.join(map(str, lens.get('input', [])))} tokens, max_tokens "
             f"{'..'.join(map(str, lens.get('output', [])))}, {lens.get('draw', '')}; engine "
             f"args: {doc.get('engine_args') or 'defaults'}): `{doc.get('command', '')}` on "
             f"{doc.get('gpu', '?')}, commit {doc.get('commit', '?')}, {doc.get('date', '')}.\n",
             "| rate (req/s) | requests | ok | req/s | output tok/s | total tok/s | TTFT p50 (ms) "
             "| TTFT p90 | TTFT p99 | ITL p50 (ms) | ITL p90 | ITL p99 | e2e p50 (ms) | "
             "SM MHz (median) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc.get("rows", []):
        t, i = r.get("ttft_ms") or {}, r.get("itl_ms") or {}
        lines.append(
            f"| {r['rate']} | {r['num_requests']} | {r['completed']} | "
            f"{_f(r.get('request_throughput'))} | {_f(r.get('output_tok_s'), ',.0f')} | "
            f"{_f(r.get('total_tok_s'), ',.0f')} | {_f(t.get('p50'), ',.1f')} | "
            f"{_f(t.get('p90'), ',.1f')} | {_f(t.get('p99'), ',.1f')} | {_f(i.get('p50'))} | "
            f"{_f(i.get('p90'))} | {_f(i.get('p99'))} | "
            f"{_f((r.get('e2e_ms') or {}).get('p50'), ',.0f')} | "
            f"{_f((r.get('clocks') or {}).get('sm_mhz_median'), '.0f')} |")
    off, acc = doc.get("offline") or {}, list((doc.get("acceptance") or {}).values()) + [None] * 2
    lines.append("")
    if doc.get("saturation_vs_offline") is not None:
        lines.append(f"Saturation / offline `LLM.generate` on the same requests "
                     f"({off['output_tok_s']:,.0f} output tok/s): "
                     f"{doc['saturation_vs_offline']:.3f}x (>= 0.95: {_yes(acc[0])}).")
    if doc.get("ttft_over_prefill_ms") is not None:
        lines.append(f"TTFT p50 at {doc['low_rate']} req/s minus prefill alone "
                     f"({off['prefill_alone_ms']['p50']:.2f} ms, `LLM.generate` max_tokens=1 on "
                     f"the same prompts): {doc['ttft_over_prefill_ms']:.2f} ms (<= 15 ms: "
                     f"{_yes(acc[1])}).")
    lines.append("")
    return lines


def results_md(docs: dict[str, dict]) -> str:
    out = [HEADER]
    if not docs:
        out.append("No results yet: run the benchmarks on a GPU (above), then this script.\n")
        return "\n".join(out)
    serve = {b: d for b, d in docs.items() if is_serve(b)}
    for bench, doc in docs.items():
        if bench in serve:
            continue
        out.append(f"## {bench}\n")
        if bench == "before_after":
            out.append(doc.get("note", "") + "\n")
            out += before_after_table(doc)
        elif bench == "bench_engine":
            out.append("Each row its own run (`python benchmarks/bench_engine.py ...`); last: "
                       f"`{doc.get('command', '')}`, {doc.get('date', '')}.\n")
            out += engine_table(doc)
        elif bench == "bench_linear_fp8":
            out.append(f"`{doc.get('command', '')}` on {doc.get('gpu', '?')}, commit "
                       f"{doc.get('commit', '?')}, {doc.get('date', '')}. Ours includes the "
                       "activation quantization; torch's FP8 GEMMs run on pre-quantized input; "
                       "vs X = X's time / ours.\n")
            out += linear_fp8_table(doc)
        else:
            out.append(f"`{doc.get('command', '')}` on {doc.get('gpu', '?')}, commit "
                       f"{doc.get('commit', '?')}, {doc.get('date', '')}.\n")
            out += kernel_table(doc)
        out.append("")
    if serve:
        out.append("## Serving\n")
        out.append("`python benchmarks/bench_serve.py`: `python -m qwen3_model serve` under "
                   "Poisson arrivals of token-id prompts (streamed /v1/completions, ignore_eos), "
                   "a run per request rate (inf: all at once); TTFT = send to the first token "
                   "chunk, ITL = the gaps between token chunks, seen by an asyncio client over "
                   "HTTP. The offline baselines run in a process of their own on the same "
                   "requests and engine flags.\n")
        for doc in serve.values():
            out += serve_section(doc)
    return "\n".join(out)


def readme_rows(docs: dict[str, dict]) -> list[str]:
    """README's table: one line a row (what, ours, baseline in the same run, ratio, GPU, commit)."""
    lines = list(README_HEAD)
    for bench, doc in docs.items():
        if is_serve(bench):  # one row for the whole run
            lines += serve_readme_row(doc)
            continue
        for r in doc.get("rows", []):
            if bench == "before_after":
                continue
            if bench == "bench_engine":
                # README keeps the engine at its defaults (FP8 weights come with the
                # checkpoint); every other setting is in RESULTS.md.
                if settings_label(r.get("settings")) != "defaults":
                    continue
                ours = f"{r['output_tok_s']:,.0f} tok/s" if r.get("output_tok_s") else ""
                if r.get("mode") == "batch1" and r.get("decode_tok_s"):
                    ours = f"{r['decode_tok_s']:,.1f} decode tok/s"
                base = (f"{r['baseline']} {r['baseline_tok_s']:,.0f} tok/s"
                        if r.get("baseline_tok_s") else "-")
                what = f"{r['model']}, {r['workload']} ({settings_label(r.get('settings'))})"
                gpu, commit = r.get("gpu", doc.get("gpu", "")), r.get("commit", "")
            elif r.get("headline"):
                unit = r.get("unit", "")
                ours = _rate(r.get("ours_rate"), unit) or f"{_us(r['ours_us'])} us"
                base = (f"{r.get('baseline')} "
                        f"{_rate(r.get('baseline_rate'), unit) or _us(r.get('baseline_us'))}"
                        if r.get("baseline") else "-")
                what = f"{r['op']} {r['case']}"
                gpu, commit = doc.get("gpu", ""), doc.get("commit", "")
            else:
                continue
            ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else "-"
            lines.append(f"| {what} | {ours} | {base} | {ratio} | {gpu} | {commit} |")
    return lines if len(lines) > len(README_HEAD) else []


def serve_readme_row(doc: dict) -> list[str]:
    """A serving run in README's table: saturation output tok/s and the lowest rate's TTFT p50
    against offline LLM.generate."""
    rows = doc.get("rows", [])
    sat = next((r for r in rows if r.get("rate") == "inf"), None)
    low = next((r for r in rows if r.get("rate") == doc.get("low_rate")), None)
    if sat is None and low is None:
        return []
    ours = [f"{sat['output_tok_s']:,.0f} tok/s at saturation"] if sat else []
    if low and (low.get("ttft_ms") or {}).get("p50") is not None:
        ours.append(f"TTFT p50 {low['ttft_ms']['p50']:,.1f} ms at {low['rate']} req/s")
    off = doc.get("offline") or {}
    base = f"offline LLM.generate {off['output_tok_s']:,.0f} tok/s" if off.get(
        "output_tok_s") else "-"
    ratio = doc.get("saturation_vs_offline")
    what = (f"{doc.get('model', '?')}, serving {doc.get('workload', '?')} "
            f"({doc.get('engine_args') or 'defaults'})")
    return [f"| {what} | {'; '.join(ours)} | {base} | {f'{ratio:.2f}x' if ratio else '-'} | "
            f"{doc.get('gpu', '')} | {doc.get('commit', '')} |"]


def update_readme(readme: Path, rows: list[str]) -> bool:
    """Replaces what is between the markers; False when the file or a marker is missing."""
    if not readme.exists():
        return False
    text = readme.read_text()
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        return False
    body = rows or [*README_HEAD, "| (no measurements yet: `bash scripts/gpu_round.sh`, then "
                                  "`python benchmarks/report.py`) | | | | | |"]
    new = (text[:text.index(BEGIN) + len(BEGIN)] + "\n" + "\n".join(body) + "\n"
           + text[text.index(END):])
    if new != text:
        readme.write_text(new)
    return True


# ---- plots --------------------------------------------------------------------------------------

def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("report.py: the plots need matplotlib: pip install matplotlib (or "
                         "pip install -e \".[plots]\"); --no-plots writes the tables only"
                         ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    fig.clf()
    return path


def _subtitle(doc: dict) -> str:
    return f"{doc.get('gpu', '?')}, commit {doc.get('commit', '?')}, {doc.get('date', '')}"


def _ceiling(ax, unit: str):
    value = record.CEILINGS.get(unit)
    if value:
        what = "read ceiling" if unit == "TB/s" else "cuBLAS 8192^3"
        ax.axhline(value, color="gray", ls=":", lw=1.2, label=f"H200 {what} {value:g} {unit}")


def plot_elementwise(plt, docs, path: Path):
    rows = [r for b in ("bench_elementwise", "bench_qk_norm_rope") for r in
            docs.get(b, {}).get("rows", []) if r.get("size") and r.get("unit") == "TB/s"]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    if not ops:
        return None
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rs = sorted((r for r in rows if r["op"] == op), key=lambda r: r["size"])
        xs = [r["size"] for r in rs]
        ax.plot(xs, [r["ours_rate"] for r in rs], "o-", label="ours")
        base = rs[0].get("baseline") or "baseline"
        ax.plot(xs, [r.get("baseline_rate") for r in rs], "s--", label=base)
        _ceiling(ax, "TB/s")
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel(f"{rs[0].get('size_name') or 'T'} (tokens)")
        ax.set_ylabel("TB/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    doc = docs.get("bench_elementwise") or docs["bench_qk_norm_rope"]
    fig.suptitle(f"Elementwise ops vs torch.compile ({_subtitle(doc)})", fontsize=10)
    return _save(fig, path)


def _bars(plt, doc, unit: str, title: str, path: Path, only=None):
    rows = [r for r in doc.get("rows", []) if r.get("unit") == unit and (only is None or only(r))]
    if not rows:
        return None
    # a row measured against another baseline than the legend's names it under its bar
    first = rows[0].get("baseline")
    ticks = [r["case"] + (f" [vs {r.get('baseline')}]" if r.get("baseline") != first else "")
             for r in rows]
    # the labels hang below the axes at 60 degrees: room for the longest
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2),
                                    3.0 + 0.055 * max(len(t) for t in ticks)))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["ours_rate"] for r in rows], 0.4, label="ours")
    ax.bar([x + 0.2 for x in xs], [r.get("baseline_rate") or 0 for r in rows], 0.4,
           label=first or "baseline")
    _ceiling(ax, unit)
    ax.set_xticks(list(xs), ticks, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(unit)
    ax.set_title(f"{title} ({_subtitle(doc)})", fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_linear(plt, doc, path: Path):
    rows = [r for r in doc.get("rows", []) if r.get("size") and " qkv " in f" {r['case']} "
            and " tp" not in r["case"]]
    if not rows:
        return None
    models = list(dict.fromkeys(r["case"].split()[0] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, unit in zip(axes, ("TB/s", "TFLOP/s")):
        for i, m in enumerate(models):
            rs = sorted((r for r in rows if r["case"].split()[0] == m and r["unit"] == unit),
                        key=lambda r: r["size"])
            if not rs:
                continue
            color = f"C{i}"
            ax.plot([r["size"] for r in rs], [r["ours_rate"] for r in rs], "o-", color=color,
                    label=f"{m} ours")
            ax.plot([r["size"] for r in rs], [r.get("baseline_rate") for r in rs], "x--",
                    color=color, alpha=0.6, label=f"{m} cuBLAS")
        _ceiling(ax, unit)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.set_title("weight streaming (small M)" if unit == "TB/s" else "compute (large M)",
                     fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"linear (fused QKV shapes) vs cuBLAS ({_subtitle(doc)})", fontsize=10)
    return _save(fig, path)


def plot_linear_fp8(plt, doc, path: Path):
    """Left: the block-scaled GEMM at large M (TFLOP/s at each projection: ours with the
    activation quantization, the GEMM alone, and every baseline of the row at the same FLOPs).
    Right: the decode token counts, time per call (us) by T, ours against cuBLAS bf16."""
    gemm = [r for r in doc.get("rows", []) if r.get("unit") == "TFLOP/s"]
    decode = [r for r in doc.get("rows", []) if r.get("unit") == "TB/s" and r.get("size")]
    if not gemm and not decode:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), squeeze=False)
    ax = axes[0][0]
    if gemm:
        names = list(dict.fromkeys(b for r in gemm for b in r.get("baselines_us", {})))
        series = [("ours (with quantize)", [r["ours_rate"] for r in gemm])]
        if any(r.get("gemm_est_rate") for r in gemm):
            series.append(("ours, GEMM alone", [r.get("gemm_est_rate") or 0 for r in gemm]))
        for b in names:  # the same FLOPs: a baseline's rate is ours scaled by the time ratio
            series.append((b, [r["ours_rate"] * r["ours_us"] / r["baselines_us"][b]
                               if r.get("baselines_us", {}).get(b) else 0 for r in gemm]))
        width = 0.8 / len(series)
        xs = range(len(gemm))
        for i, (label, vals) in enumerate(series):
            ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], vals, width, label=label)
        bf16 = record.CEILINGS.get("TFLOP/s")
        if bf16:
            ax.axhline(bf16, color="gray", ls=":", lw=1.2,
                       label=f"bf16 ceiling (cuBLAS 8192^3): {bf16:g} TFLOP/s")
        # "8B qkv N=6144 K=4096 M=2048" -> "8B qkv M=2048": the projection names the shape
        ax.set_xticks(list(xs), [" ".join(r["case"].split()[:2] + r["case"].split()[-1:])
                                 for r in gemm], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(0, 1.35 * max(max(v) for _, v in series))
        ax.set_title("block-scaled FP8 GEMM, large M", fontsize=9)
        ax.legend(fontsize=6, ncol=3, loc="upper left")
    ax = axes[0][1]
    projections = list(dict.fromkeys(" ".join(r["case"].split()[:2]) for r in decode))
    for i, proj in enumerate(projections):
        rs = sorted((r for r in decode if r["case"].startswith(proj + " ")),
                    key=lambda r: r["size"])
        xs = [r["size"] for r in rs]
        ax.plot(xs, [r["ours_us"] for r in rs], "o-", color=f"C{i}", label=f"{proj} ours")
        ax.plot(xs, [r.get("baseline_us") for r in rs], "x--", color=f"C{i}", alpha=0.6,
                label=f"{proj} {rs[0].get('baseline') or 'baseline'}")
    if projections:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("us per call (lower is faster)")
        ax.set_ylim(bottom=0)
        ax.set_title("decode token counts: FP8 weight streaming vs bf16", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"linear_fp8 ({_subtitle(doc)})", fontsize=10)
    return _save(fig, path)


def plot_engine(plt, doc, path: Path):
    """Horizontal bars, one per row: the workload rows' output tok/s and the batch-1 rows' decode
    tok/s in panels of their own (linear scales: the two differ by 100x), sorted by model."""
    rows = [r for r in doc.get("rows", []) if r.get("output_tok_s")]
    if not rows:
        return None
    by_batch = [r for r in rows if r.get("decode_tok_s_by_batch")]
    panels = [(title, [r for r in rows if (r.get("mode") == "batch1") == batch1])
              for title, batch1 in (("output tok/s (nano-vllm workload)", False),
                                    ("decode tok/s (batch 1)", True))]
    panels = [(t, sorted(rs, key=lambda r: (r["model"], settings_label(r.get("settings")))))
              for t, rs in panels if rs]
    n = len(panels) + (1 if by_batch else 0)
    tall = max(len(rs) for _, rs in panels)
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 1.2 + 0.32 * tall), squeeze=False)
    for ax, (title, rs) in zip(axes[0], panels):
        key = "decode_tok_s" if rs[0].get("mode") == "batch1" else "output_tok_s"
        vals = [r.get(key) or r["output_tok_s"] for r in rs]
        short = (("scheduling_policy=", ""), ("max_num_seqs=", "seqs "),
                 ("max_num_batched_tokens=", "tokens "), ("kv_cache_dtype=fp8", "fp8 KV"))
        labels = []
        for r in rs:
            label = settings_label(r.get("settings"))
            for a, b in short:
                label = label.replace(a, b)
            if r.get("gpu") and r["gpu"] != doc.get("gpu"):  # a row from another GPU says so
                label += f" [{r['gpu'].replace('NVIDIA ', '').split()[0]}]"
            labels.append(f"{r['model'].split(' (')[0].replace('Qwen3-', '')}: {label}")
        ys = range(len(rs))
        ax.barh(list(ys), vals, 0.7, label="ours")
        if any(r.get("baseline_tok_s") for r in rs):
            ax.barh([y + 0.35 for y in ys], [r.get("baseline_tok_s") or 0 for r in rs], 0.35,
                    label="baseline in the same run")
            for y, r in zip(ys, rs):
                if r.get("baseline_tok_s"):
                    ax.text(r["baseline_tok_s"], y + 0.35,
                            f" {r.get('baseline', '')} {r['baseline_tok_s']:,.0f}", va="center",
                            fontsize=5)
            ax.legend(fontsize=7)
        for y, v in zip(ys, vals):
            ax.text(v, y, f" {v:,.0f}", va="center", fontsize=6)
        ax.set_yticks(list(ys), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlim(0, max(vals) * 1.18)
        ax.set_title(title, fontsize=9)
    if by_batch:
        ax = axes[0][-1]
        for r in by_batch:
            bins = sorted(r["decode_tok_s_by_batch"].items(), key=lambda kv: int(kv[0]))
            xs_b = [min(int(k), 512) for k, _ in bins]  # the last bin is open-ended
            ax.plot(xs_b, [v for _, v in bins], "o-",
                    label=f"{r.get('size') or r['model']} {settings_label(r.get('settings'))}")
        ax.set_xlabel("decode batch size (upper end of the bin)")
        ax.set_ylabel("decode tok/s in those steps")
        ax.set_title("decode tok/s by batch size (--timeline)", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"Engine ({_subtitle(doc)})", fontsize=10)
    return _save(fig, path)


def plot_serve(plt, docs: dict[str, dict], path: Path):
    """Latency against achieved request rate (TTFT and ITL, p50 solid, p99 dashed) and output
    tok/s, a color per serving run; the offline LLM.generate figure as a dotted line."""
    runs = [d for b, d in docs.items() if is_serve(b) and d.get("rows")]
    if not runs:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for n, doc in enumerate(runs):
        color = f"C{n}"
        rows = sorted((r for r in doc["rows"] if r.get("request_throughput")),
                      key=lambda r: r["request_throughput"])
        xs = [r["request_throughput"] for r in rows]
        label = f"{doc.get('model', '?')} {doc.get('workload', '')}"
        for ax, key in zip(axes[:2], ("ttft_ms", "itl_ms")):
            ax.plot(xs, [r[key]["p50"] for r in rows], "o-", color=color, label=f"{label} p50")
            ax.plot(xs, [r[key]["p99"] for r in rows], "x--", color=color, alpha=0.7,
                    label=f"{label} p99")
        axes[2].plot(xs, [r["output_tok_s"] for r in rows], "o-", color=color, label=label)
        off = (doc.get("offline") or {}).get("output_tok_s")
        if off:
            axes[2].axhline(off, color=color, ls=":", lw=1.2,
                            label=f"{label}: offline LLM.generate")
        for r in rows:
            axes[2].annotate(r["rate"], (r["request_throughput"], r["output_tok_s"]),
                             fontsize=7, textcoords="offset points", xytext=(3, -9))
    from matplotlib.ticker import FormatStrFormatter

    for ax, title, unit in zip(axes, ("TTFT", "inter-token latency", "output throughput"),
                               ("ms", "ms", "output tok/s")):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.set_xlabel("achieved request rate (req/s)")
        ax.set_ylabel(unit)
        if unit == "ms":
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(title + (" (points: offered rate)" if unit != "ms" else ""), fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle(f"Serving ({_subtitle(runs[0])})", fontsize=10)
    return _save(fig, path)


def plots(docs: dict[str, dict], plots_dir: Path) -> list[Path]:
    plt = _pyplot()
    made = [plot_elementwise(plt, docs, plots_dir / "elementwise.png")]
    if "bench_attention_decode" in docs:
        made.append(_bars(plt, docs["bench_attention_decode"], "TB/s",
                          "paged_attention_decode vs cuDNN SDPA",
                          plots_dir / "attention_decode.png",
                          only=lambda r: not r["case"].endswith("short")))
    if "bench_attention_prefill" in docs:
        made.append(_bars(plt, docs["bench_attention_prefill"], "TFLOP/s",
                          "paged_attention_prefill vs cuDNN SDPA",
                          plots_dir / "attention_prefill.png"))
    if "bench_linear" in docs:
        made.append(plot_linear(plt, docs["bench_linear"], plots_dir / "linear.png"))
    if "bench_linear_fp8" in docs:
        made.append(plot_linear_fp8(plt, docs["bench_linear_fp8"], plots_dir / "linear_fp8.png"))
    if "bench_engine" in docs:
        made.append(plot_engine(plt, docs["bench_engine"], plots_dir / "engine.png"))
    made.append(plot_serve(plt, docs, plots_dir / "serve.png"))
    plt.close("all")
    return [p for p in made if p is not None]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=record.DEFAULT_RESULTS_DIR)
    p.add_argument("--results-md", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--plots-dir", type=Path, default=HERE / "plots")
    p.add_argument("--readme", type=Path, default=HERE.parent / "README.md")
    p.add_argument("--no-plots", action="store_true", help="the tables only (no matplotlib)")
    p.add_argument("--no-readme", action="store_true", help="leave README.md alone")
    args = p.parse_args(argv)
    docs = load(args.results_dir)
    args.results_md.write_text(results_md(docs))
    print(f"{args.results_md}: {sum(len(d.get('rows', [])) for d in docs.values())} rows "
          f"from {len(docs)} files")
    if not args.no_readme and update_readme(args.readme, readme_rows(docs)):
        print(f"{args.readme}: results table updated")
    if not args.no_plots and docs:
        for path in plots(docs, args.plots_dir):
            print(f"{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
