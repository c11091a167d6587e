"""Checkpoints taken inside a pass (BatchItem.captures): the SSM state a capture slot receives equals the
state of a run that stopped there, every layer's conv and recurrent state, whether it came from a varlen round
or a snapshot of the tail launch; the pass's own logits and final state are those of a pass without captures; a mixed batch with a capturing prefill next to other spans
(capturing too, and decodes) gets each right; a capture that is not inside the chunk is refused. On the
reference path, and with rounds and a tail launch on the fused kernels too (the Triton interpreter), where the
prefill conv norms q/k for the varlen rounds and the tail launch alike."""

from __future__ import annotations

import os

# triton.jit reads this when a kernel module is first imported (here, inside ops' fused branches).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from headroom.engine.config import EngineConfig  # noqa: E402
from headroom.engine.runtime.forward_batch import BatchItem  # noqa: E402
from headroom.engine.runtime.model_runner import ModelRunner  # noqa: E402

from tests.engine.helpers import new_sequence, random_prompt  # noqa: E402


@pytest.fixture(params=[(0, False), (27, False), (256, False), (27, True)],
                ids=lambda p: f"tail {p[0]}" + (" fused" if p[1] else ""))
def path(request, monkeypatch):
    """Captures as varlen rounds only (tail 0), rounds then a tail launch with a snapshot in it (27 rows: the
    44-token prompt's captures 2 and 17 as rounds, 30 a snapshot; in the mixed batch b's 24), or all in the tail,
    no round at all (256, the default: every span here is that short); on the CPU's reference path, and at 27 also on the fused kernels run by the interpreter (~30 s a test),
    where every conv norms q/k and both the rounds and the tail launch take them so (counted: None on the
    reference path)."""
    from headroom.engine.layers import linear_attention
    from headroom.kernels import conv_varlen, gdn_decode, ops

    tail_rows, fused = request.param
    monkeypatch.setattr(linear_attention, "TAIL_ROWS", tail_rows)
    if not fused:
        return None
    normed = {"conv": 0, "rounds": 0, "tail": 0}
    monkeypatch.setattr(ops, "_fused", lambda x, op: True)

    def conv(*args, _run=conv_varlen.causal_conv1d_varlen_qkv, **kwargs):
        normed["conv"] += args[7] > 0
        return _run(*args, **kwargs)

    def rounds(*args, _run=ops.gated_delta_rule_varlen, **kwargs):
        normed["rounds"] += kwargs.get("qk_normed", False)
        return _run(*args, **kwargs)

    def tail(*args, _run=gdn_decode.gated_delta_tail, **kwargs):
        normed["tail"] += kwargs.get("qk_normed", False)
        return _run(*args, **kwargs)

    monkeypatch.setattr(conv_varlen, "causal_conv1d_varlen_qkv", conv)
    monkeypatch.setattr(ops, "gated_delta_rule_varlen", rounds)
    monkeypatch.setattr(gdn_decode, "gated_delta_tail", tail)
    return normed


def _assert_normed_qk_taken(normed: dict | None) -> None:
    if normed is not None:
        assert all(normed.values()), normed


def _runner(tiny_model_factory, kind: str = "qwen3_5") -> tuple[ModelRunner, int]:
    model_dir, reference = tiny_model_factory(kind, 0)
    return ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=512, ssm_slots=16)), \
        reference.config.vocab_size


def _state(runner: ModelRunner, slot: int) -> list[torch.Tensor]:
    pool = runner.ssm_pool
    assert pool is not None
    return [t[slot].clone() for layers in (pool.conv, pool.recurrent) for t in layers]


def _assert_states_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("start", "captures"), [(0, (2, 17, 30)), (11, (1, 2, 20))], ids=["from 0", "mid-prompt"])
def test_capture_slots_hold_the_state_of_a_run_that_stopped_there(tiny_model_factory, start, captures, path):
    runner, vocab = _runner(tiny_model_factory)
    ids = random_prompt(vocab, 44, seed=5)
    seq = new_sequence(runner, "captured", ids)
    if start:
        runner.forward([BatchItem(seq, ids[:start])])
    slots = [runner.ssm_pool.alloc() for _ in captures]
    logits = runner.forward([BatchItem(seq, ids[start:], tuple(zip(captures, slots, strict=True)))])
    plain = new_sequence(runner, "plain", ids)
    if start:
        runner.forward([BatchItem(plain, ids[:start])])
    torch.testing.assert_close(logits, runner.forward([BatchItem(plain, ids[start:])]), atol=1e-5, rtol=0)
    _assert_states_equal(_state(runner, seq.ssm_slot), _state(runner, plain.ssm_slot))
    for at, slot in zip(captures, slots, strict=True):
        stopped = new_sequence(runner, f"stopped-{at}", ids)
        runner.forward([BatchItem(stopped, ids[: start + at])])
        _assert_states_equal(_state(runner, slot), _state(runner, stopped.ssm_slot))
    _assert_normed_qk_taken(path)


