"""A decode step launched but not yet read: its sampled tokens on the device, their copy to the host under way.

Why: between two decode steps the host reads the tokens, emits them, checks stops, plans the next step and
launches it. Read at once, the GPU idles through all of that: on the H200 about 0.3 ms a step at batch 1 through
the library API, and 2 ms at batch 16 behind `headroom serve`, whose event loop takes the GIL for every token it
delivers. Launching step N+1 on step N's tokens while they are still on the device (the decode graphs gather
them there: DecodeGraphs.run's tokens_on_device) and reading step N's while N+1 runs takes that work off the
GPU's path, as SGLang's overlap scheduler and vLLM's async scheduling do. engine/loop/step.py decides when a step
may be chained; this holds one step's tokens until they are read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from headroom.engine.scheduler.types import ScheduledPass
from headroom.engine.sequence import Sequence

# The input token of a step launched on device tokens, in its BatchItem: the graph's token row is overwritten
# on the device before the step runs, and -1 fails loudly anywhere it could be read instead.
PENDING_TOKEN = -1


@dataclass
class InFlightDecode:
    # The scheduler's pass (None from the LLM API's own loop).
    plan: ScheduledPass | None
    seqs: list[Sequence]
    # [len(seqs)] int64 on the device, row i being seqs[i]'s new token.
    tokens: torch.Tensor
    # perf_counter() when the step was planned: its StepStats run from here to its read.
    started: float
    host: torch.Tensor
    ready: torch.cuda.Event | None

    @classmethod
    def start_copy(cls, plan: ScheduledPass | None, seqs: list[Sequence], tokens: torch.Tensor, started: float) -> InFlightDecode:
        """Queue the tokens' copy to pinned host memory behind the step, and an event that marks it done."""
        if not tokens.is_cuda:
            return cls(plan, seqs, tokens, started, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(plan, seqs, tokens, started, host, ready)

    def read(self) -> list[int]:
        """The step's tokens, waiting for them (an event wait, which lets other Python threads run meanwhile)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def rows(self, seqs: list[Sequence]) -> list[int] | None:
        """Each of seqs' row in this step, or None when one of them was not in it."""
        where = {seq.request_id: i for i, seq in enumerate(self.seqs)}
        rows = [where.get(seq.request_id) for seq in seqs]
        return None if any(row is None for row in rows) else rows  # type: ignore[return-value]
