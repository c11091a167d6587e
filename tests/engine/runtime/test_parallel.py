"""Tensor parallelism on the CPU: two gloo processes against one, tiny random fp32 models.

TP2's greedy tokens and logits equal TP1's (chunked prefill, prefix hits, every position, the decode
graphs' static pass); each rank's KV and SSM pools are the plan's per-GPU ledger to the byte; a rank that
dies takes `headroom serve` down.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from dataclasses import replace

import httpx
import pytest
import torch
from headroom.engine.config import EngineConfig
from headroom.engine.default_model import ensure_default_model
from headroom.engine.llm import LLM
from headroom.engine.loop.engine_loop import RequestStream
from headroom.engine.models.config import model_config_from_hf
from headroom.engine.plan import Pinned, PlanRequest, Targets, load_geometry, make_plan, parse_size
from headroom.engine.runtime.forward_batch import BatchItem
from headroom.engine.runtime.leader import build_runner
from headroom.engine.runtime.loader import WeightError, expected_shapes
from headroom.engine.runtime.model_runner import ModelRunner
from headroom.engine.runtime.parallel import shard_config
from headroom.engine.runtime.pass_mirror import PassEncoder, PassMirror
from headroom.engine.runtime.sharded_loader import shard_rule
from headroom.engine.sequence import SamplingParams, Sequence
from headroom.engine.server.factory import ServeOptions, build_state, resolve_plan, warm_up
from safetensors.torch import save_file

from tests.client.engine_process import EngineProcess
from tests.engine.helpers import random_prompt

# Odd vocabulary (the last rank's rows are padded), one KV head (replicated on both ranks), output gate.
QWEN3_5 = dict(
    architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=103, hidden_size=32,
    intermediate_size=48, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4, num_key_value_heads=1, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    max_position_embeddings=4096, tie_word_embeddings=False, dtype="float32", eos_token_id=0,
)
# Fused head-grouped qkvz/ba, two value heads per key head, sparse MoE with a shared expert, biases.
QWEN3_NEXT = dict(
    QWEN3_5, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=90, num_key_value_heads=2,
    tie_word_embeddings=True, attention_bias=True, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=8, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
)


def write_model(directory, config: dict, seed: int):
    """Random weights of every tensor the engine reads (biases included when the config has them)."""
    shapes = expected_shapes(model_config_from_hf(config))
    if config.get("attention_bias"):
        for name, shape in list(shapes.items()):
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
                shapes[name.replace("weight", "bias")] = shape[:1]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        scale = 1.0 if name.endswith(("A_log", "mlp.gate.weight")) else shape[-1] ** -0.5 if len(shape) > 1 else 0.1
        tensors[name] = torch.randn(shape, generator=generator) * scale
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def pair(model_dir, **settings) -> tuple[LLM, LLM]:
    config = EngineConfig(model_path=str(model_dir), max_total_tokens=512, ssm_slots=24, chunked_prefill_size=16,
                          context_length=256, max_running_requests=4, **settings)
    return LLM(str(model_dir), config=config), LLM(str(model_dir), config=replace(config, tensor_parallel_size=2))


def prefix_workload(llm: LLM, vocab: int) -> list:
    """Cold prompts in chunks, then two prompts that extend the first one's cached prefix."""
    shared = random_prompt(vocab, 150, seed=1)
    first = llm.generate([shared, random_prompt(vocab, 21, seed=2)], max_new_tokens=5)
    return first + llm.generate([shared + random_prompt(vocab, 7, seed=3), shared[:140]], max_new_tokens=6)


