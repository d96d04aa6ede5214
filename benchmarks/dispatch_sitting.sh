#!/usr/bin/env bash
# Why a scanned decode step costs host time (docs/benchmarks.md, "Layer scan on the H200"): with the layer
# scan on, B30's decode call takes ~5 ms of host time per token where the unrolled one takes ~0.3 ms, as if
# the scan's loop ran outside XLA's command buffers. One nvidia-h200 lease:
#   1. B30 resident decode, scan on, under command-buffer settings, each its own process (unrolled too);
#   2. the best with XLA's command-buffer conversion logging why a thunk stays out (hlo-summary.txt);
#   3. the expert store's load into pinned memory (benchmarks/load_store.py: GB/s, allocation, bytes checked);
#   4. QSEED=1: qseed under 32 GiB with the setting of the least host time: cold start, then bench.
# PART=2..29 are later sittings (each described above its pipeline), PART=29 the newest.
#
#   bash benchmarks/dispatch_sitting.sh start [WAIT_S] | wait [WAIT_S [DEADLINE_S]]   (benchmarks/sitting_lib.sh)
#
# Carry .whl (benchmarks/sitting_wheels.sh). Knobs: SITTING_S (default 560), B30_SHAPE (b30), QSEED=1, NO_WHEELS=1.
set -u
cd "$(dirname "$0")/.."
source benchmarks/sitting_lib.sh "/tmp/dsit${PART:-}" 560  # each part its own folder: `wait` finds it
export STRATA_JAX_CACHE=${STRATA_JAX_CACHE:-/tmp/sjcache} PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
B30=${B30_SHAPE:-b30}
COMMON=(--tokens 128 --prompt-len 32)
CB=--xla_gpu_enable_command_buffer
NODSF=--xla_gpu_enable_dynamic_slice_fusion=false
RETURNED="progress phases.tsv results-*.json data-*.json hlo-summary.txt"
RESULTS_ARCHIVE=1
# the command-buffer conversion pass's log (why a loop stays out of the CUDA graphs), programs compiled afresh
VLOG=(TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2 STRATA_JAX_COMPILATION_CACHE=0)
QSEED32=(--shape qseed "${COMMON[@]}" --routing realistic --prefill-len 512 --vram-budget 32GiB --no-resident)

bench_b30() {  # bench_b30 NAME XLA_FLAGS [BENCH ARGS...]
  local name=$1 flags=$2
  shift 2
  phase "$name" 150 env XLA_FLAGS="$flags" "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" --resident-only \
    --out "$S/results-$name.json" "$@"
}

best_flags() {  # the XLA_FLAGS of the b30 variant with the least host time per step (file: variant<TAB>flags)
  "$PY" - "$S" <<'PY'
import json, pathlib, sys
S = pathlib.Path(sys.argv[1])
best = None
for line in (S / "variants.tsv").read_text().splitlines():
    name, flags = line.split("\t", 1)
    f = S / f"results-{name}.json"
    if f.exists():
        r = json.loads(f.read_text())["rows"][0]
        d = r.get("host_dispatch_ms_per_step")
        if d is not None and (best is None or d < best[0]):
            best = (d, flags)
print(best[1] if best else "")
PY
}

variant() {  # variant NAME FLAGS: B30 resident decode under XLA_FLAGS=FLAGS
  printf '%s\t%s\n' "$1" "$2" >> "$S/variants.tsv"
  bench_b30 "$1" "$2"
}

qseed_file() {  # qseed's synthetic GGUF, written once (phase write-qseed); QFILE: its path
  phase write-qseed 400 "$PY" "${WRITE[@]}" qseed
  QFILE=$(ls "$STRATA_JAX_CACHE"/synthetic/qseed-*.gguf 2>/dev/null | head -1)
}

cold_qseed() {  # qseed's cold start under 32 GiB (benchmarks/cold_start.py), XLA_FLAGS as given
  phase cold-qseed 300 env XLA_FLAGS="${1:-}" PYTHONPATH="$PYTHONPATH:." "$PY" benchmarks/cold_start.py --model "$QFILE" \
    --tokens 64 --out "$S/data-cold-qseed.json" -- --vram-budget 32GiB
}

conv_qseed() {  # issue 34: a 16K-token conversation's second turn, cold / RAM tier / disk tier
  phase conv-qseed 480 env PYTHONPATH="$PYTHONPATH:." "$PY" benchmarks/conversation_ttft.py --model "$QFILE" \
    --turn1 16384 --vram-budget 32GiB --out "$S/data-conv-qseed.json"
}

pipeline() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  phase write-b30 300 "$PY" "${WRITE[@]}" "$B30"
  # XLA leaves a while loop out of the command buffers when its body holds a loop-dependent dynamic-slice
  # fusion (a layer's slice of a stacked operand fed to a library call); unrolling it in the graph
  # (--xla_gpu_command_buffer_unroll_loops) failed on the prefill program ("recorded at most once")
  variant b30-default "$CB=+WHILE,+CONDITIONAL"
  variant b30-nodsf "$CB=+WHILE,+CONDITIONAL $NODSF"
  variant b30-default-2 "$CB=+WHILE,+CONDITIONAL"
  variant b30-nodsf-2 "$CB=+WHILE,+CONDITIONAL $NODSF"
  bench_b30 b30-nodsf-off "$CB=+WHILE,+CONDITIONAL $NODSF" --layer-scan off
  local flags
  flags=$(best_flags)
  note "b30: least host time with XLA_FLAGS=$flags"
  phase b30-vlog 150 env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2 \
    XLA_FLAGS="$flags" "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" \
    --resident-only --out "$S/vlog-b30.json"
  grep -h "not convertible\|Unsupported thunk\|not enabled by the user" "$S/b30-vlog.log" | sed 's/^[^]]*] //' \
    | sort | uniq -c | sort -rn | head -40 > "$S/hlo-summary.txt"
  rm -f "$STRATA_JAX_CACHE/synthetic/$B30-"*
  # the expert store's load (offload/store.py) into pinned memory: GB/s, its allocation, and whether the
  # bytes written through the host buffer's pointer are the file's
  phase load-store 300 env PYTHONPATH="$PYTHONPATH:." sh -c "'$PY' benchmarks/load_store.py --layers 12 --reps 2 --path /tmp/strata_load/b30x12.gguf > '$S/data-load.json'"
  rm -rf /tmp/strata_load
  [ -n "${QSEED:-}" ] || { note "pipeline: done"; return; }
  qseed_file
  cold_qseed "$flags"
  phase bench-qseed 420 env XLA_FLAGS="$flags" "$PY" -m strata_jax.cli bench --shape qseed "${COMMON[@]}" \
    --routing realistic --prefill-len 512 --vram-budget 32GiB --no-resident --out "$S/results-qseed.json"
  note "pipeline: done"
}

# PART=2 (after the few-query attention change, model/layers/attention.py FEW_QUERIES): which loop-dependent
# dynamic-slice fusions are left (B30's optimized decode HLO, each with its ops' metadata), B30 host ms per
# step scan on / off, the store's load (preadv), qseed's cold start and bench under the defaults
dsf_sources() { "$PY" benchmarks/dsf_report.py "$1"; }  # dsf_sources DUMP_DIR

