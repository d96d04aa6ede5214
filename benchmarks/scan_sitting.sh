#!/usr/bin/env bash
# The layer-scan sitting (model/runs.py): does compiling alike layers once bound compile time, offloaded
# too, without costing decode? One nvidia-h200 lease, in priority order:
#   1. compile time at two depths, scan on and unrolled (benchmarks/compile_probe.py): qseed's layer at 64
#      experts (qmid), all resident, then offloaded (SLOTS_PER_LAYER slots per layer: the per-layer caches
#      as blocks of one pool), then B30's layer resident;
#   2. B30 decode with 50 % of the experts cached (realistic routing), scan on and off, alternated;
#   3. B30 all-resident decode, scan on and off, alternated;
#   4. B30 all resident, one 16,384-token prompt, the on-disk compilation cache off: the first request's
#      wall time against the second's (issue 14, target 4), scan on and off.
#
#   bash benchmarks/scan_sitting.sh start [WAIT_S]   on the device: wheels, machine, snapshot, pipeline, wait
#   bash benchmarks/scan_sitting.sh wait [WAIT_S [DEADLINE_S]]   as in benchmarks/sitting_lib.sh
#
# Carry .whl (benchmarks/engine_sitting.md lists them). Knobs: SITTING_S (deadline, default 1200 s),
# QMID_LAYERS (4,16: 16 layers of qmid's experts stay below the fused kernel's 2-4 GiB gap, as qseed's
# plan does), SLOTS_PER_LAYER (16 of 64), PROBE_LAYERS (4,12), B30_SHAPE (b30), LONG (16384), NO_WHEELS=1.
set -u
cd "$(dirname "$0")/.."
source benchmarks/sitting_lib.sh /tmp/ssit 1200
export STRATA_JAX_CACHE=${STRATA_JAX_CACHE:-/tmp/sjcache} PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
B30=${B30_SHAPE:-b30}
RETURNED="progress phases.tsv data-*.json"  # the bench results travel as one archive (collect_more)
COMMON=(--tokens 128 --prompt-len 32)

probe() {  # probe NAME LIMIT SHAPE LAYERS [ARGS...]
  local name=$1 limit=$2 shape=$3 layers=$4
  shift 4
  phase "$name" "$limit" env OUT="$S" "$PY" benchmarks/compile_probe.py --shape "$shape" --layers "$layers" \
    --variants default,unrolled --out "$S/data-$name.json" "$@"
}

pipeline() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  phase write-b30 600 "$PY" "${WRITE[@]}" "$B30" &
  local writer=$!
  probe compile-qmid 300 qmid "${QMID_LAYERS:-4,16}"
  probe compile-qmid-offload 400 qmid "${QMID_LAYERS:-4,16}" --slots-per-layer "${SLOTS_PER_LAYER:-16}"
  probe compile-b30 200 "${PROBE_SHAPE:-b30}" "${PROBE_LAYERS:-4,12}"
  wait "$writer"
  local run scan
  for run in 1 2; do
    for scan in on off; do
      phase "b30-half-scan-$scan-$run" 150 "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" --no-resident \
        --cache-fraction 0.5 --routing realistic --layer-scan "$scan" --out "$S/results-b30-half-scan-$scan-$run.json"
    done
  done
  for run in 1 2; do
    for scan in on off; do
      phase "b30-scan-$scan-$run" 120 "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" --resident-only \
        --layer-scan "$scan" --out "$S/results-b30-scan-$scan-$run.json"
    done
  done
  for scan in on off; do
    phase "b30-long-scan-$scan" 240 env STRATA_JAX_COMPILATION_CACHE=0 "$PY" -m strata_jax.cli bench --shape "$B30" \
      --tokens 16 --prompt-len 32 --prefill-len "${LONG:-16384}" --ctx $(( ${LONG:-16384} + 512 )) --resident-only \
      --layer-scan "$scan" --out "$S/results-b30-long-scan-$scan.json"
  done
  note "pipeline: done"
}

collect_more() {
  (cd "$S" && ls results-*.json > /dev/null 2>&1 && tar -czf "$OUT/results.tar.gz" results-*.json)
}

prepare() {
  machine_info
  snapshot "$S/repo"
}

sitting_main "$@"
