"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A graphed decode step of the 4B model is about 430 kernels of 1-15 us each. Between two dependent kernels the GPU
drains one grid before it launches the next, and a weight-streaming kernel then ramps its loads up from nothing:
on the H200 a chain of 4 MiB streaming kernels took 3.9 us a kernel plainly, 3.2 with PDL, and 1.4 with PDL and
the weight loads issued before waiting on the producer (bench/pdl_probe.py, session 10). With PDL each kernel lets
its dependent launch at once (griddepcontrol.launch_dependents) and waits for its producer's writes
(griddepcontrol.wait) before it touches anything the producer wrote or still reads; what does not depend on the
producer (a GEMV's weights) may be loaded before the wait.

Off by HEADROOM_PDL=0, and wherever it cannot run: no CUDA, a GPU before sm_90, a Triton without launch_pdl, the
Triton interpreter (the kernels then compile the waits out: PDL is a constexpr)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a PDL kernel that reads its producer's output from the start: let the next kernel launch,
    then wait for this one's producer."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.cache
def _supported(index: int) -> bool:
    if os.environ.get("HEADROOM_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(index) >= (9, 0)


def use_pdl(device: torch.device) -> bool:
    """Whether launches on this device take PDL."""
    return device.type == "cuda" and _supported(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """A PDL kernel's launch arguments on this device: its PDL constexpr and Triton's launch_pdl, which must agree
    (a kernel launched with PDL that never waits would read its producer's data early)."""
    on = use_pdl(device)
    return {"PDL": on, "launch_pdl": on}
