"""The engine on the GPU (issue 8): correctness against transformers, then prefill/decode speed of a
Qwen3.5-4B-shaped random-weight bf16 model against the roofline and against transformers.

Run on the H200 (see bench/device_env.sh):  python3 bench/gpu_engine.py OUT.json [sections...]
sections: env roofline correctness perf perf_engine build graphs (default: all). Each section records its own error.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch

DEV = torch.device("cuda")
MODEL_4B = Path("/tmp/headroom-q35-4b")
KV_DTYPES = ("bf16", "fp8", "int8", "int4", "int2")


def sync_time(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def section_env() -> dict:
    import triton

    props = torch.cuda.get_device_properties(DEV)
    return {"gpu": props.name, "memory_bytes": props.total_memory, "torch": torch.__version__,
            "triton": triton.__version__, "sms": props.multi_processor_count}


def section_roofline() -> dict:
    """Measured ceilings: device-to-device copy bandwidth and bf16 matmul rate."""
    src = torch.empty(4 * 1024**3 // 2, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds, _ = sync_time(lambda src=src, dst=dst: [dst.copy_(src) for _ in range(10)])
    bandwidth = 2 * src.numel() * 2 * 10 / seconds
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEV)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=DEV)
    for _ in range(3):
        a @ b
    seconds, _ = sync_time(lambda: [a @ b for _ in range(10)])
    return {"hbm_bytes_per_s": bandwidth, "bf16_matmul_flops": 2 * 8192**3 * 10 / seconds}


def _tiny_config(seed: int):
    from transformers import Qwen3_5TextConfig

    rng = random.Random(seed)
    return Qwen3_5TextConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=rng.choice([512, 704]), num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=rng.choice([2, 4]), head_dim=rng.choice([64, 128]),
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )


def _save_random(config, path: Path, seed: int) -> None:
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    with torch.device(DEV):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    for param in model.parameters():
        # Larger than the init so every part (norms, gates, decays) shapes the logits.
        param.data.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    del model


def section_correctness() -> dict:
    """bf16 on the GPU: our engine vs transformers (logits, greedy tokens); KV dtypes vs our bf16."""
    from headroom.engine.llm import LLM
    from transformers import Qwen3_5ForCausalLM

    out = {}
    for seed in (0,):
        path = Path(f"/tmp/headroom-tiny-{seed}")
        _save_random(_tiny_config(seed), path, seed)
        prompt = [random.Random(seed).randrange(1000) for _ in range(777)]
        # Truth: transformers in fp32. bf16 transformers' own distance from it is the noise floor.
        truth_model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEV).eval()
        with torch.no_grad():
            truth = truth_model(torch.tensor([prompt], device=DEV), logits_to_keep=1).logits[0, -1].float()
        del truth_model
        top2 = truth.topk(2).values
        reference = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV).eval()
        with torch.no_grad():
            ref_logits = reference(torch.tensor([prompt], device=DEV), logits_to_keep=1).logits[0, -1].float()
            ref_tokens = reference.generate(
                torch.tensor([prompt], device=DEV), max_new_tokens=24, do_sample=False, min_new_tokens=24
            )[0, len(prompt):].tolist()
        case: dict = {"transformers_bf16_vs_fp32_max_abs": float((ref_logits - truth).abs().max()),
                      "fp32_top2_margin": float(top2[0] - top2[1])}
        base_tokens = None
        for kv in ("auto", *KV_DTYPES):
            llm = LLM(str(path), device="cuda", dtype="bfloat16", kv_dtype=kv, max_total_tokens=4096, ssm_slots=16,
                      chunked_prefill_size=97, context_length=4096, max_running_requests=4, enable_prefix_cache=False)
            gen = llm.generate([prompt], max_new_tokens=24, ignore_eos=True)[0]
            logits = gen.prompt_logits.float()
            entry = {
                "max_abs_logit_diff_vs_transformers": float((logits - ref_logits).abs().max()),
                "max_abs_logit_diff_vs_fp32_truth": float((logits - truth).abs().max()),
                "logit_scale": float(ref_logits.abs().max()),
                "greedy_agreement_vs_transformers": sum(a == b for a, b in zip(gen.token_ids, ref_tokens, strict=True)) / 24,
            }
            if kv == "auto":
                base_tokens = gen.token_ids
            else:
                entry["greedy_agreement_vs_engine_bf16"] = sum(a == b for a, b in zip(gen.token_ids, base_tokens, strict=True)) / 24
            case[kv] = entry
            del llm
            torch.cuda.empty_cache()
        out[f"seed{seed}"] = case
        del reference
    return out


def _build_4b() -> None:
    if (MODEL_4B / "config.json").exists():
        return
    from headroom.engine.plan.presets import preset_config
    from transformers import Qwen3_5TextConfig

    config_dict, _ = preset_config("qwen3.5-4b")
    fields = {k: v for k, v in config_dict.items() if k not in ("model_type", "architectures", "torch_dtype")}
    _save_random(Qwen3_5TextConfig(**fields), MODEL_4B, 4)


def _params(path: Path) -> int:
    from headroom.engine.plan import load_geometry

    return load_geometry(path).total_weight_bytes() // 2


def section_perf(budget_s: float = 330.0, with_hf: bool = True) -> dict:
    """Prefill tok/s at 8K/32K/128K and decode tok/s at batch 1/8/32, bf16 vs int2 KV, engine vs transformers."""
    from headroom.engine.llm import LLM
    from headroom.engine.plan import geometry_from_config
    from transformers import Qwen3_5ForCausalLM

    started = time.perf_counter()
    _build_4b()
    geometry = geometry_from_config(json.loads((MODEL_4B / "config.json").read_text()))
    out: dict = {"model": "Qwen3.5-4B-shaped random bf16", "params": _params(MODEL_4B), "engine": {}, "hf": {}}
    rng = random.Random(7)

    def prompt(n):
        return [rng.randrange(1000, 200000) for _ in range(n)]

    for kv in ("bf16", "int2"):
        llm = LLM(str(MODEL_4B), device="cuda", dtype="bfloat16", kv_dtype=kv, max_total_tokens=140000,
                  ssm_slots=40, chunked_prefill_size=8192, context_length=140000, max_running_requests=32,
                  enable_prefix_cache=False)
        # Warm-up at the sizes measured (a full chunk, a batch of decodes): Triton compiles per shape
        # class, and a first-use compile is not prefill speed.
        llm.generate([prompt(8192 + 300)], max_new_tokens=2, ignore_eos=True)
        llm.generate([prompt(64) for _ in range(32)], max_new_tokens=3, ignore_eos=True)
        res: dict = {"prefill": {}, "decode": {}}
        for n in (8192, 32768, 131072):
            if time.perf_counter() - started > budget_s:
                res["prefill"][n] = "skipped: time budget"
                continue
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            seconds, _ = sync_time(lambda n=n, llm=llm: llm.generate([prompt(n)], max_new_tokens=1, ignore_eos=True))
            res["prefill"][n] = {"seconds": seconds, "tokens_per_s": n / seconds,
                                 "peak_above_static_bytes": torch.cuda.max_memory_allocated() - before}
        for batch in (1, 8, 32):
            if time.perf_counter() - started > budget_s:
                res["decode"][batch] = "skipped: time budget"
                continue
            prompts = [prompt(256) for _ in range(batch)]
            t1, _ = sync_time(lambda p=prompts, llm=llm: llm.generate(p, max_new_tokens=1, ignore_eos=True))
            prompts = [prompt(256) for _ in range(batch)]
            t65, _ = sync_time(lambda p=prompts, llm=llm: llm.generate(p, max_new_tokens=65, ignore_eos=True))
            res["decode"][batch] = {"tokens_per_s": batch * 64 / (t65 - t1), "step_ms": (t65 - t1) / 64 * 1000}
        out["engine"][kv] = res
        del llm
        torch.cuda.empty_cache()
    if not with_hf:
        out["elapsed_s"] = time.perf_counter() - started
        return out
    hf = Qwen3_5ForCausalLM.from_pretrained(MODEL_4B, dtype=torch.bfloat16).to(DEV).eval()
    # Same warm-up for transformers.
    with torch.no_grad():
        hf(torch.tensor([prompt(8192)], device=DEV), logits_to_keep=1, use_cache=False)
        hf.generate(torch.tensor([prompt(64) for _ in range(8)], device=DEV), max_new_tokens=3, do_sample=False)
    for n in (8192, 32768, 131072):
        if time.perf_counter() - started > budget_s:
            out["hf"][f"prefill_{n}"] = "skipped: time budget"
            continue
        ids = torch.tensor([prompt(n)], device=DEV)
        with torch.no_grad():
            try:
                seconds, _ = sync_time(lambda ids=ids: hf(ids, logits_to_keep=1, use_cache=False))
                out["hf"][f"prefill_{n}"] = {"seconds": seconds, "tokens_per_s": n / seconds}
            except torch.OutOfMemoryError as exc:
                out["hf"][f"prefill_{n}"] = f"OOM: {exc}"[:200]
        torch.cuda.empty_cache()
    for batch in (1, 8, 32):
        if time.perf_counter() - started > budget_s:
            out["hf"][f"decode_{batch}"] = "skipped: time budget"
            continue
        ids = torch.tensor([prompt(256) for _ in range(batch)], device=DEV)
        with torch.no_grad():
            t1, _ = sync_time(lambda ids=ids: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False))
            t65, _ = sync_time(lambda ids=ids: hf.generate(ids, max_new_tokens=65, min_new_tokens=65, do_sample=False))
        out["hf"][f"decode_{batch}"] = {"tokens_per_s": batch * 64 / (t65 - t1)}
    out["geometry"] = {"full_attention_layers": geometry.num_full_attention_layers,
                       "linear_attention_layers": geometry.num_linear_attention_layers}
    out["elapsed_s"] = time.perf_counter() - started
    return out


def _capture_info(report) -> dict:
    """A decode-graph CaptureReport as bench JSON."""
    return {"captured_batch_sizes": list(report.batch_sizes), "capture_seconds": report.seconds,
            "graph_pool_bytes": report.pool_bytes, "graph_device_bytes": report.device_bytes}


def _teacher_forced_decode(path: Path, kv: str, graph_batch: int) -> tuple[torch.Tensor, dict]:
    """Five prompts prefilled, then 12 decode passes of fixed tokens (a sixth prompt prefills in pass 4, a
    mixed eager pass, and decodes from pass 5): logits of every pass, and the capture report."""
    from headroom.engine.config import EngineConfig
    from headroom.engine.runtime.forward_batch import BatchItem
    from headroom.engine.runtime.model_runner import ModelRunner
    from headroom.engine.sequence import Sequence

    runner = ModelRunner(EngineConfig(
        model_path=str(path), device="cuda", dtype="bfloat16", kv_dtype=kv, max_total_tokens=16384, ssm_slots=16,
        context_length=4096, max_running_requests=8, cuda_graph_max_batch=graph_batch,
    ))
    report = runner.capture_decode_graphs()
    rng = random.Random(11)
    vocab = min(runner.model_config.vocab_size, 1000)

    def new(name: str, length: int) -> Sequence:
        seq = Sequence(name, [rng.randrange(vocab) for _ in range(length)])
        seq.kv_slots = runner.kv_allocator.alloc(length) or []
        seq.ssm_slot = runner.ssm_pool.alloc() if runner.ssm_pool else None
        return seq

    def step(seq: Sequence, token: int) -> BatchItem:
        seq.output_token_ids.append(token)
        seq.kv_slots += runner.kv_allocator.alloc(1) or []
        return BatchItem(seq, [token])

    running = [new(f"r{i}", n) for i, n in enumerate((97, 300, 513, 1024, 33))]
    for seq in running:
        runner.forward([BatchItem(seq, seq.prompt_token_ids)])
    late = new("late", 777)
    rows = []
    for t in range(12):
        items = [step(seq, (t * 31 + i * 7) % vocab) for i, seq in enumerate(running)]
        if t == 4:
            items.append(BatchItem(late, late.prompt_token_ids))
            running.append(late)
        rows.append(runner.forward(items)[: len(running)].float())
    torch.cuda.synchronize()
    info = _capture_info(report)
    return torch.cat([r.flatten() for r in rows]), info


def section_graphs() -> dict:
    """Decode CUDA graphs: logits against the eager path (same passes), capture cost, decode tok/s vs eager."""
    from headroom.engine.llm import LLM

    _build_4b()
    tiny = Path("/tmp/headroom-tiny-0")
    if not (tiny / "config.json").exists():
        _save_random(_tiny_config(0), tiny, 0)
    out: dict = {"correctness": {}, "decode": {}}
    for label, path in (("tiny", tiny), ("4b", MODEL_4B)):
        for kv in ("bf16", "fp8"):
            eager, _ = _teacher_forced_decode(path, kv, 0)
            graphed, info = _teacher_forced_decode(path, kv, 8)
            torch.cuda.empty_cache()
            out["correctness"][f"{label}_{kv}"] = {
                "max_abs_logit_diff_graph_vs_eager": float((eager - graphed).abs().max()),
                "logit_scale": float(eager.abs().max()), **info,
            }
    rng = random.Random(5)

    def prompt(n):
        return [rng.randrange(1000, 200000) for _ in range(n)]

    # Graph memory against the number of graphs (the planner's graph reserve).
    for graph_batch in (16,):
        llm = LLM(str(MODEL_4B), device="cuda", dtype="bfloat16", kv_dtype="bf16", max_total_tokens=32768,
                  ssm_slots=80, context_length=4096, max_running_requests=64, cuda_graph_max_batch=graph_batch)
        out["decode"][f"bf16_capture_only_{graph_batch}"] = _capture_info(llm.graph_capture)
        del llm
        torch.cuda.empty_cache()
    for kv, graph_batch in (("bf16", 64), ("bf16", 0), ("fp8", 64)):
        label = f"{kv}_{'eager' if graph_batch == 0 else 'graphs'}"
        llm = LLM(str(MODEL_4B), device="cuda", dtype="bfloat16", kv_dtype=kv, max_total_tokens=65536, ssm_slots=80,
                  chunked_prefill_size=8192, context_length=4096, max_running_requests=64, enable_prefix_cache=False,
                  cuda_graph_max_batch=graph_batch)
        res: dict = _capture_info(llm.graph_capture)
        for batch in (1, 8, 32, 64):
            # Untimed first: the prefill of batch x 256 tokens is a new shape class for Triton.
            warm = [prompt(256) for _ in range(batch)]
            llm.generate(warm, max_new_tokens=1, ignore_eos=True)
            llm.generate(warm, max_new_tokens=3, ignore_eos=True)
            prompts = [prompt(256) for _ in range(batch)]
            t1, _ = sync_time(lambda p=prompts, llm=llm: llm.generate(p, max_new_tokens=1, ignore_eos=True))
            prompts = [prompt(256) for _ in range(batch)]
            t65, _ = sync_time(lambda p=prompts, llm=llm: llm.generate(p, max_new_tokens=65, ignore_eos=True))
            res[batch] = {"tokens_per_s": batch * 64 / (t65 - t1), "step_ms": (t65 - t1) / 64 * 1000}
            if graph_batch:
                res[batch]["graph_replay_ms"] = llm.runner.decode_graphs.replay_seconds(batch) * 1000
        out["decode"][label] = res
        del llm
        torch.cuda.empty_cache()
    return out


def section_profile() -> dict:
    """Where a decode step's GPU time goes: kernels of one eager decode pass (batch 1, 8 and 16, bf16 KV), by name."""
    from headroom.engine.config import EngineConfig
    from headroom.engine.runtime.forward_batch import BatchItem
    from headroom.engine.runtime.model_runner import ModelRunner
    from headroom.engine.sequence import Sequence
    from torch.profiler import ProfilerActivity, profile

    _build_4b()
    runner = ModelRunner(EngineConfig(
        model_path=str(MODEL_4B), device="cuda", dtype="bfloat16", kv_dtype="bf16", max_total_tokens=16384,
        ssm_slots=16, context_length=4096, max_running_requests=16, cuda_graph_max_batch=0,
    ))
    seqs = []
    for i in range(16):
        seq = Sequence(f"p{i}", [1000 + i] * 256)
        seq.kv_slots = runner.kv_allocator.alloc(256 + 16) or []
        seq.ssm_slot = runner.ssm_pool.alloc() if runner.ssm_pool else None
        runner.forward([BatchItem(seq, seq.prompt_token_ids)])
        seqs.append(seq)
    out: dict = {}
    for batch in (1, 8, 16):
        def step(batch=batch):
            for seq in seqs[:batch]:
                seq.output_token_ids.append(7)
            runner.forward([BatchItem(seq, [7]) for seq in seqs[:batch]])
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        out[batch] = kernels_by_name(prof, top=25)
    return out


