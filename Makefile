# The two commands: `make demo` and `make test`. Both set up .venv if needed.
# `make test` is the fast tier (about 10 minutes); `make test-full` adds every
# real-cluster suite (CI runs it: .ci/run).
.PHONY: demo test test-full unit smoke integration lint venv clean bench soak

VENV := .venv/.kvpush-installed
PY := .venv/bin/python

$(VENV): pyproject.toml scripts/setup-venv.sh
	./scripts/setup-venv.sh

venv: $(VENV)

demo: $(VENV)
	$(PY) -m kvpush.demo

# Reproduces BENCHMARKS.md and docs/bench/*.png: 3 interleaved rounds of the
# four configurations, each round on fresh clusters (about 25 minutes: 23.5 min on 2026-12-01).
bench: $(VENV)
	$(PY) -m kvpush bench --publish

# 10 minutes of load with client aborts; fails if a request is lost or a KV
# block leaks. Writes the soak section of BENCHMARKS.md (about 12 minutes).
soak: $(VENV)
	$(PY) -m kvpush soak --duration-s 600 --publish

lint: $(VENV)
	.venv/bin/ruff check kvpush kvpush_lab tests
	.venv/bin/ruff format --check kvpush kvpush_lab tests
	.venv/bin/mypy kvpush kvpush_lab

unit: $(VENV)
	$(PY) -m pytest tests/unit -q

# The fast tier's real-cluster checks (tests/integration/conftest.py: SMOKE_CLASSES).
smoke: $(VENV)
	$(PY) -m pytest tests/integration -q -m "integration and smoke"

# Every other real-cluster suite.
integration: $(VENV)
	$(PY) -m pytest tests/integration -q -m "integration and not smoke"

test: lint unit smoke

test-full: test integration

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache
