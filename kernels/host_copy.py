"""Host values to the device without synchronising the stream (no Triton; CPU callers get plain tensors).

torch.tensor(values, device="cuda") and a copy_ from pageable host memory both end in a stream
synchronisation: the CPU waits until the GPU has drained everything queued. Built lazily inside a pass (page
tables, slot indices, sequence bounds), they stalled the CPU 13 times in one 8,192-token prefill on the H200,
and the GPU then idled while the next layers were launched. A pinned staging copy with non_blocking=True is
ordered on the stream like any kernel; PyTorch's pinned-memory allocator keeps the staging block until the
copy has run."""

from __future__ import annotations

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on device: as is on the CPU, else through pinned memory, asynchronously."""
    if device.type != "cuda":
        return host.to(device)
    _refuse_in_capture()
    return host.pin_memory().to(device, non_blocking=True)


def _refuse_in_capture() -> None:
    """A CUDA graph would record the copy from a staging buffer that is recycled once the capture ends, and
    replay stale or foreign values: graphed passes must take every index from their static buffers."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("host-to-device copy inside a CUDA graph capture: give the graph a static buffer")


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list (of ints, or of lists of ints) as a tensor on device, without a stream synchronisation."""
    return upload(torch.tensor(values, dtype=dtype), device)


def copy_into(target: torch.Tensor, host: torch.Tensor) -> None:
    """target (a device tensor, e.g. a decode graph's static input) <- host, without a stream synchronisation."""
    if target.device.type != "cuda":
        target.copy_(host)
        return
    _refuse_in_capture()
    target.copy_(host.pin_memory(), non_blocking=True)