def assert_same(one: list, two: list, atol: float) -> None:
    # The last two prompts hit the first one's checkpoint stops (CacheManager: exact repeat, tail).
    assert [g.cached_tokens > 0 for g in one] == [False, False, True, True]
    for a, b in zip(one, two, strict=True):
        assert b.token_ids == a.token_ids and b.cached_tokens == a.cached_tokens
        torch.testing.assert_close(b.prompt_logits, a.prompt_logits, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tp_qwen3_5"), QWEN3_5, seed=5)


def test_shard_config_names_the_field_a_size_does_not_divide():
    config = model_config_from_hf(QWEN3_5)
    local = shard_config(config, 2)
    assert (local.num_heads, local.num_kv_heads, local.linear_num_value_heads, local.vocab_size) == (2, 1, 2, 52)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide num_attention_heads 4"):
        shard_config(config, 3)
    with pytest.raises(ValueError, match="neither divides num_key_value_heads 3"):
        shard_config(replace(config, num_kv_heads=3), 2)
    with pytest.raises(WeightError, match="'model.layers.0.mlp.gate_proj.qweight' has no tensor-parallel"):
        shard_rule("model.layers.0.mlp.gate_proj.qweight", config, 0)


def test_pass_descriptions_send_kv_slot_deltas_and_resend_a_repointed_prefix():
    encoder, mirror = PassEncoder(), PassMirror()
    seq = Sequence("r", [5, 6, 7, 8, 9], kv_slots=[10, 11, 12, 13])

    def step(tokens: list[int]) -> list[int]:
        encoded = encoder.encode(BatchItem(seq, tokens))
        (item,) = mirror.decode([encoded])
        assert item.seq.kv_slots == seq.kv_slots and item.seq.num_computed_tokens == seq.num_computed_tokens
        assert item.seq.tokens_between(seq.num_computed_tokens, seq.num_computed_tokens + len(tokens)) == tokens
        seq.num_computed_tokens += len(tokens)
        return encoded[6]

    assert step([5, 6, 7, 8]) == [10, 11, 12, 13]
    seq.kv_slots.append(14)
    assert step([9]) == [14]  # a decode step sends only its new slot
    # The radix cache re-points the shared prefix at its own slots (CacheManager._publish): sent whole.
    seq.kv_slots[:4], seq.num_shared_slots = [20, 21, 22, 23], 4
    seq.output_token_ids.append(3)
    seq.kv_slots.append(15)
    assert step([3]) == [20, 21, 22, 23, 14, 15]
    # A mirror that drifted from rank 0 fails loudly instead of reading the wrong slots.
    mirror.release("r")
    with pytest.raises(RuntimeError, match="rank 0 sent kv slots from 6"):
        seq.kv_slots.append(16)
        seq.output_token_ids.append(4)
        step([4])


def test_a_split_the_heads_refuse_fails_before_any_process_starts(qwen3_5_dir):
    config = EngineConfig(model_path=str(qwen3_5_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide num_attention_heads 4"):
        build_runner(config)
    with pytest.raises(ValueError, match="build the runner with engine/runtime/leader.py's build_runner"):
        ModelRunner(config)


def test_serve_refuses_a_tp_flag_that_disagrees_with_the_plan_file(qwen3_5_dir, tmp_path):
    plan = make_plan(PlanRequest(geometry=load_geometry(qwen3_5_dir), gpu_memory_bytes=parse_size("2GiB"),
                                 engine="builtin", tp=2, targets=Targets(context_length=256, max_new_tokens=16)))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    options = ServeOptions(model=str(qwen3_5_dir), plan_path=str(path), tensor_parallel_size=1)
    with pytest.raises(ValueError, match="--tensor-parallel-size 1 disagrees with the plan's tp 2"):
        resolve_plan(options, qwen3_5_dir)
    assert resolve_plan(replace(options, tensor_parallel_size=None), qwen3_5_dir).tp == 2


def test_each_ranks_pools_are_the_plans_per_gpu_ledger(qwen3_5_dir):
    """A tp=2 plan run as planned: every rank's KV and SSM pool bytes equal the ledger's; greedy tokens
    equal TP1's on the same (bf16) KV format."""
    plan = make_plan(PlanRequest(
        geometry=load_geometry(qwen3_5_dir), gpu_memory_bytes=parse_size("2GiB"), engine="builtin", tp=2,
        targets=Targets(context_length=256, max_running_requests=3, max_new_tokens=16),
        pinned=Pinned(max_total_tokens=512, chunked_prefill_size=16),
    ))
    assert plan.engine_args[-2:] == ["--tensor-parallel-size", "2"]
    config = EngineConfig.from_plan(plan, str(qwen3_5_dir), device="cpu", static_budget_bytes=None)
    two = LLM(str(qwen3_5_dir), config=config)
    try:
        assert [(r["kv_pool"], r["ssm_pool"]) for r in two.runner.rank_pools] == \
            [(plan.ledger["kv_pool"], plan.ledger["ssm_pool"])] * 2
        # The ledger's weights are half the checkpoint's; each rank also holds the copies (norms, the one KV
        # head, vocabulary padding): 2.6% more here.
        assert all(plan.ledger["weights"] < r["weights"] < 1.05 * plan.ledger["weights"] for r in two.runner.rank_pools)
        got = prefix_workload(two, QWEN3_5["vocab_size"])
    finally:
        two.close()
    one = LLM(str(qwen3_5_dir), config=replace(config, tensor_parallel_size=1))
    assert [g.token_ids for g in got] == [g.token_ids for g in prefix_workload(one, QWEN3_5["vocab_size"])]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_tp2_logits_and_greedy_tokens_equal_tp1(family, qwen3_5_dir, tmp_path):
    """fp32 weights and KV: chunked prefill, prefix hits, all-position logits and decode passes through
    the decode graphs' static buffers (the CPU runs them uncaptured) match one process."""
    model_dir = qwen3_5_dir if family == "qwen3_5" else write_model(tmp_path / "next", QWEN3_NEXT, seed=6)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    graphs = 0 if family == "qwen3_next" else 3  # MoE models are never graphed
    one, two = pair(model_dir, cuda_graph_max_batch=graphs)
    try:
        assert_same(prefix_workload(one, vocab), prefix_workload(two, vocab), atol=1e-5)
        assert two.runner.decode_graphs is None or two.runner.decode_graphs.leased_rows == 0
        prompt = random_prompt(vocab, 37, seed=9)
        rows = []
        for llm in (one, two):
            assert llm.runner.ssm_pool is not None
            seq = Sequence("all-positions", prompt, kv_slots=llm.runner.kv_allocator.alloc(len(prompt)) or [],
                           ssm_slot=llm.runner.ssm_pool.alloc())
            rows.append(torch.cat([llm.runner.forward([BatchItem(seq, prompt[i:i + 16])], all_positions=True)
                                   for i in range(0, len(prompt), 16)]))
            llm.runner.release(seq)
        assert rows[1].shape == (len(prompt), vocab)
        torch.testing.assert_close(rows[1], rows[0], atol=1e-5, rtol=0)
    finally:
        two.close()


async def _generate(loop, prompts: list[list[int]], tag: str) -> list[tuple[list[int], int]]:
    """(tokens, cached prompt tokens) of each prompt, all submitted at once."""

    async def one(index: int, prompt: list[int]) -> tuple[list[int], int]:
        stream = RequestStream(asyncio.get_running_loop(), asyncio.Queue())
        loop.submit(Sequence(f"{tag}-{index}", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True)),
                    frozenset(), stream)
        tokens: list[int] = []
        while True:
            event = await stream.events.get()
            tokens += event.token_ids
            if event.finish_reason is not None:
                assert event.finish_reason == "length", event.error
                return tokens, event.num_cached_tokens

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def test_the_servers_engine_on_two_ranks_serves_what_one_serves(tmp_path):
    """build_state + warm_up as `headroom serve` runs them, int4 KIVI KV (per-request residual windows on
    every rank): ready after the warm-up, then concurrent requests with prefix hits give TP1's tokens."""
    model = str(ensure_default_model(tmp_path / "default-model"))
    shared = random_prompt(250, 150, seed=4)
    prompts = [shared + random_prompt(250, n, seed=n) for n in (3, 17, 30)]
    served = []
    for tp in (1, 2):
        state = build_state(ServeOptions(model=model, kv_dtype="int4", context_length=256, max_total_tokens=2048,
                                         chunked_prefill_size=16, max_running_requests=3, max_new_tokens=16,
                                         tensor_parallel_size=tp))
        try:
            warm_up(state)
            assert state.warmup_error is None and state.ready.is_set()
            first = asyncio.run(_generate(state.loop, prompts[:1], "a"))
            again = asyncio.run(_generate(state.loop, prompts, "b"))
            # The first request's prefill stopped to checkpoint at 128 (a tail state, 64-token granules).
            assert [cached for _, cached in again] == [128, 128, 128]
            served.append(first + again)
        finally:
            state.loop.stop()
    assert served[1] == served[0]


def test_a_rank_that_dies_takes_the_server_down(tmp_path):
    """`headroom serve --tp 2`: ready only after both ranks warmed up, serves, and exits when rank 1 is killed."""
    log = tmp_path / "serve.log"
    server = EngineProcess(["--tp", "2", "--context-length", "512", "--max-new-tokens", "64", "--max-total-tokens", "2048",
                            "--chunked-prefill-size", "64", "--max-running-requests", "2"], tmp_path, log)
    with server as url:
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "tensor parallel", "max_tokens": 4,
                                                            "temperature": 0}, timeout=30)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{url}/plan").json()["tp"] == 2
        pid = int(re.search(r"tensor-parallel rank 1 of 2: pid (\d+)", log.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        assert server.process is not None
        code = server.process.wait(timeout=30)
    assert code == 1
    assert "tensor-parallel rank 1 exited with code -9" in log.read_text()
