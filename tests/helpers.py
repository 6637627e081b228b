"""Shared by the tests: the CUDA skip marker and the error measure."""
import contextlib
import signal

import pytest
import torch

import qwen3_kernels

HAS_CUDA = torch.cuda.is_available() and qwen3_kernels.has_cuda_kernels()

# Tests that need a GPU with the built extension use `@requires_cuda`; they skip cleanly elsewhere.
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and the built extension")


def load_checkpoint(path, device=None, dtype: torch.dtype | None = None):
    """Qwen3ForCausalLM built from the checkpoint at ``path`` (its config.json) on ``device`` in
    ``dtype`` (the current defaults where None), with the checkpoint's weights loaded."""
    from qwen3_model.loader import load_hf_config, load_model
    from qwen3_model.models.qwen3 import Qwen3ForCausalLM

    prev = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = Qwen3ForCausalLM(load_hf_config(path))
    finally:
        torch.set_default_dtype(prev)
    load_model(model, path)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (b the reference)."""
    a64, b64 = a.double(), b.double()
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item()


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t (same shape, dtype, device) one element past a 16-byte boundary: a
    view at an odd storage offset, which the ops must refuse before a 16-byte device access."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16
    return view


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices gain nothing from intra-op threads, and on a busy 2-core runner OpenMP's
    barriers make each op thousands of times slower; restored after the module.
    Use: `from tests.helpers import one_thread  # noqa: F401` (autouse, module scope)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def sigint_as_a_terminal_sends_it():
    """``preexec_fn`` for a child the test interrupts with SIGINT: a runner started in the
    background by a non-interactive shell (``cmd &``) ignores SIGINT, and its children inherit
    that, so the child's KeyboardInterrupt would never come. The default disposition restores it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
