"""Build script for replay_ops.

The Python package `replay_ops` and the Triton kernels (installed as the subpackage
`replay_ops.triton_kernels`, never as a top-level `triton_kernels`, which is Triton's
own name) are always installed.

Native extension `replay_ops._C` (sources in `csrc/`, see docs/native.md):

* The C++ CPU kernels are always built (set REPLAY_OPS_NATIVE=0 to skip the whole extension;
  the package then runs on the Triton/PyTorch backends).
* The CUDA kernels are added when the installed torch is a CUDA build and nvcc is found.
  The decision never looks at `torch.cuda.is_available()`, so a machine without a GPU can
  build CUDA wheels. REPLAY_OPS_CUDA=0 skips CUDA, REPLAY_OPS_CUDA=1 requires it (the build
  fails with the reason when it cannot be done). TORCH_CUDA_ARCH_LIST is respected; when it
  is unset, "8.0;9.0+PTX" is used.
"""
import os
import shutil
import sys

from setuptools import setup

PACKAGES = {
    "replay_ops": "replay_ops",
    "replay_ops.triton_kernels": "triton_kernels",
}

ROOT = os.path.dirname(os.path.abspath(__file__))
CPU_SOURCES = [
    "csrc/bindings/register_cpu.cpp",
    "csrc/cpu/gate_cpu.cpp",
    "csrc/cpu/permute_cpu.cpp",
    "csrc/cpu/row_kernels.cpp",
]
CUDA_SOURCES = [
    "csrc/bindings/register_cuda.cpp",
    "csrc/cuda/gate_kernels.cu",
    "csrc/cuda/permute_kernels.cu",
]
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0+PTX"


def find_subpackages():
    found = dict(PACKAGES)
    for top in ("replay_ops",):
        for root, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            if "__init__.py" in files:
                found.setdefault(root.replace(os.sep, "."), root)
    return found


def _env_flag(name):
    """None when unset/empty/'auto', else True/False."""
    v = os.environ.get(name, "").strip().lower()
    if v in ("", "auto"):
        return None
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise SystemExit(f"setup.py: {name}={os.environ[name]!r}: expected 0, 1 or auto")


def _find_nvcc():
    from torch.utils.cpp_extension import CUDA_HOME

    home = CUDA_HOME or os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cands = [os.path.join(home, "bin", "nvcc")] if home else []
    which = shutil.which("nvcc")
    if which:
        cands.append(which)
    return next((c for c in cands if os.path.exists(c)), None)


def want_cuda():
    import torch

    flag = _env_flag("REPLAY_OPS_CUDA")
    if flag is False:
        return False, "REPLAY_OPS_CUDA=0"
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"the installed torch {torch.__version__} is not a CUDA build")
    if _find_nvcc() is None:
        reasons.append("nvcc was not found (set CUDA_HOME)")
    if reasons:
        if flag:
            raise SystemExit("setup.py: REPLAY_OPS_CUDA=1 but " + "; ".join(reasons))
        return False, "; ".join(reasons)
    return True, "torch has CUDA and nvcc is present"


def native_extensions():
    if _env_flag("REPLAY_OPS_NATIVE") is False:
        print("replay_ops: REPLAY_OPS_NATIVE=0, not building the native extension")
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    include = [os.path.join(ROOT, "csrc", "include")]
    # -fno-trapping-math: FP ops are assumed not to trap (they never do here; no value
    # changes), which lets GCC vectorise the branch-free exp and max loops of the CPU gate.
    # -ffp-contract=off: no fused multiply-add, so the AVX2/AVX-512 copies of the row
    # kernels (csrc/cpu/row_kernels.h) give the same bits as the baseline copy.
    cxx = ["-O3", "-std=c++17", "-fno-trapping-math", "-ffp-contract=off",
           "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
    if sys.platform.startswith("linux"):
        cxx.append("-fopenmp")  # at::parallel_for uses OpenMP in the standard torch builds
    cuda, why = want_cuda()
    print(f"replay_ops: building CPU kernels; CUDA kernels {'on' if cuda else 'off'} ({why})")
    if cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCH_LIST)
        ext = CUDAExtension(
            "replay_ops._C",
            CPU_SOURCES + CUDA_SOURCES,
            include_dirs=include,
            define_macros=[("REPLAY_OPS_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": cxx,
                # --fmad=false: no implicit multiply-add contraction, so every launch path
                # of the gate (they inline the same device functions in different contexts)
                # gives the same bits; FMAs meant as such are explicit (__fmaf_rn).
                "nvcc": ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr",
                         "--fmad=false"],
            },
            extra_link_args=["-fopenmp"] if sys.platform.startswith("linux") else [],
        )
    else:
        ext = CppExtension(
            "replay_ops._C",
            CPU_SOURCES,
            include_dirs=include,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"] if sys.platform.startswith("linux") else [],
        )
    return [ext], {"build_ext": BuildExtension}


pkgs = find_subpackages()
ext_modules, cmdclass = native_extensions()

setup(
    name="replay_ops",
    version="0.1.0",
    description="Fused replayed top-k gating ops for Mixture-of-Experts router replay",
    packages=sorted(pkgs),
    package_dir=pkgs,
    # the start-up hook put on the PYTHONPATH of vLLM processes on a CPU (not a subpackage)
    package_data={"replay_ops.demo": ["vllm_cpu/*.py"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "numpy"],
    extras_require={
        "triton": ["triton"],
        "replay": ["omegaconf", "pyyaml", "safetensors"],
        "demo": ["tqdm", "matplotlib"],
        "test": ["pytest"],
    },
)