# logged_bench NAME XLA_FLAGS CMD...: a qseed bench under 32 GiB (CMD: how bench is started) with the conversion
# log and the decode HLO dumped: data-NAME.json, cb-NAME.txt (the log's verdicts), dsf-NAME.txt (the dump's
# dynamic-slice fusions by JAX source)
logged_bench() {
  local name=$1 flags=$2
  shift 2
  phase "$name" 170 env "${VLOG[@]}" PYTHONPATH="$PYTHONPATH:." \
    XLA_FLAGS="--xla_dump_to=$S/dump-$name --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.* $flags" \
    "$@" "${QSEED32[@]}" --label "$name" --out "$S/data-$name.json"
  grep -h "not convertible\|Unsupported thunk\|not enabled by the user" "$S/$name.log" | sed 's/^[^]]*] //' \
    | sort | uniq -c | sort -rn | head -60 > "$S/cb-$name.txt"
  dsf_sources "$S/dump-$name" > "$S/dsf-$name.txt" 2>&1
  rm -rf "$S/dump-$name"
}

pipeline2() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  phase write-b30 300 "$PY" "${WRITE[@]}" "$B30"
  phase b30-dump 150 env XLA_FLAGS="--xla_dump_to=$S/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*" \
    "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" --resident-only --out "$S/results-b30-dump.json"
  dsf_sources "$S/dump" > "$S/dsf-sources.txt" 2>&1
  rm -rf "$S/dump"
  bench_b30 b30-on-2 ""
  bench_b30 b30-off "" --layer-scan off
  rm -f "$STRATA_JAX_CACHE/synthetic/$B30-"*
  phase load-store 300 env PYTHONPATH="$PYTHONPATH:." sh -c "'$PY' benchmarks/load_store.py --layers 12 --reps 2 --path /tmp/strata_load/b30x12.gguf > '$S/data-load.json'"
  rm -rf /tmp/strata_load
  qseed_file
  cold_qseed
  phase bench-qseed 420 "$PY" -m strata_jax.cli bench --shape qseed "${COMMON[@]}" --routing realistic \
    --prefill-len 512 --vram-budget 32GiB --no-resident --out "$S/results-qseed.json"
  note "pipeline: done"
}
[ "${PART:-1}" = 2 ] && { pipeline() { pipeline2; }; RETURNED="$RETURNED dsf-sources.txt"; }

# PART=3: the loop-dependent DynamicSliceFusionV2 thunk that keeps the layer scan out of the command buffers
# is a memcpy-like dynamic slice/update fusion, which the HLO's fusion names do not tell apart: keep B30's
# optimized decode HLO (hlo-decode.tar.gz, to find them offline), and try the decode program alone with
# XLA's unrolling of known-trip-count loops inside the graph (STRATA_JAX_XLA_DECODE: prefill failed with it
# process-wide); the store's load with reads into plain and pinned memory; last, the conversion pass's log
pipeline3() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  phase write-b30 300 "$PY" "${WRITE[@]}" "$B30"
  phase b30-dump 150 env XLA_FLAGS="--xla_dump_to=$S/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*" \
    "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" --resident-only --out "$S/results-b30-dump.json"
  (cd "$S/dump" && tar -czf "$S/hlo-decode.tar.gz" *after_optimizations.txt *buffer-assignment.txt 2>/dev/null)
  rm -rf "$S/dump"
  local unroll=--xla_gpu_command_buffer_unroll_loops=true
  STRATA_JAX_XLA_DECODE="$unroll" bench_b30 b30-unroll "" --label unroll
  # the load was slow in PART=2 (docs/benchmarks.md): are the reads slow, or the pinned writes? (read_*_GB_s)
  phase load-store 120 env PYTHONPATH="$PYTHONPATH:." sh -c "'$PY' benchmarks/load_store.py --layers 6 --reps 2 --path /tmp/strata_load/b30x6.gguf > '$S/data-load.json'"
  rm -rf /tmp/strata_load
  phase b30-unroll-vlog 150 env STRATA_JAX_XLA_DECODE="$unroll" TF_CPP_MIN_LOG_LEVEL=0 \
    TF_CPP_VMODULE=command_buffer_conversion_pass=2 "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" \
    --resident-only --out "$S/results-b30-unroll-vlog.json"
  grep -h "not convertible\|Unsupported thunk\|not enabled by the user\|unroll" "$S/b30-unroll-vlog.log" \
    | sed 's/^[^]]*] //' | sort | uniq -c | sort -rn | head -40 > "$S/cb-unroll.txt"
  rm -f "$STRATA_JAX_CACHE/synthetic/$B30-"*
  [ -n "${QSEED:-}" ] || { note "pipeline: done"; return; }
  # QSEED=1: qseed under 32 GiB with the defaults: cold start, a 16K-token conversation's second turn
  # (issue 34: cold / RAM tier / disk tier), then the bench
  qseed_file
  cold_qseed
  conv_qseed
  phase bench-qseed 420 "$PY" -m strata_jax.cli bench --shape qseed "${COMMON[@]}" --routing realistic \
    --prefill-len 512 --vram-budget 32GiB --no-resident --out "$S/data-bench-qseed.json"
  note "pipeline: done"
}
[ "${PART:-1}" = 3 ] && { pipeline() { pipeline3; }; RETURNED="progress phases.tsv data-*.json hlo-decode.tar.gz cb-unroll.txt"; }

# PART=4: the 16K-token conversation alone (PART=3's failed on bfloat16 KV in the disk tier, now fixed)
pipeline4() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  qseed_file
  conv_qseed
  note "pipeline: done"
}
[ "${PART:-1}" = 4 ] && { pipeline() { pipeline4; }; RETURNED="progress phases.tsv data-*.json"; }

# PART=5: the layer loops without lax.scan's own dynamic slice/update (model/runs.py `_loop`): B30's host
# time per step, scan on and off, and the conversion pass's log (is the loop a command buffer now?); how
# fast a fresh process gets pinned memory, three ways (benchmarks/pinned_alloc.py); then qseed: cold start
# (its load logs its allocation seconds), the 16K-token conversation (issue 34) and the bench
pipeline5() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  phase write-b30 300 "$PY" "${WRITE[@]}" "$B30"
  bench_b30 b30-scan ""
  bench_b30 b30-off "" --layer-scan off
  phase b30-vlog 150 env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2 "$PY" -m strata_jax.cli \
    bench --shape "$B30" "${COMMON[@]}" --resident-only --out "$S/results-b30-vlog.json"
  grep -h "not convertible\|Unsupported thunk\|not enabled by the user\|unroll" "$S/b30-vlog.log" \
    | sed 's/^[^]]*] //' | sort | uniq -c | sort -rn | head -40 > "$S/cb-scan.txt"
  bench_b30 b30-scan-2 ""
  rm -f "$STRATA_JAX_CACHE/synthetic/$B30-"*
  local way
  for way in put threads jit; do
    phase "alloc-$way" 90 env PYTHONPATH="$PYTHONPATH:." sh -c "'$PY' benchmarks/pinned_alloc.py --way $way --gb 16 >> '$S/data-alloc.jsonl'"
  done
  qseed_file
  cold_qseed
  conv_qseed
  phase bench-qseed 420 "$PY" -m strata_jax.cli bench --shape qseed "${COMMON[@]}" --routing realistic \
    --prefill-len 512 --vram-budget 32GiB --no-resident --out "$S/data-bench-qseed.json"
  note "pipeline: done"
}
[ "${PART:-1}" = 5 ] && { pipeline() { pipeline5; }; RETURNED="progress phases.tsv results-*.json data-*.json* cb-scan.txt"; RESULTS_ARCHIVE=; }

