"""Accuracy of each KV dtype against full-precision KV on a fixed set of prompts (CPU, fp32 model).

Builds a small random Qwen3.5-style hybrid model with transformers (seeded), or uses --model DIR.
Reports, per kv dtype: max |logit error| over every prompt position (teacher-forced, chunked prefill),
that error relative to the reference's max |logit|, and greedy agreement (matching leading tokens of
--new-tokens greedy tokens, as a fraction). Writes JSON to --out and prints a Markdown table.

    .venv/bin/python bench/kv_quant_accuracy.py --out bench/results/kv_quant_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from headroom.engine.llm import LLM
from headroom.engine.runtime.forward_batch import BatchItem
from headroom.engine.runtime.model_runner import ModelRunner
from headroom.engine.sequence import Sequence

DTYPES = ["auto", "bf16", "fp8", "int8", "int4", "int2"]


def build_model(out_dir: Path, seed: int) -> None:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    )
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Larger than the default init so that attention is sharp and the KV precision matters.
            scale = 0.3 if "norm" in name else 0.08
            param.add_(torch.randn(param.shape) * scale)
    model.float().save_pretrained(out_dir, safe_serialization=True)


def prompt_logits(runner: ModelRunner, ids: list[int], chunk: int) -> torch.Tensor:
    seq = Sequence("p", ids)
    seq.kv_slots = runner.kv_allocator.alloc(len(ids)) or []
    if runner.ssm_pool is not None:
        seq.ssm_slot = runner.ssm_pool.alloc()
    rows = []
    while seq.is_prefilling:
        start = seq.num_computed_tokens
        rows.append(runner.forward([BatchItem(seq, ids[start : start + chunk])], all_positions=True))
    runner.kv_allocator.free(seq.kv_slots)
    runner.release(seq)
    if seq.ssm_slot is not None and runner.ssm_pool is not None:
        runner.ssm_pool.free(seq.ssm_slot)
    return torch.cat(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="HF model dir (default: build a random one)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        model_dir = Path(tempfile.mkdtemp(prefix="kvq_"))
        build_model(model_dir, args.seed)
    total = args.prompt_len + args.new_tokens + 64
    size = -(-total // 32) * 32 * 2
    results: dict[str, dict[str, float]] = {}
    reference_logits: list[torch.Tensor] = []
    reference_tokens: list[list[int]] = []
    for dtype in DTYPES:
        llm = LLM(str(model_dir), kv_dtype=dtype, max_total_tokens=size, ssm_slots=8, max_running_requests=1,
                  enable_prefix_cache=False, context_length=total)
        vocab = llm.runner.model_config.vocab_size
        generator = torch.Generator().manual_seed(args.seed + 1)
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=generator).tolist() for _ in range(args.prompts)]
        errors, scales, agreement = [], [], []
        for i, ids in enumerate(prompts):
            logits = prompt_logits(llm.runner, ids, args.chunk)
            tokens = llm.generate([ids], max_new_tokens=args.new_tokens, ignore_eos=True, chunk_size=args.chunk)[0].token_ids
            if dtype == "auto":
                reference_logits.append(logits)
                reference_tokens.append(tokens)
            errors.append((logits - reference_logits[i]).abs().max().item())
            scales.append(reference_logits[i].abs().max().item())
            same = next((j for j, (a, b) in enumerate(zip(tokens, reference_tokens[i], strict=True)) if a != b), len(tokens))
            agreement.append(same / len(tokens))
        results[dtype] = {
            "max_abs_logit_error": max(errors),
            "rel_logit_error": max(e / s for e, s in zip(errors, scales, strict=True)),
            "greedy_agreement": sum(agreement) / len(agreement),
            "kv_pool_bytes": llm.runner.kv_pool.nbytes(),
        }
    print("| kv dtype | max abs logit error | relative to max abs logit | greedy agreement | pool bytes |")
    print("| --- | --- | --- | --- | --- |")
    for dtype, row in results.items():
        print(f"| {dtype} | {row['max_abs_logit_error']:.2e} | {row['rel_logit_error']:.2e} | "
              f"{row['greedy_agreement']:.0%} | {row['kv_pool_bytes']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = vars(args) | {"model": str(args.model) if args.model else "random qwen3_5 (build_model)", "out": str(args.out)}
        args.out.write_text(json.dumps({"settings": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
