"""Tensor parallel 2 over gloo on the CPU gives the logits of world size 1.

Two processes (torch.multiprocessing spawn), each loading its slices of tiny checkpoints through the
same loader, run the same steps as one process does: a two-sequence prefill, then a step mixing a
new prefill with two decodes. Covers kv heads split (GQA 4:1, 5:1, MHA with biases) and kv heads
replicated (one kv head on two ranks). Non-divisible head counts / vocab / MLP fail clearly.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qwen3_kernels
from qwen3_model.models.qwen3 import Qwen3ForCausalLM
from tests.helpers import load_checkpoint, rel_err
from tests.paged_runner import PagedRunner
from tests.qwen3_tiny import TINY_CONFIGS, make_tiny_qwen3, tiny_config
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)

WORLD = 2
CASES = {
    "untied_gqa4_sharded": TINY_CONFIGS["untied_gqa4_sharded"],
    "tied_gqa5_sharded": TINY_CONFIGS["tied_gqa5_sharded"],
    "untied_mha_bias": TINY_CONFIGS["untied_mha_bias"],
    "tied_mqa_replicated_kv": dict(TINY_CONFIGS["tied_gqa2"], num_key_value_heads=1),
}
# config overrides that cannot split over 2 ranks -> the message each must give
NOT_DIVISIBLE = {
    "heads": (dict(num_attention_heads=3, num_key_value_heads=1), "num_attention_heads (3) is not divisible"),
    "kv_heads": (dict(num_attention_heads=6, num_key_value_heads=3), "num_key_value_heads (3) is not divisible"),
    "vocab": (dict(vocab_size=255), "vocab_size (255) is not divisible"),
    "mlp": (dict(intermediate_size=97), "intermediate_size (97) is not divisible"),
}


def run_steps(model, vocab, **runner_kw):
    """The same fixed steps on every rank and world size -> (logits or None, last hidden)."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (13, 29, 7))
    runner = PagedRunner(model, num_blocks=16, block_size=16, seed=1, **runner_kw)
    h1, _ = runner.step(prefills=[(0, a), (1, b)])
    h2, _ = runner.step(prefills=[(2, c)], decodes=[(0, 5), (1, 9)])
    hidden = torch.cat([h1, h2])
    with torch.no_grad():
        return model.compute_logits(hidden), hidden


