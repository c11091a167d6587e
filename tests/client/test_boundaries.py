"""The operator imports headroom.client.smoke, and its image has no torch: importing the client must not load it."""

import subprocess
import sys

CLIENT_MODULES = ["smoke", "smoke_cli", "bench", "bench_cli", "report", "plots", "telemetry", "workloads", "prompts"]


def test_client_modules_load_neither_torch_nor_engine_internals():
    imports = "; ".join(f"import headroom.client.{name}" for name in CLIENT_MODULES)
    probe = (
        f"import sys; {imports}; import headroom.client.smoke_cli as cli; cli.load_plan_targets; "
        "from headroom.engine.plan import Plan; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton') "
        "or m.startswith(('headroom.kernels', 'headroom.operator')) "
        "or (m.startswith('headroom.engine.') and not m.startswith('headroom.engine.plan'))); print(bad)"
    )
    output = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "[]"
