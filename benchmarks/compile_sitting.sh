#!/usr/bin/env bash
# The compilation sitting: where GPU compile time goes per layer (benchmarks/compile_probe.py: trace,
# lowering, backend compile at two depths, with and without the Pallas kernels and XLA's autotuning),
# B30 resident decode with XLA's WHILE/CONDITIONAL command buffers on and off (alternated, two runs
# each), then the fused IQ kernels at BSEED size if time is left. One nvidia-h200 lease.
#
#   bash benchmarks/compile_sitting.sh start [WAIT_S]   on the device: wheels, machine, snapshot, pipeline, wait
#   bash benchmarks/compile_sitting.sh wait [WAIT_S [DEADLINE_S]]   as in benchmarks/sitting_lib.sh
#
# Carry .whl (benchmarks/engine_sitting.md lists them). Knobs: SITTING_S (deadline, default 900 s),
# PROBE_SHAPE (qmid), PROBE_LAYERS (4,8), PROBE_VARIANTS (default,xla,noautotune), B30_SHAPE, SKIP_IQ=1, NO_WHEELS=1.
set -u
cd "$(dirname "$0")/.."
source benchmarks/sitting_lib.sh /tmp/csit 900
export STRATA_JAX_CACHE=${STRATA_JAX_CACHE:-/tmp/sjcache} PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
B30=${B30_SHAPE:-b30}
RETURNED="progress phases.tsv data-*.json" RESULTS_ARCHIVE=1  # the bench results travel as one archive
COMMON=(--tokens 128 --prompt-len 32)

pipeline() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  phase write-b30 600 "$PY" "${WRITE[@]}" "$B30" &
  local writer=$!
  phase compile-probe 330 env OUT="$S" "$PY" benchmarks/compile_probe.py --shape "${PROBE_SHAPE:-qmid}" \
    --layers "${PROBE_LAYERS:-4,8}" --variants "${PROBE_VARIANTS:-default,xla,noautotune}"
  wait "$writer"
  local run
  for run in 1 2; do
    phase "b30-cmdbuf-on-$run" 150 "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" --resident-only \
      --out "$S/results-b30-on-$run.json"
    phase "b30-cmdbuf-off-$run" 150 env XLA_FLAGS=--xla_gpu_enable_command_buffer= "$PY" -m strata_jax.cli bench \
      --shape "$B30" "${COMMON[@]}" --resident-only --out "$S/results-b30-off-$run.json"
  done
  iq_kernels
  note "pipeline: done"
}

sitting_main "$@"
