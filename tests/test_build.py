"""Compile-only checks that run without a GPU, so a kernel that does not compile cannot land.

Every csrc/kernels TU goes through `nvcc -c` for sm_90a and sm_80 (the two targets setup.py builds),
and csrc/torch_bindings.cpp gets a C++ syntax check against torch's headers. Skips without nvcc.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TUS = sorted((ROOT / "csrc" / "kernels").rglob("*.cu"))
NVCC = shutil.which("nvcc")


def cutlass_includes():
    try:
        import cutlass_library
    except ImportError:
        return None
    src = Path(cutlass_library.__file__).parent / "source"
    return [src / "include", src / "tools" / "util" / "include"]


def cuda_home():
    nvcc = Path(os.path.realpath(NVCC))
    for cand in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", nvcc.parent.parent):
        if cand and (Path(cand) / "include" / "cuda_runtime_api.h").exists():
            return Path(cand)
    return None


needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


@needs_nvcc
@pytest.mark.parametrize("tu", KERNEL_TUS, ids=[str(p.relative_to(ROOT / "csrc")) for p in KERNEL_TUS])
def test_kernel_tu_compiles_for_sm90a(tu, tmp_path):
    incs = cutlass_includes()
    if incs is None:
        pytest.skip("nvidia-cutlass not installed (pip install nvidia-cutlass==4.2.0.0)")
    cmd = [
        NVCC, "-c", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-DNDEBUG",
        "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_80,code=sm_80",
        f"-I{ROOT / 'csrc' / 'include'}", *[f"-I{p}" for p in incs],
        str(tu), "-o", str(tmp_path / "tu.o"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-6000:]}"


@needs_nvcc
def test_torch_bindings_syntax(tmp_path):
    home = cuda_home()
    if home is None:
        pytest.skip("CUDA headers not found")
    # A CPU build of torch ships c10/cuda headers but not this generated one; an empty stand-in is
    # enough for a syntax check (the real build uses a CUDA torch).
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("")
    ti = Path(torch.__file__).parent / "include"
    cxx = shutil.which("g++") or shutil.which("c++")
    cmd = [
        cxx, "-std=c++17", "-fsyntax-only", "-w", "-DTORCH_EXTENSION_NAME=_C",
        f"-I{ROOT / 'csrc' / 'include'}", f"-I{tmp_path / 'stub'}", f"-I{ti}",
        f"-I{ti / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{sysconfig.get_paths()['include']}",
        f"-I{home / 'include'}", str(ROOT / "csrc" / "torch_bindings.cpp"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-6000:]


def test_every_launcher_is_defined_in_a_kernel_tu():
    # The extension links only if each launcher declared in launchers.h has a definition.
    header = (ROOT / "csrc" / "include" / "qwen3_kernels" / "launchers.h").read_text()
    import re

    names = re.findall(r"^cudaError_t (\w+)\(", header, flags=re.M)
    assert names
    bodies = "\n".join(p.read_text() for p in KERNEL_TUS)
    missing = [n for n in names if not re.search(rf"cudaError_t {n}\([^;]*?\)\s*{{", bodies, flags=re.S)]
    assert not missing, f"launchers declared but not defined in csrc/kernels: {missing}"
