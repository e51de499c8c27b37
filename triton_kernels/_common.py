"""Helpers shared by the Triton kernels."""
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