def kernels_by_name(prof, top: int = 30) -> dict:
    """GPU kernel time of a torch profile, by kernel name (CUDA events only: CPU ops would count them twice)."""
    by_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernel_launches": sum(int(c) for c, _ in by_name.values()),
            "kernel_time_ms": sum(t for _, t in by_name.values()) / 1000,
            "top": [{"name": name[:100], "count": int(c), "ms": t / 1000} for name, (c, t) in ranked]}


def kernels_by_grid(prof, prefix: str) -> dict[str, dict]:
    """GPU time of the kernels whose names start with `prefix`, by launch grid ("x"-joined, from the profile's
    chrome trace, where a kernel event carries its grid): launches and total us. One kernel's launches at several
    shapes come apart this way (a GEMV's grid is its output blocks x splits)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    grids: dict[str, dict] = {}
    for event in events:
        if event.get("cat") == "kernel" and str(event.get("name", "")).startswith(prefix):
            grid = "x".join(str(d) for d in event.get("args", {}).get("grid", []))
            entry = grids.setdefault(grid, {"count": 0, "us": 0.0})
            entry["count"] += 1
            entry["us"] += float(event.get("dur", 0.0))
    return grids


SECTIONS = {"env": section_env, "roofline": section_roofline, "correctness": section_correctness, "perf": section_perf,
            "perf_engine": lambda: section_perf(budget_s=200.0, with_hf=False), "build": _build_4b,
            "graphs": section_graphs, "profile": section_profile}


def main() -> None:
    target = Path(sys.argv[1])
    names = sys.argv[2:] or list(SECTIONS)
    results: dict = {"command": "python3 bench/gpu_engine.py " + " ".join(sys.argv[1:])}
    for name in names:
        started = time.perf_counter()
        try:
            results[name] = SECTIONS[name]()
        except Exception:  # noqa: BLE001 - one failing section must not lose the others
            results[name] = {"error": traceback.format_exc()[-3000:]}
        results[name + "_seconds"] = time.perf_counter() - started
        target.write_text(json.dumps(results, indent=1, default=str))
        print(name, "done in", round(time.perf_counter() - started, 1), "s", flush=True)


if __name__ == "__main__":
    main()