# PART=6 (after PART=5: with `_loop` the scanned B30 decode call returns in 0.06 ms, yet the conversion pass
# still logs one loop "not convertible ... DynamicSliceFusionV2Thunk" and the step is slower, 195 tok/s):
# B30 scan on, and with the decode loop unrolled inside the graph; an HLO dump (decode and prefill) with the
# conversion log, to name the loop that stays out; then qseed: cold start with the store loading while
# the first prefill compiles (offload/manager.py), the bench (host time per step with `_loop`) and the
# 16K-token conversation (issue 34)
pipeline6() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  local unroll=--xla_gpu_command_buffer_unroll_loops=true
  phase write-b30 300 "$PY" "${WRITE[@]}" "$B30"
  bench_b30 b30-scan ""
  # with the DSF gone from the decode loop's body, XLA may unroll it inside the graph: no conditional node
  # per layer (decode program alone: it broke prefill process-wide)
  STRATA_JAX_XLA_DECODE="$unroll" bench_b30 b30-unroll "" --label unroll
  # compiled afresh (no compilation cache), or the conversion pass does not run and logs nothing
  phase b30-dump 150 env "${VLOG[@]}" \
    XLA_FLAGS="--xla_dump_to=$S/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*(decode|prefill).*" \
    "$PY" -m strata_jax.cli bench --shape "$B30" "${COMMON[@]}" --resident-only --out "$S/results-b30-dump.json"
  { echo "== b30-dump"; grep -h "not convertible\|Unsupported thunk\|not enabled by the user\|Convert\|module" "$S/b30-dump.log" \
    | sed 's/^[^]]*] //' | head -200; } > "$S/cb-dump.txt"
  (cd "$S/dump" && tar -czf "$S/hlo-dump.tar.gz" *after_optimizations.txt 2>/dev/null)
  rm -rf "$S/dump" "$STRATA_JAX_CACHE/synthetic/$B30-"*
  qseed_file
  cold_qseed  # the store loads in the background while the first prefill compiles
  phase bench-qseed 300 "$PY" -m strata_jax.cli bench --shape qseed "${COMMON[@]}" --routing realistic \
    --prefill-len 512 --vram-budget 32GiB --no-resident --out "$S/data-bench-qseed.json"
  conv_qseed
  note "pipeline: done"
}
[ "${PART:-1}" = 6 ] && { pipeline() { pipeline6; }; RETURNED="progress phases.tsv data-*.json cb-dump.txt hlo-dump.tar.gz"; }

# PART=7: the miss fetch as one kernel call per layer reading the pinned store, and a scanned layer's slice of
# the stacked recurrent and cache state read and written by row kernels (core/hostrows.py): their tests on
# the GPU (exact bytes, kernel == loop); then qseed under 32 GiB: the bench with the kernels compiled
# afresh with the conversion log (is the offloaded step's loop a command buffer now?), the same unrolled,
# the bench with the loop of copies and dynamic slices (the same-machine baseline), and the cold start
pipeline7() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  phase kernel-tests 240 env XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest -q -x -p no:cacheprovider \
    tests/test_offload.py tests/test_ple.py tests/test_layer_runs.py -k "fetch_kernel or quantized_table_rows or row_kernels"
  qseed_file
  phase bench-qseed-kernel 420 env "${VLOG[@]}" "$PY" -m strata_jax.cli bench "${QSEED32[@]}" --expert-fetch kernel \
    --out "$S/data-bench-qseed-kernel.json"
  grep -h "not convertible\|Unsupported thunk\|not enabled by the user" "$S/bench-qseed-kernel.log" \
    | sed 's/^[^]]*] //' | sort | uniq -c | sort -rn | head -60 > "$S/cb-qseed.txt"
  phase bench-qseed-loop 300 env STRATA_JAX_STATE_ROWS=0 "$PY" -m strata_jax.cli bench "${QSEED32[@]}" --expert-fetch loop \
    --out "$S/data-bench-qseed-loop.json"
  # every layer unrolled: no layer loop, so no traced-index slice of the stacked state can keep it out
  phase bench-qseed-unrolled 360 "$PY" -m strata_jax.cli bench "${QSEED32[@]}" --expert-fetch kernel --layer-scan off \
    --out "$S/data-bench-qseed-unrolled.json"
  cold_qseed
  note "pipeline: done"
}
[ "${PART:-1}" = 7 ] && { pipeline() { pipeline7; }; RETURNED="progress phases.tsv data-*.json cb-qseed.txt"; }

# PART=8: qseed under 32 GiB after the step profile (benchmarks/profile_check.sh): IQ3_S routed experts through
# the fused kernel by default, small stacked params read by a masked sum, row kernels at 4 KiB per block;
# the defaults (scan on) with the conversion log, the cold start, then every layer unrolled
pipeline8() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  qseed_file
  phase bench-qseed 300 env "${VLOG[@]}" "$PY" -m strata_jax.cli bench "${QSEED32[@]}" --out "$S/data-bench-qseed.json"
  grep -h "not convertible\|Unsupported thunk\|not enabled by the user" "$S/bench-qseed.log" \
    | sed 's/^[^]]*] //' | sort | uniq -c | sort -rn | head -60 > "$S/cb-qseed.txt"
  cold_qseed
  phase bench-qseed-unrolled 240 "$PY" -m strata_jax.cli bench "${QSEED32[@]}" --layer-scan off \
    --out "$S/data-bench-qseed-unrolled.json"
  note "pipeline: done"
}
[ "${PART:-1}" = 8 ] && { pipeline() { pipeline8; }; RETURNED="progress phases.tsv data-*.json cb-qseed.txt"; }

# PART=9: after float weights of a few rows became a multiply-and-reduce (model/layers/basic.py
# few_rows_product: the F16 hyper-connection matrices and the router read their stacks in place) and the
# one-entry KV write a scatter: qseed under 32 GiB with the conversion log and the decode program's
# dynamic-slice fusions by JAX source (dsf-qseed.txt); the prefill of 4,096 tokens in one chunk, every
# expert through every token (dense, the default) and each through only its own (blocked); the decode with
# XLA's dynamic-slice fusions off
pipeline9() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  qseed_file
  phase bench-qseed 300 env "${VLOG[@]}" \
    XLA_FLAGS="--xla_dump_to=$S/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*" \
    "$PY" -m strata_jax.cli bench "${QSEED32[@]}" --out "$S/data-bench-qseed.json"
  grep -h "not convertible\|Unsupported thunk\|not enabled by the user" "$S/bench-qseed.log" \
    | sed 's/^[^]]*] //' | sort | uniq -c | sort -rn | head -60 > "$S/cb-qseed.txt"
  dsf_sources "$S/dump" > "$S/dsf-qseed.txt" 2>&1
  rm -rf "$S/dump"
  # the prefill against its chunk (issue 33): a 4,096-token prompt in one chunk (the default: 512),
  # the expert cache at the 32 GiB run's share but the card uncapped, so the activations' real peak shows
  local p=(--shape qseed --tokens 8 --prompt-len 32 --routing realistic --prefill-len 4096 --cache-fraction 0.44 --no-resident)
  phase prefill-4096 150 "$PY" -m strata_jax.cli bench "${p[@]}" --prefill-chunk 4096 --out "$S/data-prefill-4096.json"
  # each expert through blocks of only its own tokens (model/layers/moe.py _experts_blocked)
  phase prefill-4096-blocked 150 env STRATA_JAX_MOE_PREFILL=blocked "$PY" -m strata_jax.cli bench "${p[@]}" \
    --prefill-chunk 4096 --label blocked --out "$S/data-prefill-4096-blocked.json"
  phase bench-qseed-nodsf 150 env XLA_FLAGS="$CB=+WHILE,+CONDITIONAL $NODSF" "$PY" -m strata_jax.cli bench "${QSEED32[@]}" \
    --label nodsf --out "$S/data-bench-qseed-nodsf.json"
  note "pipeline: done"
}
[ "${PART:-1}" = 9 ] && { pipeline() { pipeline9; }; RETURNED="progress phases.tsv data-*.json results-*.json cb-qseed.txt dsf-qseed.txt"; RESULTS_ARCHIVE=; }

