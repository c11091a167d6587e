"""The peer grid: every `headroom plan` of presets x GPUs x KV dtypes x tp x sessions for SGLang 0.5.23 and
vLLM 0.33.0, each plan parsed by the engine's own parser and sized by its rules (tests/peers/).

    make bench-peers     # .venv/bin/python bench/peer_grid.py; writes bench/results/peer_grid.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.peers import conftest  # noqa: E402  (puts the pinned engines on sys.path)
from tests.peers.grid import grid  # noqa: E402
from tests.peers.test_sglang_peer import check_sglang_plan  # noqa: E402
from tests.peers.test_vllm_peer import check_vllm_plan  # noqa: E402


def _run(engine: str, check, parser) -> dict:
    outcomes: Counter[str] = Counter()
    failures: dict[str, list[str]] = {"parse": [], "sizing": []}
    for case in grid(engine):
        try:
            outcomes[check(parser, case)] += 1
        except AssertionError as exc:
            failures["sizing"].append(f"{case}: {exc}")
        except (SystemExit, Exception) as exc:
            failures["parse"].append(f"{case}: {type(exc).__name__} {exc}")
    return {
        "cases": sum(outcomes.values()) + len(failures["parse"]) + len(failures["sizing"]),
        "plans": outcomes.pop("ok", 0),
        "refusals_by_reason": dict(sorted((k.removeprefix("refused: "), v) for k, v in outcomes.items())),
        "parse_failures": len(failures["parse"]),
        "sizing_violations": len(failures["sizing"]),
        "failures": failures["parse"][:5] + failures["sizing"][:5],
    }


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__)
    cli.add_argument("--out", default=str(REPO / "bench" / "results" / "peer_grid.json"))
    out = cli.parse_args().out
    start = time.perf_counter()
    sglang = conftest.sglang_parser.__wrapped__()
    vllm = conftest.vllm_serve.__wrapped__()
    result = {
        "command": "make bench-peers (.venv/bin/python bench/peer_grid.py)",
        "profiles": {"sglang": "0.5.23 (PyPI)", "vllm": "0.33.0 (PyPI)"},
        "grid": "presets x GPU 12/24/80/141 GiB x KV bf16/fp8/int8/int4/int2 x tp 1/2 x (0 | 4 x 32768 sessions)",
        "sglang": _run("sglang", check_sglang_plan, sglang),
        "vllm": _run("vllm", check_vllm_plan, vllm),
    }
    result["seconds"] = round(time.perf_counter() - start, 1)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k in ("sglang", "vllm", "seconds")}, indent=2))


if __name__ == "__main__":
    main()
