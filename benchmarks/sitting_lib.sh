# Shared by the GPU sitting scripts (sourced, not run): progress notes, time-limited phases under one
# deadline, the carried wheels, the machine's description, the returned files, the wait loop.
# The sourcing script sets S (its folder on the device), PY, SITTING_S and SCRIPT (its own path, for the
# "send wait" hint) before sourcing.

SITE=${SITE:-/tmp/site}

deadline() { cat "$S/deadline" 2>/dev/null || echo "$SITTING_S"; }
note() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" >> "$S/progress"; }

# phase NAME LIMIT_S CMD...: run CMD with its output in $S/NAME.log, cut at min(LIMIT_S, the deadline);
# skipped with under 30 s left. A row per phase in $S/phases.tsv: name, ok/failed/skipped, rc, seconds.
phase() {
  local name=$1 limit=$2 t0=$SECONDS rc left
  shift 2
  left=$(($(deadline) - SECONDS))
  if (( left < 30 )); then
    note "$name: skipped, ${left} s left before the deadline"
    printf '%s\tskipped\t\t0\n' "$name" >> "$S/phases.tsv"
    return 0
  fi
  (( limit > left )) && limit=$left
  note "$name: start (limit ${limit} s): $*"
  timeout -s TERM -k 40 "$limit" "$@" > "$S/$name.log" 2>&1  # the whole process group: llama-bench too
  rc=$?
  note "$name: rc $rc after $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (cut at its limit)')"
  printf '%s\t%s\t%s\t%s\n' "$name" "$([ $rc = 0 ] && echo ok || echo failed)" "$rc" "$((SECONDS - t0))" >> "$S/phases.tsv"
  return $rc
}

install_wheels() {  # .whl (carried, ignored by git) into $SITE; NO_WHEELS=1 skips it (a local dry run)
  [ -n "${NO_WHEELS:-}" ] && return 0
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    >> "$S/progress" 2>&1 || { note "the wheels did not install (carry .whl): stop"; return 1; }
}

machine_info() {  # appended to progress: the GPU, cores, memory, disk, versions and where each import came from
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1
    echo "cores $(nproc)"; free -g | head -2; df -h /tmp | tail -1
    PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} "$PY" -c "
import importlib, sys
print('python', sys.version.split()[0])
for m in ('jax', 'jaxlib', 'strata_jax', 'gguf', 'flax.struct', 'starlette', 'uvicorn', 'numpy', 'tokenizers', 'jinja2'):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, '__version__', '?'), mod.__file__)
    except Exception as e:
        print(m, 'MISSING', e)
import jax; print(jax.devices())
"
  } >> "$S/progress" 2>&1
}

snapshot() {  # snapshot DIR: the working tree as sent; a later call re-sends it, which must not change running code
  rm -rf "$1" && mkdir -p "$1"
  tar --exclude=./.git --exclude=./.sitting --exclude=./.whl --exclude=./.venv --exclude='*/__pycache__' -cf - . \
    | tar -xf - -C "$1"
}

# collect: progress, phases.tsv, results-*.json (bench rows) and data-*.json (other JSON) to $OUT; the logs'
# tails as one archive (a call returns at most 8 files)
collect() {
  [ -n "${OUT:-}" ] || return 0
  cp -f "$S/progress" "$S/phases.tsv" "$S"/results-*.json "$S"/data-*.json "$OUT"/ 2>/dev/null
  rm -rf "$S/tails" && mkdir -p "$S/tails"
  for f in "$S"/*.log; do [ -f "$f" ] && tail -n 400 "$f" > "$S/tails/$(basename "$f").tail"; done
  tar -czf "$OUT/logs.tar.gz" -C "$S" tails
  return 0
}

# wait_for [LIMIT_S [DEADLINE_S]]: until the pipeline notes "pipeline: done" or LIMIT_S pass; then collect
wait_for() {
  local limit=${1:-560} t0=$SECONDS f
  if [ -n "${2:-}" ]; then echo "$2" > "$S/deadline"; note "deadline moved to ${2} s of the pipeline"; fi
  while (( SECONDS - t0 < limit )) && ! grep -q "pipeline: done" "$S/progress" 2>/dev/null; do sleep 5; done
  collect
  tail -n 40 "$S/progress"
  [ -f "$S/phases.tsv" ] && { column -t -s $'\t' "$S/phases.tsv" 2>/dev/null || cat "$S/phases.tsv"; }
  for f in "$S"/results-*.json; do
    [ -f "$f" ] && "$PY" -c "import json, sys; print(sys.argv[1], len(json.load(open(sys.argv[1]))['rows']), 'rows')" "$f"
  done
  if grep -q "pipeline: done" "$S/progress"; then
    echo "SITTING DONE: the results are in \$OUT; give the machine back"
  else
    echo "STILL RUNNING: send 'bash $SCRIPT wait N' now (the machine goes back 30 s after a call)"
  fi
}
