"""Hugging Face Hub repo ids as ``model``: "org/name" or "org/name@revision" -> a local snapshot.

    parse_repo_id("Qwen/Qwen3-0.6B@main")   # ("Qwen/Qwen3-0.6B", "main"); None: not a repo id
    snapshot_folder("Qwen/Qwen3-0.6B")      # the folder in the HF cache (downloaded if need be)

huggingface_hub's ``snapshot_download`` does the work: online it fetches what the engine reads into
its cache; offline (HF_HUB_OFFLINE=1) or without network it finds the snapshot in the cache. Every
failure comes back as one CheckpointError line.
"""

from __future__ import annotations

from qwen3_model.loader import CheckpointError

# what the engine reads: config / generation config / index / tokenizer json, the weights, the
# chat template, and the tokenizer files of other formats (no *.bin / *.pt / *.gguf / *.onnx)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "merges.txt", "vocab*"]


def parse_repo_id(model: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` for "org/name" or "org/name@revision", else None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id, at, revision = model.partition("@")
    if repo_id.count("/") != 1 or (at and not revision):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, revision or None


def snapshot_folder(repo_id: str, revision: str | None = None) -> str:
    """The local snapshot folder of ``repo_id`` at ``revision`` (a branch, tag or commit; None:
    main), downloaded into the HF cache when online and not there yet."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf

    name = repo_id + (f"@{revision}" if revision else "")
    offline = constants.is_offline_mode()
    login = "log in with `hf auth login` or set HF_TOKEN"
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                 local_files_only=offline)
    except hf.LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        if isinstance(e, hf.IncompleteSnapshotError):
            why += "; the cached snapshot misses files"
        raise CheckpointError(
            f"model {name!r} is neither a checkpoint folder nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}; {why}); download it with `hf download {repo_id}` "
            f"(or `huggingface-cli download {repo_id}`), or pass a checkpoint folder"
        ) from None
    except hf.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(e, hf.GatedRepoError):
            why = f"{repo_id} is gated: accept its terms on huggingface.co, then {login}"
        elif isinstance(e, hf.RevisionNotFoundError):
            why = f"{repo_id} has no revision {revision!r}"
        elif isinstance(e, hf.RepositoryNotFoundError) or status == 401:
            why = f"no repo {repo_id} (or a private one: {login})"
        else:
            text = str(e).strip()
            why = f"{type(e).__name__}: {text.splitlines()[0] if text else status}"
        raise CheckpointError(f"model {name!r}: the Hugging Face Hub refused it: {why}") from None
