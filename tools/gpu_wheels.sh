#!/usr/bin/env bash
# Fetches into .whl/ (git-ignored) the wheels of what deltaserve needs and the GPU machine's image
# lacks (/work/.library/device/KINDS.md lists what it has: torch, triton, transformers, numpy,
# safetensors, tokenizers, jinja2, uvloop, xxhash, httpx, prometheus-client, pytest, hypothesis,
# anyio, h11, click, pyyaml, tqdm ...), for its Python 3.12 on manylinux x86-64. Versions are the
# ones this repository's CI venv runs, so a device run tests what CI tests. No registry is reachable
# from the device: tools/gpu_check.py installs these from .whl/ there (docs/gpu.md).
#   tools/gpu_wheels.sh            # then: carry .whl to the device run
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
PY=${PYTHON:-python3}
# name==version: pyproject's dependencies missing from the image, then what they need that is
# missing too (xgrammar: pydantic and apache-tvm-ffi; pydantic: its core, annotated-types,
# typing-inspection and a typing-extensions >= 4.16); jsonschema
# and its referencing, specifications and rpds-py for the grammar tests (attrs is in the image)
WHEELS=(
  msgspec==0.22.0
  structlog==26.1.0
  starlette==1.10.0
  uvicorn==0.54.0
  httptools==0.9.0
  pyzmq==27.3.0
  xgrammar==0.2.8
  apache-tvm-ffi==0.1.15.post2
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  sniffio==1.3.1
  pytest-asyncio==1.5.0
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1
)
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" "${WHEELS[@]}"
# one version of each: two of a name stop the whole install on the device
dupes=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z' 'a-z' | sort | uniq -d)
if [ -n "$dupes" ]; then
  echo "more than one version in $DEST of: $dupes (delete the old ones)" >&2
  exit 1
fi
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "$(ls "$DEST"/*.whl | wc -l) wheels in $DEST: $((bytes / 1024 / 1024)) MiB ($bytes bytes; the device run carries at most 64 MiB in all)"
if [ "$bytes" -gt $((60 * 1024 * 1024)) ]; then
  echo "over 60 MiB: the working tree would not travel" >&2
  exit 1
fi
