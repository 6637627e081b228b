"""Tensor parallel 4 and 8 over gloo on the CPU: the model's logits equal world size 1, and the
engine's greedy tokens at tensor_parallel_size=4 and 8 equal transformers' greedy generate.

The shapes are Qwen3-32B's head layout scaled down (64 q / 8 kv heads -> 16 q / 8 kv here): at 8 ranks
each rank holds 2 q heads and 1 kv head; a second preset has 2 kv heads, replicated over 4 and 8 ranks
(each kv head on world / 2 ranks, as vLLM does). What the GPUs would add (NCCL, kernels, graphs) is in
tests/test_tp_cuda.py and tests/test_engine_cuda.py.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen3_model import LLM, SamplingParams
from tests.helpers import one_thread, rel_err  # noqa: F401  (autouse: one intra-op thread)
from tests.qwen3_tiny import make_tiny_qwen3
from tests.helpers import load_checkpoint
from tests.test_tp import free_port, run_steps

CASES = {  # vocab, MLP and q heads divide by 8
    "kv8_split": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=16,
                      tie_word_embeddings=False, max_shard_size="100KB"),
    "kv2_replicated": dict(vocab_size=192, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                           tie_word_embeddings=True),
}
WORLDS = (4, 8)


def _worker(rank, world, port, paths, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        results = {}
        for name, path in paths.items():
            model = load_checkpoint(path)
            logits, hidden = run_steps(model, model.config.vocab_size)
            attn = model.model.layers[0].self_attn
            results[name] = {"logits": logits, "hidden": hidden,
                             "heads": (attn.num_heads, attn.num_kv_heads)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    paths = {}
    for i, (name, spec) in enumerate(CASES.items()):
        paths[name] = str(tmp_path_factory.mktemp(name))
        make_tiny_qwen3(paths[name], spec, seed=20 + i)
    return paths


@pytest.fixture(scope="module", params=WORLDS, ids=[f"tp{w}" for w in WORLDS])
def tp_run(request, ckpts, tmp_path_factory):
    world = request.param
    out_dir = str(tmp_path_factory.mktemp(f"tp{world}_out"))
    mp.spawn(_worker, args=(world, free_port(), ckpts, out_dir), nprocs=world, join=True)
    return world, [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


@pytest.mark.parametrize("name", list(CASES))
def test_wide_tp_logits_match_world_size_1(tp_run, ckpts, name):
    world, ranks = tp_run
    spec = CASES[name]
    want_logits, want_hidden = run_steps(load_checkpoint(ckpts[name]), spec["vocab_size"])
    err = rel_err(ranks[0][name]["logits"], want_logits)
    assert err <= 1e-5, f"{name}: TP={world} logits differ from world size 1 by rel err {err:.2e}"
    kv_local = max(1, spec["num_key_value_heads"] // world)
    for r in range(world):
        assert ranks[r][name]["heads"] == (spec["num_attention_heads"] // world, kv_local)
        assert rel_err(ranks[r][name]["hidden"], want_hidden) <= 1e-5
        if r:
            assert ranks[r][name]["logits"] is None  # only rank 0 gathers the vocab


@pytest.mark.parametrize("world", WORLDS)
def test_engine_wide_tp_greedy_matches_transformers(tmp_path, world):
    cfg, hf = make_tiny_qwen3(tmp_path / "ckpt", CASES["kv8_split"], seed=30, return_model=True)
    llm = LLM(str(tmp_path / "ckpt"), tensor_parallel_size=world, kvcache_block_size=16,
              max_num_seqs=4, max_num_batched_tokens=24, device="cpu")
    try:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (1, 19, 40)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p])
            with torch.no_grad():
                want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                   min_new_tokens=8, do_sample=False, pad_token_id=0)
            assert o.token_ids == want[0, len(p):].tolist()
        assert len(llm._workers) == world - 1
    finally:
        llm.close()
    assert not dist.is_initialized()
