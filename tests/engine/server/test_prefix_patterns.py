"""Prefix reuse through the HTTP API of a default `headroom serve --device cpu` (the issue's table, field report
004's chains): usage.prompt_tokens_details.cached_tokens on every revisit, and /metrics after the traffic.

One server for the module (default plan; only the warm-up is shortened); each pattern uses its own seeds, so
no pattern shares a prefix with another.
"""

from __future__ import annotations

import random
import re
import time

import httpx
import pytest

from tests.client.engine_process import EngineProcess

pytestmark = pytest.mark.slow
QUESTION = 16


def ids(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(count)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_patterns")
    with EngineProcess(["--warmup-tokens", "200"], root / "cache", root / "serve.log") as url:
        with httpx.Client(base_url=url, timeout=300.0) as client:
            yield client


def complete(client: httpx.Client, prompt: list[int], max_tokens: int = 4) -> tuple[int, list[int]]:
    """(cached_tokens, generated token ids) of one greedy completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["usage"]["prompt_tokens"] == len(prompt)
    return data["usage"]["prompt_tokens_details"]["cached_tokens"], data["choices"][0]["token_ids"]


def hit_rate(cached: list[int], shared: int) -> float:
    return sum(min(c, shared) for c in cached) / (shared * len(cached))


def test_plan_promises_reusable_sessions_by_default(server):
    plan = server.get("/plan").json()
    assert plan["retained_sessions"] >= 3 and plan["session_tokens"] >= 4096
    assert plan["ssm_slots"] >= plan["retained_sessions"] * 3 + plan["max_running_requests"]


def test_shared_document_with_a_new_question_each_visit(server):
    docs = {session: ids(1000, session) for session in (1, 2)}
    laps = [[complete(server, docs[s] + ids(QUESTION, 100 * s + visit))[0] for s in docs] for visit in (1, 2)]
    assert laps[0] == [0, 0]
    # The tail checkpoint on the last 64-token boundary inside the document: 960 of 1000.
    assert hit_rate(laps[1], 1000) >= 0.9, laps


@pytest.mark.parametrize("length", [300, 2000])
def test_exact_repeat_hits_one_token_short_of_the_end(server, length):
    prompt = ids(length, 7 + length)
    cached = [complete(server, prompt)[0] for _ in range(3)]
    assert cached[0] == 0 and cached[1:] == [length - 1, length - 1], cached


def test_a_longer_prompt_over_a_repeated_one_hits_its_own_end_on_the_repeat(server):
    base = ids(3000, 9)
    complete(server, base[:1000])
    cached = [complete(server, base)[0] for _ in range(3)]
    # The first visit reuses the shorter prompt's exact-repeat state; the repeats reuse their own.
    assert cached == [999, 2999, 2999], cached


def test_multi_turn_reuses_prompt_and_answer(server):
    turn, previous = ids(2000, 11), 0
    for index in range(4):
        cached, answer = complete(server, turn)
        if index:
            # The previous turn's prompt and answer, less its last token (sampled, never computed).
            assert cached == previous - 1, (index, cached, previous)
        previous = len(turn) + len(answer)
        turn = turn + answer + ids(48, 200 + index)


def test_field_report_004_chains_revisited_for_three_laps(server):
    chain_tokens, chains = 4000, (21, 22, 23)
    plan = server.get("/plan").json()
    assert len(chains) <= plan["retained_sessions"] and chain_tokens + QUESTION <= plan["session_tokens"]
    docs = {chain: ids(chain_tokens, chain) for chain in chains}
    laps = [[complete(server, docs[c] + ids(QUESTION, 1000 * c + lap))[0] for c in chains] for lap in (1, 2, 3)]
    assert laps[0] == [0, 0, 0]
    # Lap 2 hits the tail checkpoint (3968 of 4000); lap 3 the divergence point lap 2 left at 4000.
    assert hit_rate(laps[1] + laps[2], chain_tokens) >= 0.99, laps
    assert laps[2] == [chain_tokens] * 3, laps


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


def test_metrics_split_working_and_checkpoint_slots_and_count_the_cache(server):
    prompt = ids(500, 31)
    complete(server, prompt)
    complete(server, prompt[:400] + ids(40, 32))
    # The last token reaches the client just before the engine thread releases the request's slot: wait for idle.
    for _ in range(100):
        text = server.get("/metrics").text
        if metric(text, "headroom_ssm_used_slots") == 0:
            break
        time.sleep(0.05)
    # Idle: no running request holds a slot; the checkpoints are counted apart.
    assert metric(text, "headroom_ssm_used_slots") == 0
    assert metric(text, "headroom_ssm_checkpoint_slots") > 0
    assert metric(text, "headroom_ssm_checkpoints_taken_total") >= metric(text, "headroom_ssm_checkpoint_slots")
    looked_up = metric(text, "headroom_prefix_lookup_tokens_total")
    matched = metric(text, "headroom_prefix_matched_tokens_total")
    assert looked_up >= matched >= metric(text, "headroom_cached_prompt_tokens_total") > 0
    # The second prompt matched 400 tokens but the deepest checkpoint inside them is at 384 (tail of 500).
    assert metric(text, "headroom_prefix_matched_no_state_tokens_total") >= 16
