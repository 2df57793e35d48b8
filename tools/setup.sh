#!/usr/bin/env bash
# One-time (idempotent) set-up: a virtual environment in .venv with everything the
# project, its tests and tools need. torch is pinned and installed FIRST: an unpinned
# torch pulled in by another package would download the newest CUDA build (GBs).
# Re-running is a no-op unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${DELTASERVE_TORCH_VERSION:-2.13.0}"
PY="${PYTHON:-python3}"
stamp=".venv/.deltaserve-setup"
want="$(sha256sum pyproject.toml | cut -c1-16)-torch${TORCH_VERSION}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"
.venv/bin/python -m pip install -q -e ".[test,triton,plot,cluster]"
echo "$want" > "$stamp"
echo "deltaserve: environment ready in .venv" >&2
