#!/usr/bin/env bash
# The seed-model sitting: qwen4exp at the seed's scale (bench shape qseed, 56.6 GB) under a 32 GiB budget
# beside llama.cpp's qwen4exp on the same file (decode and prefill), the fused IQ kernels timed, the machine
# as `strata-jax check` sees it, then B30 resident prefill (the blocked attention loop) if time is left. One
# nvidia-h200 lease.
#
#   bash benchmarks/seed_sitting.sh start [WAIT_S]   on the device: wheels, machine, snapshot, pipeline, wait
#   bash benchmarks/seed_sitting.sh wait [WAIT_S [DEADLINE_S]]   as in benchmarks/sitting_lib.sh
#   bash benchmarks/seed_sitting.sh pipeline         (start runs it)
#
# Carry .whl (benchmarks/engine_sitting.md lists them) and .gpu (llama.cpp's sources:
# `python benchmarks/llamacpp.py pack --sdist llama_cpp_python-0.3.36.tar.gz`).
#
# Pipeline (the build and the qseed file are written in the background once `check` has measured the
# machine alone):
#   check-json      `strata-jax check --json` -> data-check.json: GPU, PCIe link, bandwidth, pinned memory
#   iq-kernels      decode_profile.py kernels for the seed's IQ types at BSEED size, one launch config
#                   (16x2), each right after its gather + dequantize + einsum baseline -> data-iq.json
#   check-qseed     `strata-jax check QSEED --vram-budget 32GiB`: the verdict on the seed's shape
#   bench-qseed     32 GiB, STRATA_JAX_QMATVEC=1, realistic routing, decode and prefill 512 / 4096, llama.cpp's
#                   budget placement first (before JAX takes the card) -> results-qseed.json. QSEED_S (1000 s):
#                   its limit; it needs ~100 s of loading and three ~105 s compilations before its first row
#   then the qseed file is deleted (B30's 17 GB do not fit beside it on the 64 GiB disk) and
#   b30-resident    bench --resident-only, prefill 512 / 4096 / 16384 (the blocked attention loop)
# Knobs: SITTING_S (deadline, default 1450 s), SITTING_DIR (/tmp/ssit), PY, NO_WHEELS=1, QSEED_SHAPE /
# B30_SHAPE (qtiny / tiny for a local dry run), LLAMA_BIN (an existing llama-bench: no build), SKIP_IQ=1,
# IQ_TYPES (IQ3_S,IQ3_XXS,IQ2_XS,IQ1_M), SKIP_CHECK=1, QSEED_S.
set -u
cd "$(dirname "$0")/.."
source benchmarks/sitting_lib.sh /tmp/ssit 1450
export STRATA_JAX_CACHE=${STRATA_JAX_CACHE:-/tmp/sjcache} PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
QSEED=${QSEED_SHAPE:-qseed} B30=${B30_SHAPE:-b30}
LLAMA_LINK=$S/llama-bench  # made once the build is done (/bin/false if it failed); bench waits for it
COMMON=(--tokens 128 --prompt-len 32)


pipeline() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  [ -n "${SKIP_CHECK:-}" ] || phase check-json 90 bash -c "'$PY' -m strata_jax.cli check --json > '$S/data-check.json'"
  build_llama 12 &
  phase write-qseed 900 "$PY" "${WRITE[@]}" "$QSEED" &
  local writer=$!
  iq_kernels
  wait "$writer"
  local qfile
  qfile=$(ls "$STRATA_JAX_CACHE/synthetic/$QSEED-"*.gguf 2>/dev/null | head -1)
  [ -n "${SKIP_CHECK:-}" ] || phase check-qseed 90 "$PY" -m strata_jax.cli check "$qfile" --vram-budget 32GiB
  phase bench-qseed "${QSEED_S:-1000}" env STRATA_JAX_QMATVEC=1 "$PY" -m strata_jax.cli bench --shape "$QSEED" "${COMMON[@]}" \
    --routing realistic --prefill-len 512 --prefill-len 4096 --vram-budget 32GiB --no-resident \
    --peer-llama-bench "$LLAMA_LINK" --peer-placement budget --peer-when before --peer-wait 400 --peer-reps 1 \
    --out "$S/results-qseed.json"
  rm -f "$STRATA_JAX_CACHE/synthetic/$QSEED-"*
  note "qseed GGUF deleted; disk: $(df -h "$STRATA_JAX_CACHE" | tail -1)"
  phase b30-resident 400 "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" --resident-only \
    --prefill-len 512 --prefill-len 4096 --prefill-len 16384 --out "$S/results-b30.json"
  wait
  note "pipeline: done"
}

prepare() {
  [ -n "${LLAMA_BIN:-}" ] || [ -f .gpu/llama-src.tar.xz ] || note "no .gpu/llama-src.tar.xz (carry .gpu): llama.cpp rows will fail"
  machine_info
  snapshot "$S/repo"
}

sitting_main "$@"
