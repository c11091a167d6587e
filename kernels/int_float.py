"""Small non-negative integers to fp32 without the integer-to-float conversion instruction.

On NVIDIA GPUs I2F runs at a quarter of the FP32 rate (16 a clock per SM on the H200), so kernels that turn
every packed code of a weight or KV tile into a float are bound by it before they are bound by memory. OR-ing
an integer below 2^23 into the mantissa of the float 2^23 (bits 0x4B000000) gives the float 2^23 + x exactly,
and subtracting 2^23 leaves x: one logic op and one add, both at full rate. Used by kernels/paged_attention.py
(KIVI KV codes); kernels/quant_gemv.py applies the same trick with its own mask per nibble and MAGIC_BITS passed
in as an argument (see there why)."""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC = tl.constexpr(8388608.0)


@triton.jit
def exact_float(x):
    """x (int32, every element in [0, 2^23)) as fp32, exactly."""
    return (x | MAGIC_BITS).to(tl.float32, bitcast=True) - MAGIC