# PART=10 (after PART=9: the scanned decode still kept 8 loops out of the graphs; its dynamic-slice copies were
# the F16 hyper-connection matrices, whose raw bytes' bitcast kept the slice apart, and the attention layers'
# KV read): float matrices now load as arrays of their own type; qseed under 32 GiB with the conversion log
# and the decode program's dynamic-slice fusions, then the same with XLA's dynamic-slice fusions off
pipeline10() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  qseed_file
  logged_bench bench-qseed "" "$PY" -m strata_jax.cli bench
  logged_bench bench-qseed-nodsf "$CB=+WHILE,+CONDITIONAL $NODSF" "$PY" -m strata_jax.cli bench
  note "pipeline: done"
}
[ "${PART:-1}" = 10 ] && { pipeline() { pipeline10; }; RETURNED="progress phases.tsv data-*.json cb-*.txt dsf-*.txt"; }

# PART=11 (after PART=10: the KV read and the F16 hyper-connection matrices were the copies left in the loop):
# benchmarks/slice_check.sh (its small programs and a 16-layer qwen4exp with qseed's attention, one decode per
# read form) beside qseed's file; qseed under 32 GiB with the conversion log, the code as it is and with the
# slice check's best form patched in (slice_probe.py bench); the new activation bound checked by a
# 4,096-token prefill in one chunk under the cap; issue 34's 16K conversation (cold / RAM / disk)
pipeline11() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  local forms f
  mkdir -p "$S/slcheck"
  (OUT=$S/slcheck NO_WHEELS=1 PYTHONPATH="$PYTHONPATH:." timeout 400 bash benchmarks/slice_check.sh > "$S/slcheck.log" 2>&1; \
    note "slice check: done") &
  qseed_file
  wait
  cp -f "$S/slcheck/summary.txt" "$S/slcheck-summary.txt"; cp -f "$S/slcheck/probe.jsonl" "$S/slcheck-probe.jsonl"
  forms=
  for f in kv:before kv:f32 kv:gather kv:slice; do  # the first whose 16-layer decode converted
    grep -q "^== $f+hc:shift rc 0 not_convertible 0$" "$S/slcheck/summary.txt" && { forms=$f+hc:shift; break; }
  done
  note "form for qseed: ${forms:-none converted, kv:before+hc:shift}"
  logged_bench bench-qseed "" "$PY" -m strata_jax.cli bench
  forms=${forms:-kv:before+hc:shift}
  logged_bench "bench-qseed-${forms//[:+]/_}" "" "$PY" benchmarks/slice_probe.py bench "$forms"  # no : or + in names: they do not come back
  local p=(--shape qseed --tokens 8 --prompt-len 32 --routing realistic --prefill-len 4096 --vram-budget 32GiB --no-resident)
  phase prefill-4096-cap 170 "$PY" -m strata_jax.cli bench "${p[@]}" --prefill-chunk 4096 --out "$S/data-prefill-4096-cap.json"
  conv_qseed
  note "pipeline: done"
}
[ "${PART:-1}" = 11 ] && { pipeline() { pipeline11; }; RETURNED="progress phases.tsv data-*.json cb-*.txt dsf-*.txt slcheck-*"; }

# PART=12 (after PART=11: QSA's decode write is now a scatter and READ_BEFORE_WRITE covers the static span):
# the slice check's 16-layer qwen4exp for kv:before with and without hc:shift beside qseed's file; qseed under
# 32 GiB with the conversion log as is and with kv:before+hc:shift patched in; then issue 18's verify passes
# of 2, 4 and 8 tokens on qseed under 32 GiB with drafts forced to acceptance 1, 0.8 and 0.6 (bench/spec.py)
pipeline12() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  mkdir -p "$S/slcheck"
  (OUT=$S/slcheck NO_WHEELS=1 SKIP_PROBE=1 FORMS="kv:before kv:before+hc:shift" PYTHONPATH="$PYTHONPATH:." timeout 300 \
    bash benchmarks/slice_check.sh > "$S/slcheck.log" 2>&1; note "slice check: done") &
  qseed_file
  wait
  cp -f "$S/slcheck/summary.txt" "$S/slcheck-summary.txt"
  logged_bench bench-qseed "" "$PY" -m strata_jax.cli bench
  logged_bench bench-qseed-kv_before_hc_shift "" "$PY" benchmarks/slice_probe.py bench kv:before+hc:shift
  phase spec-qseed 300 "$PY" -m strata_jax.cli bench --shape qseed "${COMMON[@]}" --routing realistic --vram-budget 32GiB \
    --no-resident --spec-pass 2 --spec-pass 4 --spec-pass 8 --spec-accept 1 --spec-accept 0.8 --spec-accept 0.6 \
    --out "$S/data-spec-qseed.json"
  note "pipeline: done"
}
[ "${PART:-1}" = 12 ] && { pipeline() { pipeline12; }; RETURNED="progress phases.tsv data-*.json cb-*.txt dsf-*.txt slcheck-*"; }

# PART=13 (after PART=12: the oracle drafted plain decode's greedy tokens, which the bf16 verify pass does not
# always reproduce, so its acceptance fell short of the forced one and drafting paused): issue 18's verify
# passes of 2, 4 and 8 tokens on qseed under 32 GiB with the acceptance forced in the pass (bench/spec.py);
# then issue 33's prefill reading the cached experts in place (STRATA_JAX_PREFILL_CACHED=1) against copying
# them all, 4,096 and 64 tokens after the decode has warmed the cache; first, the patched qseed dump naming the
# library calls that read a loop-dependent slice, with and without XLA's dynamic-slice fusion
pipeline13() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  qseed_file
  # which library calls read a loop-dependent slice (the 6 loops PART=12 left out; dsf_report now lists them),
  # then the same with XLA's dynamic-slice fusion off (does the V2 kind go with it?)
  logged_bench bench-qseed-kv_before_hc_shift "" "$PY" benchmarks/slice_probe.py bench kv:before+hc:shift
  logged_bench bench-qseed-kvb_hcs_nodsf "$NODSF" "$PY" benchmarks/slice_probe.py bench kv:before+hc:shift
  local p=(--shape qseed --tokens 32 --prompt-len 32 --routing realistic --prefill-len 4096 --prefill-len 64
           --vram-budget 32GiB --no-resident)
  phase prefill-copied 200 "$PY" -m strata_jax.cli bench "${p[@]}" --out "$S/data-prefill-copied.json"
  phase prefill-cached 200 env STRATA_JAX_PREFILL_CACHED=1 "$PY" -m strata_jax.cli bench "${p[@]}" --label cached \
    --out "$S/data-prefill-cached.json"
  phase spec-qseed 320 "$PY" -m strata_jax.cli bench --shape qseed "${COMMON[@]}" --routing realistic --vram-budget 32GiB \
    --no-resident --spec-pass 2 --spec-pass 4 --spec-pass 8 --spec-accept 1 --spec-accept 0.8 --spec-accept 0.6 \
    --out "$S/data-spec-qseed.json"
  note "pipeline: done"
}
[ "${PART:-1}" = 13 ] && { pipeline() { pipeline13; }; RETURNED="progress phases.tsv data-*.json cb-*.txt dsf-*.txt"; }

