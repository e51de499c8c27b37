"""Helpers shared by the Triton kernels."""
import triton
import triton.language as tl


@triton.jit
def cast_rne(x, DT: tl.constexpr):
    """Cast to DT with round-to-nearest-even. For bfloat16 the rounding is done explicitly
    on the fp32 bits, so compiled kernels and the Triton CPU interpreter (whose own
    fp32 -> bf16 cast truncates) produce the same bits as torch's `.to(torch.bfloat16)`."""
    if DT == tl.bfloat16:
        b = x.to(tl.float32).to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(DT)
