"""Helpers shared by the Triton kernels: the programs' prologues (a gate chunk's rows, a
row tile of slots, the tokens of expert-major rows), bf16 rounding, fixed-order row sums,
the precise math of the gate kernels, the launch options, the device context of a launch.

NOTE on math (checked on the PTX of every specialisation by tools/triton_compile_check.py):

    kernel                      exp            division     sqrt         fp fusion
    gate fwd / bwd              precise_exp    div_rn       sqrt_rn      off
    plan scan / scatter         -              -            -            off
    permute, gather-sum,        -              -            -            off
    unpermute dx / dw

* Fusion is off in every kernel (LAUNCH_OPTIONS, passed explicitly: Triton 3.9 defaults
  to on and 3.10 to off, so leaving it to the default changes fp32 bits with the Triton
  version). Off, each product and sum is rounded once, as in the CPU interpreter (numpy)
  the CI runs, in the CUDA kernels (built with --fmad=false) and in the reference; the
  kernels do a few flops per byte moved, so FMAs would save little.
* Division and square root are IEEE round-to-nearest (div.rn / sqrt.rn, subnormals kept).
  `/` on fp32 compiles to div.full.f32 (2 ulp) and tl.sqrt to sqrt.approx.ftz.f32, which
  flushes a subnormal softplus to 0. fp64 `/` and tl.sqrt are already div.rn / sqrt.rn.
* exp: `precise_exp` below for fp32 (at most 1 ulp, subnormal results kept). tl.exp is
  ex2.approx.f32 of the rounded x * log2(e), up to 60 ulp off near |x| = 80, and the gate
  tests hold the kernels to 2x the error of a same-precision reference against fp64.
  precise_exp uses only rounded adds, multiplies, floor and bit operations, so the CPU
  interpreter computes the bits the GPU does. fp64 keeps tl.exp (libdevice's exp, no
  approximate instruction).
* log (only in the gate's log1p, of 1 + exp(z) >= 1): tl.log, which Triton 3.9 lowers to
  libdevice's logf (the check fails if a Triton version lowers it to lg2.approx).
"""
import contextlib
import dataclasses
import inspect
import os

import torch
import triton
import triton.language as tl


def _interpreter_index_fix() -> bool:
    """Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) turns a tensor used as a Python
    integer (a `range` bound that is a kernel argument or is computed from program_id, as
    in every kernel here) into one with `int(data)`, and its scalars hold 1-element arrays
    of shape (1,), which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to
    Python scalars"). Triton 3.9's interpreter squeezes the array first. For an interpreter
    without the squeeze this gives it the same `__index__`. Compiled kernels are untouched:
    the interpreter alone reads it, so the kernels keep `range` (a while loop would have
    worked in both, but compiles to another loop on the GPU). Returns whether it applied."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    try:
        from triton.runtime import interpreter
        patch = interpreter._patch_lang_tensor
        source = inspect.getsource(patch)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    if getattr(patch, "_replay_ops_index_fix", False) or "squeeze" in source or \
            "int(self.handle.data)" not in source:
        return False

    def _index(self):
        return int(self.handle.data.squeeze())

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    patched._replay_ops_index_fix = True
    interpreter._patch_lang_tensor = patched
    return True


INTERPRETER_INDEX_FIX = _interpreter_index_fix()


@triton.jit
def cast_rne(x, DT: tl.constexpr):
    """Cast to DT with round-to-nearest-even. For bfloat16 the rounding is done explicitly
    on the fp32 bits, so compiled kernels and the Triton CPU interpreter (whose own
    fp32 -> bf16 cast truncates) produce the same bits as torch's `.to(torch.bfloat16)`."""
    if DT == tl.bfloat16:
        xf = x.to(tl.float32)
        b = xf.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        # NaN becomes the quiet NaN 0x7FC0 (the rounding carry could otherwise spill a NaN
        # payload into the sign bit). The high half is bitcast, never converted, so
        # subnormals keep their exact bits too.
        b = tl.where(xf != xf, 0x7FC00000, b)
        return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DT)


