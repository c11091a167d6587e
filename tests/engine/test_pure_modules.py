"""The scheduler-side modules (allocators, radix cache, cache manager, sequence) never import torch."""

from __future__ import annotations

import subprocess
import sys


def test_cache_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import headroom.engine.cache.kv_slots, headroom.engine.cache.ssm_slots, headroom.engine.cache.radix\n"
        "import headroom.engine.cache.manager, headroom.engine.sequence\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_planner_does_not_import_torch():
    # The operator and `headroom plan` run the planner where no torch is installed.
    code = "import sys\nimport headroom.engine.plan, headroom.engine.plan.engines.builtin\nprint('torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_planned_dequant_workspace_is_the_engines():
    from headroom.engine.plan.engines.builtin import DEQUANT_BLOCK_TOKENS
    from headroom.kernels.paged_kv import BLOCKWISE_WORKSPACE_TOKENS

    assert DEQUANT_BLOCK_TOKENS == BLOCKWISE_WORKSPACE_TOKENS


def test_tokens_between_equals_a_slice_of_token_ids():
    from headroom.engine.sequence import Sequence

    seq = Sequence("r", [1, 2, 3, 4])
    seq.output_token_ids = [5, 6, 7]
    for start in range(8):
        for end in range(start, 9):
            assert seq.tokens_between(start, end) == seq.token_ids[start:end], (start, end)
