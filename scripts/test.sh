#!/usr/bin/env bash
# The test command (README): make a virtualenv in .venv with the package and its test extra, run pytest.
# Downloads (the default model's PyPI parts, llama.cpp's converter) are cached under
# ~/.cache/strata-jax (or $STRATA_JAX_CACHE), keyed by sha256.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec .venv/bin/python -m pytest "$@"
