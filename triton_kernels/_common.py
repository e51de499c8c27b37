"""Helpers shared by the Triton kernels: bf16 rounding, fixed-order row sums, the device
context of a launch."""
import contextlib
import dataclasses

import torch
import triton
import triton.language as tl


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


def device_ctx(t: torch.Tensor):
    """Launch on the tensor's device (Triton uses the current stream of that device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def compute_type(dtype: torch.dtype):
    """The Triton compute type of a float dtype: fp64 for fp64, else fp32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


TILE_ELEMS = 4096  # BLOCK_R * BLOCK_H of the row kernels


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """Block sizes of the row kernels (permute, unpermute and their backward ops)."""

    BLOCK_R: int  # rows per program
    BLOCK_H: int  # hidden units per step


def row_config(H: int) -> RowConfig:
    BLOCK_H = min(triton.next_power_of_2(max(H, 1)), 256)
    return RowConfig(BLOCK_R=max(1, min(64, TILE_ELEMS // BLOCK_H)), BLOCK_H=BLOCK_H)
