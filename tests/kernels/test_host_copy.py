"""Host-to-device index copies (kernels/host_copy.py): plain tensors on a CPU, and loud inside a CUDA graph
capture, where a recorded copy would replay from a recycled staging buffer."""

from __future__ import annotations

import pytest
import torch
from headroom.kernels import host_copy


def test_cpu_copies_are_plain():
    out = host_copy.to_device([3, 1, 2], torch.int32, torch.device("cpu"))
    assert out.dtype == torch.int32 and out.tolist() == [3, 1, 2]
    target = torch.zeros(3, dtype=torch.long)
    host_copy.copy_into(target, torch.tensor([7, 8, 9]))
    assert target.tolist() == [7, 8, 9]


def test_a_copy_inside_graph_capture_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        host_copy._refuse_in_capture()
