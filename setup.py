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
* The C++ standard is the one the installed torch's headers require (C++17 up to torch 2.13,
  C++20 from 2.14; torch 2.11 asks for C++17), read from `ATen/ATen.h`, for g++ and nvcc
  alike.
* The CUDA toolkit is found where `bin/nvcc` and `include/cuda_runtime.h` sit together:
  $CUDA_HOME, $CUDA_PATH, the toolkit the `nvcc` on PATH runs (also when that `nvcc` is a
  wrapper script outside the toolkit), then /usr/local/cuda.
* Release builds carry no debug info (REPLAY_OPS_DEBUG=1 keeps `-g`).
* REPLAY_OPS_NVCC_FLAGS adds flags to every nvcc command (split like a shell line), e.g.
  "-Xptxas -warn-spills" to have ptxas report register spills.
* The build records the torch it was built against (replay_ops/_build_info.py, and a string
  inside the library), so that a library loaded under another torch is refused with both
  versions named (replay_ops/_extension.py). Every build that compiles the library (a
  wheel, an editable or a plain install) pins that torch release in its metadata and
  carries it in its version's local label, e.g. 0.1.0+pt2.14.1cu130; without the library
  (REPLAY_OPS_NATIVE=0) the package asks for the declared range (pyproject.toml's
  [tool.replay_ops]: torch>=2.11,<2.16; the `triton` extra asks for triton>=3.6).
"""
import os
import re
import shlex
import shutil
import subprocess
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


def _package_version():
    """The version, declared once: `__version__` in replay_ops/__init__.py."""
    text = open(os.path.join(ROOT, "replay_ops", "__init__.py"), encoding="utf-8").read()
    m = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    if not m:
        raise SystemExit("setup.py: replay_ops/__init__.py has no __version__ = \"...\"")
    return m.group(1)


VERSION = _package_version()


def _declared(name):
    """A supported range from pyproject.toml's [tool.replay_ops] (torch = "...", triton =
    "..."), the one place it is declared."""
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    m = re.search(r'^\[tool\.replay_ops\][^\[]*?^' + name + r'\s*=\s*"([^"]+)"', text,
                  re.M | re.S)
    if not m:
        raise SystemExit(f"setup.py: pyproject.toml has no [tool.replay_ops] {name} = \"...\"")
    return m.group(1)


def _in_range(version, spec):
    """Whether a torch version (its public part, to the minor release) meets a specifier of
    >=, >, <, <= and == clauses."""
    def key(v):
        return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])
    v = key(version)
    for clause in spec.split(","):
        m = re.fullmatch(r"\s*(>=|<=|==|>|<)\s*([\d.]+)\s*", clause)
        if not m:
            raise SystemExit(f"setup.py: cannot read the torch range clause {clause!r}")
        op, bound = m.group(1), key(m.group(2))
        vv = v[:len(bound)]
        ok = {">=": vv >= bound, "<=": vv <= bound, "==": vv == bound, ">": vv > bound,
              "<": vv < bound}[op]
        if not ok:
            return False
    return True


TORCH_RANGE = _declared("torch")
TRITON_RANGE = _declared("triton")
GENERATED = os.path.join(ROOT, "build", "generated")


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


def _toolkit_ok(root):
    return bool(root) and os.path.isfile(os.path.join(root, "bin", "nvcc")) and \
        os.path.isfile(os.path.join(root, "include", "cuda_runtime.h"))


def _nvcc_reported_root(nvcc):
    """The toolkit an `nvcc` command runs: `nvcc --dryrun` prints `_HERE_=<toolkit>/bin`,
    also when the command is a wrapper script outside the toolkit."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"^#\$ _HERE_=(.+)$", out.stdout + out.stderr, re.M)
    return os.path.dirname(m.group(1).strip()) if m else None


def find_cuda_home():
    """(toolkit root or None, what was tried). Sets nothing."""
    tried = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            if _toolkit_ok(root):
                return root, tried
            tried.append(f"${var}={root} has no bin/nvcc with include/cuda_runtime.h")
    which = shutil.which("nvcc")
    if which:
        for root in (_nvcc_reported_root(which),
                     os.path.dirname(os.path.dirname(os.path.realpath(which)))):
            if _toolkit_ok(root):
                return root, tried
        tried.append(f"the nvcc on PATH ({which}) is not inside a toolkit and did not report one")
    if _toolkit_ok("/usr/local/cuda"):
        return "/usr/local/cuda", tried
    tried.append("no /usr/local/cuda")
    return None, tried


