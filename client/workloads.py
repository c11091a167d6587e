"""The field reports' workloads, as phases of concurrent requests (sizes in tokens, delays in seconds).

002: hom_c8_2k_each, mix_short6_long2_c8, prefill_heavy_c4_4k_each, decode_heavy_c8_short (output
lengths are this project's choice; the report gives only "max_tokens 多め" for decode_heavy).
000: one and four long sessions with a short question arriving mid-prefill (the report used ~130K-token
sessions; 32K here so a default server can run it, --scale reaches either).
004: K chains of 66,000 tokens visited in turn, three laps; lap 2 and 3 should be cache hits. K=3 is
listed; any chains_k<K>_revisit name is built on demand (varying K is 004's sharpest diagnostic).
Requests of one phase start together (after their own delay); phases run one after another.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

MIN_PROMPT_TOKENS = 8
MIN_OUTPUT_TOKENS = 4
MIN_QUESTION_TOKENS = 4


@dataclass(frozen=True)
class RequestSpec:
    """One request. shared_prefix_tokens > 0 makes it a session revisit: that session's fixed context plus
    a question of the remaining tokens that differs per visit (part)."""

    label: str
    prompt_tokens: int
    max_tokens: int
    session: int
    part: str = "body"
    delay_s: float = 0.0
    shared_prefix_tokens: int = 0


@dataclass(frozen=True)
class Workload:
    name: str
    source: str
    description: str
    phases: tuple[tuple[RequestSpec, ...], ...]

    @property
    def requests(self) -> list[RequestSpec]:
        return [spec for phase in self.phases for spec in phase]


def _batch(label: str, count: int, prompt: int, output: int, first_session: int) -> tuple[RequestSpec, ...]:
    return tuple(RequestSpec(label, prompt, output, first_session + i) for i in range(count))


def _mid_prefill(num_long: int, question_delay_s: float) -> tuple[tuple[RequestSpec, ...], ...]:
    question = RequestSpec("question", 30, 16, session=99, delay_s=question_delay_s)
    return (_batch("long", num_long, 32768, 16, 0) + (question,),)


def _chains(num_chains: int, chain_tokens: int, laps: int) -> tuple[tuple[RequestSpec, ...], ...]:
    question = 32
    return tuple(
        (RequestSpec(f"lap{lap}", chain_tokens + question, 16, chain, f"q{lap}", shared_prefix_tokens=chain_tokens),)
        for lap in range(1, laps + 1)
        for chain in range(num_chains)
    )


def builtin_workloads(question_delay_s: float = 1.0) -> dict[str, Workload]:
    """Every workload by name, at the field reports' sizes."""
    listed = [
        Workload("hom_c8_2k_each", "002", "8 concurrent x 2,189-token prompts", (_batch("hom", 8, 2189, 128, 0),)),
        Workload(
            "mix_short6_long2_c8", "002", "6 x 512 (short) + 2 x 2,189 (long) concurrent: head-of-line blocking",
            (_batch("short", 6, 512, 128, 0) + _batch("long", 2, 2189, 128, 6),),
        ),
        Workload("prefill_heavy_c4_4k_each", "002", "4 concurrent x 4,323-token prompts", (_batch("long", 4, 4323, 128, 0),)),
        Workload("decode_heavy_c8_short", "002", "8 concurrent x 512-token prompts, 512 output tokens", (_batch("short", 8, 512, 512, 0),)),
        Workload("long1_short_mid", "000", "1 long session, a 30-token question arriving mid-prefill", _mid_prefill(1, question_delay_s)),
        Workload("long4_short_mid", "000", "4 long sessions, a 30-token question arriving mid-prefill", _mid_prefill(4, question_delay_s)),
        chains_workload(3),
    ]
    return {workload.name: workload for workload in listed}


def chains_workload(num_chains: int) -> Workload:
    """K chains of 66,000 tokens, visited in turn for three laps."""
    if num_chains < 1:
        raise ValueError(f"chains workload needs K >= 1 chains, got {num_chains}")
    return Workload(
        f"chains_k{num_chains}_revisit", "004", f"{num_chains} chains x 66,000 tokens visited in turn, 3 laps",
        _chains(num_chains, 66000, 3),
    )


def find_workload(name: str, question_delay_s: float = 1.0) -> Workload:
    """A listed workload, or chains_k<K>_revisit for any K; ValueError naming the known ones otherwise."""
    catalogue = builtin_workloads(question_delay_s)
    if name in catalogue:
        return catalogue[name]
    chains = re.fullmatch(r"chains_k(\d+)_revisit", name)
    if chains:
        return chains_workload(int(chains.group(1)))
    raise ValueError(f"--workload: unknown {name!r}; known: {', '.join(catalogue)}, chains_k<K>_revisit")


def scale_workload(workload: Workload, factor: float, max_prompt_tokens: int | None = None) -> Workload:
    """Prompt, shared-prefix and output lengths times factor (with floors), prompts capped at max_prompt_tokens."""
    if factor <= 0:
        raise ValueError(f"--scale must be > 0, got {factor}")

    def scaled(spec: RequestSpec) -> RequestSpec:
        prompt = max(MIN_PROMPT_TOKENS, round(spec.prompt_tokens * factor))
        if max_prompt_tokens is not None:
            prompt = min(prompt, max_prompt_tokens)
        shared = 0
        if spec.shared_prefix_tokens:
            question = max(MIN_QUESTION_TOKENS, round((spec.prompt_tokens - spec.shared_prefix_tokens) * factor))
            prompt = max(prompt, question + 1)
            shared = prompt - question
        output = max(MIN_OUTPUT_TOKENS, round(spec.max_tokens * factor))
        return replace(spec, prompt_tokens=prompt, max_tokens=output, shared_prefix_tokens=shared)

    return replace(workload, phases=tuple(tuple(scaled(spec) for spec in phase) for phase in workload.phases))


def check_fits(workload: Workload, context_length: int) -> None:
    """Refuse a workload whose request cannot fit: a server could silently truncate it and fake hits."""
    for spec in workload.requests:
        if spec.prompt_tokens + spec.max_tokens > context_length:
            raise ValueError(
                f"workload {workload.name}: {spec.label} request of {spec.prompt_tokens} prompt + {spec.max_tokens} "
                f"output tokens exceeds context length {context_length}; use --scale or --max-prompt-tokens"
            )
