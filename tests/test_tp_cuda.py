"""Tensor parallel 2 over NCCL on two GPUs gives the logits of one GPU.

fp32 with the tiny presets checks the split itself tightly (the ops run their reference there);
bf16 at head_dim 128 runs our kernels on each rank's heads. Needs 2 GPUs (skips otherwise):
    pytest -q -s tests/test_tp_cuda.py
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import HAS_CUDA, load_checkpoint, rel_err
from tests.qwen3_tiny import TINY_CONFIGS, make_tiny_qwen3
from tests.test_tp import free_port, run_steps

pytestmark = pytest.mark.skipif(
    not (HAS_CUDA and torch.cuda.device_count() >= 2), reason="needs 2 CUDA GPUs and the built extension"
)
WORLD = 2
CASES = {  # name -> (spec, dtype, tolerance vs one GPU)
    "untied_gqa4_sharded": (TINY_CONFIGS["untied_gqa4_sharded"], torch.float32, 1e-5),
    "tied_gqa5_sharded": (TINY_CONFIGS["tied_gqa5_sharded"], torch.float32, 1e-5),
    "tied_mqa_replicated_kv": (dict(TINY_CONFIGS["tied_gqa2"], num_key_value_heads=1), torch.float32, 1e-5),
    "d128_bf16": (dict(vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True), torch.bfloat16, 3e-2),
}
# zeroed cache, block tables padded with block 0: this test is about the split, not cache hygiene
CLEAN = dict(poison=False, pad_block=0)


def _worker(rank, world, port, paths, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        results = {}
        for name, path in paths.items():
            _, dtype, _ = CASES[name]
            model = load_checkpoint(path, f"cuda:{rank}", dtype)
            logits, _ = run_steps(model, model.config.vocab_size, **CLEAN)
            results[name] = None if logits is None else logits.cpu()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_nccl_logits_match_one_gpu(tmp_path):
    paths = {}
    for i, (name, (spec, _, _)) in enumerate(CASES.items()):
        paths[name] = str(tmp_path / name)
        make_tiny_qwen3(paths[name], spec, seed=20 + i)
    mp.spawn(_worker, args=(WORLD, free_port(), paths, str(tmp_path)), nprocs=WORLD, join=True)
    got = torch.load(tmp_path / "rank0.pt")
    assert all(v is None for v in torch.load(tmp_path / "rank1.pt").values())
    for name, (_, dtype, tol) in CASES.items():
        want, _ = run_steps(load_checkpoint(paths[name], "cuda:0", dtype),
                            CASES[name][0]["vocab_size"], **CLEAN)
        err = rel_err(got[name], want.cpu())
        print(f"\n{name} ({dtype}): TP=2 vs one GPU rel err {err:.2e}")
        assert not got[name].isnan().any()
        assert err <= tol, f"{name}: rel err {err:.2e} > {tol}"
