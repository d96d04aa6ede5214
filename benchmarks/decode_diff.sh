#!/usr/bin/env bash
# Where OLD's and NEW's decode steps differ on the GPU: the profiler's kernels per step (decode_profile.py
# --parts steps, a B30-shaped model with fewer layers, resident) and the decode program's optimized HLO,
# for OLD (.sitting/old, exported by `engine_sitting.sh prep`) and NEW (this tree). On the device:
#   bash benchmarks/decode_diff.sh [LAYERS] [TREES]      (defaults: 16, "old new")
# $OUT/<tree>/decode_profile.json, $OUT/<tree>/hlo/*after_optimizations.txt, $OUT/<tree>.log
set -uo pipefail
LAYERS=${1:-16}; TREES=${2:-old new}
SITE=${SITE:-/tmp/site}; PY=${PY:-python3}; OUT=${OUT:-/tmp/out}
if [ -z "${NO_WHEELS:-}" ] && [ ! -d "$SITE/flax" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
fi
for t in $TREES; do
  d=$PWD; [ "$t" = old ] && d=$PWD/.sitting/old; [ -d "$t" ] && d=$PWD/$t
  mkdir -p "$OUT/$t/hlo"
  dump=$OUT/$t/hlo
  (cd "$d" && PYTHONPATH="$d:$SITE" OUT="$OUT/$t" \
    XLA_FLAGS="--xla_dump_to=$dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*" \
    timeout 400 "$PY" benchmarks/decode_profile.py --parts steps --layers "$LAYERS" --confs resident:1 --tokens "${TOKENS:-64}") \
    > "$OUT/$t.log" 2>&1
  echo "$t rc=$?"; tail -3 "$OUT/$t.log"
  find "$OUT/$t/hlo" -type f ! -name "*after_optimizations.txt" -delete
  tar czf "$OUT/$t-hlo.tgz" -C "$OUT/$t" hlo && rm -rf "$OUT/$t/hlo"
done
