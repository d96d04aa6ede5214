# Shared by the GPU sitting scripts (sourced, not run): progress notes, time-limited phases under one
# deadline, the carried wheels, the machine's description, llama.cpp's build, the returned files, the
# wait loop, the start and the command line.
# A script sources it from the repo root as `source benchmarks/sitting_lib.sh DIR DEADLINE_S` (its folder
# on the device and its pipeline's deadline, unless SITTING_DIR / SITTING_S say otherwise) and defines
# pipeline() and may define prepare() (its checks, machine_info and snapshots, run by sitting_start after
# the wheels; nonzero stops the sitting; by default machine_info and a snapshot). Settings it may change
# after sourcing: WHEELS, RUN_TREE, RETURNED, TAILED, USAGE, RESULTS_ARCHIVE (1: results-*.json go back
# as results.tar.gz); it may define collect_more() (more files to $OUT).

S=${SITTING_DIR:-$1}
SITTING_S=${SITTING_S:-$2}
PY=${PY:-python3}
SCRIPT=benchmarks/$(basename "$0")  # for the "send wait" hint and the pipeline's launch
SITE=${SITE:-/tmp/site}
WHEELS=.whl            # the carried wheels' folder, relative to the repo
RUN_TREE=repo          # the pipeline runs from $S/$RUN_TREE (prepare's snapshot)
RETURNED="progress phases.tsv results-*.json data-*.json"  # copied from $S to $OUT by collect
TAILED="*.log"         # files of $S whose tails travel in logs.tar.gz
USAGE="start|wait"

# "$PY" "${WRITE[@]}" SHAPE: the bench shape's synthetic GGUF, written once into the cache (bench then
# takes the same file, under its lock)
WRITE=(-c "import logging, sys; logging.basicConfig(level=logging.INFO)
from strata_jax.bench.shapes import synthetic_model_path; print(synthetic_model_path(sys.argv[1]))")

deadline() { cat "$S/deadline" 2>/dev/null || echo "$SITTING_S"; }
note() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" >> "$S/progress"; }

# phase NAME LIMIT_S CMD...: run CMD with its output in $S/NAME.log, cut at min(LIMIT_S, the deadline);
# skipped with under 30 s left. A row per phase in $S/phases.tsv: name, ok/failed/skipped, rc, seconds.
# CMD is a command, not a shell function: a wrapper such as `env -C DIR VAR=...` sets its folder and
# environment.
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

# iq_kernels: the fused IQ kernels at BSEED size, each right after its gather + dequantize + einsum
# baseline, one launch config -> $S/data-iq.json (IQ_TYPES, default the seed's four); SKIP_IQ=1 skips it
iq_kernels() {
  [ -n "${SKIP_IQ:-}" ] && return 0
  phase iq-kernels 240 env OUT="$S" "$PY" benchmarks/decode_profile.py --parts kernels \
    --types "${IQ_TYPES:-IQ3_S,IQ3_XXS,IQ2_XS,IQ1_M}" --sizes bseed --no-dense --sweep 16x2
  [ -f "$S/decode_profile.json" ] && mv -f "$S/decode_profile.json" "$S/data-iq.json"
  return 0
}

install_wheels() {  # $WHEELS/*.whl (carried, ignored by git) into $SITE; NO_WHEELS=1 skips it (a local dry run)
  [ -n "${NO_WHEELS:-}" ] && return 0
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    >> "$S/progress" 2>&1 || { note "the wheels did not install (carry $WHEELS): stop"; return 1; }
}

# machine_info [WRAPPER...]: appended to progress: the GPU, cores, memory, disk, versions and where each
# import came from (the imports under WRAPPER, e.g. `env -C TREE PYTHONPATH=...`, for a tree of its own)
machine_info() {
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv 2>&1
    echo "cores $(nproc)"; free -g | head -2; df -h /tmp | tail -1
    PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} "$@" "$PY" -c "
import importlib, sys
print('python', sys.version.split()[0])
for m in ('jax', 'jaxlib', 'strata_jax', 'gguf', 'flax.struct', 'httpx', 'starlette', 'uvicorn', 'numpy', 'tokenizers', 'jinja2'):
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
  tar --exclude=./.git --exclude=./.sitting --exclude=./.whl --exclude=./.venv --exclude='./.gpu/qwen*' \
    --exclude='*/__pycache__' -cf - . | tar -xf - -C "$1"
}

# build_llama JOBS: llama-bench from the carried .gpu/llama-src.tar.xz (LLAMA_BIN: an existing one, no
# build), then $LLAMA_LINK points at it, or at /bin/false if the build failed: the benches that wait for
# the link then record failed llama.cpp rows at once
build_llama() {
  if [ -n "${LLAMA_BIN:-}" ]; then
    ln -sf "$LLAMA_BIN" "$LLAMA_LINK"
  elif phase build 900 "$PY" benchmarks/llamacpp.py build --src .gpu/llama-src.tar.xz --dir /tmp/llama -j "$1"; then
    ln -sf /tmp/llama/build/bin/llama-bench "$LLAMA_LINK"
  else
    ln -sf /bin/false "$LLAMA_LINK"
  fi
  note "llama-bench: $(readlink "$LLAMA_LINK")"
}

# collect: $RETURNED to $OUT, then collect_more if the script has one; the tails of $TAILED as one archive
# (a call returns at most 8 files)
collect() {
  [ -n "${OUT:-}" ] || return 0
  local f
  (cd "$S" && cp -f $RETURNED "$OUT"/ 2>/dev/null)
  if [ -n "${RESULTS_ARCHIVE:-}" ]; then  # many bench results travel as one file
    (cd "$S" && ls results-*.json > /dev/null 2>&1 && tar -czf "$OUT/results.tar.gz" results-*.json)
  fi
  declare -F collect_more > /dev/null && collect_more
  rm -rf "$S/tails" && mkdir -p "$S/tails"
  for f in $(cd "$S" && echo $TAILED); do [ -f "$S/$f" ] && tail -n 400 "$S/$f" > "$S/tails/$f.tail"; done
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

prepare() {  # the default; a script redefines it after sourcing this file
  machine_info
  snapshot "$S/$RUN_TREE"
}

# sitting_start WAIT_S: the wheels, prepare, then the pipeline in its own session from $S/$RUN_TREE (it
# outlives the call), then wait_for; a second start only waits
sitting_start() {
  mkdir -p "$S"
  if [ -f "$S/progress" ]; then
    echo "already started"
    wait_for "$1"
    return
  fi
  note "start"
  install_wheels && prepare || { collect; return 1; }
  (cd "$S/$RUN_TREE" && setsid nohup bash "$SCRIPT" pipeline > "$S/pipeline.log" 2>&1 < /dev/null &)
  wait_for "$1"
}

sitting_main() {  # the commands every sitting script takes: sitting_main "$@"
  case "${1:-}" in
    start) sitting_start "${2:-540}" ;;
    wait) wait_for "${2:-560}" "${3:-}" ;;
    pipeline) pipeline ;;
    *) echo "usage: $0 $USAGE [SECONDS [DEADLINE_S]]" >&2; exit 2 ;;
  esac
}
