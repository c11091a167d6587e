"""The shipped fla kernel configs (kernels/gdn_fla.py's use_tuned_fla_configs): used only for the GPU and the
fla/Triton versions that picked them, never over a user's FLA_CACHE_MODE, written where fla's config cache
reads them."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from headroom.kernels import gdn_fla

VERSIONS = {"fla": "0.6.0", "triton": "3.6.0"}
KERNEL = {"kernel_name": "chunk_fwd_kernel_o", "autotune_entries": {"abc": {
    "autotune_key": [64, "torch.bfloat16"], "config": {"kwargs": {"BK": 64}, "num_warps": 4, "num_stages": 2,
                                                        "num_ctas": 1, "maxnreg": None}}}}


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    if "fla.ops.utils.cache" in sys.modules:
        pytest.skip("fla is already imported in this process: its cache mode is fixed")
    path = tmp_path / "fla_tuned_configs.json"
    path.write_text(json.dumps({"NVIDIA_H200": {"versions": VERSIONS, "kernels": {"chunk_fwd_kernel_o": KERNEL}}}))
    monkeypatch.setattr(gdn_fla, "TUNED_CONFIGS", path)
    monkeypatch.setattr(gdn_fla, "_versions", lambda: dict(VERSIONS))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    return path


def test_configs_for_this_gpu_are_written_for_fla(shipped, monkeypatch):
    folder = gdn_fla.use_tuned_fla_configs(torch.device("cuda"))
    assert folder is not None
    assert json.loads((gdn_fla.Path(folder) / "chunk_fwd_kernel_o.json").read_text()) == KERNEL
    assert os.environ["FLA_CACHE_MODE"] == "fuzzy" and os.environ["FLA_CONFIG_DIR"] == folder


@pytest.mark.parametrize("case", ["other gpu", "other versions", "user's mode", "cpu"])
def test_configs_are_left_alone(shipped, monkeypatch, case):
    device = torch.device("cuda")
    if case == "other gpu":
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    elif case == "other versions":
        monkeypatch.setattr(gdn_fla, "_versions", lambda: {"fla": "0.7.0", "triton": "3.6.0"})
    elif case == "user's mode":
        monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    else:
        device = torch.device("cpu")
    assert gdn_fla.use_tuned_fla_configs(device) is None
    assert os.environ.get("FLA_CONFIG_DIR") is None
