"""Hub repo ids as ``model``, offline against a cache laid out as huggingface_hub lays it out
(models--org--name/{refs/<ref>: the commit, snapshots/<commit>/<file> -> ../../blobs/<sha256>}):
an id loads its snapshot and generates what the folder generates; a revision picks its ref or
commit; the TP workers load the folder rank 0 resolved; an id missing from the cache, a string that
is neither folder nor id, and the CLI's --model ORG/NAME. Never reaches the network (HF_HUB_OFFLINE,
checked before each test)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen3_model import LLM, SamplingParams
from qwen3_model.hub import parse_repo_id
from qwen3_model.loader import CheckpointError
from qwen3_model.random_checkpoint import write_random_checkpoint
from tests.helpers import one_thread  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
REPO = "qwen3-kernels-test/tiny-demo"
MAIN, V1 = "a" * 40, "b" * 40  # commits of refs/main and refs/v1
KW = dict(device="cpu", kvcache_block_size=16, max_model_len=256, max_num_seqs=4)
PROMPTS = ["Hello, world", "The capital of France is"]


def add_snapshot(cache: Path, repo: str, commit: str, folder: Path, refs=()) -> Path:
    """``folder``'s files as snapshot ``commit`` of ``repo`` in the cache ``cache``: content in
    blobs/, relative symlinks in snapshots/<commit>/, each ref in ``refs`` naming the commit."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (storage / "refs").mkdir(exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # the hub writes the hash, no newline
    return snapshot


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two random checkpoints (main, v1) and a cache holding them as REPO's refs main and v1."""
    root = tmp_path_factory.mktemp("hub")
    main, v1 = root / "main", root / "v1"
    write_random_checkpoint(main, "demo", seed=0)
    write_random_checkpoint(v1, "demo", seed=1)
    cache = root / "hub-cache"
    snaps = {"main": add_snapshot(cache, REPO, MAIN, main, refs=["main"]),
             "v1": add_snapshot(cache, REPO, V1, v1, refs=["v1"])}
    return dict(main=str(main), v1=str(v1), cache=cache, snapshots=snaps)


