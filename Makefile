# Two entry points for a fresh machine: `make demo` and `make test`. Both install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# The repo root holds a folder named operator/ (import name headroom.operator): a Python started here with
# `-m` or `-c` would put the root first on sys.path and shadow the standard library's `operator`. Tools run
# through their own scripts, and PYTHONSAFEPATH (3.11+) keeps the root off sys.path everywhere else.
export PYTHONSAFEPATH := 1

.PHONY: install demo demo-engine test lint typecheck imports pytest peers bench-plan bench-peers sync-crds clean

$(PY):
	cd / && $(PYTHON) -m venv $(abspath $(VENV))
	$(PIP) install -q --upgrade pip

# torch first, from the CPU build on local disk, so the project's range admits it and no CUDA build is fetched.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The pinned SGLang and vLLM releases (tests/peers/requirements.txt) without their heavy dependencies; the
# peer tests parse every rendered flag list with them. Cached: re-fetched only when the pins change.
PEERS := .cache/peers
PEERS_STAMP := $(PEERS)/.installed
$(PEERS_STAMP): $(STAMP) tests/peers/requirements.txt tests/peers/install.py
	$(PY) tests/peers/install.py $(PIP) $(PEERS)
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)

# The operator's story: API emulator, `headroom operator`, the node agent and the engine (tests/e2e/demo.py).
demo: $(STAMP)
	$(VENV)/bin/headroom demo

# The engine alone: plan, serve the embedded model, long and short streams, metrics.
demo-engine: $(STAMP)
	$(VENV)/bin/headroom demo --engine-only

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy engine operator

# import-linter cannot see through the editable install's path hook, so it reads a plain,
# freshly built copy of the package tree.
imports: $(STAMP)
	rm -rf .cache/importlint
	$(PIP) install -q --no-deps --no-compile --target .cache/importlint . >/dev/null
	PYTHONPATH=.cache/importlint $(VENV)/bin/lint-imports

# pytest exits 5 when it collects nothing; make treats that as a failure, as it should.
pytest: $(STAMP) $(PEERS_STAMP)
	$(VENV)/bin/pytest

test: lint typecheck imports pytest

bench-plan: $(STAMP)
	$(PY) bench/plan_speed.py

bench-peers: $(PEERS_STAMP)
	$(PY) bench/peer_grid.py

# Helm cannot read outside the chart, so the chart carries a byte-identical copy of crds/ (a test checks it).
sync-crds:
	mkdir -p charts/headroom/files/crds
	rm -f charts/headroom/files/crds/*.yaml
	cp crds/*.yaml charts/headroom/files/crds/

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