# PART=14 (issue 35): qseed's architecture at half its depth (24 layers: qseed and an IQ2_XXS copy of it take
# ~76 GB, over the 64 GiB disk of a one-GPU machine; a first try on 2026-12-07 died there without a file back)
# under 16 GiB, realistic routing, plain and with the IQ2_XXS copy serving misses until promoted after 2 uses
QPART_WRITE='import dataclasses, sys
from strata_jax.bench.shapes import SHAPES
from strata_jax.dev.synthetic import write_synthetic_gguf
spec = dataclasses.replace(SHAPES["qseed"], n_layers=int(sys.argv[3]), expert_qtype=sys.argv[2])
print(write_synthetic_gguf(sys.argv[1], spec))'
mixed_write() {  # mixed_write NAME LAYERS: qseed's architecture at LAYERS layers, IQ3_S and an IQ2_XXS copy, in the background
  mkdir -p "$STRATA_JAX_CACHE/$1"
  (phase "write-$1-cold" 300 "$PY" -c "$QPART_WRITE" "$STRATA_JAX_CACHE/$1/$1-iq2_xxs.gguf" IQ2_XXS "$2") &
  (phase "write-$1" 300 "$PY" -c "$QPART_WRITE" "$STRATA_JAX_CACHE/$1/$1.gguf" IQ3_S "$2") &
}
mixed_bench() {  # mixed_bench NAME BUDGET LIMIT_S: once the writes are done, plain and cold rows, then the files go
  wait
  local d=$STRATA_JAX_CACHE/$1
  local q=(--model "$d/$1.gguf" --label "$1" --tokens 64 --prompt-len 32 --routing realistic --vram-budget "$2"
           --no-resident)
  phase mixed-plain "$3" "$PY" -m strata_jax.cli bench "${q[@]}" --out "$S/data-mixed-plain.json"
  phase mixed-cold "$3" "$PY" -m strata_jax.cli bench "${q[@]}" --cold-experts "$d/$1-iq2_xxs.gguf" \
    --promote-after 2 --out "$S/data-mixed-cold.json"
  rm -rf "$d"
}
mixed_rows() {  # PART=14's two runs
  mixed_write qhalf 24
  mixed_bench qhalf 16GiB 220
}

pipeline14() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  mixed_rows
  note "pipeline: done"
}
[ "${PART:-1}" = 14 ] && { pipeline() { pipeline14; }; RETURNED="progress phases.tsv data-*.json"; }

# PART=15: PART=14's two runs, then PART=13's prefill with the cached experts read in place against copied, and
# its patched dump naming the loop-dependent library calls (what fits one sitting's device time)
pipeline15() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  mixed_rows
  qseed_file
  local p=(--shape qseed --tokens 32 --prompt-len 32 --routing realistic --prefill-len 4096 --prefill-len 64
           --vram-budget 32GiB --no-resident)
  phase prefill-copied 200 "$PY" -m strata_jax.cli bench "${p[@]}" --out "$S/data-prefill-copied.json"
  phase prefill-cached 200 env STRATA_JAX_PREFILL_CACHED=1 "$PY" -m strata_jax.cli bench "${p[@]}" --label cached \
    --out "$S/data-prefill-cached.json"
  logged_bench bench-qseed-kv_before_hc_shift "" "$PY" benchmarks/slice_probe.py bench kv:before+hc:shift
  note "pipeline: done"
}
[ "${PART:-1}" = 15 ] && { pipeline() { pipeline15; }; RETURNED="progress phases.tsv cb-*.txt dsf-*.txt"
  collect_more() { (cd "$S" && ls data-*.json > /dev/null 2>&1 && tar -czf "$OUT/data.tar.gz" data-*.json); }; }

# PART=16 (issues 33, 17): qseed's 4,096-token prefill under 32 GiB four ways: experts copied or read in place
# where cached (STRATA_JAX_PREFILL_CACHED=1), each with the prefill compiled with or without WHILE/CONDITIONAL
# command buffers (STRATA_JAX_XLA_PREFILL: without them the stream's copies may overlap compute,
# ../shared/probes/overlap_in_scan.py); KV streaming's check (kv_check, PART=17) first
NOWHILE=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN
pipeline16() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  kv_check
  qseed_file
  local p=(--shape qseed --tokens 16 --prompt-len 32 --routing realistic --prefill-len 4096 --vram-budget 32GiB
           --no-resident)
  phase prefill-copied 200 "$PY" -m strata_jax.cli bench "${p[@]}" --out "$S/data-prefill-copied.json"
  phase prefill-cached 200 env STRATA_JAX_PREFILL_CACHED=1 "$PY" -m strata_jax.cli bench "${p[@]}" --label cached \
    --out "$S/data-prefill-cached.json"
  phase prefill-nowhile 200 env STRATA_JAX_XLA_PREFILL="$NOWHILE" "$PY" -m strata_jax.cli bench "${p[@]}" \
    --label nowhile --out "$S/data-prefill-nowhile.json"
  phase prefill-nowhile-cached 200 env STRATA_JAX_XLA_PREFILL="$NOWHILE" STRATA_JAX_PREFILL_CACHED=1 "$PY" \
    -m strata_jax.cli bench "${p[@]}" --label nowhile-cached --out "$S/data-prefill-nowhile-cached.json"
  note "pipeline: done"
}
[ "${PART:-1}" = 16 ] && { pipeline() { pipeline16; }; RETURNED="progress phases.tsv data-*.json"; }

# PART=17 (issues 35, 17), one call: qseed's architecture at a quarter of its depth (12 layers) under 8 GiB,
# plain and with an IQ2_XXS copy serving misses until promoted after 2 uses (the files written while KV
# streaming runs its tests on the GPU (tests/test_kv_stream.py: the host-put kernel) and its bench pair)
kv_check() {  # KV streaming's tests on the GPU, then its bench pair: the small shape at a 16K context, whole / 2,048 resident
  phase kv-pytest 150 env PYTHONPATH="$PYTHONPATH:." "$PY" -m pytest -q -p no:cacheprovider -x tests/test_kv_stream.py
  local k=(--shape small --ctx 16384 --kv q8_0 --prompt-len 16000 --tokens 64 --resident-only)
  phase kv-all 120 "$PY" -m strata_jax.cli bench "${k[@]}" --out "$S/data-kv-all.json"
  phase kv-2048 120 "$PY" -m strata_jax.cli bench "${k[@]}" --kv-resident 2048 --out "$S/data-kv-2048.json"
}
pipeline17() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  mixed_write qq 12
  kv_check
  mixed_bench qq 8GiB 150
  note "pipeline: done"
}
[ "${PART:-1}" = 17 ] && { pipeline() { pipeline17; }; RETURNED="progress phases.tsv data-*.json kv-pytest.log"; }

# PART=18 (issue 17), one short call: PART=17's KV streaming part alone (its tests on the GPU, its bench pair)
pipeline18() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  kv_check
  note "pipeline: done"
}
[ "${PART:-1}" = 18 ] && { pipeline() { pipeline18; }; RETURNED="progress phases.tsv data-*.json kv-pytest.log"; }

