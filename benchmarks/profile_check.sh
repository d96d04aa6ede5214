#!/usr/bin/env bash
# One `device` call (~6 min; carry .whl): where a qseed-shaped decode step's GPU time goes, by named scope
# (scope_profile.py), for the RUNS below; B30 8 layers resident beside them. Results to $OUT. (Its first
# sitting also ran a 16-layer qtiny with STRATA_JAX_XLA_DECODE=--xla_gpu_command_buffer_unroll_loops=true:
# the same "not convertible" message and host time as without, results/h100-2026-12-06-profile/qtiny-unroll.txt.)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pcheck}
source benchmarks/check_env.sh
# RUNS: one scope_profile.py run per line, "ENV=... --args" (default: qseed 8 layers resident with the kernel
# choices of auto mode and with every matrix on the fused kernel (STRATA_JAX_QMATVEC=1), and with half the
# experts cached; the first sitting's auto mode still dequantized the IQ3_S experts)
RUNS=${RUNS:-"STRATA_JAX_QMATVEC= --shape qseed --layers 8
STRATA_JAX_QMATVEC=1 --shape qseed --layers 8
STRATA_JAX_QMATVEC=1 --shape qseed --layers 8 --slots-fraction 0.5
STRATA_JAX_QMATVEC= --shape b30 --layers 8"}
while read -r envs args; do
  [ -n "$envs" ] || continue
  echo "== $envs $args" >> "$OUT/scope.txt"
  env "$envs" TAG="${envs#*=}" timeout 300 "$PY" benchmarks/scope_profile.py $args >> "$OUT/scope.txt" 2>&1
  rm -rf "$OUT/scope-dump"
done <<< "$RUNS"
rm -f /tmp/*-8L.gguf
