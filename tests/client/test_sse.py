import asyncio

import pytest
from headroom.client.result import RequestResult
from headroom.client.sse import SSEDecodeError, aiter_events, data_blocks, decode_block


def test_data_blocks_group_lines_and_skip_comments():
    lines = [": keep-alive", "", "data: {\"a\": 1}", "", "event: x", "data: {\"b\":", "data: 2}", "", "data: [DONE]", ""]
    assert list(data_blocks(lines)) == ['{"a": 1}', '{"b":\n2}', "[DONE]"]


def test_decode_block_done_and_errors():
    assert decode_block("[DONE]") is None
    assert decode_block('{"x": 1}') == {"x": 1}
    with pytest.raises(SSEDecodeError, match="not JSON"):
        decode_block("nonsense")
    with pytest.raises(SSEDecodeError, match="not a JSON object"):
        decode_block("[1, 2]")


def test_aiter_events_stops_at_done_and_handles_missing_final_blank():
    async def lines():
        for line in ['data: {"n": 1}', "", 'data: {"n": 2}', "", "data: [DONE]", "", 'data: {"n": 3}']:
            yield line

    async def collect():
        return [event async for event in aiter_events(lines())]

    assert asyncio.run(collect()) == [{"n": 1}, {"n": 2}]


def test_result_times_tokens_and_reads_usage():
    result = RequestResult(sent_at=10.0, sent_prompt_tokens=5)
    result.absorb({"choices": [{"text": "he", "finish_reason": None}]}, 10.5)
    result.absorb({"choices": [{"delta": {"content": "llo"}, "finish_reason": None}]}, 10.6)
    result.absorb({"choices": [{"text": "", "finish_reason": "length"}]}, 10.7)
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}}
    result.absorb({"choices": [], "usage": usage}, 10.8)
    result.status, result.done_at = 200, 11.0
    assert result.text == "hello" and result.finish_reason == "length"
    assert result.ttft_s == pytest.approx(0.5)
    assert result.itl_s == [pytest.approx(0.1)]
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (5, 2, 3)
    assert result.ok and result.e2e_s == pytest.approx(1.0)


def test_result_reads_sglang_top_level_cached_tokens_and_stream_errors():
    result = RequestResult()
    result.absorb({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1, "cached_tokens": 7}}, 1.0)
    assert result.cached_tokens == 7
    result.absorb({"error": {"message": "boom"}}, 2.0)
    assert result.error is not None and "boom" in result.error


def test_empty_completion_chunk_is_a_token_but_chat_role_chunk_is_not():
    completion = RequestResult(sent_at=0.0)
    completion.absorb({"choices": [{"text": "", "finish_reason": None}]}, 0.3)
    completion.absorb({"choices": [{"text": "", "finish_reason": "stop"}]}, 0.4)
    assert completion.token_times == [0.3]
    chat = RequestResult(sent_at=0.0)
    chat.absorb({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}, 0.1)
    chat.absorb({"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}, 0.2)
    assert chat.token_times == [0.2]
