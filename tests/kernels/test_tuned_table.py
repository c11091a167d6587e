"""Shipped kernel-config tables: entries hold for their GPU and Triton version only; rewriting one GPU's entry
keeps the others."""

from __future__ import annotations

import json

import torch
import triton
from headroom.kernels import gdn_fla
from headroom.kernels.tuned_table import entries_for, table_text


def test_entries_hold_for_their_gpu_and_triton_version(tmp_path, monkeypatch):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"GPU_A": {"triton": triton.__version__, "configs": [{"n": 1}]},
                                 "GPU_B": {"triton": "0.0.1", "configs": [{"n": 2}]}}))
    cuda = torch.device("cuda")
    for gpu, expected in (("GPU_A", [{"n": 1}]), ("GPU_B", []), ("GPU_C", [])):
        monkeypatch.setattr(gdn_fla, "gpu_name", lambda device=None, gpu=gpu: gpu)
        assert entries_for(table, cuda) == expected, gpu
    assert entries_for(table, torch.device("cpu")) == []
    assert entries_for(tmp_path / "missing.json", cuda) == []


def test_rewriting_one_gpus_entry_keeps_the_others(tmp_path, monkeypatch):
    shipped = tmp_path / "table.json"
    shipped.write_text(json.dumps({"GPU_B": {"triton": "0.0.1", "configs": [{"n": 2}]}}))
    monkeypatch.setattr(gdn_fla, "gpu_name", lambda device=None: "GPU_A")
    table = json.loads(table_text(torch.device("cuda"), [{"n": 1}], "measured here", shipped))
    assert table["GPU_B"]["configs"] == [{"n": 2}]
    assert table["GPU_A"] == {"triton": triton.__version__, "source": "measured here", "configs": [{"n": 1}]}
