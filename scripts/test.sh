#!/usr/bin/env bash
# The test command (README): make a virtualenv in .venv with the package and its test extra, run pytest.
# Pytest options pass through: `bash scripts/test.sh -m "not slow"` is the quick subset.
# Downloads (the default model's PyPI parts, llama.cpp's converter) are cached under
# ~/.cache/strata-jax (or $STRATA_JAX_CACHE), keyed by sha256.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip's notices (a newer pip, running as root) and setuptools' warnings from the editable build
# ("Editable installation...") say nothing about this project; errors still print
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
echo "scripts/test.sh: installing strata-jax and its test extra into .venv (the first run fetches torch (CPU)," \
     "transformers and the other references: a few minutes; later runs only check them)" >&2
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q --upgrade pip >/dev/null
PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".[test]"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
exec .venv/bin/python -m pytest "$@"