def test_mixed_batch_with_captures(tiny_model_factory, path):
    runner, vocab = _runner(tiny_model_factory)
    a_ids, b_ids, c_ids = random_prompt(vocab, 30, seed=1), random_prompt(vocab, 25, seed=2), random_prompt(vocab, 9, seed=3)
    a, b, c = (new_sequence(runner, name, ids) for name, ids in (("a", a_ids), ("b", b_ids), ("c", c_ids)))
    runner.forward([BatchItem(c, c_ids[:8])])
    slot_a, slot_b1, slot_b2 = (runner.ssm_pool.alloc() for _ in range(3))
    mixed = runner.forward([BatchItem(a, a_ids, ((7, slot_a),)), BatchItem(c, c_ids[8:]),
                            BatchItem(b, b_ids, ((3, slot_b1), (24, slot_b2)))])
    for name, ids, slot, at in (("a7", a_ids, slot_a, 7), ("b3", b_ids, slot_b1, 3), ("b24", b_ids, slot_b2, 24)):
        stopped = new_sequence(runner, name, ids)
        runner.forward([BatchItem(stopped, ids[:at])])
        _assert_states_equal(_state(runner, slot), _state(runner, stopped.ssm_slot))
    alone = []
    for name, ids in (("a2", a_ids), ("c2", c_ids), ("b2", b_ids)):
        seq = new_sequence(runner, name, ids)
        if name == "c2":
            runner.forward([BatchItem(seq, ids[:8])])
            alone.append(runner.forward([BatchItem(seq, ids[8:])])[0])
        else:
            alone.append(runner.forward([BatchItem(seq, ids)])[0])
    torch.testing.assert_close(mixed, torch.stack(alone), atol=1e-5, rtol=0)
    _assert_normed_qk_taken(path)


@pytest.mark.parametrize(("tail_rows", "varlen_calls"), [(256, 0), (27, 2)], ids=["all in the tail", "rounds then tail"])
def test_a_pass_plans_its_captures_once_and_a_short_span_calls_no_varlen(tiny_model_factory, monkeypatch, tail_rows,
                                                                         varlen_calls):
    """The rounds and the tail are planned (and their indices uploaded) once per pass, not once per GDN layer; a
    span no longer than TAIL_ROWS runs all in the tail, no fla call in any layer (a 256-token prompt's stops cost
    it a varlen round a layer, 58.4 ms against 20.0 without its stops on the H200, session 12)."""
    from headroom.engine.layers import linear_attention
    from headroom.kernels import ops

    monkeypatch.setattr(linear_attention, "TAIL_ROWS", tail_rows)
    runner, vocab = _runner(tiny_model_factory)
    gdn_layers = sum(isinstance(layer.mixer, linear_attention.GatedDeltaNet) for layer in runner.model.layers)
    assert gdn_layers >= 2
    counts = {"plans": 0, "varlen": 0, "tail": 0}

    def counted(name, run):
        def call(*args, **kwargs):
            counts[name] += 1
            return run(*args, **kwargs)
        return call

    monkeypatch.setattr(linear_attention, "_segments", counted("plans", linear_attention._segments))
    monkeypatch.setattr(ops, "gated_delta_rule_varlen", counted("varlen", ops.gated_delta_rule_varlen))
    monkeypatch.setattr(ops, "gated_delta_tail", counted("tail", ops.gated_delta_tail))
    ids = random_prompt(vocab, 44, seed=5)
    seq = new_sequence(runner, "captured", ids)
    runner.forward([BatchItem(seq, ids, tuple(zip((2, 17, 30), (runner.ssm_pool.alloc() for _ in range(3)), strict=True)))])
    assert counts == {"plans": 1, "varlen": varlen_calls * gdn_layers, "tail": gdn_layers}


@pytest.mark.parametrize("captures", [((0, 1),), ((5, 1),), ((3, 1), (2, 2)), ((3, 1), (3, 2))], ids=str)
def test_captures_outside_the_chunk_are_refused(tiny_model_factory, captures):
    runner, vocab = _runner(tiny_model_factory)
    ids = random_prompt(vocab, 5, seed=0)
    with pytest.raises(ValueError, match="captures .* must be ascending and inside its 5 tokens"):
        runner.forward([BatchItem(new_sequence(runner, "x", ids), ids, captures)])


def _capture_slot_leaks(llm) -> int:
    """SSM slots neither free nor working nor held by the prefix cache's checkpoints."""
    llm.cache.radix.evict_checkpoints(10_000)
    return llm.cache.ssm_allocator.num_slots - llm.cache.ssm_allocator.num_free - llm.cache.num_working


@pytest.mark.parametrize("failure", ["reserve", "forward"])
def test_a_failed_llm_pass_leaks_no_capture_slot(tiny_model_factory, monkeypatch, failure):
    """LLM.generate over two 300-token prompts (checkpoint stops inside the first chunk) where the second's KV
    reservation or the pass itself fails: every capture slot taken is given back."""
    from headroom.engine.llm import LLM, CapacityError

    model_dir, reference = tiny_model_factory("qwen3_5", 0)
    vocab = reference.config.vocab_size
    llm = LLM(str(model_dir), max_total_tokens=2048, ssm_slots=16, chunked_prefill_size=512)
    prompts = [random_prompt(vocab, 300, seed=1), random_prompt(vocab, 300, seed=2)]
    if failure == "reserve":
        real = llm.cache.reserve
        monkeypatch.setattr(llm.cache, "reserve", lambda seq, n: not seq.request_id.endswith("-1") and real(seq, n))
        expected: type[Exception] = CapacityError
    else:
        def broken(items, all_positions=False):
            assert any(item.captures for item in items), "the chunk has checkpoint stops inside"
            raise RuntimeError("pass failed")

        monkeypatch.setattr(llm.runner, "forward", broken)
        expected = RuntimeError
    with pytest.raises(expected):
        llm.generate(prompts, max_new_tokens=1)
    assert _capture_slot_leaks(llm) == 0