def _worker(rank, world, port, paths, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for name, path in paths.items():
            model = load_checkpoint(path)
            logits, hidden = run_steps(model, model.config.vocab_size)
            attn = model.model.layers[0].self_attn
            results[name] = {"logits": logits, "hidden": hidden, "heads": (attn.num_heads, attn.num_kv_heads),
                             "vocab_rows": model.lm_head.weight.shape[0]}
        errors = {}
        for label, (overrides, _) in NOT_DIVISIBLE.items():
            try:
                Qwen3ForCausalLM(tiny_config("tied_gqa2", **overrides))
                errors[label] = None
            except ValueError as e:
                errors[label] = str(e)
        torch.save({"results": results, "errors": errors}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    paths = {}
    for i, (name, spec) in enumerate(CASES.items()):
        paths[name] = str(tmp_path_factory.mktemp(name))
        make_tiny_qwen3(paths[name], spec, seed=10 + i)
    out_dir = str(tmp_path_factory.mktemp("tp_out"))
    mp.spawn(_worker, args=(WORLD, free_port(), paths, out_dir), nprocs=WORLD, join=True)
    ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]
    return paths, ranks


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_logits_match_world_size_1(tp_run, name):
    paths, ranks = tp_run
    want_logits, want_hidden = run_steps(load_checkpoint(paths[name]), CASES[name]["vocab_size"])
    got = ranks[0]["results"][name]["logits"]
    assert got.shape == want_logits.shape
    err = rel_err(got, want_logits)
    assert err <= 1e-5, f"{name}: TP=2 logits differ from world size 1 by rel err {err:.2e}"
    spec = CASES[name]
    kv_local = max(1, spec["num_key_value_heads"] // WORLD)
    for r in range(WORLD):  # the split really happened
        assert ranks[r]["results"][name]["heads"] == (spec["num_attention_heads"] // WORLD, kv_local)
        assert ranks[r]["results"][name]["vocab_rows"] == spec["vocab_size"] // WORLD
    for r in range(1, WORLD):
        assert ranks[r]["results"][name]["logits"] is None  # only rank 0 gets the full vocab
    for r in range(WORLD):  # every rank ends with the same full hidden state
        assert rel_err(ranks[r]["results"][name]["hidden"], want_hidden) <= 1e-5


@pytest.mark.parametrize("label", list(NOT_DIVISIBLE))
def test_tp2_not_divisible_raises_clearly(tp_run, label):
    _, ranks = tp_run
    msg = ranks[0]["errors"][label]
    assert msg is not None, f"{label}: building the model at TP=2 did not raise"
    assert NOT_DIVISIBLE[label][1] in msg and "tensor-parallel size (2)" in msg, msg


@pytest.mark.parametrize("tp", [2, 4])
def test_weight_loaders_split_like_vllm(monkeypatch, tp):
    """Each rank's slice, simulated in one process: column layers keep output rows, row layers input
    columns, QKV keeps its q heads and its kv heads (replicated when kv heads < tp)."""
    import qwen3_model.layers.embed_head as eh
    import qwen3_model.layers.linear as lin

    hidden, d, hq, hkv, inter, vocab = 24, 8, 8, 2, 16, 32
    q, k, v = torch.randn(hq * d, hidden), torch.randn(hkv * d, hidden), torch.randn(hkv * d, hidden)
    gate, up = torch.randn(inter, hidden), torch.randn(inter, hidden)
    down, emb = torch.randn(hidden, inter), torch.randn(vocab, hidden)
    for rank in range(tp):
        for mod in (lin, eh):
            monkeypatch.setattr(mod, "get_tp_rank", lambda: rank)
            monkeypatch.setattr(mod, "get_tp_world_size", lambda: tp)
        qkv = lin.QKVParallelLinear(hidden, d, hq, hkv)
        for shard, w in zip("qkv", (q, k, v)):
            qkv.weight.weight_loader(qkv.weight, w, shard)
        nq, nkv = hq // tp, max(1, hkv // tp)
        kv_head = rank // (tp // hkv) if tp > hkv else rank * nkv
        rows = lambda w, h0, n: w[h0 * d : (h0 + n) * d]  # noqa: E731
        want = torch.cat([rows(q, rank * nq, nq), rows(k, kv_head, nkv), rows(v, kv_head, nkv)])
        assert torch.equal(qkv.weight, want), f"tp {tp} rank {rank}: wrong q/k/v heads"

        gu = lin.MergedColumnParallelLinear(hidden, [inter, inter])
        gu.weight.weight_loader(gu.weight, gate, 0)
        gu.weight.weight_loader(gu.weight, up, 1)
        n = inter // tp
        assert torch.equal(gu.weight, torch.cat([gate[rank * n : (rank + 1) * n], up[rank * n : (rank + 1) * n]]))

        row = lin.RowParallelLinear(inter, hidden)
        row.weight.weight_loader(row.weight, down)
        assert torch.equal(row.weight, down[:, rank * n : (rank + 1) * n])

        e = eh.VocabParallelEmbedding(vocab, hidden)
        e.weight.weight_loader(e.weight, emb)
        nv = vocab // tp
        assert torch.equal(e.weight, emb[rank * nv : (rank + 1) * nv])

        with pytest.raises(ValueError, match=r"expected shape \(16, 24\), got \(8, 24\)"):
            qkv.weight.weight_loader(qkv.weight, k[:8], "k")


def test_tp_allreduce_choice_is_checked(monkeypatch):
    """Config.tp_all_reduce: 'auto' (default: ours where it runs, else NCCL), 'custom' or 'nccl';
    anything else is a clear error; at world size 1 there is nothing to set up."""
    from qwen3_model import distributed as d

    with pytest.raises(ValueError, match=r"tp_all_reduce must be 'auto', 'custom' or 'nccl', "
                                         r"got 'symm_mem'"):
        d.init_all_reduce("symm_mem", 64, torch.float32, torch.device("cpu"))
    for choice in ("custom", "nccl", "auto"):
        assert d.init_all_reduce(choice, 64, torch.float32, torch.device("cpu")) is False
        assert d._CUSTOM is None

    # with 2 ranks: auto falls back to NCCL where ours cannot run (CPU, fp32); naming it is an error
    monkeypatch.setattr(d, "get_tp_world_size", lambda: 2)
    for device, dtype in (("cpu", torch.bfloat16), ("cpu", torch.float32)):
        assert d.init_all_reduce("auto", 64, dtype, torch.device(device)) is False
        assert d._CUSTOM is None
    with pytest.raises(ValueError, match="tp_all_reduce='custom' needs CUDA devices"):
        d.init_all_reduce("custom", 64, torch.bfloat16, torch.device("cpu"))


def test_config_tp_all_reduce_is_checked(tmp_path):
    from qwen3_model.config import Config
    from qwen3_model.random_checkpoint import write_random_checkpoint

    write_random_checkpoint(str(tmp_path), "demo")
    assert Config(str(tmp_path), device="cpu").tp_all_reduce == "auto"
    for choice in ("custom", "nccl"):
        assert Config(str(tmp_path), device="cpu", tp_all_reduce=choice).tp_all_reduce == choice
    for bad in ("symm_mem", "NCCL", None):
        with pytest.raises(ValueError, match=r"tp_all_reduce must be one of \('auto', 'custom', "
                                             r"'nccl'\), got"):
            Config(str(tmp_path), device="cpu", tp_all_reduce=bad)


def test_all_reduce_add_rms_norm_without_custom_is_the_fused_norm():
    """World size 1 (no process group), custom path off: all_reduce_add_rms_norm is exactly
    fused_add_rms_norm (the model's numbers at one rank do not change)."""
    from qwen3_model import distributed as d

    g = torch.Generator().manual_seed(3)
    x, r, w = (torch.randn(5, 64, generator=g, dtype=torch.bfloat16) for _ in range(3))
    w = w[0]
    want_x, want_r = qwen3_kernels.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    got_x, got_r = d.all_reduce_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    assert torch.equal(got_x, want_x) and torch.equal(got_r, want_r)


def test_row_parallel_without_reduce_adds_the_bias_once():
    """reduce_results=False at world size 1: the same output as the reducing layer (bias on
    rank 0 = this rank)."""
    from qwen3_model.layers.linear import RowParallelLinear

    torch.manual_seed(0)
    a, b = RowParallelLinear(16, 8, bias=True), RowParallelLinear(16, 8, bias=True, reduce_results=False)
    for p in (a.weight, a.bias):
        p.data.normal_()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 16)
    assert torch.equal(a(x), b(x))


def test_closed_gate_refuses_collectives_after_the_call_in_flight():
    """The abort closes the gate of the engine's eager collectives (qwen3_model.distributed):
    closing waits for a call in flight, later calls raise instead of entering NCCL, and a new
    process group opens it again. A world-size-1 gloo group stands in for NCCL."""
    import threading
    import time

    from qwen3_model import distributed as d

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        x = torch.arange(4.0)
        assert d.broadcast_from_rank0(x) is x
        inside, leave = threading.Event(), threading.Event()

        def in_flight():
            with d._collective():
                inside.set()
                leave.wait(5)

        t = threading.Thread(target=in_flight)
        t.start()
        inside.wait(5)
        threading.Timer(0.3, leave.set).start()
        t0 = time.monotonic()
        d.close_collectives()
        assert time.monotonic() - t0 >= 0.25, "closing did not wait for the call in flight"
        t.join()
        with pytest.raises(RuntimeError, match="aborted: a rank died"):
            d.broadcast_from_rank0(x)
        d.open_collectives()
        assert d.broadcast_from_rank0(x) is x
    finally:
        d.open_collectives()
        dist.destroy_process_group()
