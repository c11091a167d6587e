"""DecodeGraphs off the GPU: the static-buffer decode pass (what a graph records) against the eager path.

On the CPU nothing is captured, but every index a graph reads comes from the same static buffers and the
request-to-token table, so a wrong slot, row or position shows up as different logits here. The capture
itself is checked on the H200 (bench/gpu_engine.py graphs).
"""

from __future__ import annotations

import os

# triton.jit reads this when a kernel module is first imported (the fused-store case runs the norm/rotary kernels).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from headroom.engine.config import EngineConfig  # noqa: E402
from headroom.engine.llm import LLM  # noqa: E402
from headroom.engine.runtime import decode_graphs  # noqa: E402
from headroom.engine.runtime.decode_graphs import DecodeGraphs  # noqa: E402
from headroom.engine.runtime.forward_batch import BatchItem  # noqa: E402
from headroom.engine.runtime.model_runner import ModelRunner  # noqa: E402

from tests.engine.helpers import new_sequence, random_prompt  # noqa: E402


def _runner(model_dir, graph_batch: int, max_total_tokens: int) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=max_total_tokens, ssm_slots=4,
                                    max_running_requests=2, cuda_graph_max_batch=graph_batch))


def _generate(model_dir, vocab: int, graph_batch: int, kv_dtype: str, **settings):
    llm = LLM(str(model_dir), max_total_tokens=512, ssm_slots=16, chunked_prefill_size=5, max_running_requests=4,
              kv_dtype=kv_dtype, cuda_graph_max_batch=graph_batch, **settings)
    # Different lengths: some requests decode while others still prefill (eager mixed passes), then all decode.
    prompts = [random_prompt(vocab, n, seed=n) for n in (3, 11, 17, 6)]
    return llm, llm.generate(prompts, max_new_tokens=9)


@pytest.mark.parametrize("kind,index,kv_dtype", [("qwen3_5", 0, "auto"), ("qwen3_5", 2, "fp8"), ("qwen3", 0, "auto")])
def test_static_decode_pass_matches_the_eager_path(tiny_model_factory, kind, index, kv_dtype):
    model_dir, reference = tiny_model_factory(kind, index)
    vocab = reference.config.vocab_size
    _, eager = _generate(model_dir, vocab, 0, kv_dtype)
    graphed_llm, graphed = _generate(model_dir, vocab, 4, kv_dtype)
    assert graphed_llm.runner.decode_graphs is not None
    for a, b in zip(eager, graphed, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.prompt_logits, b.prompt_logits, atol=1e-5, rtol=0)
    # Every finished request gave its table row back.
    assert graphed_llm.runner.decode_graphs.leased_rows == 0


def test_static_pass_logits_equal_eager_logits_step_by_step(tiny_model_factory):
    """One request decodes alone, then eagerly next to a second one's prefill (its table row falls behind),
    then both decode through the static pass (one catch-up upload, one new row)."""
    model_dir, reference = tiny_model_factory("qwen3_5", 1)
    vocab = reference.config.vocab_size
    runs = {}
    for graph_batch in (0, 2):
        runner = _runner(model_dir, graph_batch, max_total_tokens=128)
        first = new_sequence(runner, "a", random_prompt(vocab, 7, seed=1))
        second = new_sequence(runner, "b", random_prompt(vocab, 4, seed=2))
        runner.forward([BatchItem(first, first.prompt_token_ids)])

        def decode(seq, step, runner=runner):
            seq.output_token_ids.append((step * 13 + len(seq.prompt_token_ids)) % vocab)
            seq.kv_slots += runner.kv_allocator.alloc(1) or []
            return BatchItem(seq, seq.output_token_ids[-1:])

        rows = [runner.forward([decode(first, step)]) for step in range(2)]
        rows.append(runner.forward([decode(first, 2), BatchItem(second, second.prompt_token_ids)]))
        rows += [runner.forward([decode(first, step), decode(second, step)]) for step in range(3, 7)]
        runs[graph_batch] = torch.cat(rows)
    torch.testing.assert_close(runs[0], runs[2], atol=1e-5, rtol=0)


def test_rows_are_leased_per_request_and_returned(tiny_model_factory):
    model_dir, _ = tiny_model_factory("qwen3_5", 0)
    runner = _runner(model_dir, 2, max_total_tokens=64)
    graphs = runner.decode_graphs
    assert graphs is not None
    seqs = [new_sequence(runner, name, [1, 2]) for name in "abc"]
    for seq in seqs:
        runner.forward([BatchItem(seq, [1])])
    assert graphs.leased_rows == 2
    # Both rows are leased: a third request's decode cannot get one and runs eagerly.
    assert not graphs.can_run([BatchItem(seqs[2], [2])])
    assert graphs.can_run([BatchItem(seqs[0], [2]), BatchItem(seqs[1], [2])])
    # Prefill chunks and batches larger than max_batch are never graphed.
    assert not graphs.can_run([BatchItem(seqs[0], [2, 3])])
    runner.release(seqs[0])
    assert graphs.leased_rows == 1
    assert graphs.can_run([BatchItem(seqs[2], [2])])