# PART=19 (issue 36), on a machine of two GPUs (run's kind nvidia-h100-x2 or nvidia-h200-x2; carry .gpu for
# llama.cpp): qseed under 32 GiB a card, its expert cache on one card against split over both (--devices), decode
# and prefill, and llama.cpp's layer split over both under the same cap. ~15 min.
pipeline19() {
  export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on shared hosts (.library/device/KINDS.md)
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  build_llama 16 &
  qseed_file
  phase check-cards 90 bash -c "'$PY' -m strata_jax.cli check '$QFILE' --devices 0,1 --vram-budget 32GiB --no-pinned-probe --json > '$S/data-check-cards.json'"
  local p=(--shape qseed "${COMMON[@]}" --routing realistic --prefill-len 512 --prefill-len 4096 --vram-budget 32GiB
           --no-resident)
  phase bench-one-card 300 "$PY" -m strata_jax.cli bench "${p[@]}" --devices 0 --out "$S/data-one-card.json"
  wait
  phase bench-two-cards 420 "$PY" -m strata_jax.cli bench "${p[@]}" --devices 0,1 --peer-llama-bench "$LLAMA_LINK" \
    --peer-placement budget --peer-when after --peer-wait 400 --peer-reps 1 --out "$S/data-two-cards.json"
  note "pipeline: done"
}
[ "${PART:-1}" = 19 ] && { pipeline() { pipeline19; }; RETURNED="progress phases.tsv data-*.json"; }

# PART=20 (issue 17's table), one GPU: B30 decoding after 4K, 32K and 128K tokens under 32 GiB with q8_0 KV (the
# planner's all-device cache, then 32,768 positions resident and the rest streamed at 128K), each beside llama.cpp
# decoding at the same depth (llama-bench -d, -ctk/-ctv q8_0; carry .gpu). ~20 min: two calls (start, wait).
kv_depth() {  # kv_depth NAME DEPTH [BENCH ARGS...]
  local name=$1 depth=$2
  shift 2
  phase "kv-$name" 420 "$PY" -m strata_jax.cli bench --shape "$B30" --tokens 64 --prompt-len "$depth" \
    --ctx $((depth + 128)) --kv q8_0 --routing realistic --vram-budget 32GiB --no-resident "$@" \
    --peer-llama-bench "$LLAMA_LINK" --peer-depth --peer-placement budget --peer-when after --peer-wait 400 \
    --peer-reps 1 --out "$S/data-kv-$name.json"
}
pipeline20() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  build_llama 16 &
  phase write-b30 400 "$PY" "${WRITE[@]}" "$B30"
  wait
  kv_depth 4k 4096
  kv_depth 32k 32768
  kv_depth 128k-streamed 131072 --kv-resident 32768
  kv_depth 128k 131072
  note "pipeline: done"
}
[ "${PART:-1}" = 20 ] && { pipeline() { pipeline20; }; RETURNED="progress phases.tsv data-*.json"; }

# PART=21 (issues 35, 18), one GPU, ~22 min: qseed's architecture at 12 layers under 8 GiB plain and with an
# IQ2_XXS copy serving misses (PART=17's rows); issue 18's verify passes of 2, 4 and 8 tokens with the acceptance
# forced to 1, 0.8 and 0.6 on qseed, then on BSEED (their files do not fit the disk together), each under 32 GiB;
# between them prompt lookup on the real default model for code edits (benchmarks/lookup_edit.py), its needle at
# 8K / 32K / 64K (YaRN; issue 17) and whether a
# cached file can be the store in place (benchmarks/pin_probe.py: issue 30's load). The model
# (491 MB) travels in pieces of .mdl/ (ignored; `split -b 52M -d -a 2 MODEL .mdl/part` and its sha256 in
# .mdl/model.sha256), one carried piece a call while the pipeline runs: `mkdir -p /tmp/mdl && cp .mdl/* /tmp/mdl/`.
spec_rows() {  # spec_rows SHAPE LIMIT_S: its verify passes under 32 GiB, realistic routing
  phase "spec-$1" "$2" "$PY" -m strata_jax.cli bench --shape "$1" "${COMMON[@]}" --routing realistic \
    --vram-budget 32GiB --no-resident --spec-pass 2 --spec-pass 4 --spec-pass 8 --spec-accept 1 --spec-accept 0.8 \
    --spec-accept 0.6 --out "$S/data-spec-$1.json"
}
lookup_default() {  # the default model's pieces from /tmp/mdl (waits up to $1 s for them), then lookup_edit.py
  local t0=$SECONDS
  until [ -f /tmp/mdl/model.sha256 ] && cat /tmp/mdl/part* > /tmp/mdl/model.gguf \
        && (cd /tmp/mdl && sha256sum -c --status model.sha256); do
    (( SECONDS - t0 > $1 )) && { note "lookup: the model's pieces did not all come"; return 1; }
    sleep 10
  done
  note "lookup: the default model is whole"
  phase lookup-default 240 env PYTHONPATH="$PYTHONPATH:." "$PY" benchmarks/lookup_edit.py --model /tmp/mdl/model.gguf \
    --tokens 96 --out "$S/data-lookup-default.json"
  return 0  # the model is whole: what follows may use it
}
pipeline21() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  mixed_write qq 12
  mixed_bench qq 8GiB 150
  qseed_file
  spec_rows qseed 330
  # issue 30's load: the store in host memory of our own, page-locked after the reads (STRATA_JAX_STORE)
  phase registered-qseed 170 env STRATA_JAX_STORE=registered "$PY" -m strata_jax.cli bench --shape qseed --tokens 64 \
    --prompt-len 32 --routing realistic --vram-budget 32GiB --no-resident --label registered \
    --out "$S/data-registered-qseed.json"
  rm -f "$STRATA_JAX_CACHE"/synthetic/qseed-*
  local whole=0
  lookup_default 120 && whole=1
  phase pin-probe 150 "$PY" benchmarks/pin_probe.py --gib 8 --out "$S/data-pin-probe.json"
  rm -f /tmp/pin_probe.bin
  phase write-bseed 300 "$PY" "${WRITE[@]}" bseed
  spec_rows bseed 330
  # issue 17's needle on the GPU at every size: 8K and 32K (trained 32,768), 64K with YaRN x2
  if [ $whole = 1 ]; then
    phase needle-default 150 env PYTHONPATH="$PYTHONPATH:." "$PY" -m strata_jax.bench.needle --model /tmp/mdl/model.gguf \
      --ctx 8192 --ctx 32768 --depth 0.1,0.5,0.9 --kv q8_0 --out "$S/data-needle-default.json"
    phase needle-default-yarn 120 env PYTHONPATH="$PYTHONPATH:." "$PY" -m strata_jax.bench.needle --model /tmp/mdl/model.gguf \
      --ctx 65536 --depth 0.1,0.5,0.9 --kv q8_0 --rope-scaling yarn --rope-scale 2 --out "$S/data-needle-default-yarn.json"
  fi
  note "pipeline: done"
}
[ "${PART:-1}" = 21 ] && { pipeline() { pipeline21; }; RETURNED="progress phases.tsv"  # a call returns at most 8 files
  collect_more() { (cd "$S" && ls data-*.json > /dev/null 2>&1 && tar -czf "$OUT/data.tar.gz" data-*.json); }; }

