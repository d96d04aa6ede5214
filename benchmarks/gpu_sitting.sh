#!/usr/bin/env bash
# The issue-5 GPU sitting in one script; benchmarks/gpu_sitting.md is the plan of the device calls.
#
#   bash benchmarks/gpu_sitting.sh start [WAIT_S]  install the carried gguf wheel, record the machine,
#        snapshot the repo, launch the pipeline in its own session (it outlives the call), then wait
#   bash benchmarks/gpu_sitting.sh wait [WAIT_S [DEADLINE_S]]   wait up to WAIT_S s (default 560) or until
#        the pipeline ends; then copy the results and the logs' tails to $OUT: every call returns what exists
#        so far. DEADLINE_S replaces SITTING_S for the phases not yet started (the machine's start time,
#        hence the device time left, is known only after the first call)
#   bash benchmarks/gpu_sitting.sh pipeline        the phases, in order (start runs it; not by hand)
#
# Pipeline: llama.cpp builds in the background while the B30 bench writes its GGUF and measures (its
# llama.cpp rows come after ours, once the build is there); the B30 file is deleted (BSEED's 43 GB and
# B30's 17 GB do not fit the 64 GiB disk together); the BSEED bench writes its file and measures under
# a 32 GiB cap. Each bench is cut at its share of the sitting (rows are saved as they come).
#
# Knobs (environment): SITTING_S (pipeline seconds, default 1500), B30_S (B30's share, default 600),
# SKIP_B30=1 (BSEED only: a second attempt), TAIL / TAIL_MIN_S (a last BSEED bench if time is left), B30_PREFILL / BSEED_PREFILL ("--prefill-len N ..."),
# LLAMA_BIN (an existing llama-bench: no build), B30_SHAPE / BSEED_SHAPE and SITTING_DIR (a local dry
# run: B30_SHAPE=tiny BSEED_SHAPE=tiny LLAMA_BIN=... SITTING_DIR=/tmp/dry OUT=/tmp/dry/out PY=python).
set -u
cd "$(dirname "$0")/.."
S=${SITTING_DIR:-/tmp/sitting}
export STRATA_JAX_CACHE=${STRATA_JAX_CACHE:-/tmp/sjcache} PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
LLAMA_DIR=/tmp/llama
LLAMA_LINK=$S/llama-bench  # made once the build is done (/bin/false if it failed): the benches wait for it
SITTING_S=${SITTING_S:-1500}
B30_S=${B30_S:-600}
COMMON=(--tokens 128 --prompt-len 32 --routing model --routing realistic --peer-llama-bench "$LLAMA_LINK"
        --peer-wait 420 --peer-reps 2)
# arrays under other names: bash stops exporting a variable once it becomes an array. B30 times only
# the 512-token prompt (llama.cpp's pp512): every other length costs compilations the sitting lacks
read -r -a B30_PREFILL_ARGS <<< "${B30_PREFILL:---prefill-len 512}"
read -r -a BSEED_PREFILL_ARGS <<< "${BSEED_PREFILL:---prefill-len 512 --prefill-len 4096}"

# the deadline a later call may move (`wait N DEADLINE_S`, once the machine's start time is known)
deadline() { cat "$S/deadline" 2>/dev/null || echo "$SITTING_S"; }

note() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*" >> "$S/progress"; }

phase() {  # phase NAME LIMIT_S CMD...: run with a time limit, log to $S/NAME.log, note rc and duration
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  note "$name: start (limit ${limit} s): $*"
  timeout -s TERM "$limit" "$@" > "$S/$name.log" 2>&1  # signals the whole process group: llama-bench too
  rc=$?
  note "$name: rc $rc after $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (cut at its limit)')"
  return $rc
}

build() {
  if [ -n "${LLAMA_BIN:-}" ]; then
    ln -sf "$LLAMA_BIN" "$LLAMA_LINK"
  elif phase build 900 "$PY" benchmarks/llamacpp.py build --src .gpu/llama-src.tar.xz --dir "$LLAMA_DIR" -j 10; then
    ln -sf "$LLAMA_DIR/build/bin/llama-bench" "$LLAMA_LINK"
  else
    ln -sf /bin/false "$LLAMA_LINK"  # the benches then record failed llama.cpp rows at once, not wait
  fi
  note "llama-bench: $(readlink "$LLAMA_LINK")"
}