@pytest.mark.parametrize("kv_dtype,kernels", [("int4", ""), ("int2", ""), ("int2", "store"), ("int2", "attention"),
                                              ("int2", "attention-pass")])
def test_kivi_static_decode_crosses_pages_as_the_eager_path(tiny_model_factory, monkeypatch, kv_dtype, kernels):
    """KIVI pages of 32: prompts of 28, 5 and 40 tokens and 30 new tokens each, so graphed steps fill and close
    pages (28 -> 32, 5 -> 32, 40 -> 64) while others only append to their window rows; tokens and logits equal
    the eager path's, and every window row is free again at the end. kernels "store": the norms and rotary through
    their Triton kernels (the interpreter), so that a graphed step's K/V reach the windows through
    qk_norm_rotary_store's own stores at DecodeGraphs' window slots, as on the GPU; "attention": a graphed step's
    paged attention through its Triton kernels, the windows attended in the split merge (KeyWindow); "attention-pass":
    the same with the merge off (HEADROOM_WINDOW_MERGE=0), the windows in a pass of their own."""
    from headroom.kernels import ops

    if kernels == "store":
        monkeypatch.setattr(ops, "_fused", lambda x, op: op == "rms_norm_rotary")
    windows: list[bool] = []
    if kernels == "attention-pass":
        # HEADROOM_WINDOW_MERGE=0: the windows in a pass of their own.
        from headroom.engine.layers import paged_attention as layer

        monkeypatch.setattr(layer, "WINDOW_MERGE", False)
    if kernels.startswith("attention"):
        from headroom.kernels import paged_attention

        # fp32 KIVI tiles in both paths' decode launches: the eager path attends some spans in other launch shapes
        # (fp32 tiles there), and decode's default half_tiles would round only the graphed step's to fp16
        # (tests/kernels/test_paged_attention.py checks those tiles)
        monkeypatch.setitem(paged_attention.DECODE_TUNING, "half_tiles", 0)

        def on_the_kernels(*args, window=None, **kwargs):
            windows.append(window is not None)
            return paged_attention.paged_attention(*args, window=window, **kwargs)

        monkeypatch.setattr(ops, "paged_attention", on_the_kernels)
    model_dir, reference = tiny_model_factory("qwen3_5", 2)
    vocab = reference.config.vocab_size
    prompts = [random_prompt(vocab, n, seed=n) for n in (28, 5, 40)]
    runs = {}
    for graph_batch in (0, 3):
        llm = LLM(str(model_dir), max_total_tokens=512, ssm_slots=16, chunked_prefill_size=64, max_running_requests=4,
                  kv_dtype=kv_dtype, cuda_graph_max_batch=graph_batch)
        steps: list[bool] = []
        graphs = llm.runner.decode_graphs
        if graphs is not None:
            real_run = graphs.run
            graphs.run = lambda items, *rest, real_run=real_run, steps=steps: steps.append(True) or real_run(items, *rest)  # type: ignore[method-assign]
        runs[graph_batch] = llm.generate(prompts, max_new_tokens=30)
        if graph_batch:
            assert len(steps) >= 25, "the decode steps went through the static pass"
        assert not llm.runner.kv_pool._residual_rows
    for a, b in zip(runs[0], runs[3], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.prompt_logits, b.prompt_logits, atol=1e-5, rtol=0)
    if kernels.startswith("attention"):
        # (On the CPU only static passes take the paged kernels; eager ones attend a gathered context.)
        assert len(windows) >= 25
        if kernels == "attention":
            assert all(windows), "every graphed step attended its windows in the split merge"
        else:
            assert not any(windows), "with the merge off, no graphed step handed its windows to the merge"


def test_bad_sizes_are_refused_with_the_numbers(tiny_model_factory):
    model_dir, _ = tiny_model_factory("qwen3_5", 0)
    with pytest.raises(ValueError, match=r"cuda_graph_max_batch=9 must be in 1..8 \(max_running_requests=8"):
        ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=128, cuda_graph_max_batch=9))
    with pytest.raises(ValueError, match=r"cuda_graph_max_batch=65 must be in 1..64 .* at most 64 graphs"):
        ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=256, max_running_requests=100,
                                 ssm_slots=100, cuda_graph_max_batch=65))
    with pytest.raises(ValueError, match="cuda_graph_max_batch must be >= 0"):
        EngineConfig(model_path=str(model_dir), cuda_graph_max_batch=-1)


def test_graphs_are_off_by_default_on_the_cpu_and_capture_is_a_no_op(tiny_model_factory):
    model_dir, _ = tiny_model_factory("qwen3", 0)
    runner = ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=64))
    assert runner.decode_graphs is None
    assert runner.capture_decode_graphs().batch_sizes == ()
    emulated = DecodeGraphs(runner, 2)
    assert emulated.capture().batch_sizes == ()
    assert emulated.capture(sizes=(2,)).batch_sizes == ()


