#!/usr/bin/env bash
# The router on kvpush's base install alone: `pip install .` (no extras) into
# a fresh venv, then prove that torch, vLLM and NIXL are absent, that the CLI
# answers `--help` in under a second, and that `kvpush router` starts and
# serves /health and /metrics. About 40 s (pip resolves and installs aiohttp,
# msgspec, numpy, prometheus-client and rich; nothing large).
# Usage: scripts/check-router-install.sh   (PYTHON=python3.12 to pick another)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

work=$(mktemp -d)
router_pid=""
cleanup() {
    if [ -n "$router_pid" ]; then kill "$router_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

# Install from a copy: pip builds in the source tree, and the checkout's
# own build/ must stay as it is.
"$PY" - "$work/src" <<'EOF'
import shutil, sys
shutil.copytree(".", sys.argv[1], ignore=shutil.ignore_patterns(
    ".git", ".venv", ".kvpush", "build", "bench-results", "*.egg-info",
    "__pycache__", ".*_cache"))
EOF
"$PY" -m venv "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install --quiet --disable-pip-version-check "$work/src"

# Nothing of the connector's stack came with it.
"$vpy" - <<'EOF'
import importlib.util
present = [m for m in ("torch", "vllm", "nixl", "nixl_cu12", "nixl_cu13",
                     "transformers")
           if importlib.util.find_spec(m) is not None]
assert not present, f"the base install brought {present}"
import kvpush.router.app  # noqa: F401
EOF

"$work/venv/bin/kvpush" router --help >/dev/null
"$vpy" - "$work/venv/bin/kvpush" <<'EOF'
import subprocess, sys, time
start = time.monotonic()
subprocess.run([sys.argv[1], "--help"], check=True, stdout=subprocess.DEVNULL)
took = time.monotonic() - start
assert took < 1.0, f"kvpush --help took {took:.2f} s"
print(f"kvpush --help: {took:.2f} s")
EOF

# A topology whose instances are not running: the router still starts,
# is live (/health) and says it is not ready (/ready).
port=$("$vpy" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$work/topology.json" <<'EOF'
{"mode": "kvpush", "backends": [
  {"role": "prefill", "url": "http://127.0.0.1:9", "engine_id": "prefill0",
   "side_channel_host": "127.0.0.1", "side_channel_port": 5600},
  {"role": "decode", "url": "http://127.0.0.1:9", "engine_id": "decode0"}]}
EOF
"$work/venv/bin/kvpush" router --topology "$work/topology.json" \
    --host 127.0.0.1 --port "$port" >"$work/router.log" 2>&1 &
router_pid=$!
"$vpy" - "$port" <<'EOF'
import sys, time, urllib.error, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 20
while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            assert r.status == 200
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
    assert b"kvpush_router" in r.read()
try:
    urllib.request.urlopen(base + "/ready", timeout=5)
    raise AssertionError("/ready said ready with no instance up")
except urllib.error.HTTPError as e:
    assert e.code == 503, e.code
print("router on the base install: /health 200, /ready 503, /metrics ok")
EOF
echo "check-router-install: ok (no torch, vLLM or NIXL installed)"
