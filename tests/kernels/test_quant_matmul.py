"""Quantized-weight GEMM (Triton, in the interpreter on CPU) against the dequantize-then-matmul reference."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels.quant_matmul import _COUNTERS, dequantize_fwd, quant_matmul, quant_matmul_fwd
from headroom.kernels.quant_pack import quantize_fp8_block, quantize_int4_group
from headroom.kernels.quant_weight import QuantizedWeight, naive_dequantize, naive_quant_linear

# (M, N, K): decode rows and a prefill-sized M, odd N, K not a multiple of the block or group.
# (2, 24, 352): K splits so that the last split's second tile starts past K.
SHAPES = [(1, 40, 96), (3, 37, 200), (17, 130, 64), (70, 72, 48), (2, 24, 352)]
FORMATS = [("fp8_block", (128, 128), True), ("fp8_block", (16, 32), True),
           ("int4_group", (1, 32), True), ("int4_group", (1, 16), False), ("int4_group", (1, 128), False)]


def make_weight(method: str, block: tuple[int, int], symmetric: bool, n: int, k: int, seed: int) -> QuantizedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if method == "fp8_block":
        data, scale = quantize_fp8_block(w, block)
        return QuantizedWeight(method, data, scale, None, n, k, block)
    packed, scale, zero = quantize_int4_group(w, block[1], symmetric)
    return QuantizedWeight(method, packed, scale, zero, n, k, block)


def _applies(path: str, method: str, rows: int) -> bool:
    """The CUDA-core kernels take at most 4 rows, the stream kernel int4 only, the cores kernel fp8 only."""
    if path in ("stream", "cores") and rows > 4:
        return False
    return not (path == "stream" and method != "int4_group" or path == "cores" and method != "fp8_block")


def fmt_id(fmt) -> str:
    return f"{fmt[0]}-{fmt[1][0]}x{fmt[1][1]}-{'sym' if fmt[2] else 'asym'}"

MATCH_CASES = [pytest.param(shape, fmt, path, id=f"{path}-{fmt_id(fmt)}-{shape}")
               for path in ("stream", "cores", "swap_ab", "m_major", "dequantize_then_matmul")
               for fmt in FORMATS for shape in SHAPES if _applies(path, fmt[0], shape[0])]


@pytest.mark.parametrize(("shape", "fmt", "path"), MATCH_CASES)
def test_matches_naive(shape, fmt, path):
    m, n, k = shape
    weight = make_weight(*fmt, n, k, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(n)
    if path == "dequantize_then_matmul":
        out = quant_matmul(x, weight, bias, dense_min_rows=1)
    else:
        out = quant_matmul_fwd(x, weight, kernel=path) + bias
    assert out.shape == (m, n) and not out.isnan().any()
    torch.testing.assert_close(out, naive_quant_linear(x, weight, bias), atol=1e-4, rtol=1e-4)
    # Split-K's arrival counters are left at zero for the next launch (and for captured decode graphs).
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.values())


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_dequantize_matches_naive(fmt):
    weight = make_weight(*fmt, 37, 200, seed=5)
    torch.testing.assert_close(dequantize_fwd(weight, torch.float32), naive_dequantize(weight), atol=0, rtol=0)


def test_split_k_sums_every_split_once():
    """A long K over few output tiles: many splits, each counted and summed once by the last to arrive;
    a second call on the same counters gives the same result."""
    weight = make_weight("int4_group", (1, 16), True, 8, 1024, seed=11)
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(2))
    first = quant_matmul(x, weight)
    torch.testing.assert_close(first, naive_quant_linear(x, weight), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(quant_matmul(x, weight), first, atol=0, rtol=0)


def test_quantization_error_is_small():
    """The references are not vacuous: the dequantized weights approximate the dense ones."""
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    data, scale = quantize_fp8_block(w, (16, 32))
    fp8 = QuantizedWeight("fp8_block", data, scale, None, 64, 96, (16, 32))
    packed, s4, zero = quantize_int4_group(w, 32, symmetric=False)
    int4 = QuantizedWeight("int4_group", packed, s4, zero, 64, 96, (1, 32))
    assert (naive_dequantize(fp8) - w).abs().max() < 0.07 * w.abs().max()
    assert (naive_dequantize(int4) - w).abs().max() < 0.1 * w.abs().max()
    assert (naive_dequantize(int4) - w).abs().max() > 1e-3


def test_wrong_input_width_is_named():
    weight = make_weight("int4_group", (1, 32), True, 8, 64, seed=0)
    with pytest.raises(ValueError, match="x has 48 input features but the weight expects 64"):
        quant_matmul(torch.zeros(2, 48), weight)


@pytest.mark.parametrize("method,symmetric,rows,kernel", [
    ("int4_group", True, 1, "stream"), ("int4_group", False, 4, "stream"), ("int4_group", True, 8, "m_major"),
    ("int4_group", False, 16, "swap_ab"), ("fp8_block", True, 2, "cores"), ("fp8_block", True, 3, "m_major"),
    ("fp8_block", True, 64, "m_major")])
def test_pick_kernel_follows_the_measured_rule(method, symmetric, rows, kernel):
    from headroom.kernels.quant_matmul import pick_kernel

    block = (1, 32) if method == "int4_group" else (16, 32)
    weight = make_weight(method, block, symmetric, 16, 64, seed=1)
    assert pick_kernel(torch.zeros(rows, 64), weight) == kernel


def test_each_cuda_core_kernel_refuses_the_other_format():
    int4 = make_weight("int4_group", (1, 32), True, 8, 64, seed=0)
    with pytest.raises(ValueError, match="reads fp8 blocks; int4 rows take the stream kernel"):
        quant_matmul_fwd(torch.zeros(1, 64), int4, kernel="cores")
