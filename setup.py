"""Build script for replay_ops.

The Python package `replay_ops` and the Triton kernels (installed as the subpackage
`replay_ops.triton_kernels`, never as a top-level `triton_kernels`, which is Triton's
own name) are always installed. Native C++/CUDA extensions from `csrc/` are optional.
"""
from setuptools import setup

PACKAGES = {
    "replay_ops": "replay_ops",
    "replay_ops.triton_kernels": "triton_kernels",
}


def find_subpackages():
    import os

    found = dict(PACKAGES)
    for top in ("replay_ops",):
        for root, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            if "__init__.py" in files:
                found.setdefault(root.replace(os.sep, "."), root)
    return found


pkgs = find_subpackages()

setup(
    name="replay_ops",
    version="0.1.0",
    description="Fused replayed top-k gating ops for Mixture-of-Experts router replay",
    packages=sorted(pkgs),
    package_dir=pkgs,
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "numpy"],
    extras_require={
        "triton": ["triton"],
        "replay": ["omegaconf", "pyyaml", "safetensors"],
        "demo": ["tqdm", "matplotlib"],
        "test": ["pytest"],
    },
)
