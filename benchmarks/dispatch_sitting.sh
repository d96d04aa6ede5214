#!/usr/bin/env bash
# Why a scanned decode step costs host time (docs/benchmarks.md, "Layer scan on the H200"): with the layer
# scan on, B30's decode call takes ~5 ms of host time per token where the unrolled one takes ~0.3 ms, as if
# the scan's loop ran outside XLA's command buffers. One nvidia-h200 lease:
#   1. B30 resident decode, scan on, under command-buffer settings (CMDBUF_VARIANTS), each its own process;
#   2. the same with the optimized HLO dumped: which loops of the decode program sit in command buffers;
#
#   bash benchmarks/dispatch_sitting.sh start [WAIT_S] | wait [WAIT_S [DEADLINE_S]]   (benchmarks/sitting_lib.sh)
#
# Carry .whl. Knobs: SITTING_S (default 560), B30_SHAPE (b30), NO_WHEELS=1.
set -u
cd "$(dirname "$0")/.."
source benchmarks/sitting_lib.sh /tmp/dsit 560
export STRATA_JAX_CACHE=${STRATA_JAX_CACHE:-/tmp/sjcache} PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
B30=${B30_SHAPE:-b30}
COMMON=(--tokens 128 --prompt-len 32)
CB=--xla_gpu_enable_command_buffer
RETURNED="progress phases.tsv results-*.json data-*.json hlo-summary.txt hlo-decode.tar.gz"

bench_b30() {  # bench_b30 NAME XLA_FLAGS
  phase "$1" 150 env XLA_FLAGS="$2" "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" --resident-only \
    --out "$S/results-$1.json"
}

pipeline() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  phase write-b30 300 "$PY" "${WRITE[@]}" "$B30"
  bench_b30 b30-default "$CB=+WHILE,+CONDITIONAL"
  bench_b30 b30-dsf "$CB=+WHILE,+CONDITIONAL,+DYNAMIC_SLICE_FUSION"
  bench_b30 b30-dsf-copy "$CB=+WHILE,+CONDITIONAL,+DYNAMIC_SLICE_FUSION,+DYNAMIC_SLICE_COPY_FUSION"
  bench_b30 b30-dump "$CB=+WHILE,+CONDITIONAL --xla_dump_to=$S/dump --xla_dump_hlo_module_re=.*decode.*"
  {
    for f in "$S"/dump/*decode*after_optimizations.txt; do
      echo "== $f"; grep -c "command_buffer" "$f"; grep -n "^ENTRY\|^%command_buffer\| while(" "$f" | head -60
    done
  } > "$S/hlo-summary.txt hlo-decode.tar.gz" 2>&1
  (cd "$S/dump" && tar -czf "$S/hlo-decode.tar.gz" *decode*after_optimizations.txt 2>/dev/null)
  note "pipeline: done"
}

prepare() {
  machine_info
  snapshot "$S/repo"
}

sitting_main "$@"
