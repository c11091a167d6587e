"""Quantized checkpoints served over HTTP (the path of `headroom serve`): greedy tokens equal transformers
running the dequantized weights in fp32, for Qwen3.5 and Qwen3-Next in block FP8 and INT4 (symmetric and
asymmetric, written by compressed-tensors), and Qwen3.5 in GPTQ's own layout."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.client.engine_process import EngineProcess
from tests.engine.quant_checkpoints import build_dense, reference_model, write_fp8, write_gptq, write_int4
from tests.engine.server_fixtures import running_server

FORMATS = {
    "fp8-128x128": lambda dense, out: write_fp8(dense, out, (128, 128)),
    "fp8-16x32": lambda dense, out: write_fp8(dense, out, (16, 32)),
    "int4-sym": lambda dense, out: write_int4(dense, out, symmetric=True),
    "int4-asym": lambda dense, out: write_int4(dense, out, symmetric=False),
    "gptq-sym": lambda dense, out: write_gptq(dense, out, symmetric=True),
    "gptq-asym-v2": lambda dense, out: write_gptq(dense, out, symmetric=False, checkpoint_format="gptq_v2"),
}
PROMPT = [int(t) for t in torch.randint(0, 259, (29,), generator=torch.Generator().manual_seed(5))]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def dense_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    return {kind: build_dense(kind, root / kind) for kind in ("qwen3_5", "qwen3_next")}


def _greedy(model) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        return tokens[0, len(PROMPT):].tolist(), model(ids).logits[0, -1]


def _completion(base_url: str) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    answer = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


# The published 128x128 FP8 block is one block on these tiny layers: served once; 16x32 blocks for both models.
# GPTQ once on Qwen3-Next, whose config names every expert in modules_in_block_to_quantize.
CASES = [("qwen3_5", fmt) for fmt in FORMATS] + [("qwen3_next", fmt) for fmt in FORMATS
                                                 if fmt not in ("fp8-128x128", "gptq-sym")]


@pytest.mark.parametrize(("kind", "fmt"), CASES)
def test_served_greedy_tokens_equal_transformers_on_dequantized_weights(dense_models, tmp_path, kind, fmt):
    from transformers import AutoModelForCausalLM

    quantized = FORMATS[fmt](dense_models[kind], tmp_path / "quantized")
    want, want_logits = _greedy(reference_model(quantized, tmp_path / "reference"))
    dense_tokens, dense_logits = _greedy(AutoModelForCausalLM.from_pretrained(dense_models[kind]).eval())
    # Not vacuous: quantization moved the logits well beyond the engine's agreement with its reference.
    assert (dense_logits - want_logits).abs().max() > 1e-3
    with running_server(tmp_path, model=str(quantized), context_length=256, max_total_tokens=1024,
                        warmup_tokens=64) as server:
        assert _completion(server.base_url) == want
        assert server.state.plan is not None


def test_headroom_serve_cli_serves_an_int4_checkpoint(dense_models, tmp_path):
    """The console command itself, in a subprocess: plans from the checkpoint, warms up, answers."""
    quantized = write_int4(dense_models["qwen3_next"], tmp_path / "quantized", symmetric=False)
    want, _ = _greedy(reference_model(quantized, tmp_path / "reference"))
    flags = ["--model", str(quantized), "--context-length", "256", "--max-total-tokens", "1024",
             "--max-new-tokens", "32"]
    with EngineProcess(flags, tmp_path / "cache", tmp_path / "serve.log") as url:
        assert _completion(url) == want
        plan = httpx.get(url + "/plan", timeout=10).json()
    assert "int4" in str(plan)
