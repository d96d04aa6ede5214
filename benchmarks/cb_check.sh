#!/usr/bin/env bash
# One `device` call (~4 min; carry .whl): which thunks keep a scanned qwen4exp decode loop out of XLA's CUDA graphs
# (issue 30: qseed's step spends ~23 ms of host time launching kernels one by one). A 16-layer qwen4exp with qseed's
# attention dims, decoded by `bench` per variant, each with XLA's whole conversion log kept (log-NAME.txt.gz), the
# decode program's thunk sequence (thunk-NAME.txt, benchmarks/thunk_report.py) and host ms per step (summary.txt):
#   resident            no expert cache: none of the engine's own kernel calls in the loop
#   offloaded           the expert cache, misses fetched by the host-rows kernel (an FFI call per layer)
#   offloaded-loop      the same with --expert-fetch loop (XLA's copies, no FFI fetch call)
#   offloaded-unroll    loops of a known trip count unrolled into the graph, dynamic-slice fusions allowed in it
#   float-stack, resident-float-stack (with CB_HC=320): offloaded / resident with STRATA_JAX_FLOAT_STACK=kernel
# e.g. CB_HC=320 CB_VARIANTS="resident resident-float-stack offloaded float-stack" bash benchmarks/cb_check.sh
# PART=24 (docs/benchmarks.md) found every named command-buffer setting leaves qseed at 23 ms; this names the thunk.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cbcheck}
mkdir -p "$OUT"
source benchmarks/check_env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# CB_HC=320: Q4_K matrices and qseed's hyper-connection rank, which Q4_K's 256-value blocks do not tile, so the `up`
# matrices are F16 as in qseed (the copies STRATA_JAX_FLOAT_STACK=kernel removes); CB_VARIANTS: the variants to run
CB_HC=${CB_HC:-} "$PY" - <<'PY'
import dataclasses, os
from strata_jax.bench.shapes import SHAPES
from strata_jax.dev.synthetic import write_synthetic_gguf
hc = {"hc_rank": int(os.environ["CB_HC"]), "qtype": "Q4_K"} if os.environ["CB_HC"] else {}
write_synthetic_gguf("/tmp/cbcheck-q16.gguf", dataclasses.replace(
    SHAPES["qtiny"], n_layers=16, n_heads=16, n_kv_heads=2, head_dim=256, rope_dim=64, rope_sections=(11, 11, 10),
    indexer_head_dim=128, **hc))
PY
FULL=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL,DYNAMIC_SLICE_FUSION
variant() {  # variant NAME XLA_FLAGS [BENCH ARGS...]
  local name=$1 flags=$2 d=/tmp/cbcheck-dump-$1
  shift 2
  rm -rf "$d"
  timeout 150 env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2 STRATA_JAX_COMPILATION_CACHE=0 \
    XLA_FLAGS="--xla_dump_to=$d --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.* $flags" \
    "$PY" -m strata_jax.cli bench --model /tmp/cbcheck-q16.gguf --tokens 64 --prompt-len 32 --ctx 1024 \
    --routing realistic "$@" --out "$OUT/bench-$name.json" > "$OUT/log-$name.txt" 2>&1
  echo "== $name rc $? not_convertible $(grep -c 'not convertible' "$OUT/log-$name.txt")"
  "$PY" - "$OUT/bench-$name.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["rows"][-1]
    print({k: r.get(k) for k in ("config", "decode_tok_s", "host_dispatch_ms_per_step", "host_wait_ms_per_step", "hit_rate")})
except Exception as e:
    print("no row:", e)
PY
  "$PY" benchmarks/thunk_report.py "$d" > "$OUT/thunk-$name.txt" 2>&1
  grep "kCommandBuffer\|kWhile\|kCustomCall" "$OUT/thunk-$name.txt" | head -8
  # the loops the pass did capture: command buffers created with a while loop among their thunks
  echo "while loops in command buffers: $(grep "Creating command buffer thunk" "$OUT/log-$name.txt" \
    | grep -o "while[.0-9]*" | sort -u | tr '\n' ' ')"
  gzip -f "$OUT/log-$name.txt"
  # the decode program's thunks and optimized HLO (custom-call targets by name), for what the log does not say
  (cd "$d" 2>/dev/null && tar -czf "$OUT/dump-$name.tar.gz" $(ls | grep -E "decode.*(thunk_sequence|after_optimizations)\.txt$"))
}
run_variant() {
  case $1 in
    resident) variant resident "" --resident-only ;;
    offloaded) variant offloaded "" --cache-fraction 0.5 --no-resident ;;
    offloaded-loop) variant offloaded-loop "" --cache-fraction 0.5 --no-resident --expert-fetch loop ;;
    offloaded-unroll) variant offloaded-unroll "$FULL --xla_gpu_command_buffer_unroll_loops=true" --cache-fraction 0.5 \
      --no-resident ;;
    float-stack) STRATA_JAX_FLOAT_STACK=kernel variant float-stack "" --cache-fraction 0.5 --no-resident ;;
    resident-float-stack) STRATA_JAX_FLOAT_STACK=kernel variant resident-float-stack "" --resident-only ;;
  esac
}
for v in ${CB_VARIANTS:-resident offloaded offloaded-loop offloaded-unroll}; do
  run_variant "$v"
done 2>&1 | tee "$OUT/summary.txt"