def test_capture_refuses_a_size_outside_its_batches(tiny_model_factory):
    model_dir, _ = tiny_model_factory("qwen3", 0)
    runner = ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=64))
    with pytest.raises(ValueError, match=r"capture sizes \(3,\) must be in 1..2"):
        DecodeGraphs(runner, 2).capture(sizes=(3,))


def test_a_one_token_prompt_starts_in_a_static_pass(tiny_model_factory):
    """A new request whose prompt is one token joins a decode-only pass: the static pass resets its SSM
    state and attends over its position 0 only."""
    model_dir, reference = tiny_model_factory("qwen3_5", 2)
    vocab = reference.config.vocab_size
    runs = {}
    for graph_batch in (0, 2):
        runner = _runner(model_dir, graph_batch, max_total_tokens=64)
        first = new_sequence(runner, "a", random_prompt(vocab, 5, seed=3))
        runner.forward([BatchItem(first, first.prompt_token_ids)])
        first.output_token_ids.append(7)
        first.kv_slots += runner.kv_allocator.alloc(1) or []
        single = new_sequence(runner, "b", [11])
        runs[graph_batch] = runner.forward([BatchItem(first, [7]), BatchItem(single, [11])])
    assert runs[2].shape[0] == 2
    torch.testing.assert_close(runs[0], runs[2], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_dtype,length,chunk", [("auto", 129, 64), ("int4", 128, 127)])
def test_a_prefix_re_pointed_by_the_cache_is_uploaded_again(tiny_model_factory, kv_dtype, length, chunk):
    """Two identical prompts in one batch: after a pass the graph rows already hold, the radix cache re-points the
    second's prefix to the first's slots and frees its own (CacheManager._publish), which the allocator hands out
    again. Its table row must follow: graphed tokens equal eager ones (they diverged at token 24 / 31 before)."""
    model_dir, reference = tiny_model_factory("qwen3", 0)
    prompt = random_prompt(reference.config.vocab_size, length, seed=1)
    out = {}
    for graph_batch in (0, 2):
        llm = LLM(str(model_dir), max_total_tokens=1024, max_running_requests=2, kv_dtype=kv_dtype,
                  cuda_graph_max_batch=graph_batch, chunked_prefill_size=chunk)
        out[graph_batch] = [g.token_ids for g in llm.generate([prompt, prompt], max_new_tokens=60)]
    assert out[0][0] == out[0][1] == out[2][0] == out[2][1]


def _fake_cuda_capture(monkeypatch) -> None:
    """torch.cuda's calls in DecodeGraphs.capture as no-ops: its order of passes runs on a CPU."""
    import contextlib

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    cuda = torch.cuda
    for name, fake in {"synchronize": lambda device=None: None, "empty_cache": lambda: None,
                       "memory_reserved": lambda device=None: 0, "mem_get_info": lambda device=None: (0, 0),
                       "graph_pool_handle": lambda: None, "Stream": Stream, "current_stream": lambda device=None: Stream(),
                       "stream": lambda stream: contextlib.nullcontext(), "CUDAGraph": object,
                       "graph": lambda graph, pool=None: contextlib.nullcontext()}.items():
        monkeypatch.setattr(cuda, name, fake)


def test_capture_runs_every_size_dry_first_and_compiles_them_in_one_round(tiny_model_factory, monkeypatch):
    """In the warm-up (compile ahead on), every size's pass runs dry before any real one and the compile ahead
    gets them all in one prepare (one round of compiles, not one a size); without it, no dry pass at all."""
    model_dir, _ = tiny_model_factory("qwen3", 0)
    runner = ModelRunner(EngineConfig(model_path=str(model_dir), max_total_tokens=64))
    _fake_cuda_capture(monkeypatch)
    events: list = []

    class Ahead:
        def prepare(self, *dry_passes):
            events.append(("prepare", len(dry_passes)))
            for dry_pass in dry_passes:
                dry_pass()
            return 0

    for ahead in (Ahead(), None):
        events.clear()
        runner.compile_ahead = ahead  # type: ignore[assignment]
        graphs = DecodeGraphs(runner, 3, capture=True)
        monkeypatch.setattr(graphs, "_pass", lambda size: events.append(("pass", size)))
        monkeypatch.setattr(decode_graphs, "wait_for_import", lambda: events.append(("fla imported",)))
        assert graphs.capture().batch_sizes == (1, 2, 3)
        # Each size: its eager warm pass, then the captured one; largest first. fla's import ahead (another thread)
        # has finished before the first of them: no thread may call CUDA while a graph is captured.
        real = [("fla imported",)] + [("pass", 3)] * 2 + [("pass", 2)] * 2 + [("pass", 1)] * 2
        assert events == ([("prepare", 3), ("pass", 3), ("pass", 2), ("pass", 1)] if ahead else []) + real
