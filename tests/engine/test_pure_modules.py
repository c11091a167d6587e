"""The scheduler-side modules (allocators, radix cache, cache manager, sequence) never import torch."""

from __future__ import annotations

import subprocess
import sys


def test_cache_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import headroom.engine.kv_cache, headroom.engine.ssm_slots, headroom.engine.radix_cache\n"
        "import headroom.engine.cache_manager, headroom.engine.sequence\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