def cxx_standard(torch_include):
    """The C++ standard (17, 20, ...) the torch headers require: ATen/ATen.h refuses older
    compilers with `#if ... __cplusplus < 2020xxL` / `#error C++NN or later ...`."""
    path = os.path.join(torch_include, "ATen", "ATen.h")
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except OSError:
        raise SystemExit(f"setup.py: cannot read {path}: is torch installed with its headers?")
    m = re.search(r"__cplusplus\s*<\s*(\d{4})(\d{2})L", text)
    if not m:
        raise SystemExit(f"setup.py: {path} states no minimum C++ standard (__cplusplus < ...)")
    year = int(m.group(1))
    return {2011: 11, 2014: 14, 2017: 17, 2020: 20, 2023: 23}.get(year, 17 if year < 2020 else 20)


def want_cuda():
    import torch

    flag = _env_flag("REPLAY_OPS_CUDA")
    if flag is False:
        return False, "REPLAY_OPS_CUDA=0"
    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"the installed torch {torch.__version__} is not a CUDA build")
    home, tried = find_cuda_home()
    if home is None:
        reasons.append("no CUDA toolkit was found (" + "; ".join(tried) + "): set CUDA_HOME "
                       "to the toolkit root, the folder with bin/nvcc and include/cuda_runtime.h")
    if reasons:
        if flag:
            raise SystemExit("setup.py: REPLAY_OPS_CUDA=1 but " + "; ".join(reasons))
        return False, "; ".join(reasons)
    # torch.utils.cpp_extension reads CUDA_HOME when it is imported (it would otherwise take
    # the parent of the nvcc on PATH, wrong for a wrapper script).
    os.environ["CUDA_HOME"] = home
    return True, f"torch {torch.__version__} has CUDA {torch.version.cuda}; toolkit {home}"


def build_info(torch, cuda, std):
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda if cuda else None,
            "with_cuda": bool(cuda), "cxx_standard": std,
            "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST") if cuda else None}


def write_build_info(info):
    """replay_ops/_build_info.py (read before the library is loaded) and the header that
    puts the same facts inside the library (read when a load fails)."""
    with open(os.path.join(ROOT, "replay_ops", "_build_info.py"), "w") as f:
        f.write('"""Written by setup.py: the torch this copy\'s replay_ops._C was built '
                'against."""\n')
        f.write(f"BUILD = {info!r}\n")
    os.makedirs(GENERATED, exist_ok=True)
    marker = (f"replay_ops build: torch={info['torch']};cuda={info['torch_cuda'] or 'none'};"
              f"cxx={info['cxx_standard']};")
    text = ("// Written by setup.py (CMake writes its own): the torch this library is built for.\n"
            "#pragma once\n"
            f'#define REPLAY_OPS_BUILD_INFO "{marker}"\n')
    path = os.path.join(GENERATED, "replay_build_info.h")
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


def wheel_pins(info):
    """A wheel's torch requirement and version label: the library loads only with the torch
    release it was built against, so pip must never pair the wheel with another."""
    public = info["torch"].split("+")[0]
    label = "pt" + public + ("cu" + info["torch_cuda"].replace(".", "") if info["torch_cuda"]
                             else "cpu")
    return f"torch=={public}", f"{VERSION}+{label}"


NO_NATIVE_HINT = (
    "The native library is optional: the ops run on the Triton or PyTorch backends without "
    "it. To install without it: REPLAY_OPS_NATIVE=0 pip install --no-build-isolation -e . "
    "(or REPLAY_OPS_NATIVE=0 make demo). To build it, install a C++ compiler (g++ 10 or "
    "newer; C++20 for torch 2.14 and newer) and set CXX if it is not on PATH as c++/g++. "
    "docs/native.md lists the build's settings.")


def find_cxx():
    """(the C++ compiler command the build will call: $CXX, else Python's configured one,
    else c++; its path, or None when it is not found)."""
    import shlex
    import sysconfig

    cmd = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    try:
        first = shlex.split(cmd)[0]
    except (ValueError, IndexError):
        return cmd, None
    return first, shutil.which(first)


def _with_hint(base):
    """`base` (torch's BuildExtension) whose failure ends with what to do instead, not
    with a compiler's traceback alone."""
    class BuildExtensionWithHint(base):
        def run(self):
            try:
                super().run()
            except Exception as e:  # a compile or link error, a missing compiler or ninja
                raise SystemExit(f"setup.py: the native library did not build "
                                 f"({type(e).__name__}: {e}). {NO_NATIVE_HINT}") from e

    return BuildExtensionWithHint