@pytest.fixture
def offline_cache(checkpoints, monkeypatch):
    """HF_HUB_OFFLINE and HF_HUB_CACHE for this process (huggingface_hub.constants reads them at
    import) and for the processes it starts (the environment)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(checkpoints["cache"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(checkpoints["cache"]))
    assert constants.is_offline_mode()
    return checkpoints


def greedy(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    return [o.token_ids for o in outs]


def test_parse_repo_id():
    assert parse_repo_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert parse_repo_id("Qwen/Qwen3-0.6B@v1.0") == ("Qwen/Qwen3-0.6B", "v1.0")
    for not_id in ["Qwen3-0.6B", "/abs/Qwen3", "./Qwen/x", "a/b/c", "~/Qwen3", "Qwen/", "org/x@",
                   "org/a--b", "org/a..b", ""]:
        assert parse_repo_id(not_id) is None, not_id


def test_repo_id_loads_its_snapshot_and_generates_as_the_folder(offline_cache):
    by_id = LLM(REPO, **KW)
    assert by_id.config.model == str(offline_cache["snapshots"]["main"])
    assert by_id.config.model_id == REPO
    by_folder = LLM(offline_cache["main"], **KW)
    assert by_folder.config.model_id == by_folder.config.model == offline_cache["main"]
    assert greedy(by_id) == greedy(by_folder)


def test_revision_picks_its_ref_or_commit(offline_cache):
    from qwen3_model.config import Config

    snaps = offline_cache["snapshots"]
    for model, snap in [(f"{REPO}@v1", "v1"), (f"{REPO}@{V1}", "v1"), (f"{REPO}@main", "main"),
                        (f"{REPO}@{MAIN}", "main")]:
        config = Config(model, **KW)
        assert (config.model, config.model_id) == (str(snaps[snap]), model)
    v1 = LLM(f"{REPO}@v1", **KW)
    assert greedy(v1) == greedy(LLM(offline_cache["v1"], **KW))
    with pytest.raises(CheckpointError, match="@v2' is neither a checkpoint folder"):
        Config(f"{REPO}@v2", **KW)


def test_missing_id_is_one_clear_line(offline_cache):
    from qwen3_model.config import Config

    with pytest.raises(CheckpointError) as e:
        Config("qwen3-kernels-test/not-cached", **KW)
    msg = str(e.value)
    assert "\n" not in msg
    for part in ["'qwen3-kernels-test/not-cached' is neither a checkpoint folder nor in the "
                 "Hugging Face cache", str(offline_cache["cache"]), "HF_HUB_OFFLINE",
                 "hf download qwen3-kernels-test/not-cached", "pass a checkpoint folder"]:
        assert part in msg, (part, msg)


def test_neither_folder_nor_repo_id(offline_cache, tmp_path):
    from qwen3_model.config import Config

    for model in [str(tmp_path / "no-such-folder"), "Qwen3-0.6B", "a/b/c"]:
        with pytest.raises(ValueError, match="a checkpoint folder that exists or a Hugging Face "
                                             "repo id 'org/name'") as e:
            Config(model, **KW)
        assert "\n" not in str(e.value)


def test_tp_workers_load_the_folder_rank_0_resolved(offline_cache, monkeypatch, tmp_path):
    # the workers' environment names an empty cache: a worker that resolved the id itself would
    # not find it there (and raise), one given rank 0's folder loads it
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    # (the one-rank reference first: an LLM built while a tensor-parallel group is up joins it)
    want = greedy(LLM(offline_cache["main"], **KW))
    llm = LLM(REPO, tensor_parallel_size=2, **KW)
    try:
        assert greedy(llm) == want
    finally:
        llm.close()


def run_cli(cache, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1",
               HF_HUB_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "qwen3_model", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_model_repo_id(checkpoints):
    common = ["--device", "cpu", "--block-size", "16", "--max-model-len", "256",
              "--temperature", "0", "--max-tokens", "4", "--no-progress", "Hello"]
    proc = run_cli(checkpoints["cache"], "--model", REPO, *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "=== prompt 0 ===" in proc.stdout and "1 requests" in proc.stdout

    proc = run_cli(checkpoints["cache"], "--model", "qwen3-kernels-test/not-cached", *common)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "nor in the Hugging Face cache" in errors[0]
    assert "hf download qwen3-kernels-test/not-cached" in errors[0]


def test_download_fetches_the_engines_files_only(checkpoints):
    from huggingface_hub.utils import filter_repo_objects

    from qwen3_model.hub import ALLOW_PATTERNS

    def wanted(name):  # what snapshot_download keeps of a repo's file list
        return list(filter_repo_objects([name], allow_patterns=ALLOW_PATTERNS)) == [name]

    for name in os.listdir(checkpoints["main"]):
        assert wanted(name), name
    for name in ["pytorch_model.bin", "model.pt", "model.gguf", "onnx/model.onnx", "README.md"]:
        assert not wanted(name), name
    for name in ["merges.txt", "vocab.json", "tokenizer.model", "model-00001-of-00002.safetensors"]:
        assert wanted(name), name


def hub_error(cls, status: int, message: str):
    import httpx

    request = httpx.Request("GET", f"https://huggingface.co/api/models/{REPO}")
    return cls(message, response=httpx.Response(status, request=request))


def test_online_download_and_hub_refusals(monkeypatch, checkpoints):
    """Online (a stand-in for snapshot_download: no network): the engine's file patterns are
    asked for, and each refusal of the Hub is one line naming the id and what to do."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub import errors as hf

    from qwen3_model.hub import ALLOW_PATTERNS, snapshot_folder

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls, raising = [], []

    def fake_snapshot_download(repo_id, **kw):
        calls.append((repo_id, kw))
        if raising:
            raise raising[0]
        return str(checkpoints["snapshots"]["main"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert snapshot_folder(REPO, "v1") == str(checkpoints["snapshots"]["main"])
    assert calls == [(REPO, dict(revision="v1", allow_patterns=ALLOW_PATTERNS,
                                 local_files_only=False))]
    for error, expected in [
        (hub_error(hf.RepositoryNotFoundError, 404, "404 Client Error.\nRepository Not Found"),
         f"no repo {REPO} (or a private one: log in with `hf auth login` or set HF_TOKEN)"),
        (hub_error(hf.GatedRepoError, 403, "403 Client Error.\nCannot access gated repo"),
         f"{REPO} is gated: accept its terms on huggingface.co, then log in"),
        (hub_error(hf.HfHubHTTPError, 401, "401 Client Error: Unauthorized"), "log in with"),
        (hub_error(hf.RevisionNotFoundError, 404, "404 Client Error.\nRevision Not Found"),
         f"{REPO} has no revision 'v1'"),
        (hub_error(hf.HfHubHTTPError, 500, "500 Server Error\nsome detail"),
         "HfHubHTTPError: 500 Server Error"),
        (hf.LocalEntryNotFoundError("Cannot find ... check your internet connection"),
         "nor in the Hugging Face cache"),
    ]:
        raising[:] = [error]
        with pytest.raises(CheckpointError) as e:
            snapshot_folder(REPO, "v1")
        msg = str(e.value)
        assert msg.startswith(f"model '{REPO}@v1'") and "\n" not in msg, msg
        assert expected in msg, (expected, msg)
    assert "the Hub could not be reached" in msg
