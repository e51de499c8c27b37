"""Check an installed replay_ops native build (run by .ci/cuda_build_job.sh; usable by hand).

    python tools/check_native_build.py [--wheel dist/replay_ops-...whl] [--archs "8.0;9.0"]
                                       [--cpu-only]

Run it from outside the source tree, so that the installed package is the one imported.
It checks, and exits non-zero on the first failure:

* replay_ops._C loads from the installed package, under the torch it records
  (_build_info.py and the library's BUILD_INFO), with the CUDA kernels compiled in;
* every kernel op of the `replay_native` namespace (the ten that take tensors) has a
  kernel for the CPU and the CUDA dispatch keys, and every knob an implementation;
* once loaded, the library has no undefined symbols: a fresh interpreter loads it with
  LD_BIND_NOW=1 and RTLD_NOW, so the loader binds every symbol at once or fails, and
  every library it needs (DT_NEEDED) is found;
* the library holds device code (cubins, and PTX where the list says +PTX) for every
  architecture asked for, read from its embedded fat binaries, and carries no debug info
  (no .debug_* section);
* the wheel: it holds the library and _build_info.py, its version carries the torch label
  and its metadata pins that torch release. Its size and contents are printed.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import zipfile

import torch


def fail(msg: str) -> None:
    print(f"check_native_build: FAIL: {msg}")
    sys.exit(1)


def ok(msg: str) -> None:
    print(f"check_native_build: ok   {msg}")


def check_load(cpu_only: bool):
    import replay_ops
    from replay_ops import _extension

    src_tree = os.path.exists(os.path.join(os.path.dirname(os.path.dirname(replay_ops.__file__)),
                                           "setup.py"))
    if src_tree:
        fail(f"replay_ops was imported from a source tree ({replay_ops.__file__}); run this "
             "from outside it")
    path = _extension.library_path()
    if path is None:
        fail("the installed package has no replay_ops._C")
    rec = _extension.recorded_build()
    if rec is None:
        fail(f"no replay_ops/_build_info.py beside {path}")
    _C = _extension.load()
    ok(f"replay_ops._C loads from {path}: {_C.BUILD_INFO} (running torch {torch.__version__}, "
       f"CUDA {torch.version.cuda})")
    if rec["torch"] != torch.__version__:
        fail(f"_build_info.py says torch {rec['torch']}, the running one is {torch.__version__}")
    if not cpu_only and not _C.WITH_CUDA:
        fail("the library was built without the CUDA kernels")
    return path, _C


def check_kernels(cpu_only: bool) -> None:
    """The kernel ops (those taking tensors) need a kernel per device; the knobs (no
    tensor argument: cpu_isa, cuda_gate_path, ...) are device-free functions."""
    names = sorted(n for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith("replay_native::"))
    tensor_ops = [n for n in names if "Tensor" in str(torch._C._get_schema(n, ""))]
    knobs = [n for n in names if n not in tensor_ops]
    if len(tensor_ops) < 10:
        fail(f"only {len(tensor_ops)} replay_native kernel ops are registered: {tensor_ops}")
    from replay_ops.backends.protocol import FUSED_OPS

    keys = ["CPU"] + ([] if cpu_only else ["CUDA"])
    # The optional fused kernels (replay_ops/backends/protocol.py FUSED_OPS) are CPU ops: the
    # native backend hands them over on a GPU, where the gate and the permute kernels run in
    # turn (csrc/bindings/register_cpu.cpp). Every other kernel op needs both.
    cpu_ops = {f"replay_native::{n}" for n in FUSED_OPS}
    missing = [(n, k) for n in tensor_ops for k in keys
               if not (k == "CUDA" and n in cpu_ops)
               and not torch._C._dispatch_has_kernel_for_dispatch_key(n, k)]
    if missing:
        fail(f"ops without a kernel: {missing}")
    if not cpu_only and "replay_native::cuda_kernel_image" not in knobs:
        fail("the CUDA build has no replay_native::cuda_kernel_image probe")
    unbound = [n for n in knobs if not torch._C._dispatch_has_kernel(n)]
    if unbound:
        fail(f"knobs without an implementation: {unbound}")
    ok(f"{len(tensor_ops)} replay_native kernel ops, each with a kernel for "
       f"{' and '.join(keys)} (the fused {', '.join(FUSED_OPS)}: CPU): "
       f"{', '.join(n.split('::')[1] for n in tensor_ops)}; "
       f"{len(knobs)} knobs ({', '.join(n.split('::')[1] for n in knobs)})")


def check_symbols(path: str) -> None:
    code = ("import os, sys, torch; sys.setdlopenflags(os.RTLD_NOW | os.RTLD_LOCAL); "
            "import replay_ops._extension as e; e.load(); print('bound')")
    env = dict(os.environ, LD_BIND_NOW="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env)
    if out.returncode != 0 or "bound" not in out.stdout:
        fail(f"the library does not load with every symbol bound (LD_BIND_NOW=1, RTLD_NOW):\n"
             f"{out.stdout}{out.stderr}")
    undefined = []
    if shutil.which("nm"):
        nm = subprocess.run(["nm", "-D", "--undefined-only", path], capture_output=True,
                            text=True, check=True)
        undefined = [line.split()[-1] for line in nm.stdout.splitlines()
                     if line.strip() and line.split()[0] == "U"]
    needed = []
    if shutil.which("readelf"):
        dyn = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True)
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn.stdout)
    ok(f"no undefined symbols once loaded: all {len(undefined)} imported symbols bound "
       f"(LD_BIND_NOW=1) against {len(needed)} needed libraries ({', '.join(needed)})")


def check_binary(path: str, archs: str | None, cpu_only: bool) -> None:
    size = os.path.getsize(path)
    sections = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True,
                              check=True).stdout
    debug = sorted(set(re.findall(r"\s(\.debug_\w+)\s", sections)))
    if debug:
        fail(f"the library carries debug info ({', '.join(debug)}); release builds must not")
    ok(f"{os.path.basename(path)}: {size / 1e6:.1f} MB, no debug info")
    if cpu_only or not archs:
        return
    code = fatbin_entries(path)
    found = sorted({arch for kind, arch in code if kind == "cubin"})
    ptx = sorted({arch for kind, arch in code if kind == "ptx"})
    want = sorted({int(a.split("+")[0].replace(".", "")) for a in archs.split(";") if a.strip()})
    lacking = [a for a in want if a not in found]
    if lacking:
        fail(f"no device code for sm_{', sm_'.join(map(str, lacking))} (cubins for "
             f"{found}, PTX for {ptx})")
    want_ptx = sorted({int(a.split("+")[0].replace(".", "")) for a in archs.split(";")
                       if a.strip().endswith("+PTX")})
    if [a for a in want_ptx if a not in ptx]:
        fail(f"no PTX for {want_ptx} (PTX for {ptx})")
    ok(f"device code: {len(code)} fatbin entries, cubins for sm_{', sm_'.join(map(str, found))}"
       f"{'; PTX for ' + str(ptx) if ptx else ''}")


FATBIN_MAGIC = 0xBA55ED50
FATBIN_ZSTD = 0x8000  # an entry's flags: the payload is zstd-compressed
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _unzstd(frame: bytes, size: int) -> bytes | None:
    """The decompressed frame, or None where no zstd module is installed."""
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)


def fatbin_entries(path: str) -> list[tuple[str, int]]:
    """(kind, sm) of every entry of the CUDA fat binaries embedded in a library, read
    without the CUDA toolkit. A fat binary is a 16-byte header (magic 0xBA55ED50, u16
    version, u16 header size, u64 payload size) followed by entries, each a header (u16
    kind: 1 PTX, 2 cubin; u16; u32 header size; u64 payload size; ...; u32 sm at byte 28)
    and its payload. A cubin's payload is an ELF file, which is checked, so a misread layout
    fails instead of passing; a compressed one (flag FATBIN_ZSTD at byte 40, as nvcc writes
    large images) is a zstd frame whose decompressed size (u64 at byte 56) is not zero,
    also checked, and decompressed and checked as ELF where the `zstandard` module is
    installed."""
    import struct

    data = open(path, "rb").read()
    out = []
    pos = 0
    while (i := data.find(struct.pack("<I", FATBIN_MAGIC), pos)) >= 0:
        pos = i + 4
        _, _, hsize, size = struct.unpack_from("<IHHQ", data, i)
        j, end = i + hsize, i + hsize + size
        while j < end:
            kind, _, ehsize, psize = struct.unpack_from("<HHIQ", data, j)
            sm = struct.unpack_from("<I", data, j + 28)[0]
            if kind not in (1, 2) or ehsize == 0 or not 10 <= sm < 1000:
                fail(f"unreadable fat binary entry at byte {j} of {path}: kind {kind}, header "
                     f"{ehsize} bytes, sm {sm}")
            payload = data[j + ehsize:j + ehsize + psize]
            flags = struct.unpack_from("<Q", data, j + 40)[0] if ehsize >= 64 else 0
            if kind == 2 and flags & FATBIN_ZSTD:
                full = struct.unpack_from("<Q", data, j + 56)[0]
                if payload[:4] != ZSTD_MAGIC or full == 0:
                    fail(f"the compressed cubin at byte {j} of {path} (sm_{sm}) is not a zstd "
                         f"frame with a size (a misread layout)")
                payload = _unzstd(payload, full)
            if kind == 2 and payload is not None and payload[:4] != b"\x7fELF":
                fail(f"the cubin at byte {j} of {path} (sm_{sm}) is not an ELF file (a "
                     f"misread layout)")
            out.append(("cubin" if kind == 2 else "ptx", sm))
            j += ehsize + psize
    if not out:
        fail(f"no CUDA fat binary in {path}")
    return out


def check_wheel(wheel: str) -> None:
    name = os.path.basename(wheel)
    public = torch.__version__.split("+")[0]
    cuda = torch.version.cuda
    label = "pt" + public + ("cu" + cuda.replace(".", "") if cuda else "cpu")
    if f"+{label}-" not in name:
        fail(f"the wheel's version does not carry the torch label +{label}: {name}")
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        files = [i.filename for i in infos]
        meta_name = next(f for f in files if f.endswith(".dist-info/METADATA"))
        meta = z.read(meta_name).decode()
    libs = [i for i in infos if re.match(r"replay_ops/_C\..*\.so$", i.filename)]
    if len(libs) != 1:
        fail(f"the wheel holds {len(libs)} replay_ops/_C libraries: {[i.filename for i in libs]}")
    if "replay_ops/_build_info.py" not in files:
        fail("the wheel has no replay_ops/_build_info.py")
    if not any(f.startswith("replay_ops/triton_kernels/") for f in files):
        fail("the wheel has no replay_ops/triton_kernels")
    reqs = [r for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]
    if f"torch=={public}" not in [r.replace(" ", "") for r in reqs]:
        fail(f"the wheel's metadata does not pin torch=={public}: {reqs}")
    lib = libs[0]
    ok(f"wheel {name}: {os.path.getsize(wheel) / 1e6:.1f} MB, {len(files)} files; "
       f"{lib.filename} {lib.file_size / 1e6:.1f} MB ({lib.compress_size / 1e6:.1f} MB "
       f"compressed); requires {', '.join(reqs)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", help="the wheel the installed package came from")
    ap.add_argument("--archs", default=os.environ.get("TORCH_CUDA_ARCH_LIST"),
                    help="the architectures the device code must cover, e.g. '8.0;9.0'")
    ap.add_argument("--cpu-only", action="store_true", help="a build without CUDA kernels")
    args = ap.parse_args()
    path, _ = check_load(args.cpu_only)
    check_kernels(args.cpu_only)
    check_symbols(path)
    check_binary(path, args.archs, args.cpu_only)
    if args.wheel:
        check_wheel(args.wheel)
    print("check_native_build: OK")


if __name__ == "__main__":
    main()
