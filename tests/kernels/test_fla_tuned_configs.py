"""The shipped fla kernel configs (kernels/gdn_fla.py): harvested from fla's autotuners, put back into their
caches only for the GPU and the fla/Triton versions that picked them, never over a user's FLA_CACHE_MODE, and
never as a config the kernel no longer offers."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import triton
import triton.language as tl
from headroom.kernels import gdn_fla

VERSIONS = {"fla": "0.6.0", "triton": "3.6.0"}
CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=4, num_stages=2)]


@triton.jit
def _kernel(x, n, BLOCK: tl.constexpr):
    tl.store(x + tl.arange(0, BLOCK), 0.0, mask=tl.arange(0, BLOCK) < n)


def _tuner():
    return triton.autotune(configs=list(CONFIGS), key=["n"])(_kernel)


@pytest.fixture
def fake_fla(tmp_path, monkeypatch):
    """A module under fla. holding one autotuner (the scan finds it as fla's), this GPU an H200, and the shipped
    file somewhere of the test's own."""
    module = types.ModuleType("fla.ops.fake")
    module.kernel = _tuner()
    monkeypatch.setitem(sys.modules, "fla.ops.fake", module)
    path = tmp_path / "fla_tuned_configs.json"
    monkeypatch.setattr(gdn_fla, "TUNED_CONFIGS", path)
    monkeypatch.setattr(gdn_fla, "_versions", lambda: dict(VERSIONS))
    monkeypatch.setattr(gdn_fla, "_pending", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    return module, path


def test_harvested_configs_seed_a_fresh_autotuner(fake_fla):
    module, path = fake_fla
    module.kernel.cache[(64, "torch.float32")] = CONFIGS[1]
    path.write_text(json.dumps(gdn_fla.harvest_fla_configs()))
    assert json.loads(path.read_text())["NVIDIA_H200"]["versions"] == VERSIONS
    module.kernel = _tuner()  # a fresh process: nothing tuned yet
    assert gdn_fla.use_tuned_fla_configs(torch.device("cuda")) == "1 keys of 1 kernels"
    assert gdn_fla._seed_autotuners() == 1
    # The kernel's own candidate object, so Triton compiles exactly that one and times nothing.
    assert module.kernel.cache == {(64, "torch.float32"): module.kernel.configs[1]}


def test_a_config_the_kernel_no_longer_offers_is_not_seeded(fake_fla):
    module, path = fake_fla
    gone = {"kwargs": {"BLOCK": 128}, "num_warps": 8, "num_stages": 3, "num_ctas": 1, "maxnreg": None}
    path.write_text(json.dumps({"NVIDIA_H200": {"versions": VERSIONS, "autotuners": {
        "fla.ops.fake:kernel": {json.dumps([64, "torch.float32"]): gone}}}}))
    assert gdn_fla.use_tuned_fla_configs(torch.device("cuda")) is not None
    assert gdn_fla._seed_autotuners() == 0 and module.kernel.cache == {}


@pytest.mark.parametrize("case", ["other gpu", "other versions", "user's mode", "cpu"])
def test_configs_are_left_alone(fake_fla, monkeypatch, case):
    module, path = fake_fla
    module.kernel.cache[(64, "torch.float32")] = CONFIGS[0]
    path.write_text(json.dumps(gdn_fla.harvest_fla_configs()))
    module.kernel = _tuner()
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
    assert gdn_fla._seed_autotuners() == 0 and module.kernel.cache == {}