# ------------------------------------------------------------------ program prologues
@triton.jit
def chunk_rows(T, SINGLE: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's rows [row_begin, row_end) in the gate kernels' chunking: every row
    with SINGLE (one program), else BLOCK_T rows per program. Returns (pid as int64,
    row_begin, row_end)."""
    pid = tl.program_id(0).to(tl.int64)
    if SINGLE:
        row_begin = 0
        row_end = T
    else:
        row_begin = pid * BLOCK_T
        row_end = tl.minimum(row_begin + BLOCK_T, T)
    return pid, row_begin, row_end


@triton.jit
def row_tile(r0, T, K, BLOCK_T: tl.constexpr, K_PAD: tl.constexpr):
    """The [BLOCK_T, K_PAD] tile of slots of rows r0 .. r0 + BLOCK_T - 1: (rows as int64,
    cols, the rows' mask, the slots' mask)."""
    rows = (r0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, K_PAD)
    rmask = rows < T
    return rows, cols, rmask, rmask[:, None] & (cols < K)[None, :]


@triton.jit
def sorted_row_tokens(Sorted_ptr, r, rmask, n_sorted, T, K):
    """The token of each expert-major row r: (its slot, -1 for a padding row, a masked row
    or r >= n_sorted; the slot's token as int64, 0 where there is none; whether the row
    has a token in [0, T))."""
    # int32 slots (< 2^31) divided in 32 bits: a 64-bit division is a subroutine on the GPU
    slot = tl.load(Sorted_ptr + r, mask=rmask & (r < n_sorted), other=-1)
    tok = tl.where(slot >= 0, slot // K, 0).to(tl.int64)
    return slot, tok, (slot >= 0) & (tok < T)


# Widest row `row_sum` adds (the Triton gate takes K <= this; see gate.MAX_TOPK).
ROW_SUM_MAX_WIDTH: tl.constexpr = tl.constexpr(1024)

# Options of every launch (see the NOTE on math above).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _halve(x, R: tl.constexpr, W: tl.constexpr):
    # [R, W] -> [R, W/2]: element j plus element j + W/2 (a sum of two is order-free)
    return tl.sum(tl.reshape(x, [R, 2, W // 2]), axis=1)


@triton.jit
def row_sum(x, R: tl.constexpr, W: tl.constexpr):
    """Sum over axis 1 of x [R, W] (W a power of two, at most 1024) in a fixed pairwise
    tree: at each step element j takes element j + w/2. A plain tl.sum reduces in an order
    that follows the register layout, which changes with the tile shape; this order does
    not, so a row's sum is the same whatever the batch size and the block shape."""
    tl.static_assert(W <= ROW_SUM_MAX_WIDTH, "row_sum: W is above ROW_SUM_MAX_WIDTH (1024)")
    if W >= 1024:
        x = _halve(x, R, 1024)
    if W >= 512:
        x = _halve(x, R, 512)
    if W >= 256:
        x = _halve(x, R, 256)
    if W >= 128:
        x = _halve(x, R, 128)
    if W >= 64:
        x = _halve(x, R, 64)
    if W >= 32:
        x = _halve(x, R, 32)
    if W >= 16:
        x = _halve(x, R, 16)
    if W >= 8:
        x = _halve(x, R, 8)
    if W >= 4:
        x = _halve(x, R, 4)
    if W >= 2:
        x = _halve(x, R, 2)
    return tl.reshape(x, [R])


# exp(r) on |r| <= ln(2)/2: the minimax polynomial of Cephes' expf
_EXP_P0: tl.constexpr = tl.constexpr(1.9875691500e-4)
_EXP_P1: tl.constexpr = tl.constexpr(1.3981999507e-3)
_EXP_P2: tl.constexpr = tl.constexpr(8.3334519073e-3)
_EXP_P3: tl.constexpr = tl.constexpr(4.1665795894e-2)
_EXP_P4: tl.constexpr = tl.constexpr(1.6666665459e-1)
_EXP_P5: tl.constexpr = tl.constexpr(5.0000001201e-1)


@triton.jit
def _exp_f32(x):
    """exp(x) in fp32 within 1 ulp over the whole range, subnormal results included (the
    tests/test_triton_kernels.py measures it against fp64 on every fp32 exponent). Cody-Waite
    reduction x = n ln2 + r with ln2 split so that n * 0.693359375 is exact, Cephes'
    polynomial for exp(r), then the scaling by 2^n as two exact powers of two, so that a
    result below 2^-126 is rounded once instead of flushed. NaN stays NaN, +-inf and
    overflow give inf and 0."""
    xc = tl.minimum(tl.maximum(x, -104.0), 89.0)
    n = tl.floor(xc * 1.44269504 + 0.5)
    r = xc - n * 0.693359375
    r = r - n * -2.12194440e-4
    p = ((((_EXP_P0 * r + _EXP_P1) * r + _EXP_P2) * r + _EXP_P3) * r + _EXP_P4) * r + _EXP_P5
    p = p * (r * r) + r + 1.0
    ni = n.to(tl.int32)
    n1 = ni >> 1
    s1 = ((n1 + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((ni - n1 + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, p * s1 * s2)


@triton.jit
def precise_exp(x):
    """exp with at most 1 ulp of error (fp32: `_exp_f32`; fp64: tl.exp, libdevice's)."""
    if x.dtype == tl.float64:
        return tl.exp(x)
    else:
        return _exp_f32(x.to(tl.float32))


@triton.jit
def fdiv(a, b):
    """a / b rounded to nearest (div.rn; fp32 `/` is div.full, 2 ulp)."""
    if b.dtype == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def fsqrt(x):
    """sqrt rounded to nearest (sqrt.rn; fp32 tl.sqrt is sqrt.approx.ftz, which flushes
    subnormal inputs to 0)."""
    if x.dtype == tl.float64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


def device_ctx(t: torch.Tensor):
    """Launch on the tensor's device (Triton uses the current stream of that device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def compute_type(dtype: torch.dtype):
    """The Triton compute type of a float dtype: fp64 for fp64, else fp32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


# NOTE: BLOCK_R * BLOCK_H of the row kernels. At 4096 (32 values a thread at 4 warps) the
# unpermute backward spilled 40 B (dx) to 5.6 KB (dw) for fp64 and for H not a multiple of
# 16, where every value needs its own 64-bit address (tools/triton_compile_check.py).
TILE_ELEMS = 2048


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """Block sizes of the row kernels (permute, unpermute and their backward ops)."""

    BLOCK_R: int  # rows per program
    BLOCK_H: int  # hidden units per step


def row_config(H: int) -> RowConfig:
    BLOCK_H = min(triton.next_power_of_2(max(H, 1)), 256)
    return RowConfig(BLOCK_R=max(1, min(64, TILE_ELEMS // BLOCK_H)), BLOCK_H=BLOCK_H)
