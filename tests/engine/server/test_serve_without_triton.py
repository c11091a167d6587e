"""`headroom serve --device cpu` in an environment with torch but without Triton: warm-up passes, /ready
turns true and a completion is answered. Triton (and fla-core, which needs it) are hidden from the import
system before anything of headroom is imported, as if they were not installed."""

from __future__ import annotations

import sys

import httpx

from tests.client.engine_process import EngineProcess

HIDE_TRITON_THEN_SERVE = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "fla"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoTriton())
from headroom.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_cpu_server_warms_up_and_answers_without_triton(tmp_path):
    engine = EngineProcess(["--context-length", "1024", "--max-new-tokens", "16"], tmp_path / "cache",
                           tmp_path / "serve.log")
    # The same flags as `headroom serve`, through the hiding prelude instead of `-m headroom.main`.
    engine.command = [sys.executable, "-c", HIDE_TRITON_THEN_SERVE, *engine.command[3:]]
    engine.env["PYTHONSAFEPATH"] = "1"
    with engine as url:
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1
    assert "No module named 'triton'" not in (tmp_path / "serve.log").read_text()


def test_the_hiding_prelude_really_hides_triton(tmp_path):
    # Guards the test above against passing vacuously: with the prelude, importing triton fails.
    import subprocess

    probe = HIDE_TRITON_THEN_SERVE.split("from headroom.main")[0] + (
        "try:\n    import triton\nexcept ModuleNotFoundError:\n    print('hidden')\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "hidden"
