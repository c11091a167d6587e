"""Which Triton kernel variants of the attention layer a server's requests would compile after /ready: the warm-up's
pass shapes (engine/server/factory.py's prompt lengths, its concurrent batch, its timing passes, decode steps of 1
to 16 sequences) against lone prompts of 1 to MAX_PROMPT tokens, random mixed batches and decode steps of other
sizes, at the 4B model's heads over each KV format, through Triton's real JIT for sm_90 on this machine (no GPU:
tests/engine/layers/attention_variants.py). Every request shape here a variant the warm-up's shapes did not meet is
a compile inside a request on the GPU (session 13's int2 server: two after /ready).

    PYTHONSAFEPATH=1 .venv/bin/python bench/variant_coverage.py OUT.json [KV_DTYPE ...]   (default: int2 bf16)

The warm-up's first phase (its long prompt beside a decode and short prompts, and a KIVI server's extra lengths)
is not modelled: it only adds variants to the warm-up's side, so what this finds is an upper bound."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_PROMPT = 1299
MIXED_BATCHES = 150


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shapes() -> tuple[dict[str, list[list[int]]], dict[str, bool]]:
    from headroom.engine.server.factory import TIMING_PASS_TOKENS, WARMUP_ALONE_PROMPTS, WARMUP_CONCURRENT

    count, tokens = WARMUP_CONCURRENT
    rng = random.Random(0)
    groups = {
        "warm_up": [[n] for n in WARMUP_ALONE_PROMPTS] + [[tokens] * count] + [[TIMING_PASS_TOKENS], [8192]],
        "warm_up_decode": [[101] * b for b in range(1, 17)],
        "lone_prompts": [[n] for n in range(1, MAX_PROMPT + 1)],
        "mixed_batches": [[rng.randint(1, 400) for _ in range(rng.randint(2, 6))] for _ in range(MIXED_BATCHES)],
        "decode_steps": [[rng.randint(2, 3000) for _ in range(b)] for b in (1, 3, 8, 16, 17, 24)],
    }
    return groups, {"warm_up_decode": True, "decode_steps": True}


def main() -> None:
    out_path = Path(sys.argv[1])
    kv_dtypes = sys.argv[2:] or ["int2", "bf16"]
    helper = _load(ROOT / "tests" / "engine" / "layers" / "attention_variants.py", "attention_variants")
    groups, decode = shapes()
    result: dict = {"command": "python3 bench/variant_coverage.py " + " ".join(sys.argv[1:]), "kv": {}}
    for kv in kv_dtypes:
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            found = helper.variants_outside(["warm_up", "warm_up_decode"], groups, "auto" if kv == "bf16" else kv,
                                            Path(tmp), decode)
        result["kv"][kv] = {"variants_outside_the_warm_up": found, "seconds": time.perf_counter() - started}
        print(kv, {name: len(v) for name, v in found.items()}, f"{time.perf_counter() - started:.0f} s", flush=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