# PART=22 (issue 30), one GPU, ~12 min: qseed under 32 GiB with the store in memory of our own (the default since
# PART=21) from process start to first token (benchmarks/cold_start.py: no allocation through JAX to stall the
# compiles now), then the store as the model file itself (STRATA_JAX_STORE=mapped: load, fetch, decode) beside the
# default in the same run
store_rows() {  # qseed under 32 GiB, the store in memory of our own, then the model file itself
  local q=(--shape qseed --tokens 128 --prompt-len 32 --routing realistic --prefill-len 4096 --vram-budget 32GiB
           --no-resident)
  phase store-registered 200 "$PY" -m strata_jax.cli bench "${q[@]}" --label registered --out "$S/data-store-registered.json"
  phase store-mapped 200 env STRATA_JAX_STORE=mapped "$PY" -m strata_jax.cli bench "${q[@]}" --label mapped \
    --out "$S/data-store-mapped.json"
}
pipeline22() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  qseed_file
  cold_qseed ""
  store_rows
  note "pipeline: done"
}
[ "${PART:-1}" = 22 ] && { pipeline() { pipeline22; }; RETURNED="progress phases.tsv data-*.json"; }

# PART=23 (issue 30), one GPU, ~11 min: PART=22's rows (qseed's cold start with the store in memory of our own;
# the store as the model file itself beside it), first which thunks keep qseed's scanned decode loops out of the
# CUDA graphs: XLA's thunk sequence of the decode program (benchmarks/thunk_report.py: each dynamic-slice fusion
# thunk, what it wraps and its JAX source), and the decode program with loops of a known trip count unrolled into
# the graph (XLA converts a loop holding a loop-dependent dynamic-slice fusion only that way)
thunk_bench() {  # thunk_bench NAME [ENV...]: qseed under 32 GiB, conversion log, decode dump -> thunk-NAME.txt
  local name=$1
  shift
  phase "$name" 200 env "${VLOG[@]}" PYTHONPATH="$PYTHONPATH:." "$@" \
    XLA_FLAGS="--xla_dump_to=$S/dump-$name --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode.*" \
    "$PY" -m strata_jax.cli bench "${QSEED32[@]}" --label "$name" --out "$S/data-$name.json"
  grep -h "not convertible\|Unsupported thunk\|not enabled by the user" "$S/$name.log" | sed 's/^[^]]*] //' \
    | sort | uniq -c | sort -rn | head -60 > "$S/thunk-$name.txt"
  "$PY" benchmarks/thunk_report.py "$S/dump-$name" >> "$S/thunk-$name.txt" 2>&1
  (cd "$S/dump-$name" 2>/dev/null && tar -czf "$S/dump-$name.tar.gz" \
    $(ls | grep -E "decode.*(thunk_sequence|after_optimizations)\.txt$"))
  rm -rf "$S/dump-$name"
}
pipeline23() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  qseed_file
  thunk_bench thunks-default
  thunk_bench thunks-unroll STRATA_JAX_XLA_DECODE=--xla_gpu_command_buffer_unroll_loops=true
  cold_qseed ""
  store_rows
  note "pipeline: done"
}
[ "${PART:-1}" = 23 ] && { pipeline() { pipeline23; }; RETURNED="progress phases.tsv thunk-*.txt"
  collect_more() { (cd "$S" && tar -czf "$OUT/data.tar.gz" data-*.json dump-*.tar.gz 2>/dev/null); }; }

# PART=24 (issue 30), one GPU, ~9 min: PART=23's log looked as if XLA converted none of qseed's decode ("not
# enabled by the user for type FUSION" for every kernel; those lines turned out to be the autotuner's modules, whose
# set is empty). qseed with the whole set named, then with loops of a known trip count unrolled into the graph,
# then with the dynamic-slice fusion kind added: none moved its 23 ms of host time (docs/benchmarks.md)
FULLCB=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL
cb_bench() {  # cb_bench NAME XLA_FLAGS [BENCH ARGS...]: a bench with the conversion log -> data-NAME.json, cb-NAME.txt
  local name=$1 flags=$2
  shift 2
  phase "$name" 200 env "${VLOG[@]}" XLA_FLAGS="$flags" "$PY" -m strata_jax.cli bench "$@" --label "$name" \
    --out "$S/data-$name.json"
  grep -h "not convertible\|Unsupported thunk\|not enabled by the user\|Removed command buffer" "$S/$name.log" \
    | sed 's/^[^]]*] //' | sort | uniq -c | sort -rn | head -40 > "$S/cb-$name.txt"
}
pipeline24() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  (qseed_file) &
  cb_bench qtiny-full "$CB=$FULLCB" --shape qtiny "${COMMON[@]}" --resident-only
  wait
  qseed_file
  cb_bench qseed-full "$CB=$FULLCB" "${QSEED32[@]}"
  cb_bench qseed-full-unroll "$CB=$FULLCB --xla_gpu_command_buffer_unroll_loops=true" "${QSEED32[@]}"
  cb_bench qseed-full-dsf-unroll "$CB=$FULLCB,DYNAMIC_SLICE_FUSION --xla_gpu_command_buffer_unroll_loops=true" \
    "${QSEED32[@]}"
  note "pipeline: done"
}
[ "${PART:-1}" = 24 ] && { pipeline() { pipeline24; }; RETURNED="progress phases.tsv cb-*.txt"
  collect_more() { (cd "$S" && tar -czf "$OUT/data.tar.gz" data-*.json 2>/dev/null); }; }

# PART=25 (issues 30, 18), one GPU, ~11 min: benchmarks/cb_check.sh (which thunk keeps a scanned offloaded decode
# loop out of the CUDA graphs: resident, fetch kernel, XLA's copies, unrolled), then qseed's 4-token verify passes
# again (PART=21's: 39.5 ms; a fully accepted pass no longer rewinds, and a rewind is the closed form from the tape)
pipeline25() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  (qseed_file) &
  phase cb-check 420 env NO_WHEELS=1 OUT="$S/cb" PY="$PY" bash benchmarks/cb_check.sh
  wait
  qseed_file
  # 4-token passes only (the budget of a session that lost minutes to failed starts): the closed-form rewind
  phase spec-qseed 260 "$PY" -m strata_jax.cli bench --shape qseed "${COMMON[@]}" --routing realistic \
    --vram-budget 32GiB --no-resident --spec-pass 4 --spec-accept 1 --spec-accept 0.6 --out "$S/data-spec-qseed.json"
  note "pipeline: done"
}
[ "${PART:-1}" = 25 ] && { pipeline() { pipeline25; }; RETURNED="progress phases.tsv data-*.json results-*.json"
  collect_more() { (cd "$S" && tar -czf "$OUT/cb.tar.gz" cb 2>/dev/null); }; }

