# The two commands: `make demo` and `make test`. Both set up .venv if needed.
# `make test` is the fast tier (about 10 minutes); `make test-full` adds every
# real-cluster suite (CI runs it: .ci/run).
.PHONY: demo test test-full unit smoke integration long lint venv clean bench soak \
	check-install

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

# 10 minutes of load with client aborts, every transfer's KV digest checked;
# fails if a request is lost, a KV block leaks or is quarantined, or a digest
# differs. Writes the soak section of BENCHMARKS.md (about 12 minutes).
soak: $(VENV)
	$(PY) -m kvpush soak --duration-s 600 --verify-kv all --publish

lint: $(VENV)
	.venv/bin/ruff check kvpush kvpush_lab tests
	.venv/bin/ruff format --check kvpush kvpush_lab tests
	.venv/bin/mypy kvpush kvpush_lab

unit: $(VENV)
	$(PY) -m pytest tests/unit -q

# The fast tier's real-cluster checks (tests/integration/conftest.py: SMOKE_CLASSES).
smoke: $(VENV)
	$(PY) -m pytest tests/integration -q -m "integration and smoke"

# Every other real-cluster suite but the long ones.
integration: $(VENV)
	$(PY) -m pytest tests/integration -q -m "integration and not smoke and not long"

# Real-cluster checks too long for CI (tests/integration: marker long), e.g.
# ten prefill restarts under load (about 7 minutes: 6.5 on a quiet machine).
long: $(VENV)
	$(PY) -m pytest tests/integration -q -m "integration and long"

# The install where vLLM users live: the router from the base install alone
# (no torch, NIXL or vLLM), and the dependency set resolving from wheels for
# Python 3.12 and 3.13 (CI runs it beside test-full: network-bound, ~4 min).
check-install:
	./scripts/check-router-install.sh
	./scripts/check-resolve.sh 3.12 3.13

test: lint unit smoke

test-full: test integration

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache
