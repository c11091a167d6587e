# Source on the GPU machine from the repo root: makes `headroom.*` importable without installing
# (the package-dir mapping becomes a symlink tree) and adds the carried wheels (.whl/: fla-core,
# fastapi, uvicorn, pydantic) to /tmp/site. Never run Python with the repo root as its first path
# entry: the repo's operator/ folder would shadow the standard library's `operator`.
rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null
mkdir -p /tmp/hr/headroom
for f in cli/*.py; do ln -sf "$PWD/$f" /tmp/hr/headroom/; done
for d in engine kernels client operator; do ln -sfn "$PWD/$d" "/tmp/hr/headroom/$d"; done
export PYTHONPATH=/tmp/hr:/tmp/site
export PYTHONUNBUFFERED=1
