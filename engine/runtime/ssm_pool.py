"""SSMPool: conv state (model dtype) + recurrent state (fp32) of every linear-attention layer, per slot.

Slot bookkeeping is the pure SSMSlotAllocator (shared with the radix cache); this adds the tensors.
"""

from __future__ import annotations

import torch
from headroom.engine.cache.ssm_slots import SSMSlotAllocator

_SSM_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class SSMPool:
    def __init__(
        self, num_slots: int, num_layers: int, conv_channels: int, conv_kernel: int,
        num_value_heads: int, key_head_dim: int, value_head_dim: int,
        conv_dtype: torch.dtype, device: torch.device, ssm_dtype: str = "fp32",
    ):
        if ssm_dtype not in _SSM_TORCH_DTYPES:
            raise ValueError(f"ssm dtype {ssm_dtype!r} is not one of {', '.join(_SSM_TORCH_DTYPES)}")
        self.allocator = SSMSlotAllocator(num_slots)
        # [layer, slot, channels, kernel-1]: the last kernel-1 conv inputs.
        self.conv = torch.zeros((num_layers, num_slots, conv_channels, conv_kernel - 1), dtype=conv_dtype, device=device)
        # [layer, slot, value heads, key dim, value dim].
        self.recurrent = torch.zeros(
            (num_layers, num_slots, num_value_heads, key_head_dim, value_head_dim),
            dtype=_SSM_TORCH_DTYPES[ssm_dtype], device=device,
        )

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def alloc(self) -> int | None:
        return self.allocator.alloc()

    def free(self, slot: int) -> None:
        self.allocator.free(slot)

    def reset(self, slot: int) -> None:
        """Zero state: the start of a sequence."""
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Copy-on-write of a checkpoint into a request's own slot (or the reverse, to checkpoint)."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.recurrent[:, dst].copy_(self.recurrent[:, src])

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()