def native_extensions():
    if _env_flag("REPLAY_OPS_NATIVE") is False:
        print("replay_ops: REPLAY_OPS_NATIVE=0, not building the native extension")
        stale = os.path.join(ROOT, "replay_ops", "_build_info.py")
        if os.path.exists(stale):
            os.remove(stale)
        return [], {}, None
    try:
        import torch
    except ImportError as e:
        raise SystemExit(
            f"setup.py: torch cannot be imported ({e}). The native extension is compiled "
            "against the torch you have: install torch first, then this package with "
            "`pip install --no-build-isolation .` (or REPLAY_OPS_NATIVE=0 for no extension)")

    cxx_cmd, cxx_path = find_cxx()
    if cxx_path is None:
        raise SystemExit(f"setup.py: no C++ compiler: {cxx_cmd!r} is not found "
                         f"({'$CXX' if os.environ.get('CXX') else 'PATH'}). {NO_NATIVE_HINT}")
    if not _in_range(torch.__version__, TORCH_RANGE):
        print(f"replay_ops: WARNING: torch {torch.__version__} is outside the supported range "
              f"torch{TORCH_RANGE} (pyproject.toml); building against it anyway")
    cuda, why = want_cuda()  # sets CUDA_HOME before cpp_extension reads it
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, \
        include_paths

    std = cxx_standard(include_paths()[0])
    include = [os.path.join(ROOT, "csrc", "include"), GENERATED]
    # -fno-trapping-math: FP ops are assumed not to trap (they never do here; no value
    # changes), which lets GCC vectorise the branch-free exp and max loops of the CPU gate.
    # -ffp-contract=off: no fused multiply-add, so the AVX2/AVX-512 copies of the row
    # kernels (csrc/cpu/row_kernels.h) give the same bits as the baseline copy.
    cxx = ["-O3", f"-std=c++{std}", "-fno-trapping-math", "-ffp-contract=off",
           "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
    if sys.platform.startswith("linux"):
        cxx.append("-fopenmp")  # at::parallel_for uses OpenMP in the standard torch builds
    debug = _env_flag("REPLAY_OPS_DEBUG")
    # Release builds: no debug info (Python's own CFLAGS may bring -g; -g0 comes last and
    # wins), and the linker drops any that remains.
    cxx.append("-g" if debug else "-g0")
    link = ["-fopenmp"] if sys.platform.startswith("linux") else []
    if not debug and sys.platform.startswith("linux"):
        link.append("-Wl,--strip-debug")
    print(f"replay_ops: building CPU kernels (C++{std}, the standard torch {torch.__version__}'s "
          f"headers require); CUDA kernels {'on' if cuda else 'off'} ({why})")
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
                "nvcc": ["-O3", f"-std=c++{std}", "-lineinfo", "--expt-relaxed-constexpr",
                         "--fmad=false"] + (["-g"] if debug else [])
                        + shlex.split(os.environ.get("REPLAY_OPS_NVCC_FLAGS", "")),
            },
            extra_link_args=link,
        )
    else:
        ext = CppExtension(
            "replay_ops._C",
            CPU_SOURCES,
            include_dirs=include,
            extra_compile_args={"cxx": cxx},
            extra_link_args=link,
        )
    info = build_info(torch, cuda, std)
    write_build_info(info)
    return [ext], {"build_ext": _with_hint(BuildExtension)}, info


pkgs = find_subpackages()
ext_modules, cmdclass, native_info = native_extensions()
requires = [f"torch{TORCH_RANGE}", "numpy", "zstandard"]
version = VERSION
if native_info is not None:
    # Every build that compiles the library (a wheel, an editable or a plain install) pins
    # the torch release it was built against: pip then never pairs it with another torch,
    # and says so when torch is changed under an installed copy.
    torch_pin, version = wheel_pins(native_info)
    requires = [torch_pin, "numpy", "zstandard"]
    print(f"replay_ops: {version} requires {torch_pin} (the torch its library is built for)")

setup(
    name="replay_ops",
    version=version,
    description="Fused replayed top-k gating ops for Mixture-of-Experts router replay",
    packages=sorted(pkgs),
    package_dir=pkgs,
    # Files that are not modules of a package: the start-up hooks put on the PYTHONPATH of
    # vLLM's and SGLang's processes on a CPU (`--engine vllm|sglang` from any install), and
    # the PEP 561 marker. tests/test_packaging.py builds a wheel and checks that it holds
    # every file of replay_ops/ and triton_kernels/ that git tracks.
    package_data={"replay_ops": ["py.typed"],
                  "replay_ops.demo": ["vllm_cpu/*.py", "sglang_cpu/*.py"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
    license="Apache-2.0",
    license_files=["LICENSE"],
    install_requires=requires,
    extras_require={
        "triton": [f"triton{TRITON_RANGE}"],
        "replay": ["omegaconf", "pyyaml", "safetensors"],
        "demo": ["tqdm", "matplotlib"],
        "test": ["pytest", "hypothesis", "pytest-xdist", "ruff==0.17.6"],
    },
    # vLLM and SGLang load these in their processes; they do nothing unless
    # REPLAY_OPS_VLLM_INJECT=1 / REPLAY_OPS_SGLANG_INJECT=1 (route injection,
    # replay_ops/integrations/vllm and replay_ops/integrations/sglang)
    entry_points={
        "vllm.general_plugins": ["replay_ops_inject = replay_ops.integrations.vllm:register"],
        "sglang.srt.plugins": ["replay_ops_inject = replay_ops.integrations.sglang:register"],
    },
)
