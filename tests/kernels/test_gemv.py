"""The decode GEMV (kernels/gemv.py, Triton interpreter on CPU) against torch's F.linear: one row and several, with and
without a split over K, shapes that no block divides."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from headroom.kernels.gemv import GemvConfig, gemv  # noqa: E402


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_matches_naive(rows, split):
    gen = torch.Generator().manual_seed(rows * 10 + split)
    x = torch.randn(rows, 200, generator=gen)
    w = torch.randn(70, 200, generator=gen)
    out = gemv(x, w, GemvConfig(block_n=32, block_k=64, split=split, num_stages=2))
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_gemv_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="at most 16 rows"):
        gemv(torch.zeros(17, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"w \(4, 9\)"):
        gemv(torch.zeros(1, 8), torch.zeros(4, 9))


def test_tuned_gemv_runs_only_the_shipped_shapes(monkeypatch):
    from headroom.kernels import gemv as module

    monkeypatch.setattr(module, "_tuned", {(70, 200, 1): GemvConfig(block_n=32, block_k=64, num_stages=2)})
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(70, 200, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 200, generator=gen).to(torch.bfloat16)
    got = module.tuned_gemv(x[:1], w)
    assert got is not None
    torch.testing.assert_close(got.float(), F.linear(x[:1].float(), w.float()), atol=0.05, rtol=0.02)
    assert module.tuned_gemv(x, w) is None  # two rows: not in the table, cuBLAS runs
    assert module.tuned_gemv(x[:1].float(), w.float()) is None  # fp32: the table is for bf16


def test_tuned_configs_are_per_gpu_and_triton_version(monkeypatch, tmp_path):
    import json

    import triton
    from headroom.kernels import gdn_fla
    from headroom.kernels import gemv as module

    entry = {"n": 8, "k": 16, "m": 1, "block_n": 16, "block_k": 128, "split": 2, "num_warps": 4, "num_stages": 3}
    table = tmp_path / "gemv_tuned_configs.json"
    table.write_text(json.dumps({"GPU_A": {"triton": triton.__version__, "configs": [entry]},
                                 "GPU_B": {"triton": "0.0.1", "configs": [entry]}}))
    monkeypatch.setattr(module, "TUNED_CONFIGS", table)
    cuda = torch.device("cuda")
    monkeypatch.setattr(gdn_fla, "gpu_name", lambda device=None: "GPU_A")
    assert module.load_tuned_configs(cuda) == {(8, 16, 1): GemvConfig(16, 128, 2, 4, 3)}
    monkeypatch.setattr(gdn_fla, "gpu_name", lambda device=None: "GPU_B")
    assert module.load_tuned_configs(cuda) == {}  # another Triton version's timings
    monkeypatch.setattr(gdn_fla, "gpu_name", lambda device=None: "GPU_C")
    assert module.load_tuned_configs(cuda) == {}
    assert module.load_tuned_configs(torch.device("cpu")) == {}
