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
# a 32 GiB cap. Each bench is cut at its share of the sitting or at the deadline (rows are saved as they
# come); a phase that would start with under 30 s left is skipped.
#
# Knobs (environment): SITTING_S (pipeline seconds, default 1500), B30_S (B30's share, default 600),
# SKIP_B30=1 (BSEED only: a second attempt), TAIL / TAIL_MIN_S (a last BSEED bench if time is left), B30_PREFILL / BSEED_PREFILL ("--prefill-len N ..."),
# LLAMA_BIN (an existing llama-bench: no build), SITE (/tmp/site, the wheels' target), B30_SHAPE /
# BSEED_SHAPE, SITTING_DIR and NO_WHEELS=1 (a local dry run: B30_SHAPE=tiny BSEED_SHAPE=tiny
# LLAMA_BIN=/bin/false SITTING_DIR=/tmp/dry OUT=/tmp/dry/out PY=python NO_WHEELS=1). The shared steps
# (phases cut at the deadline, rows in phases.tsv; the build; start, wait) are benchmarks/sitting_lib.sh.
set -u
cd "$(dirname "$0")/.."
source benchmarks/sitting_lib.sh /tmp/sitting 1500
WHEELS=.gpu/whl
RETURNED="progress results-*.json"
export STRATA_JAX_CACHE=${STRATA_JAX_CACHE:-/tmp/sjcache} PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
LLAMA_LINK=$S/llama-bench  # made once the build is done (/bin/false if it failed): the benches wait for it
B30_S=${B30_S:-600}
COMMON=(--tokens 128 --prompt-len 32 --routing model --routing realistic --peer-llama-bench "$LLAMA_LINK"
        --peer-wait 420 --peer-reps 2)
# arrays under other names: bash stops exporting a variable once it becomes an array. B30 times only
# the 512-token prompt (llama.cpp's pp512): every other length costs compilations the sitting lacks
read -r -a B30_PREFILL_ARGS <<< "${B30_PREFILL:---prefill-len 512}"
read -r -a BSEED_PREFILL_ARGS <<< "${BSEED_PREFILL:---prefill-len 512 --prefill-len 4096}"

pipeline() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  build_llama 10 &
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
  phase bench-bseed "$(deadline)" "$PY" -m strata_jax.cli bench --shape "${BSEED_SHAPE:-bseed}" \
    "${COMMON[@]}" "${BSEED_PREFILL_ARGS[@]}" --vram-budget 32GiB --no-resident --out "$S/results-bseed.json"
  # Last, and only if the deadline leaves TAIL_MIN_S (default 150): TAIL="bench arguments" on the BSEED
  # file, still on disk, e.g. TAIL="--decode-chunk 16 --routing model --vram-budget 32GiB --no-resident"
  local left=$(($(deadline) - SECONDS))
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

prepare() {
  machine_info
  snapshot "$S/repo"
}

sitting_main "$@"
