#!/usr/bin/env bash
# The layer-scan sitting (model/runs.py): the seed's model with its alike layers compiled once. One
# nvidia-h200 lease, in priority order:
#   1. qseed (56.6 GB, qwen4exp at the seed's scale) written once; while it is written, compile time at two
#      depths, scan on and unrolled, offloaded (benchmarks/compile_probe.py on qmid: qseed's layer at 64
#      experts, SLOTS_PER_LAYER slots per layer);
#   2. qseed cold start under a 32 GiB budget: `strata-jax generate` from process start to the answer's
#      first byte, the compilation cache off (benchmarks/cold_start.py: load, each program's compile);
#   3. qseed bench under 32 GiB, default kernels, realistic routing: decode, host time per step, prefill 512;
#   4. the qseed file deleted (B30's 17 GB do not fit beside it), B30 resident decode, scan on and off.
#
#   bash benchmarks/scan_sitting.sh start [WAIT_S]   on the device: wheels, machine, snapshot, pipeline, wait
#   bash benchmarks/scan_sitting.sh wait [WAIT_S [DEADLINE_S]]   as in benchmarks/sitting_lib.sh
#
# Carry .whl (benchmarks/engine_sitting.md lists them). Knobs: SITTING_S (deadline, default 1200 s),
# QSEED_SHAPE (qseed), QMID_LAYERS (4,24), SLOTS_PER_LAYER (16 of 64), B30_SHAPE (b30), NO_WHEELS=1,
# SKIP_PROBE=1. A local dry run: QSEED_SHAPE=qtiny B30_SHAPE=tiny QMID_LAYERS=2,4 NO_WHEELS=1 JAX_PLATFORMS=cpu.
set -u
cd "$(dirname "$0")/.."
source benchmarks/sitting_lib.sh /tmp/ssit 1200
export STRATA_JAX_CACHE=${STRATA_JAX_CACHE:-/tmp/sjcache} PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
B30=${B30_SHAPE:-b30} QSEED=${QSEED_SHAPE:-qseed}
RETURNED="progress phases.tsv data-*.json" RESULTS_ARCHIVE=1  # the bench results travel as one archive
COMMON=(--tokens 128 --prompt-len 32)

probe() {  # probe NAME LIMIT SHAPE LAYERS [ARGS...]
  local name=$1 limit=$2 shape=$3 layers=$4
  shift 4
  phase "$name" "$limit" env OUT="$S" "$PY" benchmarks/compile_probe.py --shape "$shape" --layers "$layers" \
    --variants default,unrolled --out "$S/data-$name.json" "$@"
}

pipeline() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  phase write-qseed 600 "$PY" "${WRITE[@]}" "$QSEED" &
  local writer=$!
  [ -n "${SKIP_PROBE:-}" ] || probe compile-qmid-offload 400 qmid "${QMID_LAYERS:-4,24}" \
    --slots-per-layer "${SLOTS_PER_LAYER:-16}"
  wait "$writer"
  local qfile scan run
  qfile=$(ls "$STRATA_JAX_CACHE/synthetic/$QSEED-"*.gguf 2>/dev/null | head -1)
  phase cold-qseed 420 "$PY" benchmarks/cold_start.py --model "$qfile" --tokens 64 --out "$S/data-cold-qseed.json" \
    -- --vram-budget 32GiB
  phase bench-qseed 600 "$PY" -m strata_jax.cli bench --shape "$QSEED" "${COMMON[@]}" --routing realistic \
    --prefill-len 512 --vram-budget 32GiB --no-resident --out "$S/results-qseed.json"
  rm -f "$STRATA_JAX_CACHE/synthetic/$QSEED-"*
  note "qseed GGUF deleted; disk: $(df -h "$STRATA_JAX_CACHE" | tail -1)"
  phase write-b30 300 "$PY" "${WRITE[@]}" "$B30"
  for run in 1 2; do
    for scan in on off; do
      phase "b30-scan-$scan-$run" 150 "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" --resident-only \
        --layer-scan "$scan" --out "$S/results-b30-scan-$scan-$run.json"
    done
  done
  note "pipeline: done"
}

sitting_main "$@"
