# Sourced by the short one-call GPU checks (kernel_check.sh, profile_check.sh): $OUT, $PY, the carried
# wheels (.whl) installed into /tmp/site unless NO_WHEELS is set, and the environment they share.
OUT=${OUT:-/tmp/check}
mkdir -p "$OUT"
PY=${PY:-python3}
if [ -z "${NO_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export STRATA_JAX_CACHE=/tmp/sjk PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
