#!/usr/bin/env bash
# Run here (not on the GPU machine, which reaches no package index) before a device session: the wheels the H200
# image lacks, for its Python 3.12, into .whl/ (git-ignored), which each `run` carries (carry [".whl"]) and
# bench/device_env.sh installs into /tmp/site. Pinned to what the device's results so far were measured with.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    fla-core==0.6.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 uvicorn==0.54.0 opentelemetry-api==1.45.2 annotated-doc==0.0.7
ls .whl
