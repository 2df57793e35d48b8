#!/usr/bin/env bash
# One-time (idempotent) set-up: a virtual environment in .venv with everything the
# project, its tests and tools need. torch is pinned and installed FIRST: an unpinned
# torch pulled in by another package would download the newest CUDA build (GBs).
# Re-running is a no-op unless pyproject.toml changed. Progress goes to stderr, one line
# per step ("[i/n] what"), so a first run (minutes: torch is large) is never silent.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION="${DELTASERVE_TORCH_VERSION:-2.13.0}"
PY="${PYTHON:-python3}"
stamp=".venv/.deltaserve-setup"
want="$(sha256sum pyproject.toml | cut -c1-16)-torch${TORCH_VERSION}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
STEPS=5
step() {  # step I WHAT: one progress line on stderr, with the seconds since set-up began
    echo "deltaserve setup [$1/$STEPS] $2 (${SECONDS}s)" >&2
}
if [ -x .venv/bin/python ]; then
    step 1 "reusing the virtual environment .venv"
else
    step 1 "creating the virtual environment .venv with $PY"
    "$PY" -m venv .venv
fi
step 2 "upgrading pip"
.venv/bin/python -m pip install -q --upgrade pip
step 3 "installing torch==${TORCH_VERSION} (the largest download: a few minutes on a first run)"
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"
# the remote extra's mooncake loads the system library libibverbs.so.1 (even over TCP):
# installed with apt-get where it is missing and we may; never fatal (without it the
# remote tier's tests skip, naming the library)
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    step 4 "system library libibverbs.so.1 (for the remote extra's mooncake): present"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step 4 "installing the system library libibverbs1 with apt-get (for the remote extra's mooncake)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; } >/dev/null 2>&1 ||
        echo "deltaserve setup: apt-get could not install libibverbs1: the remote tier's tests will skip" >&2
else
    step 4 "system library libibverbs.so.1 missing (not root, or no apt-get): the remote tier's tests will skip"
fi
step 5 "installing deltaserve in editable mode with its extras test, triton, plot, cluster, remote"
.venv/bin/python -m pip install -q -e ".[test,triton,plot,cluster,remote]"
echo "$want" > "$stamp"
echo "deltaserve: environment ready in .venv (${SECONDS}s)" >&2
