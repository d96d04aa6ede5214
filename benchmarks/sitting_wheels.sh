#!/usr/bin/env bash
# The wheels a GPU sitting carries (.whl, ignored by git): what the device's image lacks (KINDS.md lists
# what it has; benchmarks/engine_sitting.md says why each is here), for its Python 3.12 on x86_64.
#   bash benchmarks/sitting_wheels.sh      then carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
mkdir -p .whl
"$PY" -m pip download -q --no-deps -d .whl --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any --only-binary=:all: \
  gguf==0.19.0 flax==0.12.8 msgpack rich pygments PyYAML typing_extensions absl-py etils filelock \
  starlette==1.10.0 uvicorn==0.54.0 anyio==4.16.0
ls .whl && du -sh .whl
