"""LLM: the engine as a library (no server): load, prefill in chunks, decode, reuse cached prefixes."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch
from headroom.engine.cache.manager import CacheManager
from headroom.engine.config import EngineConfig
from headroom.engine.loop.in_flight import PENDING_TOKEN, InFlightDecode
from headroom.engine.runtime.forward_batch import BatchItem
from headroom.engine.runtime.leader import build_runner
from headroom.engine.runtime.model_runner import CapacityError, ModelRunner
from headroom.engine.runtime.sampling import sample, sample_on_device
from headroom.engine.sequence import SamplingParams, Sequence, SequenceStatus


@dataclass(frozen=True)
class Generation:
    """token_ids: generated tokens; cached_tokens: prompt tokens served from the prefix cache;
    prompt_logits [vocab]: logits after the last prompt token (what the first token was drawn from)."""

    token_ids: list[int]
    cached_tokens: int
    prompt_logits: torch.Tensor


class LLM:
    def __init__(self, model_path: str, config: EngineConfig | None = None, **settings: Any):
        """settings are EngineConfig fields (device, kv_dtype, max_total_tokens, chunked_prefill_size, ...)."""
        self.config = replace(config, **settings) if config else EngineConfig(model_path=model_path, **settings)
        self.runner: ModelRunner = build_runner(self.config)
        self.graph_capture = self.runner.capture_decode_graphs()
        ssm = self.runner.ssm_pool
        self.cache = CacheManager(
            self.runner.kv_allocator, ssm.allocator if ssm else None,
            ssm.copy if ssm else _no_ssm, self.config.enable_prefix_cache, self.config.max_running_requests,
            self.config.chunked_prefill_size,
        )
        self._ids = itertools.count()
        # Graphed decode steps overlap (_run); tests turn it on for the CPU's uncaptured graphs.
        self.overlap = self.runner.overlaps_decode

    def close(self) -> None:
        """Stop the other tensor-parallel ranks' processes (nothing to do on one device)."""
        self.runner.close()

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.runner.model_config.eos_token_ids

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int = 16, chunk_size: int | None = None, **sampling: Any
    ) -> list[Generation]:
        """Run prompts together (one mixed batch per pass) until each has max_new_tokens or a stop token.

        sampling: temperature, top_p, seed, stop_token_ids, ignore_eos (SamplingParams).
        """
        chunk = chunk_size or self.config.chunked_prefill_size
        if chunk < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk}")
        params = SamplingParams(max_new_tokens=max_new_tokens, **sampling)
        seqs = []
        for prompt in prompts:
            if len(prompt) + max_new_tokens > self.config.context_length:
                raise ValueError(
                    f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} exceeds "
                    f"context_length {self.config.context_length}"
                )
            seqs.append(Sequence(f"llm-{next(self._ids)}", list(prompt), params))
        first_logits: dict[str, torch.Tensor] = {}
        # At most max_running_requests together (each holds an SSM slot, a KIVI window row, a graph table row):
        # more prompts run in waves, each wave to its end.
        wave = self.config.max_running_requests
        for begin in range(0, len(seqs), wave):
            group = seqs[begin : begin + wave]
            try:
                self._run(group, chunk, first_logits)
            finally:
                for seq in group:
                    if seq.status is not SequenceStatus.WAITING:
                        self._finish(seq)
        return [Generation(s.output_token_ids, s.cached_tokens, first_logits[s.request_id]) for s in seqs]

    def _run(self, seqs: list[Sequence], chunk: int, first_logits: dict[str, torch.Tensor]) -> None:
        """Prefill in chunks and decode until every sequence has finished. Graphed decode steps overlap on a GPU
        (engine/loop/in_flight.py): each is launched on the previous step's tokens before those are read."""
        for seq in seqs:
            if not self.cache.admit(seq):
                raise CapacityError(f"no free SSM slot for request {seq.request_id!r} ({self.config.ssm_slots} slots)")
            seq.status = SequenceStatus.RUNNING
        active = [s for s in seqs if s.sampling.max_new_tokens > 0]
        in_flight: InFlightDecode | None = None
        while active or in_flight is not None:
            if in_flight is not None:
                chained = self._chain(in_flight)
                self._read(in_flight)
                in_flight = chained
                active = [s for s in active if not s.is_finished]
                continue
            spans = []
            for seq in active:
                start = seq.num_computed_tokens
                length = min(chunk, seq.num_prompt_tokens - start) if seq.is_prefilling else 1
                self._reserve(seq, start + length)
                spans.append((start, start + length))
            # Only once every sequence has its KV slots (a CapacityError above leaves no capture slot taken): a
            # hybrid prefill runs through its checkpoint stops, the pass leaving each stop's state in a slot.
            captures = [self.cache.take_captures(seq, start, end) if seq.is_prefilling else []
                        for seq, (start, end) in zip(active, spans, strict=True)]
            items = [BatchItem(seq, seq.tokens_between(start, end), tuple((stop - start, slot) for stop, slot in taken))
                     for seq, (start, end), taken in zip(active, spans, captures, strict=True)]
            graphs = self.runner.decode_graphs
            if self.overlap and graphs is not None and not any(s.is_prefilling for s in active) \
                    and graphs.can_run(items):
                in_flight = InFlightDecode.start_copy(None, list(active), sample_on_device(self.runner.forward(items), active), 0.0)
                continue
            try:
                logits = self.runner.forward(items)
                decoding = [i for i, seq in enumerate(active) if not seq.is_prefilling]
                tokens = dict(zip(decoding, sample(logits[decoding], [active[i] for i in decoding]), strict=True))
            except Exception:
                for taken in captures:
                    self.cache.drop_captures(taken)
                raise
            for seq, taken in zip(active, captures, strict=True):
                self.cache.publish_captures(seq, taken)
            for index, (seq, row) in enumerate(zip(active, logits, strict=True)):
                if seq.num_computed_tokens <= seq.num_prompt_tokens:
                    self.cache.checkpoint(seq)
                if seq.is_prefilling:
                    continue
                first_logits.setdefault(seq.request_id, row)
                self._append(seq, tokens[index])
            active = [s for s in active if not s.is_finished]

    def _reserve(self, seq: Sequence, end: int) -> None:
        if not self.cache.reserve(seq, end):
            raise CapacityError(
                f"KV pool of {self.config.max_total_tokens} tokens cannot hold request "
                f"{seq.request_id!r} at {end} tokens ({self.runner.kv_allocator.num_free_tokens} free)"
            )

    def _append(self, seq: Sequence, token: int) -> None:
        seq.output_token_ids.append(token)
        stops = set(seq.sampling.stop_token_ids) | (set() if seq.sampling.ignore_eos else set(self.eos_token_ids))
        if len(seq.output_token_ids) >= seq.sampling.max_new_tokens or token in stops:
            seq.status = SequenceStatus.FINISHED

    def _chain(self, previous: InFlightDecode) -> InFlightDecode | None:
        """The next decode step, launched on previous's device tokens, of its sequences that its token leaves
        short of their limit (None when none, or when the graphs cannot run them). A sequence that previous's
        token stops is only seen at the read: its step here is computed and dropped."""
        seqs = [s for s in previous.seqs if not s.is_finished and len(s.output_token_ids) + 1 < s.sampling.max_new_tokens]
        graphs = self.runner.decode_graphs
        if not seqs or graphs is None:
            return None
        for seq in seqs:
            # The slot of the position after previous's: previous's token goes there.
            self._reserve(seq, seq.num_computed_tokens + 1)
        items = [BatchItem(seq, [PENDING_TOKEN]) for seq in seqs]
        if not graphs.can_run(items):
            return None
        logits = self.runner.forward(items, tokens_on_device=(previous.tokens, previous.rows(seqs)))
        return InFlightDecode.start_copy(None, seqs, sample_on_device(logits, seqs, ahead=1), 0.0)

    def _read(self, step: InFlightDecode) -> None:
        for seq, token in zip(step.seqs, step.read(), strict=True):
            if not seq.is_finished:
                self._append(seq, token)

    def _finish(self, seq: Sequence) -> None:
        self.cache.finish(seq)
        self.runner.release(seq)
        seq.status = SequenceStatus.FINISHED


def _no_ssm(src: int, dst: int) -> None:
    raise RuntimeError("a full-attention model has no SSM state to copy")