pipeline() {
  note "pipeline: start in $PWD"
  build &
  if [ -z "${SKIP_B30:-}" ]; then
    phase bench-b30 "$B30_S" "$PY" -m strata_jax.cli bench --shape "${B30_SHAPE:-b30}" "${COMMON[@]}" \
      "${B30_PREFILL_ARGS[@]}" --cache-fraction 0.5 --out "$S/results-b30.json"
    # Opt-in A/B of XLA flags on the same file (XLA_VARIANT="--flag=value ..."), e.g. the command-buffer
    # update mode SKIP_TEMP (stable VMM addresses for the CUDA graph's temporaries; it crashed JAX 0.11.2
    # at start, 2026-12-01). An XLA that rejects the flags exits at once and the row is simply missing.
    [ -z "${XLA_VARIANT:-}" ] || phase bench-b30-skiptemp 150 env XLA_FLAGS="$XLA_VARIANT" \
      "$PY" -m strata_jax.cli bench --shape "${B30_SHAPE:-b30}" --resident-only --tokens 128 --prompt-len 32 \
      --routing model --out "$S/results-b30-skiptemp.json"
    rm -f "$STRATA_JAX_CACHE/synthetic/${B30_SHAPE:-b30}-"*
    note "B30 GGUF deleted; disk: $(df -h "$STRATA_JAX_CACHE" | tail -1)"
  fi
  local left=$(($(deadline) - SECONDS))
  phase bench-bseed $((left > 60 ? left : 60)) "$PY" -m strata_jax.cli bench --shape "${BSEED_SHAPE:-bseed}" \
    "${COMMON[@]}" "${BSEED_PREFILL_ARGS[@]}" --vram-budget 32GiB --no-resident --out "$S/results-bseed.json"
  # Last, and only if the deadline leaves TAIL_MIN_S (default 150): TAIL="bench arguments" on the BSEED
  # file, still on disk, e.g. TAIL="--decode-chunk 16 --routing model --vram-budget 32GiB --no-resident"
  left=$(($(deadline) - SECONDS))
  if [ -n "${TAIL:-}" ] && (( left >= ${TAIL_MIN_S:-150} )); then
    read -r -a TAIL_ARGS <<< "$TAIL"
    phase bench-tail "$left" "$PY" -m strata_jax.cli bench --shape "${BSEED_SHAPE:-bseed}" --tokens 128 \
      --prompt-len 32 "${TAIL_ARGS[@]}" --out "$S/results-tail.json"
  elif [ -n "${TAIL:-}" ]; then
    note "bench-tail: skipped, ${left} s left"
  fi
  wait  # the build, if it outlived both benches
  note "pipeline: done"
}

collect() {
  [ -n "${OUT:-}" ] || return 0
  cp -f "$S/progress" "$S"/results-*.json "$OUT"/ 2>/dev/null
  # at most 8 files come back from a call: the logs' tails travel as one archive
  mkdir -p "$S/tails"
  for f in build bench-b30 bench-b30-skiptemp bench-bseed bench-tail pipeline; do
    [ -f "$S/$f.log" ] && tail -n 400 "$S/$f.log" > "$S/tails/$f.log.tail"
  done
  tar -czf "$OUT/logs.tar.gz" -C "$S" tails
  return 0
}

wait_for() {
  local limit=${1:-560} t0=$SECONDS f
  if [ -n "${2:-}" ]; then echo "$2" > "$S/deadline"; note "deadline moved to ${2} s of the pipeline"; fi
  while (( SECONDS - t0 < limit )) && ! grep -q "pipeline: done" "$S/progress" 2>/dev/null; do sleep 5; done
  collect
  tail -n 30 "$S/progress"
  for f in "$S"/results-*.json; do
    [ -f "$f" ] && "$PY" -c "import json, sys; print(sys.argv[1], len(json.load(open(sys.argv[1]))['rows']), 'rows')" "$f"
  done
  if grep -q "pipeline: done" "$S/progress"; then
    echo "SITTING DONE: the results are in \$OUT; give the machine back"
  else
    echo "STILL RUNNING: send 'bash benchmarks/gpu_sitting.sh wait N' now (the machine goes back 30 s after a call)"
  fi
}

start() {
  mkdir -p "$S"
  if [ -f "$S/progress" ]; then
    echo "already started"
    wait_for "$1"
    return
  fi
  note "start"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    >> "$S/progress" 2>&1 || { note "the gguf wheel did not install: stop"; collect; return 1; }
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
    echo "cores $(nproc)"; free -g | head -2; df -h /tmp | tail -1
    "$PY" -c "import jax, jaxlib, gguf, strata_jax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
  } >> "$S/progress" 2>&1
  # a snapshot of the repo: a later call re-sends the working tree, which must not change running code
  rm -rf "$S/repo" && mkdir -p "$S/repo"
  tar --exclude=./.git --exclude='./.gpu/qwen*' --exclude='*/__pycache__' -cf - . | tar -xf - -C "$S/repo"
  (cd "$S/repo" && setsid nohup bash benchmarks/gpu_sitting.sh pipeline > "$S/pipeline.log" 2>&1 < /dev/null &)
  wait_for "$1"
}

case "${1:-}" in
  start) start "${2:-540}" ;;
  wait) wait_for "${2:-560}" "${3:-}" ;;
  pipeline) pipeline ;;
  *) echo "usage: $0 start|wait [SECONDS]" >&2; exit 2 ;;
esac
