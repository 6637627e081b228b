"""Builds qwen3_kernels._C when torch has CUDA and nvcc is found; otherwise the pure-Python package.

    pip install --no-build-isolation -e .        # needs torch (and nvcc + nvidia-cutlass for the kernels)

Env: CUTLASS_DIR (CUTLASS checkout; default: the nvidia-cutlass package), TORCH_CUDA_ARCH_LIST
(narrows the targets, e.g. "9.0a"), MAX_JOBS (parallel nvcc jobs), QWEN3_KERNELS_NO_CUDA=1 (skip).
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def cutlass_include_dirs():
    """CUTLASS headers from CUTLASS_DIR or the nvidia-cutlass package; nothing vendored."""
    root = os.environ.get("CUTLASS_DIR")
    if root:
        return [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]
    try:
        import cutlass_library
    except ImportError:
        sys.exit("qwen3_kernels: CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0 "
                 "or set CUTLASS_DIR to a CUTLASS checkout")
    src = os.path.join(os.path.dirname(cutlass_library.__file__), "source")
    return [os.path.join(src, "include"), os.path.join(src, "tools", "util", "include")]


def gencode_flags():
    """sm_90a for the Hopper kernels (wgmma / TMA), sm_80 so the portable ones also run on A100.
    Hopper-only code is compiled out of the sm_80 pass by __CUDA_ARCH__ guards."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0 9.0a").replace(";", " ").split()
    flags = []
    for a in archs:
        a = a.replace("+PTX", "")
        num = a.replace(".", "")
        if num == "90":  # the Hopper kernels need the arch-specific target
            num = "90a"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def cuda_extension():
    if os.environ.get("QWEN3_KERNELS_NO_CUDA") == "1":
        return None, "QWEN3_KERNELS_NO_CUDA=1"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return None, "torch is not installed in the build environment (use --no-build-isolation)"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} has no CUDA"
    if CUDA_HOME is None or shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")) is None:
        return None, "nvcc not found (set CUDA_HOME)"
    sources = ["csrc/torch_bindings.cpp"] + sorted(
        glob.glob("csrc/kernels/**/*.cu", recursive=True)
    )
    include_dirs = [os.path.join(ROOT, "csrc", "include")] + cutlass_include_dirs()
    ext = CUDAExtension(
        name="qwen3_kernels._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17"],
            "nvcc": [
                "-O3", "-std=c++17", "--expt-relaxed-constexpr", "--use_fast_math",
                "-DNDEBUG", "-lineinfo",
                # CUTLASS 3.x needs these off: the torch defaults would break its half types.
                "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
            ] + gencode_flags(),
        },
    )
    return (ext, BuildExtension), None


built, why_not = cuda_extension()
if built is None:
    print(f"qwen3_kernels: building without CUDA kernels ({why_not}); ops use the reference",
          file=sys.stderr)
    ext_modules, cmdclass = [], {}
else:
    ext, build_ext = built
    ext_modules, cmdclass = [ext], {"build_ext": build_ext.with_options(use_ninja=True)}

setup(
    packages=find_packages(include=["qwen3_kernels", "qwen3_model", "qwen3_model.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
