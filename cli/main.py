"""The `headroom` console script: one sub-command per job, each imported only when asked for.

Importing lazily keeps `headroom operator` and `headroom plan` free of torch.
"""

from __future__ import annotations

import importlib
import sys

# sub-command -> module exposing `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS = {
    "plan": ("headroom.engine.plan.cli", "derive or check engine memory settings"),
    "serve": ("headroom.engine.server.cli", "run the OpenAI-compatible engine"),
    "smoke": ("headroom.client.smoke_cli", "long-prefill smoke test against a running server"),
    "bench": ("headroom.client.bench_cli", "streaming workloads of the field reports"),
    "operator": ("headroom.operator.main", "run the Kubernetes operator"),
    "demo": ("headroom.demo", "plan, serve and exercise the embedded default model"),
}


def _usage() -> str:
    lines = ["usage: headroom <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"headroom: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"headroom {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