# PART=26 (issues 30, 33), one GPU, ~14 min: qseed's decode with the F16 hyper-connection matrices read in their
# stack by the fused kernel (STRATA_JAX_FLOAT_STACK=kernel) beside the default copy, each with the conversion log's
# verdicts (cb-*.txt) and the decode's dynamic-slice fusions (dsf-*.txt); then what the prefill program's 21.2 s
# compile is. A second prefill bucket
# compiled in 0.87 s in the same process (PART=23), as if XLA's in-process autotuning results made the rest: qseed's
# first prefill (4,096 tokens at the auto chunk) with the compilation cache off under the defaults, with the prefill
# autotuned less (STRATA_JAX_XLA_PREFILL: level 0, no autotuning) and with cuBLAS in place of Triton's GEMMs;
# each row's compile times (JAX_LOG_COMPILES) beside its prefill tok/s (what the faster compile costs). Then qseed's
# decode one token per call; then B30 resident decode (issue 30's last row).
prefill_compile() {  # prefill_compile NAME PREFILL_XLA_FLAGS
  phase "pc-$1" 200 env STRATA_JAX_XLA_PREFILL="$2" JAX_LOG_COMPILES=1 STRATA_JAX_COMPILATION_CACHE=0 "$PY" -m \
    strata_jax.cli bench --shape qseed --tokens 32 --prompt-len 32 --routing realistic --prefill-len 4096 \
    --vram-budget 32GiB --no-resident --out "$S/data-pc-$1.json"
  grep -o "Finished XLA compilation of .* sec" "$S/pc-$1.log" > "$S/compiles-$1.txt" 2>/dev/null || true
}
pipeline26() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  qseed_file
  # the F16 hyper-connection matrices read in their stack by the fused kernel (no loop-dependent slice copy)
  logged_bench fs-copy "" "$PY" -m strata_jax.cli bench
  logged_bench fs-kernel "" env STRATA_JAX_FLOAT_STACK=kernel "$PY" -m strata_jax.cli bench
  prefill_compile default ""
  prefill_compile autotune0 "--xla_gpu_autotune_level=0"
  prefill_compile cublas "--xla_gpu_enable_triton_gemm=false"
  # one token per call: no token loop (PART=24: with every layer loop unrolled into the graph, the token loop was
  # the one left out, yet 23 ms of host time stayed)
  phase dc1 150 "$PY" -m strata_jax.cli bench "${QSEED32[@]}" --decode-chunk 1 --out "$S/data-dc1.json"
  rm -f "$STRATA_JAX_CACHE"/synthetic/qseed-*
  # issue 30's last row: B30 resident decode (target: not slower than 220 tok/s)
  phase write-b30 300 "$PY" "${WRITE[@]}" "$B30"
  bench_b30 b30-resident ""
  note "pipeline: done"
}
[ "${PART:-1}" = 26 ] && { pipeline() { pipeline26; }; RETURNED="progress phases.tsv data-*.json results-*.json compiles-*.txt cb-*.txt dsf-*.txt"; }

# PART=27 (issues 30, 33, 18), one GPU, ~12 min: the rows of PART=25 and PART=26 that matter most, for a session
# whose device time went to failed starts: qseed's decode with the F16 hyper-connection matrices copied (the
# default) and read in their stack (STRATA_JAX_FLOAT_STACK=kernel), each logged (conversion verdicts, dynamic-slice
# fusions, compile times: the compilation cache is off); qseed's 4-token verify passes (closed-form rewind); the
# default run once more with the prefill program compiled without autotuning (its compile against fs-copy's).
pipeline27() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  qseed_file
  logged_bench fs-copy "" env JAX_LOG_COMPILES=1 "$PY" -m strata_jax.cli bench
  logged_bench fs-kernel "" env JAX_LOG_COMPILES=1 STRATA_JAX_FLOAT_STACK=kernel "$PY" -m strata_jax.cli bench
  phase spec-qseed 240 "$PY" -m strata_jax.cli bench --shape qseed "${COMMON[@]}" --routing realistic \
    --vram-budget 32GiB --no-resident --spec-pass 4 --spec-accept 1 --spec-accept 0.6 --out "$S/data-spec-qseed.json"
  phase pc-autotune0 170 env STRATA_JAX_XLA_PREFILL=--xla_gpu_autotune_level=0 JAX_LOG_COMPILES=1 \
    STRATA_JAX_COMPILATION_CACHE=0 "$PY" -m strata_jax.cli bench "${QSEED32[@]}" --out "$S/data-pc-autotune0.json"
  for f in "$S"/fs-copy.log "$S"/fs-kernel.log "$S"/pc-autotune0.log; do
    [ -f "$f" ] && grep -o "Finished XLA compilation of .* sec" "$f" > "$S/compiles-$(basename "$f" .log).txt"
  done
  note "pipeline: done"
}
[ "${PART:-1}" = 27 ] && { pipeline() { pipeline27; }
  RETURNED="progress phases.tsv data-*.json compiles-*.txt cb-*.txt dsf-*.txt"; }

# PART=28 (issues 33, 30), one GPU, ~9 min: split-K in the fused kernel (STRATA_JAX_QMATVEC_SPLIT=1: qseed's routed
# gate+up in 4 shares of its 12 units, the [3072, 4096] output projections in 8, now on the kernel instead of
# dequantized every step) against the default, qseed under 32 GiB (same tokens expected); then where a 4,096-token
# prefill chunk's GPU time goes (scope_profile.py --prefill, qseed cut to 8 layers, half the experts cached).
pipeline28() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  qseed_file
  phase split-off 170 env JAX_LOG_COMPILES=1 "$PY" -m strata_jax.cli bench "${QSEED32[@]}" --label split-off \
    --out "$S/data-split-off.json"
  phase split-on 170 env JAX_LOG_COMPILES=1 STRATA_JAX_QMATVEC_SPLIT=1 "$PY" -m strata_jax.cli bench "${QSEED32[@]}" \
    --label split-on --out "$S/data-split-on.json"
  rm -f "$STRATA_JAX_CACHE"/synthetic/qseed-*.gguf  # the 8-layer file needs the disk
  phase profile-prefill 300 env OUT="$S" TAG=prefill PYTHONPATH="$PYTHONPATH:." "$PY" benchmarks/scope_profile.py \
    --shape qseed --layers 8 --slots-fraction 0.5 --prefill 4096
  rm -rf "$S/scope-dump" /tmp/qseed-8L.gguf
  note "pipeline: done"
}
[ "${PART:-1}" = 28 ] && { pipeline() { pipeline28; }
  RETURNED="progress phases.tsv data-*.json scope_profile-*.json"; }  # logs: logs.tar.gz

# PART=29 (issues 33, 17), one GPU, ~10 min: layer-major prefill (STRATA_JAX_PREFILL_SUBCHUNK) on qseed under 32 GiB:
# a 16,384-token prompt with the auto chunk (1,024: the experts streamed 16 times), then in one 16,384-token chunk of
# 1,024-token sub-chunks (streamed once), then 4,096-token chunks of 1,024 (4 times); prefill tok/s, expert slots.
pipeline29() {
  note "pipeline: start in $PWD (deadline $(deadline) s)"
  qseed_file
  local q=(--shape qseed --tokens 8 --prompt-len 32 --routing realistic --prefill-len 16384 --vram-budget 32GiB
           --no-resident)
  phase sub-off 200 "$PY" -m strata_jax.cli bench "${q[@]}" --label auto --out "$S/data-sub-off.json"
  phase sub-16k 200 env STRATA_JAX_PREFILL_SUBCHUNK=1024 "$PY" -m strata_jax.cli bench "${q[@]}" --prefill-chunk 16384 \
    --label sub1024-chunk16384 --out "$S/data-sub-16k.json"
  phase sub-4k 200 env STRATA_JAX_PREFILL_SUBCHUNK=1024 "$PY" -m strata_jax.cli bench "${q[@]}" --prefill-chunk 4096 \
    --label sub1024-chunk4096 --out "$S/data-sub-4k.json"
  note "pipeline: done"
}
[ "${PART:-1}" = 29 ] && { pipeline() { pipeline29; }; RETURNED="progress phases.tsv data-*.json"; }

sitting_main "$@"
