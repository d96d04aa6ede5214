#!/usr/bin/env bash
# One `device` call (~4 min; carry .whl): what XLA's GEMM autotuning costs the prefill program's compile (issue 30's
# 15 s per program; qseed's prefill took 20.7 s, 7.9 s without autotuning but ran 5.2x slower: docs/benchmarks.md,
# PART=27), and what two ways of keeping it give back. qseed's architecture and dimensions cut to 8 layers of 64
# experts (its fusions, a file written in seconds), each run its own process with the compilation cache off:
#   level4       XLA's default autotuning (level 4: buffers initialized and results checked)
#   level1       autotuning without the initialization and the checks (--xla_gpu_autotune_level=1)
#   cache-cold   the default with a per-fusion autotune cache (--xla_gpu_per_fusion_autotune_cache_dir), empty
#   cache-warm   the same again: the compile a later start pays once the cache holds the fusions
# Per run: the programs' compile seconds (JAX_LOG_COMPILES), prefill and decode tok/s, the tokens (summary.txt).
# AT_RUNS="level1 cache-cold cache-warm" runs fewer (cache-cold autotunes as level4 does, and fills the cache).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/atcheck}
mkdir -p "$OUT"
source benchmarks/check_env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
MODEL=/tmp/atcheck-qseed8.gguf
ATC=/tmp/atcheck-autotune  # outside $OUT: its files do not come back
rm -rf "$ATC"
t0=$(date +%s)
"$PY" - "$MODEL" <<'PY'
import dataclasses, sys
from strata_jax.bench.shapes import SHAPES
from strata_jax.dev.synthetic import write_synthetic_gguf
write_synthetic_gguf(sys.argv[1], dataclasses.replace(SHAPES["qseed"], n_layers=8, n_experts=64, ple_head_vocab=50_000))
PY
echo "wrote $MODEL in $(( $(date +%s) - t0 )) s ($(du -h "$MODEL" | cut -f1))"
run() {  # run NAME XLA_FLAGS
  local name=$1 flags=$2
  timeout 150 env JAX_LOG_COMPILES=1 STRATA_JAX_COMPILATION_CACHE=0 XLA_FLAGS="$flags" "$PY" -m strata_jax.cli bench \
    --model "$MODEL" --tokens 32 --prompt-len 32 --prefill-len 512 --resident-only --out "$OUT/bench-$name.json" \
    > "$OUT/log-$name.txt" 2>&1
  echo "== $name rc $?"
  grep -o "Finished XLA compilation of jit([a-z_]*) in [0-9.]* sec" "$OUT/log-$name.txt" \
    | grep -E "jit\((prefill|decode|verify)\)" | sed 's/Finished XLA compilation of //'
  "$PY" - "$OUT/bench-$name.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["rows"][-1]
    print({k: r.get(k) for k in ("decode_tok_s", "prefill_tok_s", "prefill_first_s")}, "tokens", r.get("token_ids", [])[:12])
except Exception as e:
    print("no row:", e)
PY
}
{
  for name in ${AT_RUNS:-level4 level1 cache-cold cache-warm}; do  # AT_RUNS: fewer, for a short lease
    case $name in
      level4) run level4 "" ;;
      level1) run level1 "--xla_gpu_autotune_level=1" ;;
      cache-cold|cache-warm) run "$name" "--xla_gpu_per_fusion_autotune_cache_dir=$ATC" ;;
    esac
  done
  echo "autotune cache: $(ls "$ATC" 2>/dev/null | wc -l) files, $(du -sh "$ATC" 2>/dev/null | cut -f1)"
} 2>&1 | tee "$OUT/summary.txt"
